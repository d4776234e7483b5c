"""The Mixture-of-Experts family trains: DeepSpeed's MoE layer against a plain-torch reference of its routing,
in one process and through ``deepspeed --num_gpus 4`` as PP 2 x DP 2 x EP 2.

The reference (``moe.reference_routing``) shares only the parameters with DeepSpeed's layer: it gathers each
expert's tokens itself, so a wrong dispatch, all-to-all or combine changes the loss.  Experts start distinct
(seeded by their global id), so routing a token to the wrong expert does too."""

import math

import pytest
import torch

from ds_pipe_ext.models import get_family, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.train.data import SyntheticTokens

MOE = get_family("moe")


def flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_deepspeed_moe_layer_equals_the_reference_routing(top_k):
    cfg = load_model("moe-tiny", top_k=top_k, norm_topk_prob=top_k > 1)
    ours = MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    ref = MOE.sequential(MOE.layer_specs(cfg, reference=True), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    experts = ours.layers[2].mlp.moe.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].down.weight, experts[1].down.weight)  # re-initialised apart
    x, y = next(SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=1))
    loss_a, loss_b = ours(x, y), ref(x, y)
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    terms = {k: v.item() for k, v in ours.loss_fn.additional_losses().items()}
    assert loss_a.item() == pytest.approx(terms["lm_loss"] + cfg.aux_loss_coef * terms["moe_aux_loss"], rel=1e-6)
    assert terms["moe_aux_loss"] > 3 * 0.99  # three MoE blocks, each >= 1 (1 is a perfectly balanced router)
    ga, gb = flat_grad(ours), flat_grad(ref)
    assert ((ga - gb).norm() / gb.norm()).item() < 1e-5
    gate = ours.layers[2].mlp.moe.deepspeed_moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # the router learns (aux and combine weights)


@pytest.mark.parametrize("fields, match", [
    ({"norm_topk_prob": False}, "renormalises the top-k gate weights; set norm_topk_prob = true"),
    ({"top_k": 1, "norm_topk_prob": True}, "does not renormalise .* set norm_topk_prob = false"),
    ({"tie_embeddings": True}, "tied embeddings are not built for the moe family"),
])
def test_what_deepspeed_moe_cannot_train_is_named(fields, match):
    with pytest.raises(ModelConfigError, match=match):
        MOE.layer_specs(load_model("moe-tiny", **fields))


def test_tensor_parallel_moe_layers_are_refused():
    with pytest.raises(ModelConfigError, match="tensor parallelism of a Mixture-of-Experts model"):
        MOE.layer_specs(load_model("moe-tiny"), MOE.tensor_parallel(2, False))


def moe_reference(cfg, weights_path, steps: int, *, dp: int, micro_batch: int, gas: int, seed: int = 1234,
                  lr: float = 3e-4):
    """What PP x DP x EP computes, in one process: each DP rank's stream, each micro-batch routed (and its
    load-balancing loss taken) on its own tokens as the ranks do; the step's gradient is the mean over
    the dp x gas micro-batches, and every expert is counted once in the gradient norm."""
    model = MOE.sequential(MOE.layer_specs(cfg, reference=True), MOE.loss_fn(cfg), base_seed=None, recompute=False)
    model.load_state_dict(torch.load(weights_path))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    streams = [SyntheticTokens(cfg.vocab_size, micro_batch, cfg.seq_len, seed=seed + 1000 + r) for r in range(dp)]
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for data in streams:
            for _ in range(gas):
                loss = model(*next(data))
                (loss / (gas * dp)).backward()
                total += loss.item()
        norms.append(float(flat_grad(model).double().norm()))
        losses.append(total / (gas * dp))
        opt.step()
    return losses, norms


@pytest.mark.multiprocess
def test_pp2_dp2_ep2_parity_through_deepspeed(tmp_path):
    """deepspeed --num_gpus 4: 2 stages x 2 data-parallel ranks, each MoE layer's 4 experts split over EP 2,
    from the weights of one process: first loss and gradient norm within 1e-5, later losses within 1e-4."""
    from ds_pipe_ext.runner import launch, write_config

    cfg = load_model("moe-tiny")
    init = tmp_path / "init.pt"
    torch.save(MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=99, recompute=False).state_dict(),
               init)
    steps, mb, gas = 3, 2, 2
    want_losses, want_norms = moe_reference(cfg, init, steps, dp=2, micro_batch=mb, gas=gas)
    ds = write_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
                      pipeline={"stages": 2, "partition_method": "parts:0,3,6"}, moe={"ep_size": 2},
                      train={"model": "moe-tiny", "steps": steps})
    proc, ranks = launch(4, ds, "--steps", str(steps), "--run", f"moe-tiny={init}", out_dir=tmp_path, cwd=tmp_path,
                         script="tests/models_in_turn.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("pp 2 x tp 1 x dp 2") == 1
    run = ranks[0]["runs"]["moe-tiny"]
    assert run["parts"] == [0, 3, 6] and all(math.isfinite(x) for x in run["losses"])
    assert run["losses"][0] == pytest.approx(want_losses[0], rel=1e-5)
    assert run["grad_norms"][0] == pytest.approx(want_norms[0], rel=1e-5)
    assert run["losses"] == pytest.approx(want_losses, rel=1e-4)
