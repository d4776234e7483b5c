"""Multi-token prediction (``models.mtp``): the moe family's loss with D MTP layers against megatron-core's
procedure written out here (ids and labels rolled one place a layer, the rolled loss mask, the shared embedding
and head, lambda / D); its gradients; the description and costs that see each MTP layer as a pipeline layer."""

import json

import pytest
import torch
import torch.nn.functional as F

from ds_pipe_ext.models import get_family, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.train.data import SyntheticTokens

MOE = get_family("moe")
MLA = dict(kv_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           router="sigmoid", router_groups=2, router_topk_groups=1, top_k=2, norm_topk_prob=True)


def roll_left(t: torch.Tensor, fill) -> torch.Tensor:
    """megatron-core's roll_tensor at CP 1: torch.roll by -1 along the sequence, the last position filled."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = fill
    return out


def written_out_loss(model, cfg, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss megatron-core computes (gpt_model._postprocess with mtp_num_layers = D), from the model's modules."""
    emb, *rest = model.layers
    blocks, mtp, head = rest[:cfg.layers], rest[cfg.layers:-1], rest[-1]
    table = emb.embed_tokens.weight
    x = F.embedding(tokens, table).transpose(0, 1)
    aux = torch.zeros(1)
    for block in blocks:
        x, aux = block((x, aux))[:2]
    main = F.cross_entropy(F.linear(head.norm(x), head.lm_head.weight).float().reshape(-1, cfg.vocab_size),
                           labels.t().reshape(-1))
    ids, mtp_labels, mask, h = tokens, labels.clone(), torch.ones_like(labels, dtype=torch.float), x
    mtp_total = 0.0
    for layer in mtp:
        ids = roll_left(ids, 0)
        e = F.embedding(ids, table).transpose(0, 1)
        z = layer.eh_proj(torch.cat((layer.enorm(e), layer.hnorm(h)), dim=-1))
        z, aux = layer.block((z, aux))[:2]
        h = layer.final_norm(z)
        logits = F.linear(h, head.lm_head.weight).float()  # the shared output head
        mtp_labels, mask = roll_left(mtp_labels, 0), roll_left(mask, 0.0)
        per_token = F.cross_entropy(logits.transpose(0, 1).reshape(-1, cfg.vocab_size), mtp_labels.reshape(-1),
                                    reduction="none")
        mtp_total = mtp_total + (per_token * mask.reshape(-1)).sum() / mask.sum()
    return main + cfg.aux_loss_coef * aux.reshape(()) + cfg.mtp_loss_scale / cfg.mtp_layers * mtp_total


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_and_gradients_equal_megatrons_procedure_written_out(depth):
    cfg = load_model("moe-tiny", **MLA, mtp_layers=depth, mtp_loss_scale=0.3)
    model = MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=5, recompute=False)
    assert len(model.layers) == cfg.layers + depth + 2 == cfg.num_pipeline_layers
    tokens, labels = next(SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=2))
    ours = model(tokens, labels)
    ours.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want = written_out_loss(model, cfg, tokens, labels)
    want.backward()
    assert ours.item() == pytest.approx(want.item(), rel=1e-6)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[name], p.grad, rtol=1e-4, atol=1e-7), name
    table = model.layers[0].embed_tokens.weight
    terms = model.loss_fn.additional_losses()
    assert set(terms) == {"lm_loss", "moe_aux_loss", "mtp_loss"} and terms["mtp_loss"] > 0
    # the MTP losses reach the one word table and the one head (no copies to keep tied)
    assert sum(p is table for p in model.parameters()) == 1


def test_mtp_layers_are_pipeline_layers_the_costs_and_megatron_see():
    cfg = load_model("moe-tiny", **MLA, mtp_layers=1)
    desc = cfg.describe()
    assert desc.mtp_layers == 1 and desc.blocks[-1].mtp and desc.num_pipeline_layers == cfg.num_pipeline_layers
    from ds_pipe_ext.costs.estimate import EstimateRequest, estimate_layers
    from ds_pipe_ext.costs.hardware import get_device

    rows = estimate_layers(cfg, EstimateRequest(2, cfg.seq_len, dtype="fp32"), get_device("cpu"))
    assert len(rows) == len(MOE.layer_specs(cfg))
    built = [sum(p.numel() for p in spec.build().parameters()) for spec in MOE.layer_specs(cfg)]
    assert [int(r["params"]) for r in rows] == built  # the MTP layer's own weights; the table and head not again
    no_mtp = estimate_layers(load_model("moe-tiny", **MLA), EstimateRequest(2, cfg.seq_len, dtype="fp32"),
                             get_device("cpu"))
    assert rows[-1]["fwd_flops"] > 1.9 * no_mtp[-1]["fwd_flops"]  # the head projects twice the tokens
    assert rows[1]["output_bytes"] == 2 * no_mtp[1]["output_bytes"]  # the shifted embedding travels


