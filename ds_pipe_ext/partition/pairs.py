"""Exact min-max partitioning for DualPipeV: 2p contiguous chunks, balanced by rank pairs.

DualPipeV (DeepSpeed's ``DualPipeVModule``) cuts the layers into 2p chunks and gives
rank r chunks r and 2p - 1 - r: the outermost pair to rank 0, the middle pair to rank
p - 1.  A rank runs both its chunks for every micro-batch, so what must be balanced is
the pair's sum:

    minimise  max_r  T(chunk r) + T(chunk 2p - 1 - r)

Method.  Bisection on the bound B (``algorithms._bisect_floats``) with an exact
feasibility probe that peels the pairs from the outside in.  After r outer pairs the
layers left are one interval [i, j); ``reach[r][i, j]`` says whether some choice of
those pairs fits B.  The next pair takes [i, i') and [j', j), which fits when

    P[i'] - P[j'] + (P[j] - P[i]) <= B        (P: prefix sums of the times)

so for every (i', j') only the smallest P[j] - P[i] over reachable (i < i', j > j')
matters: a 2-D running minimum, O(n^2) a pair with numpy.  The middle pair is one
interval [i, j) cut anywhere inside (its sum does not depend on the cut; we cut it
as evenly as the layers allow).  Times only: memory caps and boundary transfers are
the general solver's (``algorithms``), for one chunk per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .algorithms import _bisect_floats
from .problem import PartitionError


def pair_times(times: Sequence[float], parts: Sequence[int]) -> list[float]:
    """Per rank: the time of its two chunks (chunk r and 2p - 1 - r of ``parts``)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(times, dtype=np.float64))])
    chunk = [float(prefix[parts[c + 1]] - prefix[parts[c]]) for c in range(len(parts) - 1)]
    p = len(chunk) // 2
    return [chunk[r] + chunk[2 * p - 1 - r] for r in range(p)]


def _probe(prefix: np.ndarray, p: int, bound: float) -> list[int] | None:
    n = len(prefix) - 1
    idx = np.arange(n + 1)
    i_grid, j_grid = np.meshgrid(idx, idx, indexing="ij")
    span = prefix[j_grid] - prefix[i_grid]  # P[j] - P[i]
    inf = np.inf
    # the interval left after r outer pairs must hold the 2 (p - r) chunks still to come
    reach = [(i_grid == 0) & (j_grid == n)]
    for r in range(p - 1):
        left = 2 * (p - r - 1)
        m = np.where(reach[-1], span, inf)
        # best[i', j'] = min over reachable (i <= i' - 1, j >= j' + 1) of P[j] - P[i]
        best = np.minimum.accumulate(m, axis=0)
        best = np.minimum.accumulate(best[:, ::-1], axis=1)[:, ::-1]
        shifted = np.full_like(best, inf)
        shifted[1:, :-1] = best[:-1, 1:]
        ok = np.isfinite(shifted) & (shifted + (prefix[i_grid] - prefix[j_grid]) <= bound) & (j_grid - i_grid >= left)
        if not ok.any():
            return None
        reach.append(ok)
    last = reach[-1] & (j_grid - i_grid >= 2) & (span <= bound)
    if not last.any():
        return None
    i, j = (int(x) for x in np.argwhere(last)[0])
    lefts, rights = [i], [j]
    for r in range(p - 1, 0, -1):  # walk back to the pair that left (i, j)
        cand = reach[r - 1] & (i_grid < i) & (j_grid > j)
        cand &= span + (prefix[i] - prefix[j]) <= bound  # the forward test's own arithmetic
        i, j = (int(x) for x in np.argwhere(cand)[0])
        lefts.append(i)
        rights.append(j)
    lo, hi = lefts[0], rights[0]  # the middle pair's interval
    inner = np.arange(lo + 1, hi)
    cut = int(inner[np.argmin(np.abs((prefix[inner] - prefix[lo]) - (prefix[hi] - prefix[inner])))])
    return sorted(lefts) + [cut] + sorted(rights)


def _probed_max(prefix: np.ndarray, parts: list[int]) -> float:
    """The slowest rank's pair as the probe computes it: (P[j] - P[i]) + (P[i'] - P[j']) for an outer pair
    that leaves [i', j') of [i, j), P[j] - P[i] for the middle one.  Rounded like the probe's test, so that
    a split found under a bound is found again under its own value."""
    p = (len(parts) - 1) // 2
    worst = float(prefix[parts[p + 1]] - prefix[parts[p - 1]])
    for r in range(p - 1):
        outer = prefix[parts[2 * p - r]] - prefix[parts[r]]
        worst = max(worst, float(outer + (prefix[parts[r + 1]] - prefix[parts[2 * p - 1 - r]])))
    return worst


def partition_pairs_min_max(times: Sequence[float], num_ranks: int) -> list[int]:
    """DeepSpeed ``parts`` (2 x num_ranks + 1 boundaries) minimising the slowest rank's two chunks."""
    t = np.asarray(times, dtype=np.float64)
    n, p = len(t), num_ranks
    if p < 1:
        raise PartitionError(f"num_ranks must be >= 1, got {p}")
    if 2 * p > n:
        raise PartitionError(f"DualPipeV cuts {2 * p} chunks (2 per rank) but there are only {n} layers: "
                             f"use at most {n // 2} pipeline ranks")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise PartitionError("layer times must be finite and >= 0")
    prefix = np.concatenate([[0.0], np.cumsum(t)])

    def probe(bound):
        parts = _probe(prefix, p, bound)
        return None if parts is None else (parts, _probed_max(prefix, parts))

    first = _probe(prefix, p, np.inf)
    best, _ = _bisect_floats(None, _probed_max(prefix, first), probe)
    final = _probe(prefix, p, best)
    assert final is not None
    return final
