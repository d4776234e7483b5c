"""Byte counts of what a stage holds: parameters, gradients, optimizer states, process memory."""

from __future__ import annotations

import resource
import sys

import torch

from ..compat.optimizer import unwrap_optimizer
from ..compat.zero import held_model_state_bytes


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state_bytes(module: torch.nn.Module, optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds, counted from the tensors
    (ZeRO's flat buffers, padding and fp32 master copies included: ``compat.zero``)."""
    return held_model_state_bytes(module, optimizer)


class ModelStateProbe:
    """Counts the model states when they are complete: at every step of the inner optimizer
    (gradients reduced, not yet freed), through a step pre-hook.  ``latest`` is the last count."""

    def __init__(self, module: torch.nn.Module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.latest: dict[str, int] | None = None
        self._handle = unwrap_optimizer(optimizer).register_step_pre_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.latest = held_model_state_bytes(self.module, self.optimizer)

    def read(self) -> dict[str, int]:
        """The count at the last optimizer step (now, if there was none yet)."""
        return dict(self.latest) if self.latest is not None else held_model_state_bytes(self.module, self.optimizer)

    def remove(self) -> None:
        self._handle.remove()


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
            # a parameter is not an activation: ZeRO-3 gathers parameters into fresh storages, so
            # the storages seen at start are not enough; the saved tensor is the Parameter or its view
            if not (key in self._param_storages or isinstance(t, torch.nn.Parameter)
                    or isinstance(t._base, torch.nn.Parameter)):
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
