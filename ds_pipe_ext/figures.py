"""The one way this package makes PNG charts: matplotlib without a display, saved at one size."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: the CI machine and ranks have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> Path:
    """Lay out, write (making the folder) and close ``fig``; returns the path written."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
