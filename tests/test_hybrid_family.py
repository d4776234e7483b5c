"""The hybrid family (Nemotron-H): its configs, its layers against Hugging Face's NemotronHForCausalLM on the
same weights, what it refuses, and its description as the planner reads it."""

import json

import pytest
import torch

from ds_pipe_ext.models import HYBRID, family_of, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.models.hybrid import from_hf_state_dict


def test_the_published_shapes_load_with_their_patterns_and_parameter_counts():
    """Nemotron-H 8B and 56B as published (their layer mix, and parameters within 1% of 8.1B and 56B)."""
    for name, mix, billions in (("nemotron-h-8b", (24, 4, 24), 8.1), ("nemotron-h-56b", (54, 10, 54), 56.0)):
        cfg = load_model(name)
        assert family_of(cfg) is HYBRID
        kinds = cfg.kinds
        assert (kinds.count("mamba"), kinds.count("attention"), kinds.count("mlp")) == mix
        desc = cfg.describe()
        assert [b.kind for b in desc.blocks] == list(kinds)
        h, v = cfg.hidden, cfg.padded_vocab
        m = cfg.mamba
        inner, conv = m.heads * m.head_dim, m.heads * m.head_dim + 2 * m.groups * m.state
        mamba = h + h * (inner + conv + m.heads) + conv * (m.conv_kernel + 1) + 3 * m.heads + inner + inner * h
        attention = h + h * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.heads * cfg.head_dim * h
        mlp = h + 2 * h * cfg.ffn
        total = 2 * v * h + h + mix[0] * mamba + mix[1] * attention + mix[2] * mlp
        assert total == pytest.approx(billions * 1e9, rel=0.01), (name, total)


def test_a_pattern_that_does_not_fit_is_refused_by_name(tmp_path):
    from ds_pipe_ext.models.config import CONFIG_DIR

    path = tmp_path / "bad.toml"
    tiny = (CONFIG_DIR / "hybrid-tiny.toml").read_text()
    path.write_text(tiny.replace('pattern = "M-M*-M"', 'pattern = "M-M*-X"'))
    with pytest.raises(ModelConfigError, match=r"hybrid_override_pattern has 'X' at layer 5"):
        load_model(str(path))
    path.write_text(tiny.replace("layers = 6", "layers = 7"))
    with pytest.raises(ModelConfigError, match=r"the pattern describes 6 layers, the config has layers = 7"):
        load_model(str(path))
    path.write_text(tiny.replace('pattern = "M-M*-M"', 'pattern = "M-M*-E"'))
    with pytest.raises(ModelConfigError, match=r"the pattern has E \(MoE\) layers: experts = 0; a positive integer"):
        load_model(str(path))


def test_the_layers_are_hugging_faces_nemotron_h_on_the_same_weights(tmp_path):
    """fp32 on CPU: the family's layers (our Mamba-2 mixer, the Llama family's attention without positions, a
    squared-ReLU MLP) give the model's own labels= loss within 1e-5, from its save_pretrained config.json."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=5,
        max_position_embeddings=16, hybrid_override_pattern="M-M*-M")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").eval()
    model.save_pretrained(tmp_path / "nh")
    cfg = load_model(str(tmp_path / "nh"))
    assert cfg.pattern == "M-M*-M" and cfg.mamba.groups == 2 and cfg.seq_len == 16
    ours = HYBRID.sequential(HYBRID.layer_specs(cfg), HYBRID.loss_fn(cfg), base_seed=0, recompute=False)
    ours.load_state_dict(from_hf_state_dict(model.state_dict(), cfg))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(tokens, labels=tokens).loss.item()
    # ours predicts labels[i] from tokens[..i] (the family's lm_loss), transformers shifts inside its loss
    got = ours(tokens[:, :-1], tokens[:, 1:]).item()
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("reference", [False, True], ids=["deepspeed's dispatch", "reference routing"])
def test_moe_layers_are_hugging_faces_on_the_same_weights(tmp_path, reference):
    """A pattern with E layers (squared-ReLU experts, DeepSeek-V3's sigmoid router with its bias and groups, a
    shared expert): the family's layers over DeepSpeed's MoE layer give the model's own labels= loss within 1e-5
    (fp32), through DeepSpeed's dispatch and through the plain-torch reference routing; a latent projection
    around the experts is refused by name."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6, n_groups=2, chunk_size=5,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=16,
        hybrid_override_pattern="M-ME*E")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # a router that is not zero (transformers initialises it so) and a bias that matters
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(std=0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    model.save_pretrained(tmp_path / "nh")
    cfg = load_model(str(tmp_path / "nh"))
    assert cfg.pattern == "M-ME*E" and (cfg.experts, cfg.top_k, cfg.router_groups) == (8, 2, 4)
    desc = cfg.describe()
    assert [b.kind for b in desc.blocks].count("moe") == 2 and desc.blocks[3].experts.router == "sigmoid"
    ours = HYBRID.sequential(HYBRID.layer_specs(cfg, reference=reference), HYBRID.loss_fn(cfg), base_seed=0,
                             recompute=False)
    ours.load_state_dict(from_hf_state_dict(model.state_dict(), cfg))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    want = model(tokens, labels=tokens).loss.item()
    got = ours(tokens[:, :-1], tokens[:, 1:]).item()
    assert got == pytest.approx(want, rel=1e-5)
    data = {**json.loads((tmp_path / "nh" / "config.json").read_text()), "moe_latent_size": 8}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelConfigError, match=r"moe_latent_size = 8: a latent projection .* hf.pipeline_layers"):
        load_model(str(tmp_path / "config.json"))


