"""Fit a ``StepModel`` to instrumented runs, and predict runs with it.

A run directory (``rundir``) holds the layer costs and split a run used and what each stage
measured.  From one or two runs (different splits, stage counts, micro-batches or
models are what make the fit transfer) the fit reads:

* stage forward / backward per micro-batch against the stage's layer costs: scale x layer time
  + a fixed cost per instruction + a cost per layer, over every stage of every run, least
  squares in relative error with no coefficient below zero.
  Where ranks share cores the measured times are first divided by the slowdown the model
  predicts for that run (a fixed point: fit, simulate, divide, fit again);
* p2p: each run's fastest activation send (the others waited for their receiver): latency +
  bytes / bandwidth;
* the optimizer step: each rank updates after its last backward and the step ends with the last
  update, so the smallest optimizer time over the stages is an update with nothing to wait for
  (divided by the memory-bandwidth sharing the model predicts for it): a line in the parameter
  bytes over the runs (one run: through the origin);
* the tail: the smallest loss-broadcast time over the stages;
* last, what the counters mix with waiting, fitted to the calibration runs' steps: where ranks
  share cores, the wake-up of a rank that slept at a rendezvous while the cores were taken;
  otherwise the engine's cost of a transfer instruction whose partner is ready (a latency of at
  least the fastest send).
* activation checkpointing: a replayed layer repeats the engine's per-layer forward work (fitted
  on the forward); any cost beyond that is fitted only where a calibration run checkpointed.
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
    schedule: str = "1f1b"  # the schedule the run ran (its order, its in-flight counts)


def run_stages(run: Run, name: str = "") -> RunStages:
    pred, summary = run.predicted, run.summary
    ranks = summary.get("ranks") or summary.get("stages")
    if not ranks:
        raise StepModelError(f"run {name}: its summary.json has no per-rank records; train with instrumentation on")
    p = len(pred.parts) - 1
    m = pred.micro_batches
    stages = stage_costs(pred.layer_costs, pred.parts, micro_batches=m, recompute=pred.recompute,
                         schedule=pred.schedule)
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
        ranks=len(ranks), schedule=pred.schedule,
    )


def _relative_nnls(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Coefficients >= 0 of y ~ sum_k c_k columns[k], least squares in *relative* error, so that a run
    whose stages take milliseconds counts as much as one whose stages take seconds.  Few columns:
    every subset is solved and the best one with no negative coefficient is kept."""
    X, y = np.asarray(columns, float).T, np.asarray(y, float)
    keep = y > 0
    X, y = X[keep] / y[keep, None], np.ones(int(keep.sum()))
    k = X.shape[1]
    best, best_err = [0.0] * k, float(np.sum(y**2))
    for mask in range(1, 2**k):
        cols = [c for c in range(k) if mask >> c & 1]
        sub = X[:, cols]
        if np.linalg.matrix_rank(sub) < len(cols):
            continue
        coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if np.any(coef < 0):
            continue
        err = float(np.sum((sub @ coef - y) ** 2))
        if err < best_err - 1e-15:
            best, best_err = [0.0] * k, err
            for c, v in zip(cols, coef):
                best[c] = float(v)
    return best


def _line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """y = a x + b, a, b >= 0, in relative error."""
    a, b = _relative_nnls([x, [1.0] * len(x)], y)
    return a, b


