"""The step model (simulate/step_model.py), its fit (instrument/step_fit.py) and the partition that
minimises it (partition/step_search.py): exact against brute force, fitted terms recovered."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_pipe_ext.costs.stage import stage_costs
from ds_pipe_ext.costs.types import LayerCost
from ds_pipe_ext.instrument.rundir import Predicted, Run
from ds_pipe_ext.instrument.step_fit import fit_step_model, predict_run, run_stages
from ds_pipe_ext.partition import partition_min_max
from ds_pipe_ext.partition.step_search import partition_min_step
from ds_pipe_ext.simulate.step_model import StepModel, StepModelError, step_lower_bound


def random_costs(rng: random.Random, n: int) -> list[LayerCost]:
    return [LayerCost(f"L{i}", forward_s=rng.uniform(0.01, 1.0), backward_s=rng.uniform(0.02, 2.0),
                      recompute_s=rng.uniform(0.0, 0.5), param_bytes=rng.choice([0, 1, 10, 100]) * 10**6,
                      activation_bytes=rng.randint(1, 100) * 10**5, output_bytes=rng.randint(1, 10) * 10**5)
            for i in range(n)]


def random_model(rng: random.Random) -> StepModel:
    return StepModel(forward_scale=rng.uniform(0.5, 2.0), backward_scale=rng.uniform(0.5, 2.0),
                     forward_fixed_s=rng.choice([0.0, rng.uniform(0, 0.2)]),
                     backward_fixed_s=rng.choice([0.0, rng.uniform(0, 0.2)]),
                     p2p_latency_s=rng.choice([0.0, 0.01]), p2p_bandwidth=rng.choice([None, 1e7, 1e8]),
                     optimizer_fixed_s=rng.uniform(0, 0.1), optimizer_s_per_param_byte=rng.choice([1e-9, 1e-8, 5e-8]),
                     step_fixed_s=rng.uniform(0, 0.1), cores=rng.choice([None, None, 2]),
                     recompute_per_layer_s=rng.choice([0.0, rng.uniform(0, 0.1)]), p2p_wake_s=rng.choice([0.0, 0.02]))


def all_splits(n: int, p: int):
    for inner in itertools.combinations(range(1, n), p - 1):
        yield [0, *inner, n]


def predicted(model, costs, parts, m, schedule, recompute=False) -> float:
    stages = stage_costs(costs, parts, micro_batches=m, recompute=recompute, schedule=schedule)
    return model.predict(stages, m, schedule=schedule).step_s


def test_partition_min_step_equals_brute_force_on_small_instances():
    """Up to 10 layers, 2 to 4 stages, 1F1B, GPipe and ZB-H1, random costs with an optimizer time
    per parameter byte and per-instruction costs: the search's split has the smallest simulated
    step of every split, and the simulation never goes below the model's lower bound."""
    rng = random.Random(13)
    moved = 0
    for case in range(40):
        n = rng.randint(2, 10)
        p = rng.randint(2, min(4, n))
        m = rng.randint(1, 8)
        schedule = rng.choice(["1f1b", "1f1b", "gpipe", "zb-h1"])
        recompute = rng.random() < 0.3
        costs, model = random_costs(rng, n), random_model(rng)
        found = partition_min_step(costs, p, micro_batches=m, model=model, schedule=schedule, recompute=recompute)
        steps = {}
        for parts in all_splits(n, p):
            steps[tuple(parts)] = predicted(model, costs, parts, m, schedule, recompute)
            stages = stage_costs(costs, parts, micro_batches=m, recompute=recompute, schedule=schedule)
            drains = schedule != "zb-h1"  # ZB-H1's deferred W overlap the last gradient's way down
            for k in range(p + 1):  # the one bound with the first k stages fixed: k = p is the whole split
                fixed = model.split_bound(stages[:k], m)
                rest = sum(model.stage_forward_s(st) + model.stage_backward_s(st) for st in stages[k:])
                mean_update = model.optimizer_s(sum(st.param_bytes for st in stages[k:]) / max(p - k, 1))
                bound = step_lower_bound(fixed, rest_s=rest, rest_update_s=mean_update, stages_left=p - k,
                                         drains=drains, fixed_s=model.step_fixed_s)
                assert bound <= steps[tuple(parts)] * (1 + 1e-12), (case, parts, k)
        best = min(steps.values())
        assert found.gap == 0.0
        assert found.step_s == pytest.approx(best, rel=1e-12), (case, found, best)
        assert steps[tuple(found.parts)] == pytest.approx(best, rel=1e-12)
        assert found.leaves <= len(steps)
        moved += found.parts != found.min_max_parts
    assert moved >= 5  # the predicted step does move the split away from the min-max one


