"""Split and recompute chosen together (``partition.recompute``) against brute force: every split, and per
stage every choice of modes, on random instances of up to 12 layers, 4 stages and 3 modes."""

import itertools
import random

import numpy as np
import pytest

from ds_pipe_ext.partition.problem import InfeasibleMemoryCap
from ds_pipe_ext.partition.recompute import RecomputeMode, cheapest_modes, partition_with_recompute


def random_instance(rng: random.Random):
    n = rng.randint(1, 12)
    p = rng.randint(1, min(4, n))
    times = [rng.uniform(0.5, 3.0) for _ in range(n)]
    static = [rng.uniform(0.0, 4.0) for _ in range(n)]
    options = []
    for i in range(n):
        act = rng.uniform(0.5, 6.0)
        modes = [RecomputeMode("none", act)]
        if rng.random() < 0.7:  # attention's core: some of the bytes, a little time
            core = act * rng.uniform(0.1, 0.6)
            modes.append(RecomputeMode("selective", act - core, core, times[i] * rng.uniform(0.02, 0.2)))
        kept = rng.uniform(0.05, 0.5)  # the layer's input
        modes.append(RecomputeMode("full", kept, act, times[i] * rng.uniform(0.25, 0.45)))
        options.append(modes)
    m = rng.randint(1, 8)
    inflight = [min(p - s, m) for s in range(p)]
    reserve = [rng.uniform(0.0, 2.0) for _ in range(p)]
    # half the instances: the optimizer step's bytes per layer, a second bound whatever the modes
    step = [rng.uniform(0.0, 12.0) for _ in range(n)] if rng.random() < 0.5 else None
    return times, static, options, p, inflight, reserve, step


def brute_stage(times, static, options, i, j, budget_cap, inflight, reserve, step):
    """(least stage time, least memory) over every choice of modes of layers i..j-1 fitting the cap."""
    layers = options[i:j]
    choice = np.array(list(itertools.product(*[range(len(layer)) for layer in layers])))
    kept = np.array([[m.kept_bytes for m in layer] + [0.0] * (3 - len(layer)) for layer in layers])
    replay = np.array([[m.replay_bytes for m in layer] + [0.0] * (3 - len(layer)) for layer in layers])
    rtime = np.array([[m.replay_time for m in layer] + [0.0] * (3 - len(layer)) for layer in layers])
    rows = np.arange(len(layers))
    memory = (sum(static[i:j]) + inflight * kept[rows, choice].sum(axis=1) + replay[rows, choice].max(axis=1)
              + reserve)
    time = sum(times[i:j]) + rtime[rows, choice].sum(axis=1)
    at_step = sum(step[i:j]) if step else 0.0
    fits = (memory <= budget_cap) & (at_step <= budget_cap)
    return (float(time[fits].min()) if fits.any() else np.inf), max(float(memory.min()), at_step)


def brute_force(times, static, options, p, cap, inflight, reserve, step):
    n = len(times)
    best, best_parts, least_cap = np.inf, None, np.inf
    for cuts in itertools.combinations(range(1, n), p - 1):  # lexicographic order of parts
        parts = [0, *cuts, n]
        stages = [brute_stage(times, static, options, parts[s], parts[s + 1], cap, inflight[s], reserve[s], step)
                  for s in range(p)]
        value = max(t for t, _ in stages)
        least_cap = min(least_cap, max(mem for _, mem in stages))
        if value < best * (1 - 1e-12):
            best, best_parts = value, parts
    return best, best_parts, least_cap


