"""The planner's model under Megatron-LM's runtime, through which the at-scale efficiencies are fitted
(bench/calibrate_at_scale.py): its pieces agree with the simulator's formulas and Megatron's settings."""

import pytest

from ds_pipe_ext.costs.hardware import DEVICES
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.models.gpt_config import GPTConfig
from ds_pipe_ext.plan.machine import Cluster
from ds_pipe_ext.plan.model import PlanModel

A100 = DEVICES["a100-80gb"]
CLUSTER = Cluster(8, 300e9, 25e9)


def _even(layers: int, chunks: int) -> list[int]:
    per = layers // chunks
    return [0, *(1 + per * k for k in range(1, chunks)), layers + 2]


def _step(cfg, lay: Layout):
    model = PlanModel(cfg, A100, CLUSTER, seq=cfg.seq_len, global_batch=lay.global_batch, dtype="bf16")
    return model.evaluate(lay, _even(cfg.layers, lay.num_chunks), check_memory=False), model


def test_pipeline_bubble_and_interleaving():
    small_vocab = GPTConfig(name="u", vocab_size=128, hidden=4096, layers=32, heads=32, seq_len=2048)  # ~equal stages
    base = dict(tp=8, dp=4, micro_batch=1, micro_batches=16, recompute="full", runtime="megatron")
    flat, _ = _step(small_vocab, Layout(pp=1, **base))
    piped, _ = _step(small_vocab, Layout(pp=4, **base))
    inter, _ = _step(small_vocab, Layout(pp=4, schedule="interleaved:2", **base))
    m = 16
    assert flat.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert piped.bubble_fraction == pytest.approx(3 / (m + 3), rel=0.05)  # 1F1B: (p - 1) / (m + p - 1)
    # v = 2 halves the fill and drain (its extra p2p crossings add a little)
    assert inter.bubble_fraction == pytest.approx(1.5 / (m + 1.5), rel=0.1)


def test_recompute_costs_time_and_overlap_hides_the_gradient_reduction():
    cfg = GPTConfig(name="t", vocab_size=51200, hidden=4096, layers=32, heads=32, seq_len=2048, dropout=0.1)
    kw = dict(tp=1, pp=1, dp=64, micro_batch=4, micro_batches=2, runtime="megatron")
    none, model = _step(cfg, Layout(recompute="none", **kw))
    full, _ = _step(cfg, Layout(recompute="full", **kw))
    lay = Layout(recompute="none", **kw)
    update = model.update_s(lay, model.totals(1, False, 4, "none")[1])  # all the model's parameters
    # the compute of a step, without its update: one more forward of three under full recompute
    assert update > 0 and (full.step_s - update) / (none.step_s - update) == pytest.approx(4 / 3, rel=0.1)
    update = model.update_s(lay, 1e9)
    hidden = model.update_s(lay.replace(overlap_comm=True), 1e9, hide_under=(0.001, 0.002))
    assert 0 < hidden < update
    # with all of it hidden only Adam is left; the distributed optimizer (ZeRO-1) owns 1/dp of it
    assert model.update_s(lay.replace(overlap_comm=True), 1e9) < hidden
    assert model.update_s(lay.replace(zero=1, overlap_comm=True), 1e9) == pytest.approx(
        model.update_s(lay.replace(overlap_comm=True), 1e9) / 64)


def test_both_engines_send_a_tp_ranks_share_of_each_boundary_tensor(monkeypatch):
    """Megatron's scatter/gather and DeepSpeed's pipe_partitioned / grad_partitioned: each TP rank sends 1/t of
    a boundary tensor; under SP (DeepSpeed's turned off there) the activation is already the rank's shard."""
    from dataclasses import replace
    import ds_pipe_ext.plan.model as M

    for runtime in ("megatron", "deepspeed"):
        lay = Layout(pp=2, tp=4, dp=1, micro_batch=1, micro_batches=4, runtime=runtime)
        assert M.boundary_split(lay) == 4
        assert M.boundary_split(replace(lay, sp=True)) == M.boundary_split(replace(lay, tp=1)) == 1
    # on a slow link between the stages, the split shows in DeepSpeed's step as it does in Megatron's
    cfg = GPTConfig(name="b", vocab_size=128, hidden=2048, layers=4, heads=16, seq_len=2048)
    slow = Cluster(4, 300e9, 1e9)  # tp 4 fills a node: the stages talk over 1 GB/s
    lay = Layout(pp=2, tp=4, dp=1, micro_batch=1, micro_batches=4, runtime="deepspeed")

    def step_s() -> float:
        model = PlanModel(cfg, A100, slow, seq=cfg.seq_len, global_batch=lay.global_batch, dtype="bf16")
        return model.evaluate(lay, _even(cfg.layers, 2), check_memory=False).step_s

    split = step_s()
    monkeypatch.setattr(M, "boundary_split", lambda _lay: 1)
    whole = step_s()
    boundary = 2 * 2048 * 2048 / 1e9  # one micro-batch's bf16 activation over 1 GB/s
    assert whole - split > boundary  # at least one crossing each way, 3/4 of it saved each
