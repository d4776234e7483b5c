"""Split and recompute chosen together: the contiguous split of layers into pipeline stages and, per
stage, which layers recompute, minimising the slowest stage under a memory cap.  Pure functions of
plain lists (no torch, no numpy), so every rule is checked against brute force.

Each layer offers a few recompute modes (none; selective: attention's core; full: only its input kept),
each a ``RecomputeMode``:

    kept_bytes     what the layer holds per in-flight micro-batch
    replay_bytes   what its backward re-materialises beside that (full: its activations again; none: 0)
    replay_time    the forward it replays in its backward (seconds)

Stage s holding layers [i, j) with one mode each costs

    time   = sum(time[i:j]) + sum(replay_time)
    memory = sum(static[i:j]) + inflight[s] * sum(kept_bytes) + max(replay_bytes) + reserve[s]

(a backward replays one layer at a time, so only the largest replay adds to the peak), and, where given,
sum(step[i:j]) <= cap too (the optimizer step's bytes, whatever the modes).

The cheapest modes for one stage (``cheapest_modes``) are a multiple-choice knapsack with a max term.
For each candidate largest replay R (one of the stage's own values, smallest first), only modes replaying
at most R are allowed, and the Pareto frontier of (kept bytes, replay time) is built layer by layer: a
pair another beats in both can never complete a better set, so the frontier's cheapest pair that fits is
the optimum.  Alike layers land on the same points, so a stage of k alike blocks keeps O(k^2) of them.

The split: best[s][i] = min over j of max(stage cost(s, i, j), best[s + 1][j]).  A stage's cost never falls
as it gains a layer at either end (more time, more memory, never a cheaper recompute), and best[s + 1][j]
never rises with j, so each (s, i) bisects for the crossing: O(p n log n) stage evaluations, cached.
Ties go to the lexicographically smallest ``parts`` (the slack in the early stages, as the split alone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..costs.stage import RecomputeMode
from .problem import InfeasibleMemoryCap, PartitionError

__all__ = ["RecomputeMode", "JointSplit", "cheapest_modes", "partition_with_recompute", "stage_memory"]

INF = math.inf


@dataclass(frozen=True)
class JointSplit:
    parts: list[int]
    modes: list[str]  # one per layer
    bottleneck: float  # the slowest stage's time, recompute included
    stage_times: list[float]
    stage_memory: list[float]  # each stage's peak by the rule: its backward's or its optimizer step's


def stage_memory(static_bytes: Sequence[float], chosen: Sequence[RecomputeMode], inflight: int, reserve: float = 0.0,
                 step_bytes: Sequence[float] = ()) -> float:
    """One stage's peak by the rule above: its backward's (its layers' states, ``inflight`` micro-batches of the
    kept bytes, the largest replay, the reserve), or its optimizer step's bytes where larger."""
    during = (sum(static_bytes) + inflight * sum(m.kept_bytes for m in chosen)
              + max((m.replay_bytes for m in chosen), default=0.0) + reserve)
    return max(during, sum(step_bytes))


def cheapest_modes(options: Sequence[Sequence[RecomputeMode]], budget: float,
                   inflight: int) -> tuple[float, tuple[int, ...]] | None:
    """The least replay time of one mode per layer with inflight x sum(kept) + max(replay) <= budget, and
    the modes' indices; None when no choice fits."""
    return _cheapest_modes(tuple(tuple(layer) for layer in options), float(budget), int(inflight))


@lru_cache(maxsize=65536)  # stages of alike blocks repeat the same question
def _cheapest_modes(options: tuple, budget: float, inflight: int) -> tuple[float, tuple[int, ...]] | None:
    if budget < 0:
        return None
    # the quickest modes (no recompute, usually; the first listed among equally quick): the answer whenever
    # they fit
    quick = tuple(min(range(len(layer)), key=lambda k: (layer[k].replay_time, k)) for layer in options)
    chosen = [layer[k] for layer, k in zip(options, quick)]
    if inflight * sum(m.kept_bytes for m in chosen) + max((m.replay_bytes for m in chosen), default=0.0) <= budget:
        return sum(m.replay_time for m in chosen), quick
    replays = sorted({m.replay_bytes for layer in options for m in layer})
    best: tuple[float, tuple[int, ...]] | None = None
    for cap_replay in replays:
        if cap_replay > budget:
            break
        room = (budget - cap_replay) / inflight if inflight else INF
        # frontier: (kept, time, choice) sorted by kept, time strictly falling
        frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
        for layer in options:
            allowed = [(k, m) for k, m in enumerate(layer) if m.replay_bytes <= cap_replay]
            if not allowed:
                frontier = []
                break
            merged = sorted(((kept + m.kept_bytes, time + m.replay_time, choice + (k,))
                             for kept, time, choice in frontier for k, m in allowed), key=lambda x: (x[0], x[1]))
            frontier = []
            for point in merged:
                if point[0] > room:
                    break
                if not frontier or point[1] < frontier[-1][1]:
                    frontier.append(point)
        if frontier:
            time, choice = frontier[-1][1], frontier[-1][2]
            if best is None or time < best[0]:
                best = (time, choice)
    return best


