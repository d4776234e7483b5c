"""ZeRO-3's parameter prefetch against compute on a GPU (plan.zero3), NCCL's collective latency
(costs.nccl), and the published runs the at-scale model is checked against without being fitted."""

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from ds_pipe_ext.costs.nccl import NET_HOP_S, NVLINK_HOP_S, RING_BASE_S, ring_latency_s
from ds_pipe_ext.layout import Layout
from ds_pipe_ext.models import load_model_config
from ds_pipe_ext.plan.machine import Cluster, plan_device
from ds_pipe_ext.plan.model import PlanModel
from ds_pipe_ext.plan.zero3 import ModuleTraffic, chain_s, microbatch_s

ROOT = Path(__file__).resolve().parents[1]


def test_ring_latency_counts_hops_inside_and_between_nodes():
    assert ring_latency_s("all-gather", 1, 8) == 0.0
    assert ring_latency_s("all-gather", 8, 8) == pytest.approx(RING_BASE_S + 7 * NVLINK_HOP_S)
    # 16 ranks on 2 nodes: 15 steps, one of them crosses the network
    assert ring_latency_s("reduce-scatter", 16, 8) == pytest.approx(RING_BASE_S + 14 * NVLINK_HOP_S + NET_HOP_S)
    # an all-reduce is a reduce-scatter then an all-gather: twice the steps
    assert ring_latency_s("all-reduce", 16, 8) == pytest.approx(RING_BASE_S + 28 * NVLINK_HOP_S + 2 * NET_HOP_S)


def test_chain_prefetches_the_next_gather_under_the_current_compute():
    # first gather exposed (1), then max(compute 2, next gather 3), then the last compute alone
    assert chain_s([(2, 1, 0), (2, 3, 0)], overlap_reduce=False) == 6
    assert chain_s([(5, 1, 0), (5, 1, 0)], overlap_reduce=False) == 11  # compute hides every later gather
    events = [(2, 1, 1), (2, 1, 1), (2, 1, 1)]
    # overlapped: the previous reduction shares the link with the next gather; the last one is exposed
    assert chain_s(events, overlap_reduce=True) == 1 + 2 + max(2, 1 + 1) + max(2, 1) + 1
    # not overlapped: each reduction waits after its compute
    assert chain_s(events, overlap_reduce=False) == 1 + 3 + 3 + 3
    assert chain_s([], overlap_reduce=True) == 0.0


def test_full_recompute_gathers_each_module_again_in_the_backward():
    layer = [ModuleTraffic(forward_s=1.0, backward_s=2.0, gather_s=0.5, reduce_s=0.5)]
    # forward 0.5 + 1; backward: gather 0.5, replayed forward 1, backward 2 (its gather hidden), last reduce 0.5
    assert microbatch_s([layer], recompute=True, overlap_reduce=True) == pytest.approx(1.5 + 0.5 + 1 + 2 + 0.5)
    assert microbatch_s([layer], recompute=False, overlap_reduce=True) == pytest.approx(1.5 + 0.5 + 2 + 0.5)


def test_a_module_used_again_within_the_reuse_distance_is_not_gathered_again():
    # DeepSpeed releases a module after each use unless it is used again within stage3_max_reuse_distance
    # elements: under full recompute the last module of a layer (nothing between its replay and its backward)
    # stays gathered.  Two modules of 10 elements, gathers (3) longer than compute (forward 1, backward 2):
    # forward 3 + max(1, 3) + 1 = 7; backward, every visit gathering: 3 + 3 + 3 + max(2, 3) + 2 = 14
    layer = [ModuleTraffic(forward_s=1.0, backward_s=2.0, gather_s=3.0, reduce_s=0.0, elements=10.0)] * 2
    assert microbatch_s([layer], recompute=True, overlap_reduce=False) == pytest.approx(7 + 14)
    # distance 5: the second module's backward follows its replay directly (kept); the first module's
    # replay and backward each have the other module (10 elements) in between (gathered):
    # 3 + max(1, 3) + max(1, 0) + max(2, 3) + 2 = 12
    assert microbatch_s([layer], recompute=True, overlap_reduce=False, max_reuse=5) == pytest.approx(7 + 12)
    # without recompute the last module's backward follows its forward directly
    assert microbatch_s([layer], recompute=False, overlap_reduce=False, max_reuse=5) == pytest.approx(
        7 + max(2, 3) + 2)


def _zero3_step(device: str, *, overlap: bool, buckets: dict | None = None) -> float:
    cfg = load_model_config("gpt3-175b")
    # one 200 Gb/s NIC a node: the traffic is the step's larger part, as the prefetch's point needs
    slow = Cluster(8, 300e9, 25e9, nics_per_node=1, compute_capability=80, name="one NIC a node")
    model = PlanModel(cfg, plan_device(device), slow, seq=2048, global_batch=1536, runtime_terms=overlap,
                      zero_settings=buckets)
    lay = Layout(pp=1, tp=1, dp=384, zero=3, micro_batch=4, micro_batches=1, recompute="full")
    return model.evaluate(lay, check_memory=False).step_s


DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                      "stage3_param_persistence_threshold": 1e5}


def test_zero3_on_a_gpu_hides_traffic_under_compute_with_deepspeeds_default_buckets():
    chained, serial = _zero3_step("a100", overlap=True, buckets=DEEPSPEED_DEFAULTS), _zero3_step("a100", overlap=False)
    assert chained < serial  # gathers prefetched under the compute
    # with 5e6-element reduce buckets (what our ds.json emits) NCCL's latency per bucket dominates
    assert _zero3_step("a100", overlap=True) > chained


