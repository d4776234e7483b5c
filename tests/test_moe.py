"""The Mixture-of-Experts family's configs: named shapes, Hugging Face config.json files, what it refuses.

Its layers, profile and analytic costs: tests/test_moe_training.py."""

import math
from dataclasses import replace

import pytest
import torch

from ds_pipe_ext.arch import DescriptionError, Experts
from ds_pipe_ext.costs.op_cost import AnalyticError
from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.models import MoEConfig, family_of, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.models.registry import from_hf_config

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
           "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
           "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
           "vocab_size": 32000}
QWEN_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
            "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
            "max_window_layers": 21, "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24,
            "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
            "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
            "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
             "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
             "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
             "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
             "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
             "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
             "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
DEEPSEEK_MOE = {"architectures": ["DeepseekForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
                "intermediate_size": 10944, "max_position_embeddings": 4096, "model_type": "deepseek",
                "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_routed_experts": 64, "n_shared_experts": 2,
                "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
                "num_hidden_layers": 28, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None,
                "rope_theta": 10000, "tie_word_embeddings": False, "vocab_size": 102400}


def same_shape(a: MoEConfig, b: MoEConfig) -> bool:
    """Equal but for the name and the sequence (a config.json's is its longest; a named config's, the trained)."""
    return replace(a, name="x", seq_len=1) == replace(b, name="x", seq_len=1)


@pytest.mark.parametrize("data, named", [(MIXTRAL, "mixtral-8x7b"), (QWEN_MOE, "qwen-moe"),
                                         (QWEN3_MOE, "qwen3-30b-a3b"), (DEEPSEEK_MOE, "deepseek-moe-16b")])
def test_hugging_face_configs_are_the_named_shapes(data, named):
    cfg = from_hf_config(data, name=named + "-hf")
    assert isinstance(cfg, MoEConfig) and family_of(cfg).name == "moe"
    assert same_shape(cfg, load_model(named))


def test_the_description_routes_every_block_after_the_dense_ones():
    ds = load_model("deepseek-moe-16b").describe()
    assert ds.blocks[0].experts is None and ds.blocks[0].mlp.ffn == 10944
    assert all(b.experts == Experts(64, 6, shared_ffn=2816) and b.mlp.ffn == 1408 for b in ds.blocks[1:])
    qwen = load_model("qwen-moe").describe().blocks[0].experts
    assert (qwen.count, qwen.top_k, qwen.shared_ffn, qwen.shared_gate) == (60, 4, 5632, True)
    qwen3 = load_model("qwen3-30b-a3b").describe().blocks[0]  # Qwen3's attention: 32 heads of 128 on 2,048
    assert (qwen3.attention.head_dim, qwen3.attention.qk_norm, qwen3.experts.count, qwen3.experts.top_k) == (
        128, True, 128, 8)
    tiny = load_model("moe-tiny")
    assert family_of(tiny).name == "moe" and family_of(load_model("llama-tiny")).name == "llama"
    assert [b.experts is not None for b in tiny.describe().blocks] == [False, True, True, True]


@pytest.mark.parametrize("data, match", [
    ({**DEEPSEEK_MOE, "model_type": "deepseek_v2"}, "DeepSeek-V2's softmax group-limited router is not modelled"),
    ({**DEEPSEEK_MOE, "model_type": "deepseek_v3"}, r"lacks the multi-head latent attention fields \['kv_lora_rank'"),
    ({**QWEN_MOE, "decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({**DEEPSEEK_MOE, "moe_layer_freq": 2}, "moe_layer_freq"),
    ({**MIXTRAL, "num_experts_per_tok": 9}, r"top_k \(9\) exceeds experts \(8\)"),
    ({**MIXTRAL, "model_type": "dbrx"}, "model_type 'dbrx' is not supported"),
])
def test_unmodelled_features_are_named(data, match):
    with pytest.raises(ModelConfigError, match=match):
        from_hf_config(data, name="m")


@pytest.mark.parametrize("fields, match", [
    ({"top_k": 0}, "top_k = 0"),
    ({"dense_layers": 4}, "leaves no MoE block"),
    ({"shared_ffn_hidden": 0, "shared_gate": True}, "shared_gate needs shared experts"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
])
def test_bad_moe_fields_are_named(fields, match):
    with pytest.raises(ModelConfigError, match=match):
        load_model("moe-tiny", **fields)
    with pytest.raises(DescriptionError, match="top_k"):
        Experts(4, 5)


def test_analytic_costs_name_the_experts():
    from ds_pipe_ext.costs.op_cost import Shape
    from ds_pipe_ext.costs.moe_ops import routed_mlp

    experts = load_model("moe-tiny").describe().blocks[1].experts
    with pytest.raises(AnalyticError, match="ep = 3 does not divide the 4 experts"):
        routed_mlp(Shape(b=1, s=32, h=64, a=4, f=96, V=512, ep=3), experts, ep=3)
    rows = estimate_layers(load_model("moe-tiny"), EstimateRequest(1, 32), get_device("h100"))
    assert [r["expert_params"] > 0 for r in rows] == [False, False, True, True, True, False]


def test_analytic_routed_experts_under_tensor_parallelism():
    """Under TP 2 every rank routes the same 32 tokens, runs half of every expert's 16 slots (DeepSpeed's
    drop_tokens) and gathers the experts' output back over TP; the experts' weights stay whole."""
    from ds_pipe_ext.costs.moe_ops import routed_mlp, slots_per_expert
    from ds_pipe_ext.costs.op_cost import Shape

    experts = load_model("moe-tiny").describe().blocks[1].experts
    shape = dict(b=1, s=32, h=64, a=4, f=96, V=512, e=4)
    one = {op.name: op for op in routed_mlp(Shape(**shape), experts, imbalance=1.0)}  # 16 slots: the mean load
    two = {op.name: op for op in routed_mlp(Shape(**shape, t=2), experts, ep=2, imbalance=1.0)}
    for name in ("expert_gate_up", "expert_swiglu", "expert_down"):
        assert two[name].fwd_flops == one[name].fwd_flops / 2 and two[name].activation_bytes == one[name].activation_bytes / 2
    assert two["expert_gate_up"].weight_bytes == one["expert_gate_up"].weight_bytes / 2  # E / ep experts, whole
    assert two["router"] == one["router"] and two["combine"] == one["combine"]
    gather = two["tp_gather_slots"]
    assert (gather.comm_type, gather.comm_fwd_bytes, gather.comm_bwd_bytes) == ("all-gather", 4 * 16 * 64 * 4,
                                                                                4 * 16 * 64 * 4)
    assert two["dispatch_all_to_all"].comm_fwd_bytes == 4 * 8 * 64 * 4  # this TP rank's half of the slots
    assert "tp_gather_slots" not in one
    assert slots_per_expert(30, experts, 1.0, tp=2) == 16 and slots_per_expert(30, experts, 1.0) == 15  # padded to tp


def _simulated_busiest_load(tokens: int, experts: int, top_k: int, ranks: int, trials: int) -> float:
    """A uniformly random top-k router, simulated: each token's k distinct experts drawn at random on each rank;
    the largest load over the ranks' experts, averaged over ``trials``."""
    import numpy as np

    rng = np.random.default_rng(0)
    picks = np.argsort(rng.random((trials, ranks, tokens, experts)), axis=-1)[..., :top_k]
    loads = np.zeros((trials, ranks, experts), dtype=np.int64)
    for t in range(trials):
        for r in range(ranks):
            loads[t, r] = np.bincount(picks[t, r].ravel(), minlength=experts)
    return float(loads.max(axis=(1, 2)).mean())


@pytest.mark.parametrize("tokens, experts, top_k, ranks", [(1024, 8, 2, 1), (512, 64, 8, 1), (256, 16, 4, 4)])
def test_a_dropless_layers_slots_are_the_busiest_load_a_uniform_router_gives(tokens, experts, top_k, ranks):
    """DeepSpeed's dropless capacity is the largest expert count, the MAX over the EP group: what a router that
    favours no expert gives, within 1% of a simulated one; above the mean, the more so over more ranks."""
    from ds_pipe_ext.costs.moe_ops import busiest_expert_load

    load = busiest_expert_load(tokens, experts, top_k, ranks)
    assert load == pytest.approx(_simulated_busiest_load(tokens, experts, top_k, ranks, trials=200), rel=0.01)
    assert load > busiest_expert_load(tokens, experts, top_k, 1) if ranks > 1 else load > top_k * tokens / experts
    assert busiest_expert_load(1, experts, top_k) == 1  # one token: the largest load is 1, never under the mean


def test_dropless_slots_follow_the_ep_groups_distinct_tokens():
    """C by default: the busiest load over the EP group's ranks whose tokens differ (TP peers route the same
    tokens); a measured imbalance times the mean where one is given."""
    from ds_pipe_ext.costs.moe_ops import busiest_expert_load, slots_per_expert

    experts = Experts(count=16, top_k=4, capacity_factor=0.0)
    assert slots_per_expert(512, experts) == math.ceil(busiest_expert_load(512, 16, 4, 1)) > 128
    assert slots_per_expert(512, experts, ep=4) == math.ceil(busiest_expert_load(512, 16, 4, 4)) > \
        slots_per_expert(512, experts)
    assert slots_per_expert(512, experts, tp=2, ep=2) == slots_per_expert(512, experts, tp=2)  # the same tokens
    assert slots_per_expert(512, experts, tp=2, ep=4) == 2 * math.ceil(busiest_expert_load(512, 16, 4, 2) / 2)
    assert slots_per_expert(512, experts, 1.5, ep=4) == 192  # measured: 1.5 x the mean, whatever the group
    assert slots_per_expert(512, Experts(count=16, top_k=4, capacity_factor=1.25), ep=4) == 160  # capacity: fixed


def test_plan_says_how_dropless_slots_are_priced():
    """`plan`'s header line: the busiest load over the mean, on one rank and over the pick's EP group; a given
    imbalance as given; nothing for a model without dropless experts."""
    from ds_pipe_ext.costs.moe_ops import dropless_note

    note = dropless_note(load_model("deepseek-v3"), 4096, None, ep=8)
    assert "1.25x the mean at 4096 tokens a rank, 1.31x over an EP group of 8" in note  # 256 experts, top 8
    assert dropless_note(load_model("mixtral-8x7b"), 4096, 1.2) == \
        "dropless experts: each padded to 1.20x the mean load (--expert-imbalance)"
    assert dropless_note(load_model("llama3-8b"), 4096, None) is None
    assert dropless_note(load_model("bench-cpu-moe"), 4096, None) is None  # a capacity factor: slots fixed


def test_the_busiest_load_prices_the_capacities_an_h200_measured():
    """The H200 session's routed blocks (docs/gpu-runs/h200-2026-11-30, nothing fitted to them): each dropless
    MoE layer's capacity on a random input against the uniform router's busiest load: within 3%."""
    import json
    from pathlib import Path

    from ds_pipe_ext.costs.moe_ops import busiest_expert_load

    records = Path(__file__).resolve().parents[1] / "docs/gpu-runs/h200-2026-11-30/today-records.json"
    routed = [r for r in json.loads(records.read_text())["layers"] if "slots" in r]
    assert {r["model"] for r in routed} == {"mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"}
    for r in routed:
        tokens, k = r["b"] * r["s"], load_model(r["model"]).describe().blocks[-1].experts.top_k
        experts = round(k * tokens * r["imbalance"] / r["slots"])  # the block's experts (DeepSeek-V3's: 64 of 256)
        assert busiest_expert_load(tokens, experts, k) == pytest.approx(r["slots"], rel=0.03), r


@pytest.mark.parametrize("kwargs, match", [
    ({"dp": 2, "ep": 2, "model": "llama-tiny"}, "expert parallelism needs a Mixture-of-Experts model"),
    ({"dp": 3, "ep": 3}, r"ep = 3 does not divide the 4 experts of model 'moe-tiny'"),
    ({"tp": 2, "sp": True}, "DeepSpeed's MoE layer takes the TP ranks to hold the same tokens"),
    ({"tp": 2, "runtime": "megatron"}, "Megatron-LM runs a Mixture-of-Experts model's TP with sequence parallelism"),
    ({"tp": 2, "ep": 4}, "ep = 4 does not divide tp x dp = 2"),
    ({"dp": 2, "zero": 3}, "Native DeepSpeed MoE is not supported with ZeRO Stage 3"),
])
def test_expert_parallel_layouts_the_model_refuses(kwargs, match):
    from ds_pipe_ext.layout import Layout, LayoutError

    model = load_model(kwargs.pop("model", "moe-tiny"))
    with pytest.raises(LayoutError, match=match):
        Layout(**kwargs).check(model)
    ok = Layout(dp=4, ep=4, zero=2)
    ok.check(load_model("moe-tiny"))  # 4 experts over 4 ranks: one each
    Layout(pp=2, tp=2, ep=2).check(load_model("moe-tiny"))  # EP over the TP ranks (Megatron's expert TP 1)
    assert Layout(tp=2, dp=2, ep=2).expert_dp == 2 and Layout(tp=2, dp=2).expert_dp == 4
    assert ok.name == "pp1-tp1-dp4-ep4-z2-mb1-none" and Layout(dp=4).name == "pp1-tp1-dp4-z0-mb1-none"


def test_tensor_parallelism_must_split_each_experts_capacity_slots():
    """DeepSpeed splits each expert's ceil(tokens / E x capacity_factor x k) slots over the TP ranks: at 32 tokens,
    4 experts, top-2 and a factor of 1.05 that is 17 at micro-batch 1 (refused at TP 2) and 34 at 2; the planner
    keeps only the micro-batches whose slots split."""
    from ds_pipe_ext.layout import Layout, LayoutError
    from ds_pipe_ext.plan.space import enumerate_layouts

    model = load_model("moe-tiny", capacity_factor=1.05)
    with pytest.raises(LayoutError, match=r"capacity_factor 1.05 gives 17 slots an expert at micro-batch 1"):
        Layout(tp=2).check(model)
    Layout(tp=2, micro_batch=2).check(model)
    Layout(dp=2, micro_batch=1).check(model)  # no TP: nothing to split
    layouts, dropped = enumerate_layouts(model, 2, gpus_per_node=8, global_batch=4)
    assert {lay.micro_batch for lay in layouts if lay.tp == 2} == {2, 4}
    assert {lay.micro_batch for lay in layouts if lay.tp == 1} == {1, 2, 4}
    assert dropped["refused: an expert's capacity slots that TP does not split"] == 1


def test_an_expert_parallel_layout_round_trips_through_its_ds_json():
    from ds_pipe_ext.layout import Layout

    layout = Layout(pp=2, dp=4, ep=2, zero=1, micro_batch=2, micro_batches=4)
    ds = layout.ds_config()
    assert ds["moe"] == {"ep_size": 2} and "expert_parallel" not in ds  # DeepSpeed's key is AutoEP's
    assert Layout.from_ds_config(ds, 8) == layout
    assert "--expert-model-parallel-size" in layout.megatron_args()


def test_compare_adds_expert_parallel_rows_and_shows_zero3_refused(capfd):
    """`compare` and `estimate --compare` on an MoE model: each layout's EP variants (ep dividing dp and the
    experts), and the ZeRO-3 rows kept, marked refused with DeepSpeed's reason instead of launched."""
    from ds_pipe_ext.cli import main
    from ds_pipe_ext.compare.configs import comparison_configs
    from ds_pipe_ext.compare.run import refusal

    configs = {c.name: c for c in comparison_configs(4, global_batch=16, micro_batch=2, experts=4)}
    assert {"pipe-profiled-pp2-dp2-ep2-z0", "pipe-uniform-pp2-dp2-ep2-z1", "zero1-ep4", "zero2-ep2", "zero3"} <= set(configs)
    assert "zero3-ep2" not in configs and configs["zero2-ep2"].layout.ep == 2
    assert [c.name for c in comparison_configs(4, global_batch=16, micro_batch=2)] == \
        [n for n in configs if "-ep" not in n]  # a dense model: no EP rows
    model = load_model("moe-tiny")
    assert "Native DeepSpeed MoE is not supported with ZeRO Stage 3" in refusal(configs["zero3"], model)
    assert refusal(configs["zero2-ep2"], model) is None
    assert main(["estimate", "--compare", "--model", "moe-tiny", "--world", "4", "--device", "cpu",
                 "--micro-batch", "2"]) == 0
    out = capfd.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("zero3 ")).rstrip().endswith("refused")
    assert "zero3: refused: ZeRO-3 on model 'moe-tiny'" in out and "2x1x2 ep2" in out


def test_compare_predicts_a_ranks_share_of_the_experts():
    """`compare`'s model states under EP: a rank holds 1/ep of each layer's experts, and ZeRO partitions them
    over dp / ep (measured equal on every EP row of moe-tiny on 4 ranks: docs/results/2026-11-25-mixture-of-experts.md)."""
    from ds_pipe_ext.compare.configs import comparison_configs
    from ds_pipe_ext.compare.predict import model_shape, predicted_ranks

    cfg = load_model("moe-tiny")
    shape = model_shape(cfg)
    experts = sum(sum(layer) for layer in shape.layer_expert_numels)
    dense = shape.params - experts
    configs = {c.name: c for c in comparison_configs(4, global_batch=16, micro_batch=2, experts=4)}
    (z1,) = predicted_ranks(configs["zero1-ep2"], shape, [0.0] * 6)
    assert z1["param_bytes"] == 4 * (dense + experts // 2)
    assert z1["optimizer_bytes"] == 12 * (dense // 4 + experts // 2 // 2)  # dense over dp 4, experts over dp/ep 2
    stages = predicted_ranks(configs["pipe-uniform-pp2-dp2-ep2-z0"], shape, [0.0] * 6, parts=[0, 3, 6])
    stage_experts = [sum(sum(layer) for layer in shape.layer_expert_numels[a:b]) for a, b in ((0, 3), (3, 6))]
    assert [s["param_bytes"] for s in stages] == [
        4 * (sum(sum(layer) for layer in shape.layer_numels[a:b]) - x // 2)
        for (a, b), x in zip(((0, 3), (3, 6)), stage_experts)]


def test_deepspeeds_moe_layer_is_priced_with_the_kernels_its_code_launches():
    """On a GPU spec each local expert launches its own GEMMs and activation (DeepSpeed's Experts loops over them),
    and the gating, dispatch and combine launch what sharded_moe.py's sparse-routes path runs: the host's dispatch
    of them is priced (Mixtral-8x7B's bf16 block on an H200: 23.9 ms, against the 29.3 ms measured), and halving
    the local experts under EP 2 halves the experts' launches."""
    from ds_pipe_ext.costs.estimate import shape_for
    from ds_pipe_ext.costs.layer_ops import block_ops
    from ds_pipe_ext.costs.moe_ops import COMBINE_KERNELS, DISPATCH_KERNELS, GATING_KERNELS

    cfg = load_model("mixtral-8x7b")
    desc = cfg.describe()
    ops = {}
    for ep in (1, 2):
        shp = shape_for(cfg, EstimateRequest(1, 4096, ep=ep), get_device("h200"))
        ops[ep] = {op.name: op for op in block_ops(desc, desc.blocks[0], shp, device="h200")}
    one, two = ops[1], ops[2]
    assert (one["gating"].kernels, one["dispatch"].kernels, one["combine"].kernels) == (
        GATING_KERNELS[2], DISPATCH_KERNELS, COMBINE_KERNELS)  # Mixtral's top 2: DeepSpeed's top2gating
    assert one["expert_gate_up"].kernels == (8, 16) and two["expert_gate_up"].kernels == (4, 8)
    assert one["expert_swiglu"].kernels == (24, 88)  # 8 experts: 2 + a chunk's copy forward, 10 + 1 backward


def test_an_experts_activation_is_priced_with_the_kernels_its_code_launches():
    """Each expert activation's (forward, backward) kernels are what its autograd Function runs, counted here under
    a dispatch mode (views and kernel-less allocations left out): the SwiGLU's, gpt-oss's with biases alone and with
    its clamp; gpt-oss-20b's routed block prices its 32 experts with the clamped one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ds_pipe_ext.costs.estimate import shape_for
    from ds_pipe_ext.costs.layer_ops import block_ops
    from ds_pipe_ext.costs.moe_ops import EXPERT_ACTIVATIONS, EXPERT_COPY_KERNELS
    from ds_pipe_ext.models.experts import ClampedSwiGLU
    from ds_pipe_ext.models.llama import SwiGLU

    no_kernel = ("split", "empty_like", "detach", "view", "slice", "alias")

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not any(name in str(func) for name in no_kernel)
            return func(*args, **(kwargs or {}))

    def counted(activation):
        x = torch.randn(4, 16, requires_grad=True)
        grad = torch.ones(4, 8)
        with Kernels() as fwd:
            y = activation(x)
        with Kernels() as bwd:
            y.backward(grad)
        return fwd.count, bwd.count

    assert counted(SwiGLU.apply) == EXPERT_ACTIVATIONS["swiglu"][0]
    assert counted(lambda x: ClampedSwiGLU.apply(x, 0.0, 1.702)) == EXPERT_ACTIVATIONS["gpt-oss"][0]
    assert counted(lambda x: ClampedSwiGLU.apply(x, 7.0, 1.702)) == EXPERT_ACTIVATIONS["gpt-oss clamped"][0]
    cfg = load_model("gpt-oss-20b")
    desc = cfg.describe()
    shp = shape_for(cfg, EstimateRequest(1, 4096), get_device("h200"))
    act = {op.name: op for op in block_ops(desc, desc.blocks[0], shp, device="h200")}["expert_swiglu"]
    clamped = EXPERT_ACTIVATIONS["gpt-oss clamped"][0]
    assert act.kernels == tuple(32 * (k + c) for k, c in zip(clamped, EXPERT_COPY_KERNELS))
