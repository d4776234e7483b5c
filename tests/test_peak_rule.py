"""The peak rule (costs.peak) on hand-worked steps: every figure below is worked out in the comments."""

import pytest

from ds_pipe_ext.costs.op_cost import OpCost
from ds_pipe_ext.costs.estimate import rank_steps
from ds_pipe_ext.costs.peak import RankStep, ZeroSettings, _overlapping_partition, step_peak
from ds_pipe_ext.layout import Layout

# layer A: a linear op of one 10-element weight, saves 100 B, outputs 50 B forward, writes its input's
# gradient (60 B) and its weight's (40 B) backward.  Layer B: the loss, saves 200 B, outputs 80 B forward,
# writes two 300 B gradients backward.  fp32 (e = 4).
LINEAR = OpCost("a", "matrix", activation_bytes=100, weights=(10,), fwd_allocs=(50,), bwd_allocs=(60, 40))
LOSS = OpCost("loss", "vector", activation_bytes=200, fwd_allocs=(80,), bwd_allocs=(300, 300))
DP_ORDER = (("F", 0), ("B", 0), ("F", 1), ("B", 1))


def kinds(peak) -> dict:
    return {k: v for k, v in peak.by_kind.items() if v}


def test_zero0_peaks_in_the_last_backward_at_the_loss():
    # states (fp32 ZeRO-0): params 40, optimizer 80 (two moments).  A micro-batch saves 300; its backward's
    # worst moment is the loss's: all 300 saved + 600 of gradients = 900.  The first backward has no
    # gradients yet (1020 in all); by the second every gradient (40) is kept: 120 + 40 + 900 = 1060
    peak = step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(stage=0)))
    assert peak.phase == "backward 1"
    assert kinds(peak) == {"param_bytes": 40, "grad_bytes": 40, "optimizer_bytes": 80, "activation_bytes": 300,
                           "temporary_bytes": 600}
    assert peak.total_bytes == 1060


def test_zero1_holds_every_gradient_and_its_bucket_from_the_first_gradient():
    # ZeRO-1 over 2 ranks: the 10 elements pad to 12, each rank owns 6: params 48, optimizer 12 x 6 = 72.
    # The bucket (25 elements, 100 B) is made at the first weight gradient (op a, first backward) and held
    # to the step; every gradient (40) is kept until the boundary.  Second backward at the loss:
    # 48 + 72 + 40 + 100 + 300 + 600 = 1160
    peak = step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(stage=1, reduce_bucket_size=25), dp=2))
    assert peak.phase == "backward 1"
    assert kinds(peak) == {"param_bytes": 48, "grad_bytes": 40, "optimizer_bytes": 72, "buffer_bytes": 100,
                           "activation_bytes": 300, "temporary_bytes": 600}


def test_zero2_keeps_only_the_partitions_buffer_between_micro_batches():
    # ZeRO-2: the bucket lives only inside a backward (from the first gradient) and is freed by the
    # micro-batch's reduction, which leaves the buffer of the parameters overlapping the rank's partition
    # (all 10 elements: 40 B).  At the second backward's loss no bucket exists yet: 48 + 72 + 40 + 900
    peak = step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(stage=2, reduce_bucket_size=25), dp=2))
    assert kinds(peak) == {"param_bytes": 48, "grad_bytes": 40, "optimizer_bytes": 72, "activation_bytes": 300,
                           "temporary_bytes": 600}


def test_zero3_holds_its_gradient_partitions_bucket_and_the_gathered_layers():
    # ZeRO-3 over 2 ranks: each rank's partition is 5 elements: params 20, gradient partitions 20, optimizer
    # 12 x 5 = 60, bucket 100 from the start; the forward gathers the layer whole (40) and keeps it to its
    # backward.  Second backward at the loss: 20 + 20 + 60 + 100 + 40 + 300 + 600 = 1140
    peak = step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(stage=3, reduce_bucket_size=25,
                                                                              persistence_threshold=0), dp=2))
    assert kinds(peak) == {"param_bytes": 20, "grad_bytes": 20, "optimizer_bytes": 60, "buffer_bytes": 100,
                           "gathered_bytes": 40, "activation_bytes": 300, "temporary_bytes": 600}


def test_a_pipeline_stage_keeps_two_buffers_of_inputs_and_outputs():
    # the last stage (1 in flight, 2 micro-batches: DeepSpeed keeps max(2, 1) = 2 buffers): at the second
    # backward both micro-batches' received inputs (7 each) and outputs (1000 each) are alive beside the
    # profile's 600 of temporaries: 2614
    step = RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(), pipe_buffers=2, output_bytes=1000, input_bytes=7)
    peak = step_peak(step)
    assert peak.phase == "backward 1" and peak.by_kind["temporary_bytes"] == 2614


def test_the_optimizer_step_can_hold_the_peak():
    # with nothing saved, the step is the peak: 16-bit ZeRO-0 (2-byte params 20, gradients 2 + 4 per
    # element: 60, master and moments 120) plus Adam's two fp32 temporaries of the flat master (2 x 40)
    idle = OpCost("w", "matrix", weights=(10,))
    peak = step_peak(RankStep([[idle]], DP_ORDER, 2, ZeroSettings()))
    assert peak.phase == "optimizer_step 0"
    assert kinds(peak) == {"param_bytes": 20, "grad_bytes": 60, "optimizer_bytes": 120, "temporary_bytes": 80}


