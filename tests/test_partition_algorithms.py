"""The partitioner against brute force, literal cases and DeepSpeed's own balancer.

Costs in the hypothesis tests are small integers held as floats, so every sum is
exact and 'optimal' and 'lexicographically smallest' can be checked to the letter.
"""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipe_ext.costs.types import LayerCost
from ds_pipe_ext.partition import InfeasibleMemoryCap, PartitionError, partition_min_max
from ds_pipe_ext.partition.algorithms import partition_min_max_lists


def brute_force(times, p, static=None, act=None, m=None, cap=None, boundary=None):
    """Every split in lexicographic order; the first with the smallest bottleneck wins."""
    n = len(times)
    m = p if m is None else m
    best, best_parts = None, None
    for cuts in itertools.combinations(range(1, n), p - 1):
        parts = [0, *cuts, n]
        worst, fits = 0, True
        for s in range(p):
            i, j = parts[s], parts[s + 1]
            t = sum(times[i:j])
            if boundary is not None:
                t += (2 * boundary[i - 1] if i > 0 else 0) + (2 * boundary[j - 1] if j < n else 0)
            worst = max(worst, t)
            if cap is not None:
                mem = sum(static[i:j]) + min(p - s, m) * sum(act[i:j])
                fits &= mem <= cap
        if fits and (best is None or worst < best):
            best, best_parts = worst, parts
    return best_parts


def smallest_cap(times, p, static, act, m):
    n = len(times)
    return min(
        max(sum(static[parts[s]:parts[s + 1]]) + min(p - s, m) * sum(act[parts[s]:parts[s + 1]]) for s in range(p))
        for parts in ([0, *c, n] for c in itertools.combinations(range(1, n), p - 1))
    )


def instance(max_layers=9, with_memory=False, with_boundary=False):
    @st.composite
    def build(draw):
        n = draw(st.integers(1, max_layers))
        p = draw(st.integers(1, n))
        ints = st.lists(st.integers(0, 20), min_size=n, max_size=n)
        d = {"times": [float(x) for x in draw(ints)], "p": p}
        if with_memory:
            d["static"] = [float(x) for x in draw(ints)]
            d["act"] = [float(x) for x in draw(ints)]
            d["m"] = draw(st.integers(1, 6))
            d["cap"] = float(draw(st.integers(1, 150)))
        if with_boundary:
            d["boundary"] = [float(x) for x in draw(ints)]
        return d

    return build()


def test_literal_cases():
    assert partition_min_max([1, 2, 3, 4, 5, 6], 2) == [0, 4, 6]
    assert partition_min_max([1, 1, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert partition_min_max([5], 1) == [0, 1]
    # ties: slack goes to the early stages (lexicographically smallest parts)
    assert partition_min_max([1, 1, 1], 2) == [0, 1, 3]
    # the GPT shape: a cheap embedding, 12 blocks, a head worth 4 blocks:
    # stage 0 = 0.1 + 8 blocks = 8.1, stage 1 = 4 blocks + head = 8
    assert partition_min_max([0.1] + [1.0] * 12 + [4.0], 2) == [0, 9, 14]


@settings(max_examples=1500, deadline=None)
@given(instance())
def test_matches_brute_force(d):
    got = partition_min_max_lists(d["times"], d["p"])
    assert got == brute_force(d["times"], d["p"])


@settings(max_examples=1500, deadline=None)
@given(instance(with_memory=True))
def test_memory_cap_matches_brute_force(d):
    want = brute_force(d["times"], d["p"], d["static"], d["act"], d["m"], d["cap"])
    kw = dict(static_bytes=d["static"], activation_bytes=d["act"], micro_batches=d["m"], memory_cap=d["cap"])
    if want is None:
        with pytest.raises(InfeasibleMemoryCap) as err:
            partition_min_max_lists(d["times"], d["p"], **kw)
        assert err.value.min_feasible_cap == smallest_cap(d["times"], d["p"], d["static"], d["act"], d["m"])
    else:
        assert partition_min_max_lists(d["times"], d["p"], **kw) == want


@settings(max_examples=1000, deadline=None)
@given(instance(with_memory=True, with_boundary=True))
def test_boundary_comm_and_memory_match_brute_force(d):
    want = brute_force(d["times"], d["p"], d["static"], d["act"], d["m"], d["cap"], d["boundary"])
    kw = dict(static_bytes=d["static"], activation_bytes=d["act"], micro_batches=d["m"], memory_cap=d["cap"],
              boundary_time=d["boundary"])
    if want is None:
        with pytest.raises(InfeasibleMemoryCap):
            partition_min_max_lists(d["times"], d["p"], **kw)
    else:
        assert partition_min_max_lists(d["times"], d["p"], **kw) == want


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_dense_programme_equals_the_bisection_on_real_costs(data):
    """Boundary terms take the O(p n^2) dynamic programme; the probe bisection, forced here, must
    return the same partition to the bit (both compute the optimum exactly)."""
    from ds_pipe_ext.partition import algorithms

    n = data.draw(st.integers(2, 60))
    p = data.draw(st.integers(1, min(n, 12)))
    floats = st.lists(st.floats(0, 1e3, allow_nan=False), min_size=n, max_size=n)
    kw = dict(boundary_time=data.draw(floats), static_bytes=data.draw(floats), activation_bytes=data.draw(floats),
              micro_batches=data.draw(st.integers(1, 8)), schedule=data.draw(st.sampled_from(["1f1b", "gpipe"])))
    kw["memory_cap"] = data.draw(st.floats(1.0, 1e5))
    times = data.draw(floats)
    try:
        dense = partition_min_max_lists(times, p, **kw)
    except InfeasibleMemoryCap:
        dense = None
    saved, algorithms.DENSE_MAX_LAYERS = algorithms.DENSE_MAX_LAYERS, 0
    try:
        bisected = partition_min_max_lists(times, p, **kw)
    except InfeasibleMemoryCap:
        bisected = None
    finally:
        algorithms.DENSE_MAX_LAYERS = saved
    assert dense == bisected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=2, max_size=40), st.integers(1, 8))
