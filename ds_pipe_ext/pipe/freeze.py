"""Frozen layers: a pipeline's layer list with some layers' parameters frozen.

PipeTransformer freezes layers as training goes on; a layer whose parameters are all frozen
computes no weight gradients and holds no gradients or optimizer states, so each stage's cost
changes and the partition should follow (``costs.frozen`` says how).

Any layer DeepSpeed accepts can be frozen, before the ``PipelineModule`` is built:

* a ``LayerSpec`` becomes a ``FrozenLayerSpec``, which builds the same module and freezes it, so
  DeepSpeed's ``parameters`` method (it counts trainable parameters only) and the profiler see
  it frozen, and its ``repr`` (the profile cache key) says so;
* an ``nn.Module`` instance is frozen in place;
* a ``TiedLayerSpec`` is refused: its weight is shared with another layer, which would then
  change too;
* a callable has no parameters: nothing to freeze.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn


class FrozenLayerSpec(LayerSpec):
    """A ``LayerSpec`` whose built module has ``requires_grad=False`` on every parameter."""

    def build(self, log=False):
        module = super().build(log=log)
        for p in module.parameters():
            p.requires_grad_(False)
        return module

    def __repr__(self) -> str:
        return "frozen " + super().__repr__()


def parse_layer_set(text: str | Sequence[int] | None, num_layers: int) -> list[int]:
    """``"1-6"``, ``"0,3,5-7"`` or a list of indices -> sorted layer indices, checked against the model."""
    if text is None or text == "":
        return []
    if isinstance(text, str):
        indices: set[int] = set()
        for part in text.split(","):
            part = part.strip()
            try:
                lo, _, hi = part.partition("-")
                a, b = int(lo), int(hi) if hi else int(lo)
            except ValueError:
                raise ValueError(f"frozen layers {text!r}: {part!r} is not an index or a range a-b "
                                 f"(write e.g. \"1-6\" or \"0,3,5-7\")") from None
            if b < a:
                raise ValueError(f"frozen layers {text!r}: the range {part!r} runs backwards")
            indices.update(range(a, b + 1))
    else:
        indices = {int(i) for i in text}
    bad = sorted(i for i in indices if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"frozen layers {text!r}: {bad} outside the pipeline's layers 0-{num_layers - 1}")
    return sorted(indices)


def freeze_layers(layers: Sequence, indices: Sequence[int]) -> list:
    """The layer list with the layers at ``indices`` frozen (see the module docstring)."""
    out = list(layers)
    for i in indices:
        layer = out[i]
        if isinstance(layer, TiedLayerSpec):
            raise ValueError(f"layer {i} ({layer.typename.__name__}) is tied to another layer by key "
                             f"{layer.key!r}: freezing it would freeze its partner too; untie the weights "
                             f"(tie_embeddings = false) or leave it trainable")
        if isinstance(layer, LayerSpec):
            frozen = FrozenLayerSpec.__new__(FrozenLayerSpec)
            frozen.__dict__.update(layer.__dict__)
            out[i] = frozen
        elif isinstance(layer, nn.Module):
            for p in layer.parameters():
                p.requires_grad_(False)
    return out


def frozen_flags(layers: Sequence) -> list[bool]:
    """Per layer: does it hold parameters, all of them frozen?  (Without building a ``LayerSpec``.)"""
    flags = []
    for layer in layers:
        if isinstance(layer, FrozenLayerSpec):
            flags.append(True)
        elif isinstance(layer, nn.Module):
            params = list(layer.parameters())
            flags.append(bool(params) and not any(p.requires_grad for p in params))
        else:
            flags.append(False)
    return flags
