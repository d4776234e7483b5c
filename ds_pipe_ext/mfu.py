"""Model FLOPs utilisation: what every printed throughput comes with.

MFU = model FLOPs per second / the device's peak.  The model FLOPs of a sample are the planner's count
(``model_flops_per_sample``: the matrix and attention FLOPs of one forward and backward, no recompute,
as Megatron-LM and PaLM count them); the peak is the datasheet's for the GPU and precision (fp32 runs on
a GPU: TF32's tensor-core peak where torch lets fp32 matmuls use TF32, else the CUDA-core fp32 peak), and
on a CPU the measured ``cpu`` spec's GEMM peak (cached in ~/.cache/ds_pipe_ext, or ``DS_PIPE_EXT_CACHE_HOME``, so a
launch measures it once per machine), which the result says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .costs.estimate import EstimateRequest, shape_for
from .costs.layer_ops import layer_ops

# where the CPU peak is kept: the user's cache, or DS_PIPE_EXT_CACHE_HOME (the test suite points it at the checkout's
# measurement cache: a peak measured while its workers share the cores reads low, and must not stay in the user's)
CACHE_DIR = Path(os.environ.get("DS_PIPE_EXT_CACHE_HOME")
                 or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ds_pipe_ext")


def model_flops_per_sample(model, seq: int | None = None) -> float:
    """Matrix and attention FLOPs of one sample's forward + backward (no recompute): MFU's numerator."""
    from .arch import as_description

    desc = as_description(model)
    # routed experts: the routed tokens' FLOPs (slots at the mean load), not a dropless layer's padding
    shp = shape_for(desc, EstimateRequest(micro_batch=1, seq=seq or desc.seq_len, dtype="bf16"))
    return sum(op.fwd_flops + op.bwd_flops for _, _, ops in layer_ops(desc, shp, expert_imbalance=1.0) for op in ops
               if op.kind != "vector")


def peak_flops(device_type: str, dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for ``dtype``, what that peak is); None where the GPU is not one we know."""
    from .costs.hardware import get_device

    if device_type != "cuda":
        try:
            spec = get_device("cpu", cache_dir=str(CACHE_DIR))
        except OSError:  # a read-only home: measured again, not cached
            spec = get_device("cpu", cache_dir=None)
        peak = spec.matrix_flops["fp32"]
        return peak, f"the measured cpu spec's GEMM peak ({peak / 1e12:.3f} TFLOP/s)"
    import torch

    from .costs.hardware import datasheet_name

    name = torch.cuda.get_device_name()
    key = datasheet_name(name, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if key is None:
        return None, f"no datasheet peak for {name}"
    spec = get_device(key, calibrated=False)
    if dtype == "fp32" and not torch.backends.cuda.matmul.allow_tf32:
        return spec.vector_flops["fp32"], f"{spec.name} datasheet fp32 (no TF32)"
    return spec.matrix_flops[dtype], f"{spec.name} datasheet {dtype}{' (TF32)' if dtype == 'fp32' else ''}"


@dataclass(frozen=True)
class Throughput:
    """What turns a run's step time into samples/s and MFU: the trainer's log line and summary, and the run
    directory's record that ``report`` reads (``Predicted.throughput``, this as a dict)."""

    samples_per_step: int
    world_size: int
    model_flops_per_sample: float
    peak_flops: float | None  # one device's; None: unknown (or not looked up: ranks other than 0)
    peak: str  # what that peak is

    @classmethod
    def of(cls, model, *, samples_per_step: int, world_size: int, device_type: str, dtype: str,
           with_peak: bool = True) -> "Throughput":
        """``with_peak=False``: no peak looked up (on a CPU it is measured, once per machine)."""
        peak, what = peak_flops(device_type, dtype) if with_peak else (None, "rank 0 reports it")
        return cls(samples_per_step, world_size, model_flops_per_sample(model), peak, what)

    def samples_per_s(self, step_s: float) -> float:
        return self.samples_per_step / step_s

    def mfu(self, step_s: float) -> float | None:
        per_device = self.samples_per_s(step_s) * self.model_flops_per_sample / self.world_size
        return per_device / self.peak_flops if self.peak_flops else None

    def fields(self, step_s: float) -> dict:
        """A run summary's MFU fields at this step time."""
        per_device = self.samples_per_s(step_s) * self.model_flops_per_sample / self.world_size
        return {"model_flops_per_sample": self.model_flops_per_sample,
                "model_tflops_per_s_per_device": per_device / 1e12, "mfu": self.mfu(step_s), "mfu_peak": self.peak}
