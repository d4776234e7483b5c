"""The one layout record, the one schedule parser and the one ZeRO rule: literal in, literal out."""

import json

import pytest

from ds_pipe_ext.arch import MLP, Attention, Block, ModelDescription
from ds_pipe_ext.costs.zero import state_bytes_per_param, zero_model_states
from ds_pipe_ext.layout import Layout, LayoutError
from ds_pipe_ext.simulate.schedules import ScheduleSpec, parse_schedule

def _toy(*, heads=12, kv_heads=None, hidden=768, vocab=50304, seq_len=1024) -> ModelDescription:
    """A GPT-2-small-like description: 12 blocks, 14 pipeline layers."""
    return ModelDescription("toy", hidden, vocab, seq_len, (Block(Attention(heads, kv_heads), MLP(3072)),) * 12)


GPT = _toy()


def test_schedule_names_parse_once_to_one_spelling():
    assert parse_schedule("1f1b") == ScheduleSpec("1f1b", 1)
    assert parse_schedule("interleaved") == parse_schedule("interleaved:2") == ScheduleSpec("interleaved", 2)
    assert parse_schedule(" GPipe ").name == "gpipe"
    spec = parse_schedule("interleaved:3")
    assert (spec.name, spec.chunks_per_rank, spec.chunk_rank(2), spec.simulated_only) == \
        ("interleaved:3", 3, (0, 1, 0, 1, 0, 1), True)
    v = parse_schedule("dualpipev")
    assert (v.chunks_per_rank, v.chunk_rank(3), v.simulated_only, v.drains) == (2, (0, 1, 2, 2, 1, 0), False, False)
    assert parse_schedule("zb-h1").drains is False and parse_schedule("gpipe").drains is True
    # activations held, read off the order: 1F1B's stage s holds min(p - s, m); GPipe all m
    assert parse_schedule("1f1b").in_flight(4, 8) == (4, 3, 2, 1)
    assert parse_schedule("gpipe").in_flight(4, 3) == (3, 3, 3, 3)
    for bad in ("interleaved:1", "interleaved:x", "pipedream", "1f1b:2"):
        with pytest.raises(ValueError, match="known: gpipe, 1f1b, interleaved, zb-h1, dualpipev"):
            parse_schedule(bad)


def test_layout_derives_world_batch_and_chunks():
    lay = Layout(pp=4, tp=2, dp=3, micro_batch=2, micro_batches=8, schedule="interleaved")
    assert (lay.world_size, lay.global_batch, lay.schedule, lay.num_chunks, lay.runnable) == \
        (24, 48, "interleaved:2", 8, False)
    assert Layout.from_world(8, pp=2, tp=2) == Layout(pp=2, tp=2, dp=2)
    assert Layout().schedule == "none" and Layout(pp=2).schedule == "1f1b"
    dp = Layout(dp=4, zero=3, offload=True)
    assert (dp.pipelined, dp.runnable, dp.num_chunks, dp.name) == (False, True, 1, "pp1-tp1-dp4-z3-mb1-none-offload")


@pytest.mark.parametrize("kwargs, match", [
    ({"pp": 0}, r"pp = 0: a positive integer"),
    ({"tp": True}, r"tp = True: a positive integer"),
    ({"sp": True}, "sequence parallelism needs tensor parallelism"),
    ({"zero": 4}, "ZeRO stage is 0, 1, 2 or 3"),
    ({"pp": 2, "dp": 2, "zero": 2}, "ZeRO-0 or 1 under a pipeline, not ZeRO-2"),
    ({"recompute": "some"}, "recompute = 'some': use one of none, selective, full"),
    ({"schedule": "pipedream"}, "unknown pipeline schedule 'pipedream'"),
    ({"pp": 2, "schedule": "none"}, "pp = 2 needs a pipeline schedule"),
    ({"pp": 4, "micro_batches": 6, "schedule": "interleaved:2"}, "multiple of the stages"),
    ({"pp": 4, "micro_batches": 7, "schedule": "dualpipev"}, "at least 2 x stages"),
    ({"zero": 0, "offload": True}, "offload moves ZeRO's partitioned states"),
    ({"zero": 3, "offload": True, "schedule": "1f1b"}, "ZeRO-0 or 1 under a pipeline"),
    ({"ep": 2}, "ep = 2 does not divide tp x dp = 1: DeepSpeed builds each expert-parallel group"),
    ({"ep": 4, "tp": 2}, "ep = 4 does not divide tp x dp = 2"),
    ({"runtime": "jax"}, "runtime = 'jax'"),
])
def test_a_layout_that_cannot_run_is_refused_when_built(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs)


