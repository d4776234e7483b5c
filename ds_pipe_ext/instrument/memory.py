"""Byte counts of what a stage holds: parameters, gradients, optimizer states, process memory."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from ..compat.optimizer import unwrap_optimizer
from ..compat.zero import held_model_state_bytes


class ModelStateProbe:
    """Counts the model states when they are complete, around every step of the inner optimizer:
    gradients just before it (reduced, not yet freed), parameters and optimizer states just after it
    (Adam creates its moments in its first step).  ``read()`` is the last step's count.

    ZeRO-1/2 step DeepSpeed's MoE parameter groups one at a time, each its own inner step: the
    gradients are the most held before any of them in the training step (a forward starts the next)."""

    def __init__(self, module: torch.nn.Module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.latest: dict[str, int] | None = None
        self._grads = 0
        inner = unwrap_optimizer(optimizer)
        self._handles = [inner.register_step_pre_hook(lambda *_: self._before()),
                         inner.register_step_post_hook(lambda *_: self._after()),
                         module.register_forward_pre_hook(lambda *_: self._next_step())]

    def _next_step(self) -> None:
        self._grads = 0

    def _before(self) -> None:
        self._grads = max(self._grads, held_model_state_bytes(self.module, self.optimizer)["grad_bytes"])

    def _after(self) -> None:
        self.latest = {**held_model_state_bytes(self.module, self.optimizer), "grad_bytes": self._grads}

    def read(self) -> dict[str, int]:
        """The count at the last optimizer step (now, if there was none yet)."""
        return dict(self.latest) if self.latest is not None else held_model_state_bytes(self.module, self.optimizer)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _vm_hwm_bytes() -> int | None:
    """Linux: the resident-set high-water mark, which ``reset_process_peak`` can reset."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_memory_fields(states: "ModelStateProbe", meter: "SavedActivationMeter", device) -> dict:
    """A step record's memory on one rank: the model states by kind, the saved activations' peak and the
    process's (or the CUDA allocator's) peak."""
    return {**states.read(), "activation_peak_bytes": meter.peak, **process_peak_bytes(device)}


def process_peak_bytes(device: torch.device | None = None) -> dict[str, int]:
    """Peak allocator memory on GPU; peak resident set size of the process on CPU (since the last
    ``reset_process_peak``, on Linux)."""
    if device is not None and device.type == "cuda":
        return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return {"peak_rss_bytes": hwm}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": rss if sys.platform == "darwin" else rss * 1024}  # Linux reports KiB


def reset_process_peak(device: torch.device | None = None) -> str:
    """Start the peak over: what training needs, not what building (and profiling) the model needed.

    Returns what the peak now measures, for the run's summary.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "allocator peak since the model was built"
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return "resident-set peak since the model was built"
    except OSError:
        return "resident-set peak of the whole process (this kernel cannot reset it)"


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
        self.last_saved: list[int] = []  # the storages (data_ptr) the last forward saved

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
                meter.last_saved = [ptr for ptr, _ in seen]
                meter._held[buffer_id] = meter._held.get(buffer_id, 0) + nbytes
                meter.live += nbytes
                meter.peak = max(meter.peak, meter.live)

        return _Ctx()

    def backward_done(self, buffer_id: int) -> None:
        self.live -= self._held.pop(buffer_id, 0)

    def reset_peak(self) -> None:
        self.peak = self.live