def test_mtp_saved_bytes_match_the_profiler():
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.costs.probes import saved_activation_bytes

    cfg = load_model("moe-tiny", **MLA, mtp_layers=1)
    b = 4
    torch.manual_seed(0)
    layer = MOE.layer_specs(cfg)[-2].build()
    x = [torch.randn(cfg.seq_len, b, cfg.hidden, requires_grad=True) for _ in range(2)]
    aux = torch.zeros(1, requires_grad=True)
    saved, _ = saved_activation_bytes(lambda: layer((x[0], aux, x[1])), list(layer.parameters()))
    load = layer.block.tokens_per_expert
    imbalance = int(load.max()) / (cfg.top_k * b * cfg.seq_len / cfg.experts)
    analytic = analytic_layer_costs(cfg, EstimateRequest(b, cfg.seq_len, dtype="fp32", expert_imbalance=imbalance),
                                    get_device("cpu"))[-2]
    assert analytic.activation_bytes == pytest.approx(saved, rel=0.03)


def test_mtp_refusals_name_the_field():
    with pytest.raises(ModelConfigError, match="mtp_layers = -1"):
        load_model("moe-tiny", mtp_layers=-1)
    with pytest.raises(ModelConfigError, match="mtp_loss_scale"):
        load_model("moe-tiny", mtp_layers=1, mtp_loss_scale=-0.1)


@pytest.mark.multiprocess
def test_mtp_trains_as_a_pipeline_with_the_layer_on_either_stage(tmp_path, forked_ranks):
    """Two stages (DeepSpeed's pipeline, forked ranks), the MTP layer on the head's stage, and on the stage
    before it (its output travels beside the hidden states); 3 steps each from one process's weights, gradients
    clipped to norm 1: the losses and gradient norms of the one-process model within 1e-5 relative (first step)
    and 1e-4."""
    from test_moe_training import moe_reference

    from ds_pipe_ext.runner import launch, write_config

    fields = {**MLA, "mtp_layers": 1, "mtp_loss_scale": 0.3}
    whole = {k: v for k, v in load_model("moe-tiny", **fields).to_dict().items() if v is not None and k != "name"}
    toml = tmp_path / "mtp-tiny.toml"
    toml.write_text('family = "moe"\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in whole.items()))
    cfg = load_model(str(toml))
    init = tmp_path / "init.pt"
    torch.save(MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=99, recompute=False).state_dict(), init)
    steps, mb, gas = 3, 2, 2
    # DeepSpeed's default gradient_clipping (1.0) clips these steps (norms of 1.3-1.7): by the whole model's norm
    # (train.grad_norm.clip_by_the_whole_pipeline), as the reference does
    want_losses, want_norms = moe_reference(cfg, init, steps, dp=1, micro_batch=mb, gas=gas)
    assert want_norms[0] > 1.0
    ds = write_config(tmp_path / "ds.json", pipeline={"stages": 2, "partition_method": "parts:0,3,7"},
                      train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
                      train={"model": str(toml), "steps": steps})
    runs = ["--run", f"with the head: --init-from {init} --partition-method parts:0,3,7",
            "--run", f"before the head: --init-from {init} --partition-method parts:0,6,7"]
    proc, ranks = launch(2, ds, "--steps", str(steps), *runs, out_dir=tmp_path, cwd=tmp_path,
                         script="tests/models_in_turn.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("with the head", "before the head"):
        got = ranks[0]["runs"][name]
        assert "error" not in got, got
        assert got["losses"][0] == pytest.approx(want_losses[0], rel=1e-5), name
        assert got["grad_norms"][0] == pytest.approx(want_norms[0], rel=1e-5), name
        assert got["losses"] == pytest.approx(want_losses, rel=1e-4), name
        assert got["grad_norms"] == pytest.approx(want_norms, rel=1e-4), name
