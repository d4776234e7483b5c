"""Closing the loop: correct per-layer costs with the stage times an earlier run measured.

A run directory holds what was predicted (``predicted.json``: the layer costs and
parts) and what was measured (``summary.json``: per-stage forward/backward means,
p2p, optimizer step).  Each layer's forward and backward time is scaled by its
stage's measured/predicted ratio, so whatever the per-layer profile misses on
that stage (engine overhead, the loss, ranks sharing memory bandwidth) is folded
into its layers.  The p2p and optimizer-step times are kept as ``overheads`` for
the step-time prediction.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..costs.types import LayerCost
from .rundir import Run, RunDir, RunDirError  # noqa: F401 - RunDirError is part of this module's API


def load_run(run_dir: str | Path) -> Run:
    return RunDir(run_dir).read()


def measured_overheads(run: Run) -> dict:
    """What a stage spends besides its layers' compute, in seconds, from a measured run.

    Per micro-batch: sending its activation on (gloo/NCCL sends occupy the sender),
    sending the input gradient back, loading the micro-batch (first and last stage).
    Per step: gradient reduction + optimizer step per stage, and the loss broadcast
    after the schedule (its smallest time over stages: the others include waiting).
    """
    stages = run.summary["stages"]
    m = run.predicted.micro_batches
    per_mb = lambda key: [st.get(key, 0.0) / m / 1e3 for st in stages]  # noqa: E731
    return {
        "send_forward_s": per_mb("send_activation_ms_mean"),
        "send_backward_s": per_mb("send_grad_ms_mean"),
        "load_s": per_mb("load_micro_batch_ms_mean"),
        "optimizer_s": [(st["optimizer_step_ms_mean"] + st["reduce_grads_ms_mean"] + st["reduce_tied_grads_ms_mean"]) / 1e3
                        for st in stages],
        "tail_s": min(st.get("aggregate_loss_ms_mean", 0.0) for st in stages) / 1e3,
    }


def refine_costs(costs: list[LayerCost], run_dir: str | Path) -> list[LayerCost]:
    run = load_run(run_dir)
    old = run.predicted.layer_costs
    if [c.name for c in old] != [c.name for c in costs]:
        raise RunDirError(f"{run_dir} was measured on a different model ({len(old)} layers: "
                          f"{[c.name for c in old][:3]}...); refine only from a run of the same model")
    parts = run.predicted.parts
    refined = list(costs)
    for stage in run.summary["stages"]:
        s = stage["stage"]
        i, j = parts[s], parts[s + 1]
        pf = sum(c.forward_s for c in costs[i:j])
        pb = sum(c.backward_s for c in costs[i:j])
        kf = stage["forward_ms_mean"] / 1e3 / pf if pf > 0 else 1.0
        kb = stage["backward_ms_mean"] / 1e3 / pb if pb > 0 else 1.0
        for k in range(i, j):
            c = refined[k]
            refined[k] = replace(c, forward_s=c.forward_s * kf, backward_s=c.backward_s * kb,
                                 recompute_s=c.recompute_s * kf)
    return refined
