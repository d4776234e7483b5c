"""Partition by the predicted step: an exact branch and bound over contiguous splits.

``partition_min_max`` minimises the slowest stage's forward + backward.  A step also holds the
pipeline's fill and drain, every stage's optimizer step after the stages meet (it grows with a
stage's parameters), the engine's fixed cost per instruction and the transfers: what
``StepModel.predict`` simulates.  This finds the contiguous split whose predicted step is
smallest:

* incumbent: the min-max split (the fast core), so the search starts from a good answer;
* branch: boundaries left to right, one stage at a time; a stage over the memory cap is cut;
* bound: ``step_lower_bound`` (the one bound: a stage's m forwards and backwards after micro-batch
  0's way in, then its update or the drain back to stage 0 and stage 0's update) over the stages
  fixed so far (``FixedStages``), and for the layers left its least value over every real split of
  their time.  Under ZB-H1 the drain term is left out.  The simulation never goes below it
  (``tests/test_step_model.py``);
* leaves whose own bound (the whole split's) is below the best found are simulated.  A subtree is
  dropped only when its bound reaches the best step found, so the answer is the minimum over
  every split: exact.  Past ``max_leaves`` simulations the search expands nothing more (every
  subtree not yet entered stays open) and ``StepSearch.gap`` states how far from the optimum the
  answer can be (best / smallest bound left open - 1).  So it does past ``BOUNDS_PER_LEAF`` x
  ``max_leaves`` children bounded: on a deep pipeline of alike layers (llama3.1-405b, p = 64) the
  bounds cut most leaves without a simulation, and the leaf budget alone never ran out.  The default budget is a number of
  simulated instructions (2 p m a leaf), so deep pipelines get fewer leaves, not longer searches:
  on gpt3-175b's 98 analytic layers (A100, TP 8, one CPU core) p = 8, m = 32 takes ~9 s and
  p = 16, m = 64 ~14 s.  The budget is a count, not a clock, so every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..costs.stage import LayerColumns, held_activation_bytes, in_flight, replayed
from ..simulate.schedules import parse_schedule
from ..simulate.step_model import FixedStages, StepModel, step_lower_bound
from .problem import InfeasibleMemoryCap
from .split import partition_min_max

SIMULATED_INSTRUCTIONS = 2_000 * 2 * 8 * 32  # the default budget: 2,000 leaves at p = 8, m = 32
# and a budget of bounds: where the bounds are loose (deep pipelines of many alike layers) subtrees whose
# every leaf is cut by its own bound cost no simulation, and without it the search never reaches a leaf
BOUNDS_PER_LEAF = 50


@dataclass(frozen=True)
class StepSearch:
    parts: list[int]
    step_s: float  # the predicted step of ``parts``
    leaves: int  # splits simulated
    gap: float  # 0.0: proven optimal; otherwise best / lowest open bound - 1
    min_max_parts: list[int]
    min_max_step_s: float


def partition_min_step(
    costs: Sequence,
    num_stages: int,
    *,
    micro_batches: int,
    model: StepModel | None = None,
    schedule: str = "1f1b",
    recompute: bool = False,
    memory_cap_gib: float | None = None,
    link_bandwidth: float | None = None,
    max_leaves: int | None = None,
    peak_rule=None,
) -> StepSearch:
    """The split of ``costs`` (``LayerCost`` list) into ``num_stages`` stages with the smallest step
    ``model`` predicts under ``schedule`` (one chunk per rank: 1f1b, gpipe, zb-h1).  ``max_leaves``:
    simulations before the search states its gap (default: ``SIMULATED_INSTRUCTIONS`` / (2 p m))."""
    # without a fitted step model, each stage's optimizer step is the one its layers were profiled with
    # (``LayerCost.optimizer_step_s``, as ``PartitionPlan.predicted_step_ms`` runs it); a step model has its own
    measured_update = model is None
    model = model or StepModel()
    if link_bandwidth:  # the configured link wins over the model's fitted one
        model = replace(model, p2p_bandwidth=link_bandwidth)
    m, p, n = micro_batches, num_stages, len(costs)
    if max_leaves is None:
        max_leaves = max(100, SIMULATED_INSTRUCTIONS // (2 * p * max(m, 1)))
    start = partition_min_max(costs, p, memory_cap_gib=memory_cap_gib, micro_batches=m, link_bandwidth=link_bandwidth,
                              recompute=recompute, schedule=schedule, peak_rule=peak_rule)  # raises on an infeasible cap

    columns = LayerColumns(costs, recompute=recompute)  # read once: the leaves price thousands of splits

    def step(parts: Sequence[int]) -> float:
        stages = columns.stages(parts, micro_batches=m, schedule=schedule)
        update = [s.optimizer_s for s in stages] if measured_update else None
        return model.predict(stages, m, schedule=schedule, timeline=False, update_s=update).step_s

    best_parts, best = list(start), step(start)
    min_max_step = best
    prefix = lambda v: np.concatenate(([0.0], np.cumsum(np.asarray(v, dtype=float))))  # noqa: E731
    F = prefix([c.forward_s for c in costs])
    B = prefix([c.backward_s + (c.recompute_s if recompute else 0.0) for c in costs])
    P = prefix([c.param_bytes for c in costs])
    O = prefix([getattr(c, "optimizer_step_s", 0.0) if measured_update else 0.0 for c in costs])
    R = (model.forward_per_layer_s + model.recompute_per_layer_s) * prefix(  # per replayed layer
        [float(replayed(c, recompute=recompute)) for c in costs])
    held = peak_rule.layer_states(list(costs)) if peak_rule is not None and memory_cap_gib is not None else costs
    S = prefix([c.static_bytes for c in held])
    ruled = peak_rule is not None and memory_cap_gib is not None
    reserve = peak_rule.stage_reserves(list(costs), p, micro_batches=m) if ruled else [0.0] * p
    T = prefix(peak_rule.step_bytes(list(costs)) if ruled else [0.0] * n)  # bytes at the optimizer step
    A = prefix(held_activation_bytes(costs, recompute=recompute))
    cap = None if memory_cap_gib is None else memory_cap_gib * 2.0**30
    inflight = [in_flight(s, p, m, schedule) for s in range(p)]
    opt = model.optimizer_s
    drains = parse_schedule(schedule).drains
    per_layer = model.forward_per_layer_s + model.backward_per_layer_s

    def f(i: int, j: int) -> float:  # one micro-batch's forward on layers [i, j)
        return model.forward_scale * (F[j] - F[i]) + model.forward_fixed_s + model.forward_per_layer_s * (j - i)

    def t(i: int, j: int) -> float:  # one micro-batch's forward + backward on layers [i, j)
        return (model.forward_scale * (F[j] - F[i]) + model.forward_fixed_s
                + model.backward_scale * (B[j] - B[i]) + model.backward_fixed_s + per_layer * (j - i) + R[j] - R[i])

    def bound(k: int, i: int, fixed: FixedStages) -> float:
        """Stages 0..k-1 fixed, layers [i, n) left for stages k..p-1: the rest's stage times sum to
        ``rest`` whatever the split (t is affine in the layers), and the update of a mean share of
        their parameters is the mean of theirs (opt is affine)."""
        left = p - k
        rest = (model.forward_scale * (F[n] - F[i]) + model.backward_scale * (B[n] - B[i]) + per_layer * (n - i)
                + R[n] - R[i]) + left * (model.forward_fixed_s + model.backward_fixed_s)
        return step_lower_bound(fixed, rest_s=rest, rest_update_s=opt((P[n] - P[i]) / left) + (O[n] - O[i]) / left,
                                stages_left=left,
                                drains=drains, fixed_s=model.step_fixed_s)

    def extend(i: int, j: int, fixed: FixedStages) -> FixedStages:
        """The fixed stages once the next takes layers [i, j)."""
        return fixed.then(f(i, j), t(i, j), opt(P[j] - P[i]) + O[j] - O[i])

    leaves, bounds, open_bounds = 0, 0, []
    max_bounds = BOUNDS_PER_LEAF * max_leaves
    parts = [0] * (p + 1)
    parts[p] = n

    def search(k: int, i: int, fixed: FixedStages) -> None:
        nonlocal best, best_parts, leaves, bounds
        if k == p - 1:  # the last stage takes the rest
            if cap is not None and max(S[n] - S[i] + inflight[k] * (A[n] - A[i]) + reserve[k], T[n] - T[i]) > cap:
                return
            whole = step_lower_bound(extend(i, n, fixed), drains=drains, fixed_s=model.step_fixed_s)  # the split's
            if whole >= best:
                return  # no simulation can beat the best: not worth one
            if leaves >= max_leaves:
                open_bounds.append(whole)
                return
            leaves += 1
            parts[k] = i
            value = step(parts)
            if value < best * (1 - 1e-12):
                best, best_parts = value, list(parts)
            return
        if leaves >= max_leaves or bounds >= max_bounds:  # out of budget: the subtree stays open, in the gap
            open_bounds.append(bound(k, i, fixed))
            return
        children = []
        bounds += n - (p - k - 1) - i
        for j in range(i + 1, n - (p - k - 1) + 1):
            if cap is not None and max(S[j] - S[i] + inflight[k] * (A[j] - A[i]) + reserve[k], T[j] - T[i]) > cap:
                break  # longer stages only hold more
            nxt = extend(i, j, fixed)
            children.append((bound(k + 1, j, nxt), j, nxt))
        for nb, j, nxt in sorted(children):  # most promising first: the best found falls early
            if nb >= best:
                break
            parts[k] = i
            search(k + 1, j, nxt)

    if p == 1:
        return StepSearch([0, n], best, 1, 0.0, best_parts, min_max_step)
    search(0, 0, FixedStages(m))
    lowest_open = min(open_bounds, default=float("inf"))
    gap = 0.0 if lowest_open >= best else best / lowest_open - 1.0
    return StepSearch(best_parts, best, leaves, gap, list(start), min_max_step)


__all__ = ["InfeasibleMemoryCap", "StepSearch", "partition_min_step"]