def test_megatron_runtime_keeps_zero_beyond_one_under_a_pipeline():
    assert Layout(pp=2, dp=2, zero=3, runtime="megatron").zero == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 5}, r"tensor parallel degree 5 does not divide the attention heads \(12\)"),
    ({"tp": 8}, r"does not divide the attention heads"),
    ({"tp": 4, "sp": True}, None),
    ({"pp": 15}, "15 stages but model 'toy' has only 14 pipeline layers: use at most 14 stages"),
    ({"pp": 8, "micro_batches": 8, "schedule": "interleaved:2"}, r"8 stages x 2 chunks .* at most 7 stages"),
])
def test_check_owns_every_rule_the_model_sets(kwargs, match):
    lay = Layout(**kwargs)
    if match is None:
        lay.check(GPT)
        return
    with pytest.raises(LayoutError, match=match):
        lay.check(GPT)


def test_check_names_vocabulary_padding_and_key_value_heads():
    with pytest.raises(LayoutError, match="vocab_pad_to = 256"):
        Layout(tp=2).check(_toy(vocab=50257))
    with pytest.raises(LayoutError, match=r"does not divide the key/value heads \(2\)"):
        Layout(tp=4).check(_toy(kv_heads=2))
    with pytest.raises(LayoutError, match=r"splits the sequence \(1020\) 8 ways"):
        Layout(tp=8, sp=True).check(_toy(seq_len=1020, heads=16, hidden=1024))


@pytest.mark.parametrize("lay", [
    Layout(pp=2, tp=2, dp=1, sp=True, micro_batch=2, micro_batches=4, recompute="full", schedule="gpipe"),
    Layout(pp=2, dp=2, zero=1, micro_batches=8, schedule="dualpipev"),
    Layout(pp=1, dp=1, micro_batches=2, schedule="1f1b"),  # a one-stage pipeline is a pipeline
    Layout(dp=4, zero=3, schedule="none", offload=True, overlap_comm=True),
    Layout(dp=2, zero=1, offload=True),
    Layout(tp=2, dp=2, zero=2, recompute="selective", schedule="none"),
])
def test_ds_json_round_trips_through_the_layout(lay):
    ds = lay.ds_config(train={"model": "tiny", "steps": 3}, pipeline={"partition_method": "profiled"}
                       if lay.pipelined else None, steps_per_print=10**6)
    again = json.loads(json.dumps(ds))
    assert Layout.from_ds_config(again, lay.world_size) == lay
    assert Layout.from_ds_config(again, lay.world_size).ds_config(
        train={"model": "tiny", "steps": 3}, pipeline={"partition_method": "profiled"} if lay.pipelined else None,
        steps_per_print=10**6) == ds


def test_the_writer_writes_literal_sections():
    ds = Layout(pp=2, tp=2, dp=2, sp=True, zero=1, micro_batch=2, micro_batches=4, recompute="full").ds_config(
        train={"model": "tiny"}, pipeline={"partition_method": "parts:0,3,6"})
    assert ds == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "train": {"model": "tiny", "recompute": "full"},
        "tensor_parallel": {"size": 2, "sequence_parallel": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6,
                              "stage3_prefetch_bucket_size": 5e6, "stage3_param_persistence_threshold": 0,
                              "contiguous_gradients": True, "overlap_comm": False},
        "pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "parts:0,3,6"},
    }
    with pytest.raises(LayoutError, match="DeepSpeed runs no zb-h1"):
        Layout(pp=2, schedule="zb-h1").ds_config()
    with pytest.raises(LayoutError, match="without a pipeline"):
        Layout(schedule="none").ds_config(pipeline={"stages": 2})


def test_reading_a_ds_json_an_interval_means_full_recompute_and_bad_sections_are_named():
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
          "pipeline": {"stages": 4, "activation_checkpoint_interval": 1}}
    assert Layout.from_ds_config(ds, 8) == Layout(pp=4, dp=2, micro_batches=4, recompute="full")
    # DeepSpeed's default overlap_comm: on under ZeRO-3, off below
    assert Layout.from_ds_config({"zero_optimization": {"stage": 3}}, 4) == Layout(dp=4, zero=3, overlap_comm=True)
    assert Layout.from_ds_config({"zero_optimization": {"stage": 2}}, 4) == Layout(dp=4, zero=2)
    # ZeRO-Offload: the optimizer's states at stage 2, the parameters only under ZeRO-3
    z2 = Layout(dp=2, zero=2, offload=True).ds_config()["zero_optimization"]
    assert z2["offload_optimizer"] == {"device": "cpu"} and "offload_param" not in z2
    with pytest.raises(LayoutError, match="world size 6 is not pipeline"):
        Layout.from_ds_config({"pipeline": {"stages": 4}}, 6)
    with pytest.raises(LayoutError, match='"tensor_parallel" must be an object'):
        Layout.from_ds_config({"tensor_parallel": 2}, 2)


