"""The whole model's gradient norm, each stage, TP shard and expert counted once, and the pipeline's clip by it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import Layout


def squared_l2(t: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """sum(t**2) in float64, to ~1e-6 relative: fp32 norms of 4,096-element rows, combined in float64.
    One fp32 norm over 26M elements is off by 1e-3; ``t.double().pow(2)`` is exact but copies the
    gradient twice, which took 0.64 s of every 89M-parameter step on CPU (46x this)."""
    flat = t.detach().reshape(-1)
    whole = flat.numel() // chunk * chunk
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, chunk), dim=1, dtype=torch.float32).double()
    tail = torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).double()
    return rows.pow(2).sum() + tail.pow(2)


def clip_by_the_whole_pipeline(engine, model, layout: Layout, norms: list, *, dtype: str) -> None:
    """Clip a pipeline's fp32 gradients by the norm over every stage, as ``gradient_clipping`` means.

    DeepSpeed 0.19 clips an fp32 ZeRO-0 engine's gradients with ``runtime.utils.clip_grad_norm_(mpu=the pipeline
    grid)``, which counts a parameter only on model-parallel rank 0 or where megatron marks it split; the grid's
    model-parallel group spans the stages, so only the first stage's gradients set every stage's factor (llama-tiny
    on 2 stages: clipped by 1.78 where the whole model's norm is 2.60).  Its bf16, fp16 and ZeRO optimizers count by
    tensor-parallel rank and are left alone.  Each step's norm before the clip is appended to ``norms``."""
    max_norm = float(engine.gradient_clipping())
    if not max_norm > 0 or layout.zero != 0 or dtype != "fp32":
        return

    def clip() -> None:
        norm = global_grad_norm(model, layout)
        norms.append(norm)
        factor = min(1.0, max_norm / (norm + 1e-6))  # DeepSpeed's clip_coef
        if factor < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    engine.clip_fp32_gradients = clip


def global_grad_norm(model, layout: Layout) -> float:
    """L2 norm of the whole model's gradient: TP shards summed, TP-replicated and DP-replicated copies once
    (an expert's gradient lives on tp x dp / ep ranks of a stage, ``Layout.expert_dp``; a dense parameter's on
    all dp)."""
    tp_rank = 0
    if layout.tp > 1:
        from megatron.core import parallel_state

        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # on the gradients' device: the all-reduce below runs on it (NCCL takes CUDA tensors only)
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dense = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "allreduce", True) is False:  # DeepSpeed's mark on expert parameters: whole on every TP rank
            experts += squared_l2(p.grad)
        elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense += squared_l2(p.grad)
    total = torch.stack((dense / layout.dp, experts / layout.expert_dp))
    dist.all_reduce(total)
    return float(total.sum().sqrt())
