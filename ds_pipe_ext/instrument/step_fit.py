"""Fit a ``StepModel`` to instrumented runs, and predict runs with it.

A run directory (``rundir``) holds the layer costs and split a run used and what each stage
measured.  From one or two runs (different splits, stage counts, micro-batches or
models are what make the fit transfer) the fit reads:

* stage forward / backward per micro-batch against the stage's layer costs: a least-squares
  line, scale x layer time + a fixed cost per instruction, over every stage of every run.
  Where ranks share cores the measured times are first divided by the slowdown the model
  predicts for that run (a fixed point: fit, simulate, divide, fit again);
* p2p: the fastest activation send seen (sends that waited for their receiver are slower);
* the optimizer step: the stages meet before it, so the smallest optimizer time over the
  stages is the update of the stage that arrived last, with nothing to wait for: a line in
  the parameter bytes over the runs (one run: through the origin);
* the tail: the smallest loss-broadcast time over the stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..costs.stage import stage_costs
from ..simulate.step_model import StepModel, StepModelError
from .rundir import Run

FIT_ROUNDS = 4


@dataclass(frozen=True)
class RunStages:
    """One measured run in the terms the fit needs."""

    name: str
    stages: list  # StageCost per stage, from the run's own layer costs and split
    micro_batches: int
    forward_s: list[float]  # measured, per micro-batch, mean over the stage's ranks
    backward_s: list[float]
    optimizer_s: list[float]  # per stage: reduce + optimizer step (waiting included)
    send_s: list[float]  # per activation send
    tail_s: float
    step_s: float
    ranks: int


def run_stages(run: Run, name: str = "") -> RunStages:
    pred, summary = run.predicted, run.summary
    ranks = summary.get("ranks") or summary.get("stages")
    if not ranks:
        raise StepModelError(f"run {name}: its summary.json has no per-rank records; train with instrumentation on")
    p = len(pred.parts) - 1
    m = pred.micro_batches
    stages = stage_costs(pred.layer_costs, pred.parts, micro_batches=m, recompute=pred.recompute)
    by_stage: list[list[dict]] = [[] for _ in range(p)]
    for r in ranks:
        by_stage[r["stage"]].append(r)
    if any(not rs for rs in by_stage):
        raise StepModelError(f"run {name}: summary.json lacks a stage ({[len(rs) for rs in by_stage]} ranks per stage)")
    mean = lambda rs, k: float(np.mean([r.get(k, 0.0) for r in rs]))  # noqa: E731
    return RunStages(
        name=name, stages=stages, micro_batches=m,
        forward_s=[mean(rs, "forward_ms_mean") / 1e3 for rs in by_stage],
        backward_s=[mean(rs, "backward_ms_mean") / 1e3 for rs in by_stage],
        optimizer_s=[(mean(rs, "optimizer_step_ms_mean") + mean(rs, "reduce_grads_ms_mean")
                      + mean(rs, "reduce_tied_grads_ms_mean")) / 1e3 for rs in by_stage],
        send_s=[mean(rs, "send_activation_ms_mean") / 1e3 / m for rs in by_stage],
        tail_s=min(r.get("aggregate_loss_ms_mean", 0.0) for r in ranks) / 1e3,
        step_s=max(r["step_ms_median"] for r in ranks) / 1e3,
        ranks=len(ranks),
    )


def _line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a x + b with a, b >= 0 (a fixed cost below zero means: through the origin)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(set(np.round(x, 12))) >= 2:
        a, b = np.polyfit(x, y, 1)
        if a > 0 and b >= 0:
            return float(a), float(b)
    if np.dot(x, x) > 0:
        a = float(np.dot(x, y) / np.dot(x, x))
        if a > 0:
            return a, 0.0
    return 0.0, float(max(np.mean(y), 0.0))


def fit_step_model(runs: Sequence[RunStages], *, cores: float | None = None) -> StepModel:
    if not runs:
        raise StepModelError("fit_step_model needs at least one instrumented run")
    model = StepModel(cores=cores, calibrated_on=tuple(r.name for r in runs))
    for _ in range(FIT_ROUNDS):
        xf, yf, xb, yb = [], [], [], []
        for run in runs:
            stretch = _stage_slowdown(model, run)
            for st, f, b, k in zip(run.stages, run.forward_s, run.backward_s, stretch):
                xf.append(st.forward_s)
                yf.append(f / k)
                xb.append(st.backward_s)
                yb.append(b / k)
        fs, ff = _line(xf, yf)
        bs, bf = _line(xb, yb)
        model = replace(model, forward_scale=fs, forward_fixed_s=ff, backward_scale=bs, backward_fixed_s=bf)
    # p2p: the fastest send per byte
    rates = [st.boundary_out_bytes / t for run in runs for st, t in zip(run.stages, run.send_s)
             if st.boundary_out_bytes and t > 0]
    # the optimizer: the last stage to arrive waits for nobody; all ranks update together
    xo, yo = [], []
    for run in runs:
        last = int(np.argmin(run.optimizer_s))
        params = [st.param_bytes for st in run.stages]
        xo.append(max(params[last], sum(params) / cores) if cores else params[last])
        yo.append(run.optimizer_s[last])
    per_byte, fixed = _line(xo, yo)
    return replace(model, p2p_bandwidth=max(rates) if rates else None, optimizer_s_per_param_byte=per_byte,
                   optimizer_fixed_s=fixed, step_fixed_s=float(np.mean([r.tail_s for r in runs])))


def _stage_slowdown(model: StepModel, run: RunStages) -> list[float]:
    """Mean shared-core stretch of each stage's compute in ``run``, as ``model`` predicts it."""
    if not model.cores or len(run.stages) <= model.cores:
        return [1.0] * len(run.stages)
    pred = model.predict(run.stages, run.micro_batches)
    out = []
    for s in range(len(run.stages)):
        ks = [k for (r, w), k in pred.slowdown.items() if r == s]
        out.append(float(np.mean(ks)) if ks else 1.0)
    return out


def predict_run(model: StepModel, run: RunStages, *, schedule: str = "1f1b") -> float:
    """The step ``model`` predicts for ``run``'s split, layer costs and micro-batches (seconds)."""
    return model.predict(run.stages, run.micro_batches, schedule=schedule).step_s