def test_grads_in_partition_counts_every_parameter_overlapping_the_partition_whole():
    # tensors of 3 and 5 elements over 2 ranks: padded to 8, partitions [0, 4) and [4, 8); rank 0 overlaps
    # both (8 elements), rank 1 only the second (5)
    assert _overlapping_partition([3, 5], 2, 0) == 8
    assert _overlapping_partition([3, 5], 2, 1) == 5


def test_rank_steps_read_the_zero_settings_the_layout_writes():
    from ds_pipe_ext.layout import ZERO_SETTINGS
    from ds_pipe_ext.models.registry import load_model

    cfg = load_model("compare-cpu")
    [dp] = rank_steps(cfg, Layout(dp=2, zero=3, micro_batch=2, micro_batches=2))
    assert dp.zero.stage == 3 and dp.zero.reduce_bucket_size == int(ZERO_SETTINGS["reduce_bucket_size"])
    assert dp.zero.persistence_threshold == int(ZERO_SETTINGS["stage3_param_persistence_threshold"])
    assert [k for k, _ in dp.order] == ["F", "B", "F", "B"]
    pipe = rank_steps(cfg, Layout(pp=2, micro_batch=2, micro_batches=2), parts=[0, 3, 6], dtype="bf16")
    assert [s.pipe_buffers for s in pipe] == [2, 2] and [s.flat_grad_bytes for s in pipe] == [2, 2]
    assert pipe[1].output_bytes == 2 * 256 * 8192 * 2  # the logits, in bf16
    with pytest.raises(ValueError, match="needs its split"):
        rank_steps(cfg, Layout(pp=2, micro_batch=2, micro_batches=2))


def test_full_recompute_keeps_layer_inputs_and_replays_one_layer_at_a_time():
    # each layer keeps only its input (0 for the first, 30 for the loss layer); the loss layer's backward
    # first replays its forward (200 saved again): 230 alive beside its 600 of gradients.  Second backward:
    # 40 + 80 (states) + 40 (gradients) + 230 + 600 = 990
    step = RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, ZeroSettings(), checkpoint_bytes=(0.0, 30.0))
    peak = step_peak(step)
    assert kinds(peak) == {"param_bytes": 40, "grad_bytes": 40, "optimizer_bytes": 80, "activation_bytes": 230,
                           "temporary_bytes": 600}


@pytest.mark.parametrize("zero", [0, 1])
def test_the_partitioners_form_bounds_the_peak_and_equals_it_on_the_last_stage(zero):
    # compare-cpu on 2 stages, 2 micro-batches: the partitioner's stage memory (its layers' states as held in
    # a backward, the in-flight activations, the stage's reserve, or its optimizer step's bytes) is the peak
    # rule's on the last stage (whose peak is the loss's backward, every gradient made), and above it on
    # stage 0 (whose peak falls in its first backward, before its gradients are all made; under ZeRO-1 the
    # reserve also covers the gradient reduction's two buckets, which the backward's activations do not
    # share in the rule: a bucket, 19 MiB, of slack there)
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.peak_rule import PipelinePeakRule
    from ds_pipe_ext.costs.stage import held_activation_bytes
    from ds_pipe_ext.models.registry import load_model
    from ds_pipe_ext.partition.problem import make_problem

    cfg = load_model("compare-cpu")
    costs = analytic_layer_costs(cfg, EstimateRequest(micro_batch=2, seq=256, dtype="fp32", mask_bytes=4),
                                 get_device("cpu"))
    lay = Layout(pp=2, zero=zero, micro_batch=2, micro_batches=2)
    rule = PipelinePeakRule(ZeroSettings.from_ds_config({"zero_optimization": lay.zero_section()} if zero else {}))
    pb = make_problem([1.0] * 6, 2, static_bytes=[c.static_bytes for c in rule.layer_states(costs)],
                      activation_bytes=held_activation_bytes(costs), micro_batches=2,
                      stage_reserve_bytes=rule.stage_reserves(costs, 2, micro_batches=2), step_bytes=rule.step_bytes(costs))
    first, last = (step_peak(s).total_bytes for s in rank_steps(cfg, lay, parts=[0, 3, 6], mask_bytes=4))
    assert pb.stage_memory(1, 3, 6) == pytest.approx(last, rel=1e-12)
    assert first < pb.stage_memory(0, 0, 3) < (1.35 if zero else 1.25) * first