def test_train_py_trains_the_hybrid_family_by_name_as_a_pipeline(tmp_path, forked_ranks):
    """deepspeed --num_gpus 2, hybrid-tiny (M-M*-M) in 2 stages split by "profiled", from one process's
    weights: the first loss is that process's."""
    from ds_pipe_ext.runner import launch, write_config

    cfg = load_model("hybrid-tiny")
    init = tmp_path / "init.pt"
    model = HYBRID.sequential(HYBRID.layer_specs(cfg), HYBRID.loss_fn(cfg), base_seed=7, recompute=False)
    torch.save(model.state_dict(), init)
    ds = write_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                      pipeline={"stages": 2, "partition_method": "profiled"},
                      train={"model": "hybrid-tiny", "steps": 2, "seed": 1234})
    proc, ranks = launch(2, ds, "--init-from", str(init), out_dir=tmp_path, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from ds_pipe_ext.train.data import SyntheticTokens

    data = SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=1234 + 1000)
    with torch.no_grad():
        want = sum(model(*next(data)).item() for _ in range(2)) / 2
    assert len(ranks[0]["parts"]) == 3 and ranks[0]["losses"][0] == pytest.approx(want, rel=1e-5)


def test_what_megatron_core_can_run_of_a_hybrid_split_is_said():
    """Megatron-core's MambaModel splits a hybrid pattern evenly, or with first/last stage sizes, and does not
    interleave: plan prints those arguments for its pick, or why the pick needs more (8 layers + embedding
    and head: pipeline layers 0..9)."""
    from types import SimpleNamespace

    from ds_pipe_ext.layout import Layout
    from ds_pipe_ext.plan.render import megatron_hybrid_split

    lay = Layout(pp=4, micro_batches=8)
    assert megatron_hybrid_split(SimpleNamespace(layout=lay, parts=[0, 3, 5, 7, 10])) == (
        "an even split", "2 layers a stage")
    assert megatron_hybrid_split(SimpleNamespace(layout=lay, parts=[0, 2, 5, 8, 10]))[0] == (
        "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1")
    split, why = megatron_hybrid_split(SimpleNamespace(layout=lay, parts=[0, 3, 4, 8, 10]))
    assert split is None and "layers a stage [2, 1, 4, 1]: the stages between the first and the last differ" in why
    split, why = megatron_hybrid_split(SimpleNamespace(layout=Layout(pp=2, micro_batches=8, schedule="interleaved:2"),
                                                       parts=[0, 3, 5, 7, 10]))
    assert split is None and "without interleaving" in why


def test_a_moe_layers_analytic_saved_bytes_and_weights():
    """The E layer's saved bytes against the profiler's count (fp32, this CPU) within 3% at its own largest expert
    load (routed layers come out within 0.2%), and its weights exact: squared-ReLU experts (up, down) and the
    sigmoid router's kept tensors (costs/moe_ops.py)."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.probes import saved_activation_bytes

    cfg = load_model("hybrid-tiny", pattern="M-ME", layers=4, experts=8, top_k=2, expert_ffn_hidden=24,
                     shared_ffn_hidden=16, router_groups=4, router_topk_groups=2)
    b = 4
    torch.manual_seed(0)
    layer = HYBRID.layer_specs(cfg)[4].build()
    x = torch.randn(cfg.seq_len, b, cfg.hidden, requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: layer(x), list(layer.parameters()))
    imbalance = int(layer.tokens_per_expert.max()) / (cfg.top_k * b * cfg.seq_len / cfg.experts)
    analytic = analytic_layer_costs(cfg, EstimateRequest(b, cfg.seq_len, dtype="fp32", expert_imbalance=imbalance),
                                    get_device("cpu"))[4]
    assert analytic.activation_bytes == pytest.approx(saved, rel=0.03)
    assert analytic.param_bytes == sum(p.numel() * 4 for p in layer.parameters())
