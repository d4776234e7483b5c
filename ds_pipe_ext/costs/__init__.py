"""Layer costs: the `LayerCost` record and its sources (profiled; analytic to come)."""

from .types import LayerCost

__all__ = ["LayerCost"]
