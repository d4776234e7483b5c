"""Byte counts of what a stage holds: parameters, gradients, optimizer states, process memory."""

from __future__ import annotations

import resource
import sys

import torch

from ..compat.optimizer import unwrap_optimizer


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of this rank.

    Optimizer state counts the per-parameter moment tensors (same size as the
    parameter, e.g. Adam's exp_avg and exp_avg_sq); scalar bookkeeping such as
    Adam's step counter is left out, as the cost model leaves it out.
    """
    params = list({id(p): p for p in module.parameters()}.values())
    out = {
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "grad_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": 0,
    }
    state = getattr(unwrap_optimizer(optimizer), "state", {})
    for p, s in state.items():
        for v in s.values():
            if isinstance(v, torch.Tensor) and v.numel() == p.numel() and v.dim() > 0:
                out["optimizer_bytes"] += tensor_bytes(v)
    return out


def process_peak_bytes(device: torch.device | None = None) -> dict[str, int]:
    """Peak allocator memory on GPU; peak resident set size of the process on CPU."""
    if device is not None and device.type == "cuda":
        return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}  # Linux reports KiB


class SavedActivationMeter:
    """Bytes autograd saves during a stage's forwards, alive until that micro-batch's backward.

    ``forward(buffer_id)`` is a context manager that counts the unique non-parameter
    storages saved; ``backward_done(buffer_id)`` releases them.  ``peak`` is the
    most held at once: what 1F1B's in-flight micro-batches cost this stage.
    """

    def __init__(self, module: torch.nn.Module):
        self._param_storages = {self._key(p) for p in module.parameters()}
        self._held: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, int]:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes())

    def forward(self, buffer_id: int):
        seen: set[tuple[int, int]] = set()

        def pack(t):
            key = self._key(t)
            if key not in self._param_storages:
                seen.add(key)
            return t

        meter = self

        class _Ctx:
            def __enter__(self):
                self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                self._hooks.__enter__()

            def __exit__(self, *exc):
                self._hooks.__exit__(*exc)
                nbytes = sum(n for _, n in seen)
                meter._held[buffer_id] = meter._held.get(buffer_id, 0) + nbytes
                meter.live += nbytes
                meter.peak = max(meter.peak, meter.live)

        return _Ctx()

    def backward_done(self, buffer_id: int) -> None:
        self.live -= self._held.pop(buffer_id, 0)

    def reset_peak(self) -> None:
        self.peak = self.live