def test_memory_cap_is_respected_and_infeasible_caps_report_the_smallest():
    rng = random.Random(3)
    costs = random_costs(rng, 8)
    model = StepModel(optimizer_s_per_param_byte=1e-8)
    free = partition_min_step(costs, 3, micro_batches=4, model=model)
    mem = lambda parts: max(s.memory_bytes for s in stage_costs(costs, parts, micro_batches=4))  # noqa: E731
    cap = 0.9 * mem(free.parts) / 2**30
    feasible = [parts for parts in all_splits(8, 3) if mem(parts) <= cap * 2**30]
    assert feasible, "the test needs a cap that binds but admits a split"
    capped = partition_min_step(costs, 3, micro_batches=4, model=model, memory_cap_gib=cap)
    assert mem(capped.parts) <= cap * 2**30
    assert capped.step_s == pytest.approx(min(predicted(model, costs, q, 4, "1f1b") for q in feasible), rel=1e-12)
    with pytest.raises(ValueError, match="smallest cap"):
        partition_min_step(costs, 3, micro_batches=4, model=model, memory_cap_gib=1e-6)


def test_a_budget_past_which_the_gap_is_stated():
    rng = random.Random(5)
    costs = random_costs(rng, 30)
    found = partition_min_step(costs, 4, micro_batches=8, model=StepModel(optimizer_s_per_param_byte=1e-8),
                               max_leaves=3)
    assert found.leaves == 3 and found.gap >= 0.0
    exact = partition_min_step(costs, 4, micro_batches=8, model=StepModel(optimizer_s_per_param_byte=1e-8))
    assert exact.gap == 0.0 and exact.step_s <= found.step_s
    assert found.step_s <= exact.step_s * (1 + found.gap) + 1e-12


def test_the_optimizer_step_moves_the_split_of_a_gpt_like_model():
    """An embedding with many parameters and little compute, blocks, a heavy head: with the
    optimizer's cost per parameter the split moves blocks off the embedding's stage."""
    costs = ([LayerCost("emb", 0.01, 0.02, param_bytes=100 * 10**6)]
             + [LayerCost(f"block{i}", 0.1, 0.2, param_bytes=12 * 10**6) for i in range(8)]
             + [LayerCost("head", 0.5, 1.0, param_bytes=0)])
    plain = partition_min_max(costs, 2, micro_batches=4)
    heavy = partition_min_step(costs, 2, micro_batches=4, model=StepModel(optimizer_s_per_param_byte=2e-7))
    assert heavy.parts[1] < plain[1]
    assert heavy.step_s < predicted(StepModel(optimizer_s_per_param_byte=2e-7), costs, plain, 4, "1f1b")


def _synthetic_run(model: StepModel, costs, parts, m, name, recompute=False) -> Run:
    """What an instrumented run of ``model`` would record (no shared cores, 1F1B)."""
    stages = stage_costs(costs, parts, micro_batches=m, recompute=recompute)
    pred = model.predict(stages, m)
    finish = pred.simulation.stage_finish_s
    # each rank updates after its last backward; the loss broadcast then waits for the last update
    end = max(t + model.optimizer_s(st.param_bytes) for t, st in zip(finish, stages))
    ranks = []
    for s, st in enumerate(stages):
        ranks.append({
            "rank": s, "stage": s, "forward_ms_mean": 1e3 * model.stage_forward_s(st),
            "backward_ms_mean": 1e3 * model.stage_backward_s(st),
            "optimizer_step_ms_mean": 1e3 * (end - finish[s]),
            "reduce_grads_ms_mean": 0.0, "reduce_tied_grads_ms_mean": 0.0,
            "send_activation_ms_mean": 1e3 * m * st.boundary_out_bytes / model.p2p_bandwidth,
            "aggregate_loss_ms_mean": 1e3 * model.step_fixed_s, "step_ms_median": 1e3 * pred.step_s,
        })
    return Run(Predicted("parts:", list(parts), m, list(costs), recompute=recompute), {"ranks": ranks})