def test_megatron_arguments():
    lay = Layout(pp=8, tp=8, dp=16, sp=True, zero=1, micro_batch=1, micro_batches=96, recompute="selective",
                 schedule="interleaved:3", runtime="megatron")
    assert lay.megatron_args() == [
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8", "--micro-batch-size", "1",
        "--global-batch-size", "1536", "--sequence-parallel", "--num-virtual-stages-per-pipeline-rank", "3",
        "--recompute-granularity", "selective", "--use-distributed-optimizer"]
    assert Layout(recompute="full", dp=2, micro_batches=2).megatron_args()[-6:] == [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


@pytest.mark.parametrize("element_bytes", [4, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_the_linear_form_is_the_zero_rule_where_nothing_pads(stage, dp, element_bytes):
    # dp + 1 tensors of 2 dp elements: no padding (ZeRO-3 pads each tensor to a multiple of dp, ZeRO-1/2
    # the whole to 2 dp), and a ZeRO-1/2 partition (2 dp + 2 elements) never lies inside one tensor
    numels = [2 * dp] * (dp + 1)
    rule = zero_model_states(numels, dp=dp, stage=stage, element_bytes=element_bytes).total_bytes
    assert rule == state_bytes_per_param(stage, dp, element_bytes) * sum(numels)


def test_the_linear_form_by_hand():
    # bf16 with fp32 masters: 2 + 6 + 12 (ZeRO-0), 2 + 16/dp (1, 2), 20/dp (3)
    assert [state_bytes_per_param(z, 8, 2) for z in (0, 1, 2, 3)] == [20, 4, 4, 2.5]
    assert [state_bytes_per_param(z, 2, 4) for z in (0, 1, 3)] == [16, 12, 12]


def test_layer_states_follow_the_rule_and_the_cap_counts_them():
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.costs.zero import layer_states_by_rule
    from ds_pipe_ext.partition import InfeasibleMemoryCap, partition_min_max

    # four fp32 layers of 1,000 parameters as the profiler counts them (weights, gradient, Adam's m and v)
    costs = [LayerCost(f"l{i}", 1.0, 2.0, param_bytes=4000, grad_bytes=4000, optimizer_bytes=8000,
                       activation_bytes=100, output_bytes=10) for i in range(4)]
    assert layer_states_by_rule(costs, stage=0, dp=4) == costs  # ZeRO-0 in fp32: 4 + 4 + 8 bytes a parameter
    z1 = layer_states_by_rule(costs, stage=1, dp=4)
    assert [(c.param_bytes, c.grad_bytes, c.optimizer_bytes) for c in z1] == [(4000, 1000, 3000)] * 4
    frozen = layer_states_by_rule([costs[0].__class__(**{**costs[0].__dict__, "grad_bytes": 0,
                                                          "optimizer_bytes": 0})], stage=1, dp=4)
    assert (frozen[0].param_bytes, frozen[0].grad_bytes, frozen[0].optimizer_bytes) == (4000, 0, 0)
    # 2 stages, 1F1B, 2 micro-batches: stage 0 holds 2 x 2 x 100 activation bytes beside its states.
    # ZeRO-0: 2 x 16,000 + 400 = 32,400 a stage; ZeRO-1 over 4 ranks: 2 x 8,000 + 400 = 16,400
    cap = 20_000
    with pytest.raises(InfeasibleMemoryCap):
        partition_min_max(costs, 2, memory_cap_bytes=cap, micro_batches=2)
    assert partition_min_max(z1, 2, memory_cap_bytes=cap, micro_batches=2) == [0, 2, 4]


@pytest.mark.parametrize("accum", [2, 4])
def test_bf16_optimizer_states_are_what_deepspeed_allocated(accum):
    # bench/zero_rules_16bit.py on 2 CPU ranks (DeepSpeed 0.19.8, bf16): its odd model (320,000 + 6,175 + 96,000
    # elements, padded to 422,176) under BF16_Optimizer, gradients accumulated in bf16 (a pipeline without ZeRO)
    # and in fp32 (ZeRO-1 with grad_accum_dtype fp32): every rank held exactly these bytes
    from ds_pipe_ext.costs.zero import bf16_accumulation_bytes, bf16_optimizer_states

    numels = [320_000, 64 * 95, 95, 95 * 1000, 1000]
    states = bf16_optimizer_states(numels, dp=2, accum_bytes=accum)
    grads = states.grad_bytes + bf16_accumulation_bytes(numels, dp=2, accum_bytes=accum)
    assert (states.param_bytes, grads, states.optimizer_bytes) == (844_352, 2_533_054, 2_533_056)
