"""Published training runs that `plan --only` sets its prediction beside.  None of them is fitted: the A100
and H100 specs are calibrated on ``bench/data``'s Megatron-LM tables alone (docs/CALIBRATION.md), so each figure
here is a prediction's yardstick.  A row says what the run did that the prediction does not, and a row the model
cannot cost (FP8: no FP8 device spec) is listed with the reason instead of a number.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str  # a name in model_configs/
    device: str
    gpus: int
    tp: int
    pp: int
    dp: int
    seq: int
    global_batch: int  # sequences per step
    tflops_per_gpu: float | None  # the run's model TFLOP/s per GPU, as published
    precision: str
    source: str
    differs: str = ""  # what the run did that the predicted layout does not
    not_modelled: str = ""  # why the model cannot cost it ("": it can)


LLAMA3_PAPER = "Dubey et al. 2024, 'The Llama 3 Herd of Models' (arXiv 2407.21783), Table 4"
LLAMA3_DIFFERS = ("Meta sharded parameters, gradients and optimizer states across DP (FSDP, ZeRO-3-like), which "
                  "DeepSpeed's pipeline engine does not run (ZeRO-1 here), and ran its own interleaved schedule "
                  "with asynchronous point-to-point")
BRIDGE = "NVIDIA Megatron-Bridge H100 performance recipes (bridge.perf_recipes.llama.h100)"

PUBLISHED = (
    PublishedRun("llama3-405b-16k-gpus", "llama3.1-405b", "h100", 16384, tp=8, pp=16, dp=128, seq=8192,
                 global_batch=2048, tflops_per_gpu=400.0, precision="bf16", source=LLAMA3_PAPER, differs=LLAMA3_DIFFERS),
    PublishedRun("llama3-405b-8k-gpus", "llama3.1-405b", "h100", 8192, tp=8, pp=16, dp=64, seq=8192,
                 global_batch=2048, tflops_per_gpu=430.0, precision="bf16", source=LLAMA3_PAPER, differs=LLAMA3_DIFFERS),
    # degrees as the recipes' names state them; their sequence and batch are not stated there (0)
    PublishedRun("bridge-llama31-405b-fp8", "llama3.1-405b", "h100", 1024, tp=8, pp=8, dp=8, seq=0, global_batch=0,
                 tflops_per_gpu=None, precision="fp8", source=BRIDGE + ": llama31_405b_pretrain_1024gpu_h100_fp8cs",
                 not_modelled="FP8 (no FP8 device spec yet) and context parallelism (CP 2)"),
    PublishedRun("bridge-llama3-70b-fp8", "llama3-70b", "h100", 64, tp=4, pp=8, dp=2, seq=0, global_batch=256,
                 tflops_per_gpu=None, precision="fp8", source=BRIDGE + ": llama3_70b_pretrain_64gpu_h100_fp8cs",
                 not_modelled="FP8 (no FP8 device spec yet)"),
)


def matching(model: str, device: str, gpus: int, lay, seq: int, global_batch: int) -> list[PublishedRun]:
    """The published runs of this model whose cluster and degrees are the layout's."""
    return [r for r in PUBLISHED if r.model == model and device.startswith(r.device) and r.gpus == gpus
            and (r.tp, r.pp, r.dp) == (lay.tp, lay.pp, lay.dp) and r.seq in (0, seq)
            and r.global_batch in (0, global_batch)]


def beside(run: PublishedRun, cost, peak_flops: float) -> list[str]:
    """Lines that set a layout's predicted step beside a published run."""
    if run.not_modelled:
        return [f"published: {run.name} ({run.precision}, {run.source}): not modelled: {run.not_modelled}"]
    predicted = cost.mfu * peak_flops / 1e12
    lay = cost.layout
    return [f"published: {run.name}: {run.tflops_per_gpu:.0f} TFLOP/s per GPU ({run.source})",
            f"  predicted here: {predicted:.0f} TFLOP/s per GPU ({100 * (predicted / run.tflops_per_gpu - 1):+.1f}%), "
            f"step {cost.step_s:.2f} s: a prediction, no parameter fitted to this run; assumed micro-batch "
            f"{lay.micro_batch} ({lay.micro_batches} a step), schedule {lay.schedule}, ZeRO-{lay.zero}, "
            f"recompute {lay.recompute}",
            f"  the run differs: {run.differs}"]
