"""`SequentialLayers`: the layers of a pipeline model run in one process.

The data-parallel twin of a ``PipelineModule`` (ZeRO baselines) and the reference of
parity checks: the same layer list DeepSpeed accepts (``LayerSpec``, ``TiedLayerSpec``,
``nn.Module`` instances, callables), built and called in order, with the loss at the end.

* ``TiedLayerSpec``s with the same key share one module, as in DeepSpeed's pipeline.
* With ``base_seed``, spec i is built after seeding base_seed + i, as a
  ``PipelineModule(seed_layers=True)`` does, so both start from the same weights.
* ``nn.Module`` instances and callables are used as given (no copy).
* ``recompute=True``: full activation recomputation, each layer checkpointed (it keeps
  only its input), as a pipeline with ``activation_checkpoint_interval=1``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from ..costs.layers import is_layer_spec


def _seed_everything(seed: int) -> None:
    """What DeepSpeed's ``ds_utils.set_random_seed`` does for ``seed_layers``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class SequentialLayers(nn.Module):
    def __init__(self, layers: Sequence, loss_fn: Callable | None = None, *, base_seed: int | None = None,
                 recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.layers = nn.ModuleList()
        self._calls: list[tuple[int | None, Callable | None]] = []  # (module index or None, function)
        tied: dict[str, int] = {}
        for layer_idx, layer in enumerate(layers):
            spec = is_layer_spec(layer)
            key = getattr(layer, "key", None) if spec else None
            if key is not None and key in tied:
                self._calls.append((tied[key], getattr(layer, "forward_fn", None)))
                continue
            if spec:  # LayerSpec / TiedLayerSpec: build it now
                if base_seed is not None:
                    _seed_everything(base_seed + layer_idx)
                self.layers.append(layer.build())
                if key is not None:
                    tied[key] = len(self.layers) - 1
                self._calls.append((len(self.layers) - 1, getattr(layer, "forward_fn", None)))
            elif isinstance(layer, nn.Module):
                self.layers.append(layer)
                self._calls.append((len(self.layers) - 1, None))
            elif callable(layer):
                self._calls.append((None, layer))
            else:
                raise TypeError(f"layer {layer_idx} ({layer!r}) is not a LayerSpec, an nn.Module or a callable")
        self.loss_fn = loss_fn

    def _call(self, idx: int | None, fn: Callable | None, x):
        if idx is None:
            return fn(x)
        layer = self.layers[idx]
        return fn(layer, x) if fn is not None else layer(x)

    def forward(self, inputs, labels=None):
        x = inputs
        for idx, fn in self._calls:
            if self.recompute and idx is not None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(self._call, idx, fn, x, use_reentrant=False)
            else:
                x = self._call(idx, fn, x)
        return x if labels is None or self.loss_fn is None else self.loss_fn(x, labels)
