"""Where a planned step goes: its shares by kind of work, so a user can see why a plan predicts its MFU.

For the busiest pipeline rank (the most compute a step): its layers' GEMMs, attention cores, memory-bound ops,
the host's dispatch beyond the kernels (eager GPUs) and the collectives inside the layers (TP/SP), each over
its micro-batches (full recompute replays the forward: the layer's time scaled by (2 fwd + bwd) / (fwd + bwd));
the optimizer (Adam and the runtime's own passes over the gradients, ``RankUpdate``); the data-parallel
collectives the update leaves exposed; and the rest of the step: the schedule's bubble, the pipeline's sends
and waits.  Where these parts overlap in the simulated step (they add up to more than it), each is scaled
down alike, so the shares always sum to the step.
"""

from __future__ import annotations

from ..costs.estimate import EstimateRequest, estimate_layers
from ..costs.hardware import adam_step_s

KINDS = ("gemm", "attention", "memory", "host", "communication in layers", "optimizer",
         "exposed data-parallel communication", "bubble, sends and waits")


def step_shares(model, cost) -> dict[str, float]:
    """Seconds of ``cost``'s step (a ``LayoutCost`` of ``model``, a ``PlanModel``) by kind (``KINDS``)."""
    lay = cost.layout
    req = EstimateRequest(micro_batch=lay.micro_batch, seq=model.seq, tp=lay.tp, sp=lay.sp, dtype=model.dtype,
                          selective_recompute=lay.recompute == "selective", ep=lay.ep,
                          expert_imbalance=model.expert_imbalance, execution=model.execution)
    rows = estimate_layers(model.cfg, req, model.device)
    chunk_rank = lay.schedule_spec.chunk_rank(lay.pp)
    per_rank: list[dict[str, float]] = [dict.fromkeys(("gemm", "attention", "memory", "host", "communication"), 0.0)
                                        for _ in range(lay.pp)]
    params = [0.0] * lay.pp
    tensors: list[list] = [[] for _ in range(lay.pp)]
    for chunk in range(len(cost.parts) - 1):
        rank = chunk_rank[chunk]
        for row in rows[cost.parts[chunk]:cost.parts[chunk + 1]]:
            total = row["fwd_s"] + row["bwd_s"]
            replay = (total + row["fwd_s"]) / total if lay.recompute == "full" and total else 1.0
            for kind, seconds in row["class_s"].items():
                per_rank[rank][kind] += seconds * replay * lay.micro_batches
            params[rank] += row["params"]
            tensors[rank] += row["tensors"]
    busiest = max(range(lay.pp), key=lambda r: sum(per_rank[r].values()))
    work = per_rank[busiest]
    owned = params[busiest] / (lay.dp if lay.zero >= 1 or lay.runtime == "megatron" else 1)
    optimizer = adam_step_s(owned, model.device, bytes_per_param=model.adam_bytes_per_param)
    if lay.runtime == "deepspeed":
        optimizer += model.engine_passes_s(lay, params[busiest], tensors=tensors[busiest])
    update = model.update_s(lay, params[busiest], tensors=tensors[busiest])
    shares = {"gemm": work["gemm"], "attention": work["attention"], "memory": work["memory"], "host": work["host"],
              "communication in layers": work["communication"], "optimizer": optimizer,
              "exposed data-parallel communication": max(0.0, update - optimizer)}
    busy = sum(shares.values())
    shares["bubble, sends and waits"] = max(0.0, cost.step_s - busy)
    scale = cost.step_s / max(busy, cost.step_s)
    return {kind: seconds * scale for kind, seconds in shares.items()}


def render_shares(model, cost) -> str:
    """One line a kind: seconds and share of the step, and the MFU they add up to."""
    shares = step_shares(model, cost)
    total = sum(shares.values())
    lines = [f"  where the step goes (busiest rank; {1e3 * cost.step_s:.1f} ms, MFU {100 * cost.mfu:.1f}%):"]
    for kind in KINDS:
        lines.append(f"    {kind:36s} {1e3 * shares[kind]:10.1f} ms  {100 * shares[kind] / total:5.1f}%")
    return "\n".join(lines)


__all__ = ["KINDS", "render_shares", "step_shares"]
