"""The package version, in a module of its own: the profile cache keys on it without importing the package."""

__version__ = "0.1.0"