def test_real_valued_costs_are_optimal(times, p):
    p = min(p, len(times))
    parts = partition_min_max_lists(times, p)
    assert parts[0] == 0 and parts[-1] == len(times) and all(a < b for a, b in zip(parts, parts[1:]))
    worst = max(sum(times[parts[s]:parts[s + 1]]) for s in range(p))
    if len(times) <= 12:
        ref = brute_force(times, p)
        ref_worst = max(sum(times[ref[s]:ref[s + 1]]) for s in range(p))
        assert worst <= ref_worst * (1 + 1e-12) + 1e-12


def test_layer_costs_and_memory_cap_in_gib():
    gib = 2**30
    costs = [LayerCost(f"l{i}", forward_s=1.0, backward_s=2.0, param_bytes=gib // 4, activation_bytes=gib // 8)
             for i in range(8)]
    # without a cap: 4 layers a stage
    assert partition_min_max(costs, 2, micro_batches=4) == [0, 4, 8]
    # stage 0 holds 2 micro-batches in flight, stage 1 one: 4 layers on stage 0 need 4*(1/4+2/8) = 2 GiB
    # stage 0 holds 2 micro-batches in flight, stage 1 holds 1: stage 0 costs 0.5 GiB a layer,
    # stage 1 0.375 GiB a layer.  Cap 1.5 GiB: stage 0 <= 3 layers, stage 1 <= 4 layers -> infeasible
    # for 8 layers; cap 2 GiB: [0,4,8] fits (2.0 and 1.5 GiB).
    assert partition_min_max(costs, 2, micro_batches=4, memory_cap_gib=2.0) == [0, 4, 8]
    # cap 2.25 GiB with a slow last layer: the time optimum [0,5,8] would need 2.5 GiB on stage 0
    slow_tail = costs[:-1] + [LayerCost("tail", 4.0, 8.0, param_bytes=gib // 4, activation_bytes=gib // 8)]
    assert partition_min_max(slow_tail, 2, micro_batches=4) == [0, 5, 8]
    assert partition_min_max(slow_tail, 2, micro_batches=4, memory_cap_gib=2.25) == [0, 4, 8]
    with pytest.raises(InfeasibleMemoryCap) as err:
        partition_min_max(costs, 2, micro_batches=4, memory_cap_gib=1.5)
    # best is [0,4,8]: max(4*0.5, 4*0.375) = 2 GiB; [0,3,8] needs 5*0.375 = 1.875 GiB
    assert err.value.min_feasible_cap == pytest.approx(1.875 * gib)
    assert "smallest cap" in str(err.value) and "1.8750 GiB" in str(err.value)


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2, 3], 4), "at most 3 stages"),
        (([1, 2, 3], 0), "positive integer"),
        (([], 1), "no layers"),
        (([1, -2, 3], 2), r"times\[1\]"),
        (([1, float("nan")], 1), r"times\[1\]"),
    ],
)
def test_bad_input_names_the_fix(args, match):
    with pytest.raises(PartitionError, match=match):
        partition_min_max(*args)