def test_a_model_fitted_on_two_runs_predicts_a_third_configuration():
    rng = random.Random(11)
    costs = random_costs(rng, 9)
    truth = StepModel(forward_scale=1.3, backward_scale=0.8, forward_fixed_s=0.05, backward_fixed_s=0.02,
                      p2p_bandwidth=1e8, optimizer_fixed_s=0.0, optimizer_s_per_param_byte=2e-9, step_fixed_s=0.01)
    a = run_stages(_synthetic_run(truth, costs, [0, 3, 9], 4, "a"), "a")
    b = run_stages(_synthetic_run(truth, costs, [0, 2, 5, 7, 9], 2, "b"), "b")
    fitted = fit_step_model([a, b])
    for field in ("forward_scale", "backward_scale", "forward_fixed_s", "backward_fixed_s", "p2p_bandwidth",
                  "step_fixed_s", "optimizer_s_per_param_byte"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    assert fitted.calibrated_on == ("a", "b")
    c = run_stages(_synthetic_run(truth, costs, [0, 1, 4, 9], 8, "c"), "c")
    assert predict_run(fitted, c) == pytest.approx(c.step_s, rel=0.02)


def test_a_replayed_layer_repeats_the_engines_per_layer_work_and_more_is_fitted_where_a_run_checkpoints():
    rng = random.Random(12)
    costs = random_costs(rng, 9)
    truth = StepModel(forward_scale=1.1, backward_scale=0.9, forward_fixed_s=0.04, backward_fixed_s=0.03,
                      forward_per_layer_s=0.02, recompute_per_layer_s=0.05, p2p_bandwidth=1e8,
                      optimizer_s_per_param_byte=2e-9)
    plain = run_stages(_synthetic_run(truth, costs, [0, 4, 9], 4, "plain"), "plain")
    ckpt = run_stages(_synthetic_run(truth, costs, [0, 2, 6, 9], 2, "ckpt", recompute=True), "ckpt")
    assert ckpt.stages[1].recomputed_layers == 4 and plain.stages[1].recomputed_layers == 0
    fitted = fit_step_model([plain, ckpt])
    assert fitted.recompute_per_layer_s == pytest.approx(0.05, rel=1e-6)
    assert fitted.forward_per_layer_s == pytest.approx(0.02, rel=1e-6)
    # a replayed layer costs the engine its per-layer forward work again, beyond the profiled replay
    st = ckpt.stages[1]
    assert truth.stage_backward_s(st) == pytest.approx(
        0.9 * st.backward_s + 0.03 + (0.02 + 0.05) * st.recomputed_layers, rel=1e-12)
    assert fitted.backward_fixed_s == pytest.approx(0.03, rel=1e-6)
    assert fit_step_model([plain]).recompute_per_layer_s == 0.0  # nothing checkpointed: no term
    other = run_stages(_synthetic_run(truth, costs, [0, 5, 9], 8, "other", recompute=True), "other")
    assert predict_run(fitted, other) == pytest.approx(other.step_s, rel=0.02)


def test_a_rank_woken_while_the_cores_are_taken_waits_for_one():
    """The rank that posted first at a rendezvous (it slept) is delayed by its wake-up; its partner is not.
    On shared cores the delay applies only where the other ranks compute on every core."""
    from ds_pipe_ext.pipe.schedules import engine_schedule
    from ds_pipe_ext.simulate.events import ChunkCosts, simulate

    sched = engine_schedule("1f1b", 2, 1)
    costs = ChunkCosts([1.0, 1.0], [2.0, 2.0])
    key = ("A", 0, 0)  # micro-batch 0's activation, stage 0 -> 1: stage 1 posts its receive at once
    sim = simulate(sched, costs, wake_s={key: 0.5})
    assert sim.rendezvous[0][:2] == (key, 1)  # stage 1 waited
    ra = next(s for s in sim.timeline if s.rank == 1 and s.work.kind == "RA")
    sa = next(s for s in sim.timeline if s.rank == 0 and s.work.kind == "SA")
    assert (sa.end_s, ra.end_s) == pytest.approx((1.0, 1.5))
    assert sim.step_s == pytest.approx(simulate(sched, costs).step_s + 0.5)

    costs4 = [LayerCost(f"L{i}", 1.0, 2.0, output_bytes=10) for i in range(4)]
    stages = stage_costs(costs4, [0, 1, 2, 3, 4], micro_batches=4)
    base = StepModel(cores=2)
    woken = StepModel(cores=2, p2p_wake_s=0.1)
    assert woken.predict(stages, 4).step_s > base.predict(stages, 4).step_s  # 4 ranks on 2 cores
    no_sharing = StepModel(cores=4, p2p_wake_s=0.1)  # a core each: never waits for one
    assert no_sharing.predict(stages, 4).step_s == pytest.approx(StepModel(cores=4).predict(stages, 4).step_s)


def test_an_item_no_other_rank_computes_beside_takes_its_alone_share():
    """CPU ranks slow each other while they compute together: costs are for ranks together, and an
    item while no other rank computes takes ``alone_share`` of its time.  One micro-batch through two
    stages: every item runs alone, so the step is the share of the item sum (to the fixed point's
    damping, 2^-6 of the gap).  Ranks in lockstep (``peers`` > 1: a TP or DP group) never run alone;
    two micro-batches overlap in part, so their step falls by less than the share."""
    costs = [LayerCost(f"L{i}", 1.0, 2.0) for i in range(2)]
    alone = StepModel(alone_share=0.5)
    one = stage_costs(costs, [0, 1, 2], micro_batches=1)
    assert StepModel().predict(one, 1, schedule="gpipe", runtime="megatron").step_s == pytest.approx(6.0)
    assert alone.predict(one, 1, schedule="gpipe", runtime="megatron").step_s == pytest.approx(3.0 + 3.0 / 64)
    assert alone.predict(one, 1, schedule="gpipe", runtime="megatron", peers=2).step_s == pytest.approx(6.0)
    whole = stage_costs(costs, [0, 2], micro_batches=2)  # one rank, alone: nothing else computes
    assert alone.predict(whole, 2, schedule="none").step_s == pytest.approx(6.0 + 6.0 / 64)
    two = stage_costs(costs, [0, 1, 2], micro_batches=2)
    base, shared = (m.predict(two, 2, schedule="1f1b", runtime="megatron").step_s for m in (StepModel(), alone))
    assert 0.5 * base * 1.01 < shared < base
    with pytest.raises(StepModelError, match="alone_share"):
        StepModel(alone_share=0.0)


def test_step_model_files_round_trip_and_bad_ones_say_what_to_do(tmp_path):
    model = StepModel(forward_scale=1.2, cores=2, calibrated_on=("x",))
    model.save(tmp_path / "m.json")
    assert StepModel.load(tmp_path / "m.json") == model
    with pytest.raises(StepModelError, match="step-model fit"):
        StepModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"forward_scale": 1, "speed": 2}')
    with pytest.raises(StepModelError, match="unknown step model fields"):
        StepModel.load(tmp_path / "bad.json")
    with pytest.raises(StepModelError, match="finite number"):
        StepModel(backward_scale=-1)


