"""What freezing layers does to their costs: a pure function of a ``LayerCost`` list.

* A frozen layer computes no weight gradient and holds no gradient or optimizer state: its
  backward is the input gradient alone.  Profiled costs already say so (the profiler builds the
  frozen layer and measures it); analytic ones are corrected here (``weight_grad_s`` is the part
  that goes, half the backward where the cost model did not separate it).
* No layer before the first trainable one runs a backward at all: nothing upstream needs a
  gradient (a pipeline's first input, token ids, needs none), so autograd neither saves their
  activations nor replays them under checkpointing.  The profiler measured these layers with an
  input that needs a gradient, as a stage input does, so this applies to both sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .types import LayerCost


def freeze_costs(costs: Sequence[LayerCost], frozen: Sequence[bool], *, measured: bool) -> list[LayerCost]:
    """``costs`` as they are with the ``frozen`` layers frozen.

    ``measured``: the costs were profiled on the frozen layers (backward and bytes already reflect
    them); otherwise (analytic) a frozen layer's weight gradient and states are removed here.
    """
    if len(frozen) != len(costs):
        raise ValueError(f"{len(frozen)} frozen flags for {len(costs)} layers")
    out = []
    for c, f in zip(costs, frozen):
        if f:
            c = replace(c, name=f"{c.name}(frozen)")  # the partition table and the reports show it
        if f and not measured:
            wgrad = c.backward_s / 2 if c.weight_grad_s is None else min(c.weight_grad_s, c.backward_s)
            c = replace(c, backward_s=c.backward_s - wgrad, weight_grad_s=0.0, grad_bytes=0, optimizer_bytes=0)
        elif f:
            c = replace(c, grad_bytes=0, optimizer_bytes=0, weight_grad_s=0.0)
        out.append(c)
    first_trainable = next((i for i, c in enumerate(out) if c.grad_bytes > 0), len(out))
    return [replace(c, backward_s=0.0, recompute_s=0.0, weight_grad_s=0.0, activation_bytes=0)
            if i < first_trainable else c for i, c in enumerate(out)]