def test_cap_needs_bytes():
    with pytest.raises(PartitionError, match="LayerCost"):
        partition_min_max([1.0, 2.0], 2, memory_cap_gib=1)


# --------------------------------------------------------------------------- against DeepSpeed


def _bottleneck(times, parts):
    return max(sum(times[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1))


def test_deepspeed_partition_balanced_is_worse_here():
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    # DeepSpeed minimises (slowest - fastest), not the slowest stage: it picks
    # [1+6 | 3 | 3] (spread 4, bottleneck 7) over [1 | 6 | 3+3] (spread 5, bottleneck 6).
    times = [1, 6, 3, 3]
    ours, theirs = partition_min_max(times, 3), [int(b) for b in ds_utils.partition_balanced(times, 3)]
    assert ours == [0, 1, 2, 4] and _bottleneck(times, ours) == 6
    assert theirs == [0, 2, 3, 4] and _bottleneck(times, theirs) == 7


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=16), st.integers(2, 6))
def test_deepspeed_never_better(times, p):
    ds_utils = pytest.importorskip("deepspeed.runtime.utils")
    p = min(p, len(times))
    ours = partition_min_max([float(t) for t in times], p)
    theirs = ds_utils.partition_balanced(times, p)
    assert _bottleneck(times, ours) <= _bottleneck(times, theirs)


def test_dualpipev_pairs_are_balanced_exactly_against_brute_force():
    """DualPipeV gives rank r chunks r and 2p - 1 - r: the split minimises the slowest pair."""
    import itertools
    import random

    from ds_pipe_ext.partition.pairs import pair_times, partition_pairs_min_max

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 10)
        p = rng.randint(1, n // 2)
        t = [float(rng.randint(0, 20)) for _ in range(n)]
        brute = min(max(pair_times(t, [0, *c, n])) for c in itertools.combinations(range(1, n), 2 * p - 1))
        parts = partition_pairs_min_max(t, p)
        assert parts[0] == 0 and parts[-1] == n and len(parts) == 2 * p + 1
        assert all(a < b for a, b in zip(parts, parts[1:]))
        assert max(pair_times(t, parts)) == brute, (t, p, parts)
    # an embedding (cheap) and a head (dear) at the two ends land on the same rank, 0, which then
    # takes two blocks (1 + 4 + 4 + 9 = 18) and leaves four to rank 1 (16); a 1F1B-style min-max
    # over the four chunks alone would give rank 0 the head's chunk plus another
    t = [1, 4, 4, 4, 4, 4, 4, 9]
    assert pair_times(t, partition_pairs_min_max(t, 2)) == [18.0, 16.0]
    with pytest.raises(PartitionError, match="at most 2 pipeline ranks"):
        partition_pairs_min_max([1.0] * 5, 3)
    # non-integer times: the probe's sums round differently from pair_times', and a split found under
    # a bound must be found again under its own value (this one stopped on an assertion)
    t = [x * 3 if i in (3, 5, 6, 8) else x for i, x in enumerate([0.2, 0.001, 0.1, 0.3, 0.7, 0.3, 0.3, 0.1 * 3,
                                                                   0.3, 0.2 * 3, 0.003, 0.3, 0.1 * 3, 0.7, 0.001,
                                                                   0.3, 0.2, 0.1 * 3])]
    brute = min(max(pair_times(t, [0, *c, 18])) for c in itertools.combinations(range(1, 18), 9))
    assert max(pair_times(t, partition_pairs_min_max(t, 5))) == pytest.approx(brute, rel=1e-12)


def test_the_hand_rules_people_set():
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.partition.hand_rules import fewer_at_the_ends, megatron_accounting

    # Llama 3 405B: 126 blocks on 16 stages, 7 on the first and the last, 8 between (Dubey et al. 2024)
    parts = megatron_accounting(126, 16)
    blocks = [b - a for a, b in zip(parts, parts[1:])]
    assert blocks[0] == 1 + 7 and blocks[-1] == 7 + 1 and set(blocks[1:-1]) == {8} and parts[-1] == 128
    assert megatron_accounting(16, 2) == [0, 9, 18]  # at 2 stages: DeepSpeed's uniform over 18 layers
    with pytest.raises(PartitionError, match=r"stages \(4\) to divide blocks \+ 2 \(34\)"):
        megatron_accounting(32, 4)  # llama3-8b
    assert fewer_at_the_ends(32, 4) == [0, 8, 17, 26, 34]  # 7, 9, 9, 7 blocks
    assert fewer_at_the_ends(32, 8) == [0, 2, 7, 12, 17, 22, 27, 32, 34]  # 1, 5 x 6, 1: 3 and 2 leave a remainder