def test_processor_sharing_splits_the_server_while_jobs_overlap():
    from ds_pipe_ext.simulate.step_model import processor_sharing

    assert processor_sharing([0.0, 0.0], [1.0, 2.0]) == pytest.approx([2.0, 3.0])
    assert processor_sharing([0.0, 1.0], [2.0, 1.0]) == pytest.approx([3.0, 3.0])
    assert processor_sharing([0.0, 5.0], [1.0, 1.0]) == pytest.approx([1.0, 6.0])  # apart: each alone
    model = StepModel(shared_memory=True)
    assert model.optimizer_finish_s([0.0, 1.0], [2.0, 1.0]) == pytest.approx([3.0, 3.0])
    assert StepModel().optimizer_finish_s([0.0, 1.0], [2.0, 1.0]) == pytest.approx([2.0, 2.0])


def test_step_model_cli_fits_and_predicts_run_directories(tmp_path, capsys):
    import json

    from ds_pipe_ext.cli import main
    from ds_pipe_ext.instrument.rundir import RunDir

    rng = random.Random(2)
    costs = random_costs(rng, 8)
    truth = StepModel(forward_scale=1.1, forward_fixed_s=0.01, p2p_bandwidth=1e8, optimizer_s_per_param_byte=1e-9)
    dirs = []
    for name, parts, m in (("a", [0, 3, 8], 4), ("b", [0, 2, 4, 6, 8], 2), ("c", [0, 5, 8], 8)):
        run = _synthetic_run(truth, costs, parts, m, name)
        rd = RunDir(tmp_path / name)
        rd.write_predicted(run.predicted)
        rd.write_summary(run.summary)
        dirs.append(str(tmp_path / name))
    out = tmp_path / "model.json"
    assert main(["step-model", "fit", dirs[0], dirs[1], "--out", str(out)]) == 0
    assert StepModel.load(out).forward_scale == pytest.approx(1.1, rel=1e-6)
    capsys.readouterr()
    assert main(["step-model", "predict", dirs[2], "--step-model", str(out), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert abs(row["error_pct"]) < 2
    assert main(["step-model", "fit", dirs[0]]) == 2
    assert "--out" in capsys.readouterr().err


def test_blocks_of_different_widths_build_and_bad_widths_are_refused():
    from ds_pipe_ext.models.config import ModelConfigError
    from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
    from ds_pipe_ext.models.gpt import gpt_layer_specs

    cfg = load_model_config("tiny", block_ffn_hidden=[64, 128, 256, 512])
    specs = gpt_layer_specs(cfg)
    widths = [spec.build().mlp.fc.out_features for spec in specs[1:-1]]
    assert widths == [64, 128, 256, 512]
    with pytest.raises(ModelConfigError, match="one positive width per block"):
        GPTConfig(name="x", vocab_size=8, hidden=8, layers=2, heads=2, seq_len=4, block_ffn_hidden=(8,))


def test_the_step_search_stops_on_its_bound_budget(monkeypatch):
    """Deep pipelines of alike layers: the bounds cut nearly every leaf without a simulation, so the leaf
    budget alone never runs out (llama3.1-405b on 16,384 GPUs ran for over 10 minutes).  The search
    stops after BOUNDS_PER_LEAF x max_leaves children bounded, no worse than its min-max start, its gap
    stated."""
    import ds_pipe_ext.partition.step_search as step_search

    calls = []
    counted = step_search.step_lower_bound
    monkeypatch.setattr(step_search, "step_lower_bound", lambda *a, **k: calls.append(1) or counted(*a, **k))
    costs = ([LayerCost("emb", 0.01, 0.02, param_bytes=100 * 10**6)]
             + [LayerCost(f"block{i}", 0.1, 0.2, param_bytes=12 * 10**6) for i in range(126)]
             + [LayerCost("head", 0.3, 0.6, param_bytes=100 * 10**6)])
    found = partition_min_step(costs, 32, micro_batches=32, model=StepModel(), max_leaves=4)
    n = len(costs)
    assert len(calls) <= step_search.BOUNDS_PER_LEAF * 4 + 4 * n  # the budget, one node's children past it
    assert found.step_s <= found.min_max_step_s and found.gap >= 0.0 and found.leaves <= 4


def test_deepspeeds_engine_order_registers_itself_where_a_step_asks_for_it():
    """A bench or a Python caller that never imported ``pipe.schedules`` (conftest does, for the suite) still gets
    DeepSpeed's order of 1F1B: the step model imports the runtime's adapter the first time it needs it."""
    import subprocess
    import sys

    code = ("from ds_pipe_ext.simulate import step_model as S\n"
            "assert 'deepspeed' not in S.ENGINE_ORDERS\n"
            "s = S._schedule('1f1b', 2, 4, 'deepspeed')\n"
            "assert 'deepspeed' in S.ENGINE_ORDERS and s is not None\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