def test_zero3_on_cpu_ranks_keeps_the_serial_formula():
    cfg = load_model_config("tiny")
    model = PlanModel.on_its_cluster(cfg, plan_device("cpu"), seq=cfg.seq_len, global_batch=8)
    lay = Layout(pp=1, tp=1, dp=2, zero=3, micro_batch=4, micro_batches=1)
    assert not model.zero3_prefetched(lay)


PREDICTED = ROOT / "bench" / "data" / "published_at_scale.csv"


def test_every_predicted_row_names_its_source_cluster_and_flop_convention():
    with open(PREDICTED) as f:
        rows = list(csv.DictReader(f))
    assert len({r["name"] for r in rows}) == len(rows) >= 8
    for r in rows:
        assert r["source"] and r["cluster"] and float(r["inter_gbs_per_gpu"]) > 0, r["name"]
        assert r["convention"] in ("iter_s", "tflops96", "tflops72"), r["name"]
        assert r["group"] in ("deepspeed-engine", "deep-pipeline", "zero3", "megatron"), r["name"]
        assert r["execution"] in ("megatron", "megatron-2021"), r["name"]  # the kernels, and accumulation, of its era
        assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) % int(r["gpus_per_node"]) == 0, r["name"]
        for field in filter(None, r["assumed"].split(";")):  # an assumed field names a column or a setting
            assert field in r or field in ("schedule", "micro_batch", "dtype", "interleave", "zero3_buckets", "intra_gbs", "convention"), field


def _a100_model(name: str, **kw) -> PlanModel:
    cfg = load_model_config(name)
    return PlanModel.on_its_cluster(cfg, plan_device("a100"), seq=cfg.seq_len, global_batch=64, dtype="bf16", **kw)


def test_bf16_optimizer_reduces_fp32_gradients_and_partitions_its_states():
    # DeepSpeed's BF16_Optimizer (a bf16 pipeline without ZeRO) accumulating in fp32: the fp32 gradient
    # buffers are all-reduced, the updated bf16 partitions all-gathered, Adam runs on the rank's 1/dp share
    model = _a100_model("gpt3-1.3b", grad_accum_dtype="fp32")
    before = _a100_model("gpt3-1.3b", runtime_terms=False)
    lay = Layout(pp=2, tp=1, dp=8, zero=0, micro_batch=1, micro_batches=8)
    params = 6.5e8
    assert model.bf16_optimizer(lay) and not before.bf16_optimizer(lay)
    group, dev = model.placements(lay)["dp"], model.device
    from ds_pipe_ext.costs.hardware import adam_step_s

    def coll(nbytes, kind):
        return dev.group_time(kind, nbytes, group)

    expected = (coll(params * 4, "all-reduce") + coll(params * 2, "all-gather")
                + model.engine_passes_s(lay, params)
                + adam_step_s(params / 8, dev, bytes_per_param=model.adam_bytes_per_param))
    assert model.update_s(lay, params) == pytest.approx(expected)
    # without the term: ZeRO-0's rule, the bf16 gradients all-reduced and Adam over every parameter
    assert before.update_s(lay, params) == pytest.approx(
        coll(params * 2, "all-reduce") + before.engine_passes_s(lay, params)
        + adam_step_s(params, dev, bytes_per_param=before.adam_bytes_per_param))
    # DeepSpeed 0.19's default accumulates in the training dtype: bf16 gradients reduced, and its passes over
    # bf16 buffers (plan.update.engine_passes_s: no cast's temporary each micro-batch)
    default = _a100_model("gpt3-1.3b")
    assert default.engine_passes_s(lay, params) < model.engine_passes_s(lay, params)
    assert default.update_s(lay, params) == pytest.approx(
        expected - coll(params * 4, "all-reduce") + coll(params * 2, "all-reduce")
        - model.engine_passes_s(lay, params) + default.engine_passes_s(lay, params))
    # with ZeRO-1 DeepSpeed's ZeRO optimizer runs instead: its rule is unchanged
    z1 = Layout(pp=2, tp=1, dp=8, zero=1, micro_batch=1, micro_batches=8)
    assert model.update_s(z1, params) == before.update_s(z1, params)


def test_tied_embedding_gradients_are_all_reduced_between_first_and_last_stage():
    model = _a100_model("gpt2-small")  # ties its head to the embedding
    lay = Layout(pp=4, tp=1, dp=2, zero=1, micro_batch=1, micro_batches=8)
    tied = model.costs_of(lay)[0].param_bytes / model.e
    pair = model.placements(lay)["tied"]
    assert pair.size == 2  # the first and the last stage's rank of one data index, 3 x 2 ranks apart: one node
    extra = model.device.group_time("all-reduce", tied * model.e, pair)
    assert extra > 0
    assert model.update_s(lay, 1e8, tied_params=tied) - model.update_s(lay, 1e8) == pytest.approx(extra)
    # on the step: two stages, both holding the tied weight (with four, a middle stage's longer update hides it)
    two = replace(lay, pp=2, dp=4)
    with_terms = model.evaluate(two, check_memory=False).step_s
    without = _a100_model("gpt2-small", runtime_terms=False).evaluate(two, check_memory=False).step_s
    assert with_terms > without
