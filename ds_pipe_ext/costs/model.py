"""`CostModel`: what the analytic cost source needs from a model.

The core never imports a model.  A model that wants ``partition_method: "analytic"``
hands the ``PipelineModule`` an object with this protocol (``cost_model=...``); ours,
for the families in ``models/``, is ``models.costs.DescribedCostModel``.

This is also the one hook through which parallel degrees reach the analytic costs:
the tensor-parallel degree comes from the pipeline's topology and is passed in as
``tp``; whether the layers are sequence-parallel is the model's own knowledge (its
layer implementation), so the cost model says it, not a search of the layer specs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .hardware import DeviceSpec
from .types import LayerCost


@runtime_checkable
class CostModel(Protocol):
    """Per-layer analytic costs of one tensor-parallel shard of a model."""

    def layer_costs(self, inputs, *, tp: int, device: DeviceSpec, dtype: str) -> list[LayerCost]:
        """One ``LayerCost`` per pipeline layer, in order, for one micro-batch ``inputs``
        (what the first layer receives: a tensor or a tuple of tensors)."""
        ...

    def calibrate(self, inputs, *, tp: int, device: DeviceSpec, dtype: str, cache_dir: str | None) -> DeviceSpec:
        """``device`` with its efficiency factors fitted to a few layers profiled on this machine."""
        ...
