"""Each layer's forward and backward time inside a running stage (``instrument.per_layer``).

A profile times a layer alone; a stage runs it inside DeepSpeed's engine, between its neighbours, beside
other ranks.  Module hooks on each of the stage's layers time the same calls in training, so a report can
put every layer beside its profile, and the stage's instruction time beside the sum of its layers (what is
left is the engine's own time around each call, and on the last stage the loss).

- forward: from the layer's forward pre-hook to its forward hook;
- backward: from its full-backward pre-hook (the gradient of its output has arrived) to its full-backward
  hook (the gradient of its input is computed).  A layer whose inputs need no gradient (an embedding of
  token ids) fires both at once, so its backward is not timed here, and weight gradients autograd
  computes after the input's gradient (a separate node) fall outside the window.

Layers DeepSpeed built as modules are timed; tied layers called through a function are not.  A
recomputed layer would run its forward hooks again in the backward, so ``train/config.py`` refuses
``per_layer`` with recompute.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
from torch import nn

from ..compat.engine import local_layers


def _needs_grad(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


class LayerTimer:
    """Hooks on a stage's layers; ``times[(kind, layer)]`` gathers ms per call, ``kind`` forward or backward."""

    def __init__(self, module: nn.Module, clock):
        self.clock = clock  # hooks.py's _Clock: perf_counter on CPU, CUDA events on a GPU
        self.times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self._handles = []
        self._backward_timed: dict[int, bool] = {}
        for idx, layer in local_layers(module):
            self._hook(idx, layer)

    def _hook(self, idx: int, layer: nn.Module) -> None:
        started: dict[str, object] = {}
        timer = self

        def forward_pre(_, args):
            timer._backward_timed[idx] = _needs_grad(args)
            started["forward"] = timer.clock.start()

        def forward_post(_, args, output):
            timer.clock.stop(("forward", idx), started.pop("forward"), timer.times)

        def backward_pre(_, grad_output):
            started["backward"] = timer.clock.start()

        def backward_post(_, grad_input, grad_output):
            token = started.pop("backward", None)
            if token is not None and timer._backward_timed.get(idx):
                timer.clock.stop(("backward", idx), token, timer.times)

        self._handles += [layer.register_forward_pre_hook(forward_pre), layer.register_forward_hook(forward_post),
                          layer.register_full_backward_pre_hook(backward_pre),
                          layer.register_full_backward_hook(backward_post)]

    def take_step(self) -> dict:
        """This step's calls, ``{"layer_forward_ms": {layer: [ms, ...]}, "layer_backward_ms": {...}}``
        (layers as strings: the record is JSON), and start the next step."""
        self.clock.resolve(self.times)
        out = {"layer_forward_ms": {}, "layer_backward_ms": {}}
        for (kind, idx), values in sorted(self.times.items()):
            out[f"layer_{kind}_ms"][str(idx)] = list(values)
        self.times.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def summarize_layer_times(steady: list[dict]) -> dict[str, dict[str, float]]:
    """Per layer over the summarised steps: mean forward and backward ms a call (backward absent where
    untimed)."""
    calls: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in steady:
        for kind in ("forward", "backward"):
            for layer, values in rec.get(f"layer_{kind}_ms", {}).items():
                calls[layer][kind] += values
    return {layer: {f"{kind}_ms": statistics.fmean(v) for kind, v in kinds.items() if v}
            for layer, kinds in sorted(calls.items(), key=lambda kv: int(kv[0]))}