def partition_with_recompute(times: Sequence[float], static_bytes: Sequence[float],
                             options: Sequence[Sequence[RecomputeMode]], num_stages: int, *,
                             memory_cap: float, inflight: Sequence[int],
                             reserve: Sequence[float] | None = None,
                             step_bytes: Sequence[float] | None = None) -> JointSplit:
    """The split into ``num_stages`` stages and a recompute mode per layer with the smallest slowest stage
    (layer times plus replays) such that every stage fits ``memory_cap``; ``inflight[s]``: micro-batches
    stage s holds (``costs.stage.in_flight``); ``reserve[s]``: what it holds whatever its layers.
    Raises ``InfeasibleMemoryCap`` (with the smallest cap that fits) when no split and modes fit."""
    n, p = len(times), num_stages
    if not (len(static_bytes) == len(options) == n):
        raise PartitionError(f"times ({n}), static_bytes ({len(static_bytes)}) and options ({len(options)}) "
                             f"need one entry per layer")
    if not 1 <= p <= n:
        raise PartitionError(f"cannot split {n} layers into {p} non-empty stages: use 1 to {n} stages")
    if len(inflight) != p or (reserve is not None and len(reserve) != p):
        raise PartitionError(f"inflight and reserve need one entry per stage ({p})")
    if any(not layer for layer in options):
        raise PartitionError("every layer needs at least one recompute mode (none)")
    reserve = [0.0] * p if reserve is None else list(reserve)
    prefix_t, prefix_m, prefix_step = [0.0], [0.0], [0.0]
    for t, m, b in zip(times, static_bytes, step_bytes or [0.0] * n):
        prefix_t.append(prefix_t[-1] + t)
        prefix_m.append(prefix_m[-1] + m)
        prefix_step.append(prefix_step[-1] + b)
    frozen = tuple(tuple(layer) for layer in options)

    @lru_cache(maxsize=None)
    def stage(s: int, i: int, j: int) -> tuple[float, tuple[int, ...]] | None:
        if prefix_step[j] - prefix_step[i] > memory_cap:
            return None
        budget = memory_cap - reserve[s] - (prefix_m[j] - prefix_m[i])
        found = _cheapest_modes(frozen[i:j], budget, inflight[s])
        if found is None:
            return None
        return (prefix_t[j] - prefix_t[i]) + found[0], found[1]

    def cost(s: int, i: int, j: int) -> float:
        found = stage(s, i, j)
        return INF if found is None else found[0]

    # best[s][i]: the smallest bottleneck of stages s..p-1 over layers i..n-1
    best = [[INF] * (n + 1) for _ in range(p + 1)]
    best[p][n] = 0.0
    for s in range(p - 1, -1, -1):
        for i in range(s, n - (p - s) + 1):
            lo, hi = i + 1, n - (p - s - 1)  # stage s ends at j in [lo, hi]
            # the first j where the stage's cost reaches the rest's best: the optimum is there or just before
            a, b = lo, hi
            while a < b:
                mid = (a + b) // 2
                if cost(s, i, mid) >= best[s + 1][mid]:
                    b = mid
                else:
                    a = mid + 1
            best[s][i] = min(max(cost(s, i, j), best[s + 1][j]) for j in {max(lo, a - 1), a})
    bound = best[0][0]
    if bound == INF:
        raise InfeasibleMemoryCap(memory_cap, _smallest_cap(frozen, prefix_m, prefix_step, inflight, reserve, n, p))
    # the lexicographically smallest parts within the bound: each stage ends at the first j whose rest
    # fits the bound (best[s + 1][j] only falls with j, and the stage's cost there is within it)
    parts, modes, stage_times, stage_peaks = [0], [], [], []
    for s in range(p):
        i = parts[-1]
        a, b = i + 1, n - (p - s - 1)
        while a < b:
            mid = (a + b) // 2
            if best[s + 1][mid] <= bound:
                b = mid
            else:
                a = mid + 1
        j = a
        time, choice = stage(s, i, j)
        chosen = [frozen[i + k][c] for k, c in enumerate(choice)]
        parts.append(j)
        modes += [m.name for m in chosen]
        stage_times.append(time)
        stage_peaks.append(stage_memory(static_bytes[i:j], chosen, inflight[s], reserve[s],
                                        step_bytes[i:j] if step_bytes is not None else ()))
    return JointSplit(parts, modes, best[0][0], stage_times, stage_peaks)


def _smallest_cap(options, prefix_m, prefix_step, inflight, reserve, n: int, p: int) -> float:
    """The smallest cap any split fits with its leanest modes: min over splits of the most any stage needs.

    A stage's leanest need is the least, over candidate largest replays r, of inflight x (each layer's smallest
    kept bytes among modes replaying at most r) + r.  Per r those sums are prefix sums over the layers, so a
    stage costs O(#r); an r none of the stage's own modes has never wins (the sums are those of the stage's
    next smaller value, r is larger)."""
    replays = sorted({m.replay_bytes for layer in options for m in layer})
    kept_sums, missing = {}, {}  # per r: prefix sums of the leanest kept bytes; of layers with no mode <= r
    for r in replays:
        kept, none = [0.0], [0]
        for layer in options:
            allowed = [m.kept_bytes for m in layer if m.replay_bytes <= r]
            kept.append(kept[-1] + (min(allowed) if allowed else 0.0))
            none.append(none[-1] + (not allowed))
        kept_sums[r], missing[r] = kept, none

    def need(s: int, i: int, j: int) -> float:
        lean = min(inflight[s] * (kept_sums[r][j] - kept_sums[r][i]) + r
                   for r in replays if missing[r][j] == missing[r][i])
        return max(prefix_m[j] - prefix_m[i] + reserve[s] + lean, prefix_step[j] - prefix_step[i])

    best = [[INF] * (n + 1) for _ in range(p + 1)]
    best[p][n] = 0.0
    for s in range(p - 1, -1, -1):
        for i in range(s, n - (p - s) + 1):
            best[s][i] = min(max(need(s, i, j), best[s + 1][j]) for j in range(i + 1, n - (p - s - 1) + 1))
    return best[0][0]