def test_the_joint_split_is_brute_forces_on_300_random_instances():
    rng = random.Random(2026)
    infeasible = solved = 0
    for trial in range(300):
        times, static, options, p, inflight, reserve, step = random_instance(rng)
        _, _, least_cap = brute_force(times, static, options, p, np.inf, inflight, reserve, step)
        cap = least_cap * rng.choice([0.9, 0.999, 1.001, 1.05, 1.3, 2.0, 10.0])  # not on the boundary's rounding
        want, want_parts, _ = brute_force(times, static, options, p, cap, inflight, reserve, step)
        kw = dict(inflight=inflight, reserve=reserve, step_bytes=step)
        if want == np.inf:
            with pytest.raises(InfeasibleMemoryCap) as err:
                partition_with_recompute(times, static, options, p, memory_cap=cap, **kw)
            assert err.value.min_feasible_cap == pytest.approx(least_cap, rel=1e-9), trial
            partition_with_recompute(times, static, options, p, memory_cap=least_cap * (1 + 1e-9), **kw)  # it fits
            infeasible += 1
            continue
        got = partition_with_recompute(times, static, options, p, memory_cap=cap, **kw)
        assert got.bottleneck == pytest.approx(want, rel=1e-9), trial
        assert got.parts == want_parts, trial
        # what it returns is what it claims: each stage's time and memory from its modes, all under the cap
        by_name = [{m.name: m for m in layer} for layer in options]
        for s in range(p):
            i, j = got.parts[s], got.parts[s + 1]
            chosen = [by_name[k][got.modes[k]] for k in range(i, j)]
            time = sum(times[i:j]) + sum(m.replay_time for m in chosen)
            memory = max(sum(static[i:j]) + inflight[s] * sum(m.kept_bytes for m in chosen)
                         + max(m.replay_bytes for m in chosen) + reserve[s], sum(step[i:j]) if step else 0.0)
            assert got.stage_times[s] == pytest.approx(time, rel=1e-12)
            assert got.stage_memory[s] == pytest.approx(memory, rel=1e-12) and memory <= cap * (1 + 1e-12)
        assert max(got.stage_times) == got.bottleneck
        solved += 1
    assert infeasible >= 20 and solved >= 200  # both sides of the cap are exercised


def test_a_stage_of_alike_blocks_recomputes_the_cheapest_count():
    # 8 alike blocks, 10 bytes kept each without recompute, 1 with (replaying 10 bytes and 1 s each); 2 in
    # flight, 100 bytes of room: 2 x (10 (8 - r) + r) + 10 <= 100 -> r >= 3.9: four blocks recompute
    block = [RecomputeMode("none", 10.0), RecomputeMode("full", 1.0, 10.0, 1.0)]
    time, choice = cheapest_modes([block] * 8, 100.0, 2)
    assert time == 4.0 and sorted(choice).count(1) == 4
    assert cheapest_modes([block] * 8, 2 * 8 + 9.0, 2) is None  # all recompute: 16 + 10 > 25


def test_joint_stage_memory_is_what_the_joint_partitioner_holds_to_its_cap():
    """``partition.joint_stage_memory`` evaluates a given split and modes by the rule ``partition_jointly``
    caps: on its own choice it gives the stages' memory the choice reports, under the tightest cap."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.peak import ZeroSettings
    from ds_pipe_ext.costs.peak_rule import PipelinePeakRule
    from ds_pipe_ext.models.registry import load_model
    from ds_pipe_ext.partition import joint_stage_memory, partition_jointly

    cfg = load_model("llama-tiny")
    costs = analytic_layer_costs(cfg, EstimateRequest(micro_batch=4, seq=cfg.seq_len), get_device("cpu"))
    rule = PipelinePeakRule(ZeroSettings(), element_bytes=4)
    with pytest.raises(InfeasibleMemoryCap) as err:
        partition_jointly(costs, 2, memory_cap_gib=1e-6, micro_batches=8, peak_rule=rule)
    cap = err.value.min_feasible_cap
    got = partition_jointly(costs, 2, memory_cap_gib=cap / 2**30, micro_batches=8, peak_rule=rule)
    assert {"none", "full"} <= set(got.modes)  # the tightest cap makes some layers, not all, recompute
    memory = joint_stage_memory(costs, got.parts, got.modes, micro_batches=8, peak_rule=rule)
    assert memory == pytest.approx(got.stage_memory, rel=1e-12) and max(memory) <= cap * (1 + 1e-12)
    assert max(joint_stage_memory(costs, got.parts, None, micro_batches=8, peak_rule=rule)) > cap
