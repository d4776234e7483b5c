"""Exact contiguous min-max partitioning of layer costs into pipeline stages.

Pure functions of plain lists (numpy only, no torch, no process groups), so every
rule here is testable against brute force.

Problem.  Layers 0..n-1 with times t_i go, in order, into p non-empty stages; the
boundaries ``parts = [0, b_1, ..., b_{p-1}, n]`` follow DeepSpeed's convention
(stage s owns layers ``parts[s]:parts[s+1]``).  We minimise the slowest stage:

    stage_time(i, j) = sum(t[i:j]) + comm_in(i) + comm_out(j)

where the optional boundary terms are the p2p time of the activation that enters
(i > 0) or leaves (j < n) the stage.  Under 1F1B a stage receives its input and
sends its input-gradient, and sends its output and receives the output-gradient,
so each boundary costs the stage ``2 * boundary_time``.

Memory.  With a cap, stage s must also fit

    stage_memory(s, i, j) = sum(static[i:j]) + inflight(s) * sum(activation[i:j]) + reserve(s)

where static = parameter + gradient + optimizer-state bytes, and stage s holds
``inflight(s)`` micro-batches of activations, as the stage model
(``ds_pipe_ext.costs.stage.in_flight``) says for the schedule: min(p - s, m)
under 1F1B (stage 0 holds the most), m under GPipe.  ``reserve(s)`` (0 unless given) is what the
stage holds whatever its layers: the peak rule's buckets, pipe buffers and largest temporaries.  With
per-layer ``step`` bytes (the peak rule's optimizer step) a stage must also fit sum(step[i:j]).

Method.  Bisection on the bottleneck B over floats, where each probe is an exact
feasibility test that also returns the bottleneck it actually achieved.  The
search stops when the infeasible bound and the achieved value are adjacent
floats, so the result is the optimum of the objective exactly as
``stage_time`` computes it.  The feasibility test:

* without boundary terms, every constraint is monotone in the interval, so a
  greedy pass from the last stage that starts each stage as early as allowed
  finds the component-wise smallest feasible boundaries (O(p log n) a probe);
* with boundary terms stage time is no longer monotone, so a reachability pass
  over (stage, boundary) uses vectorised range-minimum queries (O(p n log n)).

With boundary terms and up to ``DENSE_MAX_LAYERS`` layers, a dynamic programme over
(stage, start) replaces the bisection: best[s][i] = min over j of max(stage_time(i, j),
best[s + 1][j]), each stage one vectorised pass over the (n+1) x (n+1) matrix of stage
times (O(p n^2), no probes).  It computes the same subtractions, so it returns the same
optimum and the same partition (tested against the bisection and brute force); the
planner, which partitions thousands of layouts, needs its speed.

Feasibility of a memory cap alone does not depend on time, so it always takes the
monotone probe, boundary terms or not (the smallest feasible cap bisects it).

Ties.  Among optimal partitions we return the lexicographically smallest
``parts``.  That puts the slack in the early stages, which is what 1F1B wants:
they hold the most in-flight activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .problem import InfeasibleMemoryCap, PartitionError, Problem, make_problem

__all__ = ["InfeasibleMemoryCap", "PartitionError", "Problem", "make_problem", "solve", "partition_min_max_lists",
           "smallest_feasible_cap_lists", "bottleneck"]


# --------------------------------------------------------------------------- feasibility probes


def _first_start(prefix: np.ndarray, end: int, budget: float, lo: int) -> int:
    """Smallest i in [lo, end] with prefix[end] - prefix[i] <= budget (prefix non-decreasing).

    searchsorted finds it up to rounding; the two loops make the answer agree
    exactly with the subtraction used everywhere else.
    """
    i = int(np.searchsorted(prefix, prefix[end] - budget, side="left"))
    i = max(i, lo)
    while i < end and prefix[end] - prefix[i] > budget:
        i += 1
    while i > lo and prefix[end] - prefix[i - 1] <= budget:
        i -= 1
    return i


def _probe_monotone(pb: Problem, bound: float, cap: float | None) -> list[int] | None:
    """Exact feasibility when stage cost and memory only grow with the interval.

    Going from the last stage backwards, each stage starts as early as its time and
    memory budgets allow (and late enough to leave one layer per earlier stage).
    Any feasible partition has every boundary at or after these, so the result is
    the component-wise (hence lexicographically) smallest feasible partition, or
    None when even the first stage cannot fit.
    """
    p, n = pb.num_stages, pb.n
    parts = [0] * (p + 1)
    parts[p] = n
    for s in range(p - 1, 0, -1):
        end = parts[s + 1]
        start = _first_start(pb.prefix_time, end, bound, s)
        if cap is not None:
            mem = pb.memory_prefix(pb.inflight(s))
            start = max(start, _first_start(mem, end, pb.stage_budget(s, cap), s))
            if pb.step is not None:  # the optimizer step's moment fits too
                start = max(start, _first_start(pb.step, end, cap, s))
        if start >= end:  # not even one layer fits this stage
            return None
        parts[s] = start
    if pb.stage_time(0, parts[1]) > bound:
        return None
    if cap is not None and pb.stage_memory(0, 0, parts[1]) > cap:
        return None
    return parts


def _range_min_table(values: np.ndarray) -> np.ndarray:
    """Sparse table: row l holds min(values[i : i + 2**l]) (inf past the end)."""
    n = len(values)
    levels = max(1, int(math.floor(math.log2(max(n, 1)))) + 1)
    table = np.full((levels, n), np.inf)
    table[0] = values
    for lvl in range(1, levels):
        half = 1 << (lvl - 1)
        table[lvl, : n - half] = np.minimum(table[lvl - 1, : n - half], table[lvl - 1, half:])
    return table


def _range_min(table: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """min(values[lo:hi+1]) for each query; inf where the range is empty."""
    out = np.full(len(lo), np.inf)
    ok = hi >= lo
    if not np.any(ok):
        return out
    a, b = lo[ok], hi[ok]
    lvl = np.floor(np.log2(b - a + 1)).astype(np.int64)
    out[ok] = np.minimum(table[lvl, a], table[lvl, b - (1 << lvl) + 1])
    return out


def _last_ends(prefix: np.ndarray, budget: float) -> np.ndarray:
    """For every start i, the largest j with prefix[j] - prefix[i] <= budget (j >= i).

    searchsorted gives it up to rounding; the loops make it agree exactly with the
    subtraction that stage_memory uses.
    """
    last = len(prefix) - 1
    hi = np.minimum(np.searchsorted(prefix, prefix + budget, side="right") - 1, last)
    hi = np.maximum(hi, np.arange(len(prefix)))
    while True:
        over = prefix[hi] - prefix > budget
        if not np.any(over):
            break
        hi = np.where(over, hi - 1, hi)
    while True:
        nxt = np.minimum(hi + 1, last)
        grow = (nxt > hi) & (prefix[nxt] - prefix <= budget)
        if not np.any(grow):
            break
        hi = np.where(grow, nxt, hi)
    return hi


def _probe_general(pb: Problem, bound: float, cap: float | None) -> list[int] | None:
    """Exact feasibility with boundary p2p terms (stage time not monotone).

    reach[s] marks the boundaries b at which stages s..p-1 can start and still
    cover b..n.  Start i can begin stage s iff some end j in reach[s+1] with
    i < j <= last_end(i) (the memory cap) has
        prefix[j] + 2*boundary[j] <= bound + prefix[i] - 2*boundary[i],
    a range-minimum query over the reachable ends.  Then the partition is read
    forwards taking the smallest admissible end each time (lexicographic order).
    """
    p, n = pb.num_stages, pb.n
    idx = np.arange(n + 1)
    end_key, start_key = pb.end_key, pb.start_key
    reach = [np.zeros(n + 1, dtype=bool) for _ in range(p + 1)]
    reach[p][n] = True
    last_end = [np.full(n + 1, n) for _ in range(p)]  # the memory cap limits how far a stage reaches
    for s in range(p - 1, -1, -1):
        masked = np.where(reach[s + 1], end_key, np.inf)
        table = _range_min_table(masked)
        if cap is not None:
            last_end[s] = _last_ends(pb.memory_prefix(pb.inflight(s)), pb.stage_budget(s, cap))
            if pb.step is not None:
                last_end[s] = np.minimum(last_end[s], _last_ends(pb.step, cap))
        best = _range_min(table, idx + 1, last_end[s])
        ok = np.isfinite(best) & (best - start_key <= bound)  # inf = no reachable end in range
        # room for one layer per earlier stage and per later stage
        ok &= (idx >= s) & (idx <= n - (p - s))
        reach[s] = ok
    if not reach[0][0]:
        return None
    parts = [0]
    for s in range(p):
        i = parts[-1]
        for j in range(i + 1, int(last_end[s][i]) + 1):
            if reach[s + 1][j] and end_key[j] - start_key[i] <= bound:
                parts.append(j)
                break
        else:  # pragma: no cover - reach[] guarantees an end exists
            raise AssertionError("reachability table inconsistent")
    return parts


def _probe(pb: Problem, bound: float, cap: float | None) -> list[int] | None:
    if pb.boundary is None or bound == math.inf:  # memory alone is monotone in the interval
        return _probe_monotone(pb, bound, cap)
    return _probe_general(pb, bound, cap)


def bottleneck(pb: Problem, parts: Sequence[int]) -> float:
    return max(pb.stage_time(parts[s], parts[s + 1]) for s in range(pb.num_stages))


def _bits(x: float) -> int:
    """Order-preserving integer for a non-negative double (its IEEE-754 bit pattern)."""
    return int(np.float64(x).view(np.int64))


def _from_bits(b: int) -> float:
    return float(np.int64(b).view(np.float64))


def _bisect_floats(lo: float | None, hi: float, probe):
    """Smallest double in (lo, hi] at which ``probe`` succeeds.

    ``probe(x)`` returns (result, achieved) with achieved <= x on success, or None.
    ``lo`` is a value known to fail (None: below 0).  Bisecting the bit patterns
    of non-negative doubles takes at most 64 probes, whatever the magnitudes.
    Returns (hi, result at hi or None if hi was never probed).
    """
    lo_bits = -1 if lo is None else _bits(lo)
    hi_bits, result = _bits(hi), None
    while hi_bits - lo_bits > 1:
        mid_bits = (lo_bits + hi_bits) // 2
        got = probe(_from_bits(mid_bits))
        if got is None or _bits(got[1]) > mid_bits:  # defensive: never trust an overshoot
            lo_bits = mid_bits
        else:
            result, achieved = got
            hi_bits = _bits(achieved)
    return _from_bits(hi_bits), result


def _min_feasible_cap(pb: Problem) -> float:
    """Smallest memory cap that admits any partition (time unconstrained), exactly."""

    def peak(parts):
        return max(pb.stage_memory(s, parts[s], parts[s + 1]) for s in range(pb.num_stages))

    def probe(cap):
        parts = _probe(pb, math.inf, cap)
        return None if parts is None else (parts, peak(parts))

    start = _probe(pb, math.inf, None)
    cap, _ = _bisect_floats(None, peak(start), probe)
    return cap


DENSE_MAX_LAYERS = 512  # the dynamic programme holds (n+1)^2 floats a stage; beyond, bisect


def _solve_dense(pb: Problem) -> list[int]:
    """The optimal, lexicographically smallest partition by dynamic programming (a feasible cap given).

    ``best[s][i]``: the least bottleneck of stages s..p-1 over layers i..n.  A stage's cost
    matrix ``cost[i, j] = stage_time(i, j)`` (inf unless i < j and the stage fits its cap) is the
    probes' own subtraction, so the optimum is ``bottleneck`` of the returned partition exactly.
    """
    p, n, cap = pb.num_stages, pb.n, pb.memory_cap
    times = pb.end_key[None, :] - pb.start_key[:, None]
    times[np.tril_indices(n + 1)] = np.inf  # a stage holds at least one layer

    def cost(s: int, rows=slice(None)) -> np.ndarray:
        if cap is None:
            return times[rows]
        mem = pb.memory_prefix(pb.inflight(s))
        fits = mem[None, :] - mem[rows, None] <= pb.stage_budget(s, cap)
        if pb.step is not None:
            fits &= pb.step[None, :] - pb.step[rows, None] <= cap
        return np.where(fits, times[rows], np.inf)

    best = [np.empty(0)] * p + [np.full(n + 1, np.inf)]
    best[p][n] = -np.inf
    for s in range(p - 1, -1, -1):
        best[s] = np.maximum(cost(s), best[s + 1][None, :]).min(axis=1)
    opt = best[0][0]
    parts = [0]
    for s in range(p):  # the smallest end at each stage that still reaches the optimum: lexicographic
        row = cost(s, slice(parts[-1], parts[-1] + 1))[0]
        parts.append(int(np.argmax((row <= opt) & (best[s + 1] <= opt))))
    return parts


def solve(pb: Problem, *, explain_infeasible: bool = True) -> list[int]:
    """Optimal boundaries for a validated problem (see the module docstring).

    ``explain_infeasible=False``: an infeasible cap raises without the smallest feasible cap
    (``min_feasible_cap`` None), which costs up to 64 probes; a search over many layouts asks later."""
    cap = pb.memory_cap
    first = _probe(pb, math.inf, cap)
    if first is None:
        raise InfeasibleMemoryCap(cap, _min_feasible_cap(pb) if explain_infeasible else None)
    if pb.boundary is not None and pb.n <= DENSE_MAX_LAYERS:
        return _solve_dense(pb)

    def probe(bound):
        parts = _probe(pb, bound, cap)
        return None if parts is None else (parts, bottleneck(pb, parts))

    # No stage is faster than its slowest layer (float subtraction is monotone, so
    # this holds for the computed stage times too): just below it, nothing fits.
    slowest_layer = float(np.max(np.diff(pb.prefix_time)))
    lo = None if slowest_layer == 0.0 else np.nextafter(slowest_layer, -math.inf)
    best, _ = _bisect_floats(lo, bottleneck(pb, first), probe)
    # the lexicographically smallest partition whose bottleneck is the optimum
    final = _probe(pb, best, cap)
    assert final is not None and bottleneck(pb, final) <= best
    return final


def partition_min_max_lists(times: Sequence[float], num_stages: int, **options) -> list[int]:
    """Plain-list entry point: returns DeepSpeed ``parts`` (num_stages + 1 boundaries).

    ``options`` are ``make_problem``'s: static_bytes, activation_bytes, micro_batches,
    memory_cap, boundary_time, schedule; and ``solve``'s explain_infeasible.
    """
    explain = options.pop("explain_infeasible", True)
    return solve(make_problem(times, num_stages, **options), explain_infeasible=explain)


def smallest_feasible_cap_lists(times: Sequence[float], num_stages: int, **options) -> float:
    """The smallest memory cap that admits any split (``make_problem``'s options, no memory_cap)."""
    pb = make_problem(times, num_stages, **options)
    if pb.static is None:
        raise PartitionError("the smallest feasible cap needs per-layer static_bytes and/or activation_bytes")
    return _min_feasible_cap(pb)