def test_zero3_releases_a_module_whose_reuse_is_farther_than_the_max_reuse_distance():
    # two 10-element linears then the loss, ZeRO-3 over 2 ranks.  The first linear's reuse (its backward)
    # comes after 2 x 10 elements of the second's gathers: beyond a max reuse distance of 15 it is released
    # after its forward and gathered again for its backward; with DeepSpeed's default (1e9) both stay.  At
    # the loss's backward: one gathered layer (40 B) against two (80 B)
    second = OpCost("b", "matrix", weights=(10,), bwd_allocs=(60, 40))
    layers, z = [[LINEAR], [second], [LOSS]], dict(stage=3, reduce_bucket_size=25, persistence_threshold=0)
    near = step_peak(RankStep(layers, DP_ORDER, 4, ZeroSettings(**z, max_reuse_distance=15), dp=2))
    far = step_peak(RankStep(layers, DP_ORDER, 4, ZeroSettings(**z), dp=2))
    assert (near.by_kind["gathered_bytes"], far.by_kind["gathered_bytes"]) == (40, 80)


def test_zero3_on_one_rank_gathers_nothing():
    # a partition group of one rank: the partition is the whole parameter and DeepSpeed's gather makes the
    # parameter a view of it (``_no_gather_coalesced``).  The rank holds all 10 elements: params 40, gradient
    # partitions 40, optimizer 12 x 10 = 120, bucket 100; nothing gathered.  Over 2 ranks the layer is (40 B)
    z = ZeroSettings(stage=3, reduce_bucket_size=25, persistence_threshold=0)
    one = step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, z, dp=1))
    assert kinds(one) == {"param_bytes": 40, "grad_bytes": 40, "optimizer_bytes": 120, "buffer_bytes": 100,
                          "activation_bytes": 300, "temporary_bytes": 600}
    assert step_peak(RankStep([[LINEAR], [LOSS]], DP_ORDER, 4, z, dp=2)).by_kind["gathered_bytes"] == 40


def test_a_recompute_mode_per_layer_walks_like_the_global_setting():
    """The peak rule with a mode per layer: every layer alike is exactly the layout's one setting; a mix
    lies between none and full on every stage."""
    from dataclasses import replace

    from ds_pipe_ext.models.registry import load_model

    cfg = load_model("compare-cpu")
    n = cfg.num_pipeline_layers
    plain = Layout(pp=2, micro_batch=2, micro_batches=4)
    peaks = {}
    for mode in ("none", "selective", "full"):
        glob = [step_peak(s).total_bytes for s in rank_steps(cfg, replace(plain, recompute=mode), parts=[0, 3, n])]
        assert [step_peak(s).total_bytes for s in rank_steps(cfg, plain, parts=[0, 3, n], modes=[mode] * n)] == glob
        peaks[mode] = glob
    mixed = (["none", "full", "selective"] * n)[:n]
    got = [step_peak(s).total_bytes for s in rank_steps(cfg, plain, parts=[0, 3, n], modes=mixed)]
    assert all(peaks["full"][s] < got[s] < peaks["none"][s] for s in range(2))


@pytest.mark.parametrize("accum", [2, 4])
def test_bf16_optimizer_partitions_master_weights_and_moments_in_both_forms(accum):
    # DeepSpeed's BF16_Optimizer (bf16 under its pipeline without ZeRO): bf16 weights and gradients whole, a
    # flat accumulation buffer of `accum` bytes an element, fp32 master weights and moments on 1/dp.  compare-cpu
    # on 2 stages x dp 2: the partitioner's form equals the walked rule on the last stage, and the optimizer
    # states are half ZeRO-0's 16-bit ones
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.peak_rule import PipelinePeakRule
    from ds_pipe_ext.costs.stage import held_activation_bytes
    from ds_pipe_ext.models.registry import load_model
    from ds_pipe_ext.partition.problem import make_problem

    cfg = load_model("compare-cpu")
    costs = analytic_layer_costs(cfg, EstimateRequest(micro_batch=2, seq=256, dtype="bf16", mask_bytes=4),
                                 get_device("cpu"))
    lay = Layout(pp=2, dp=2, zero=0, micro_batch=2, micro_batches=2)
    bf16 = ZeroSettings(bf16_accum_bytes=accum)  # DeepSpeed's BF16_Optimizer in place of ZeRO's
    rule = PipelinePeakRule(bf16, dp=2, element_bytes=2)
    pb = make_problem([1.0] * 6, 2, static_bytes=[c.static_bytes for c in rule.layer_states(costs)],
                      activation_bytes=held_activation_bytes(costs), micro_batches=2,
                      stage_reserve_bytes=rule.stage_reserves(costs, 2, micro_batches=2), step_bytes=rule.step_bytes(costs))
    walked = rank_steps(cfg, lay, parts=[0, 3, 6], dtype="bf16", mask_bytes=4, zero=bf16)
    plain = rank_steps(cfg, lay, parts=[0, 3, 6], dtype="bf16", mask_bytes=4)
    last, zero0 = step_peak(walked[1]), step_peak(plain[1])
    assert pb.stage_memory(1, 3, 6) == pytest.approx(last.total_bytes, rel=1e-6)
    numels = sum(n for layer in walked[1].layers for op in layer for n in op.weights)
    padded = -(-numels // 4) * 4
    assert last.by_kind["optimizer_bytes"] == 12 * padded // 2 == pytest.approx(zero0.by_kind["optimizer_bytes"] / 2, rel=1e-5)
    assert last.by_kind["param_bytes"] == 2 * padded