def fit_step_model(runs: Sequence[RunStages], *, cores: float | None = None, shared_memory: bool = False) -> StepModel:
    """``cores``, ``shared_memory``: the ranks share this many CPU cores and one memory system."""
    if not runs:
        raise StepModelError("fit_step_model needs at least one instrumented run")
    model = StepModel(cores=cores, shared_memory=shared_memory, calibrated_on=tuple(r.name for r in runs))
    for _ in range(FIT_ROUNDS):
        cols_f, cols_b, yf, yb = [[], [], []], [[], [], [], []], [], []
        for run in runs:
            stretch = _stage_slowdown(model, run)
            for st, f, b, k in zip(run.stages, run.forward_s, run.backward_s, stretch):
                for cols, t in ((cols_f, st.forward_s), (cols_b, st.backward_s)):
                    cols[0].append(t)
                    cols[1].append(1.0)
                    cols[2].append(st.stop - st.start)
                cols_b[3].append(st.recomputed_layers)  # all 0 (no term) unless a run checkpointed
                yf.append(f / k)
                yb.append(b / k)
        fs, ff, fl = _relative_nnls(cols_f, yf)
        # a replayed layer repeats the engine's per-layer forward work (StepModel.stage_backward_s)
        yb = [y - fl * r for y, r in zip(yb, cols_b[3])]
        bs, bf, bl, br = _relative_nnls(cols_b, yb)
        model = replace(model, forward_scale=fs, forward_fixed_s=ff, forward_per_layer_s=fl,
                        backward_scale=bs, backward_fixed_s=bf, backward_per_layer_s=bl, recompute_per_layer_s=br)
    # p2p: per run, its fastest send (the others waited for their receiver): latency + bytes / bandwidth
    sends = [min((t, st.boundary_out_bytes) for st, t in zip(run.stages, run.send_s) if st.boundary_out_bytes and t > 0)
             for run in runs if any(st.boundary_out_bytes and t > 0 for st, t in zip(run.stages, run.send_s))]
    per_byte, latency = _line([b for _, b in sends], [t for t, _ in sends]) if sends else (0.0, 0.0)
    model = replace(model, p2p_latency_s=latency, p2p_bandwidth=1.0 / per_byte if per_byte > 0 else None)
    # the optimizer: each rank updates after its last backward, and the step ends with the last one
    # (the loss broadcast waits for it), so a rank's measured time is its update plus the wait for the
    # last; the smallest is an update with no wait.  With shared memory that update may have shared
    # the bandwidth with another: divide by the stretch the model predicts, and fit again.
    for _ in range(FIT_ROUNDS):
        xo, yo = [], []
        for run in runs:
            last = int(np.argmin(run.optimizer_s))
            xo.append(run.stages[last].param_bytes)
            yo.append(run.optimizer_s[last] / _optimizer_stretch(model, run, last))
        per_byte, fixed = _line(xo, yo)
        model = replace(model, optimizer_s_per_param_byte=per_byte, optimizer_fixed_s=fixed)
    model = replace(model, step_fixed_s=float(np.mean([r.tail_s for r in runs])))
    # what no counter isolates (the counters mix it with waiting), the one term fitted to the steps
    # themselves, the value that brings the calibration runs' steps closest:
    # * where ranks share cores (more ranks than ``cores`` in a calibration run): the wake-up of a rank
    #   that slept in a send or receive while the other ranks hold the cores (p2p_wake_s); the latency
    #   stays the fastest sends' line.  A latency fitted instead piles up along every rendezvous of the
    #   critical path, busy cores or not, and over-predicts a run whose light stages leave a core free.
    # * otherwise: the engine's cost of a send or receive instruction whose partner is ready, as a
    #   latency of at least the fastest send.
    def misfit(trial: StepModel) -> float:
        return sum(((predict_run(trial, r) - r.step_s) / r.step_s) ** 2 for r in runs)

    steps = [0.0, *np.geomspace(1e-5, 0.1, 41)]
    if cores and any(r.ranks > cores for r in runs):
        return min((replace(model, p2p_wake_s=float(w)) for w in steps), key=misfit)
    return min((replace(model, p2p_latency_s=float(model.p2p_latency_s + x)) for x in steps), key=misfit)


def _optimizer_stretch(model: StepModel, run: RunStages, rank: int) -> float:
    """How much longer ``rank``'s update takes in ``run`` than alone, as ``model`` predicts it."""
    alone = model.optimizer_s(run.stages[rank].param_bytes)
    if not model.shared_memory or alone <= 0:
        return 1.0
    pred = model.predict(run.stages, run.micro_batches, schedule=run.schedule)
    starts = pred.simulation.stage_finish_s
    ends = model.optimizer_finish_s(starts, [model.optimizer_s(st.param_bytes) for st in run.stages])
    return (ends[rank] - starts[rank]) / alone


def _stage_slowdown(model: StepModel, run: RunStages) -> list[float]:
    """Mean shared-core stretch of each stage's compute in ``run``, as ``model`` predicts it."""
    if not model.cores or len(run.stages) <= model.cores:
        return [1.0] * len(run.stages)
    pred = model.predict(run.stages, run.micro_batches, schedule=run.schedule)
    out = []
    for s in range(len(run.stages)):
        ks = [k for (r, w), k in pred.slowdown.items() if r == s]
        out.append(float(np.mean(ks)) if ks else 1.0)
    return out


def predict_run(model: StepModel, run: RunStages) -> float:
    """The step ``model`` predicts for ``run``'s split, layer costs, micro-batches and schedule (seconds)."""
    return model.predict(run.stages, run.micro_batches, schedule=run.schedule).step_s
