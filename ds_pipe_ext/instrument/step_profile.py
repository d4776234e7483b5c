"""One training step under ``torch.profiler``, summarized where it ran: a raw trace of a GPU step is too large
to carry back, so what comes back is a small record.

``summarize(prof)`` (a pure reading of a finished profiler) gives: the step's wall time; the device's busy
time (the union of its kernels' intervals) and so its idle gaps; the top kernels by device time, with calls;
the top host ops by their own time; the host-device synchronisations (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``aten::_local_scalar_dense``: a tensor read back, ``.item()``), count and time; the
trainer's labelled phases (``ds_pipe_ext.optimizer_step``: DeepSpeed's ``engine.step()``), host time from
their start to their end, which on a device that waits on nothing else is the phase's time.
``train.profile_step`` (train/config.py) profiles that step and writes ``step_profile.json`` beside the
run's records (bench/gpu_path.py's ``speed`` part brings it back).
"""

from __future__ import annotations

import json
from pathlib import Path

RANGE_PREFIX = "ds_pipe_ext."  # torch.profiler.record_function labels the trainer puts on its phases
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(prof, *, top: int = 15) -> dict:
    """The record of a finished ``torch.profiler.profile`` over one step (times in ms)."""
    events = list(prof.events())
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    averages = prof.key_averages()
    by_device = sorted((e for e in averages if _device_us(e) > 0), key=_device_us, reverse=True)
    by_host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    syncs = [e for e in averages if e.key in SYNCS]
    ranges = [e for e in averages if e.key.startswith(RANGE_PREFIX)]  # the trainer's labelled phases
    return {
        "wall_ms": wall / 1e3,
        "device_busy_ms": busy / 1e3,
        "device_idle_ms": max(wall - busy, 0.0) / 1e3,
        "kernels": len(kernels),
        "top_kernels": [{"name": e.key[:120], "calls": e.count, "ms": _device_us(e) / 1e3} for e in by_device[:top]],
        "top_host_ops": [{"name": e.key[:120], "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
                         for e in by_host[:top]],
        "syncs": {e.key: {"calls": e.count, "ms": e.cpu_time_total / 1e3} for e in syncs},
        "phases": {e.key.removeprefix(RANGE_PREFIX): {"calls": e.count, "ms": e.cpu_time_total / 1e3}
                   for e in ranges},
    }


def write_summary(prof, path: str | Path, **extra) -> Path:
    path = Path(path)
    path.write_text(json.dumps({**extra, **summarize(prof)}, indent=1))
    return path
