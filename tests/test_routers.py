"""DeepSeek-V3's router (``models.routers``): the experts and weights Hugging Face's router chooses for the same
logits, and DeepSpeed's MoE layer running it against the plain-torch reference."""

import pytest
import torch

from ds_pipe_ext.models import get_family, load_model
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.models.routers import make_sigmoid_gate
from ds_pipe_ext.train.data import SyntheticTokens

MOE = get_family("moe")


def test_the_sigmoid_router_chooses_and_weighs_as_hugging_faces():
    """One router's weights and bias in both; the bias large enough to change choices, and the groups limit
    them (with 8 groups of 4 and 2 chosen groups a token can reach 8 of 32 experts)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hidden, experts, k, groups, topk_groups, scale = 64, 32, 6, 8, 2, 2.5
    config = transformers.DeepseekV3Config(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=k,
                                           n_group=groups, topk_group=topk_groups, routed_scaling_factor=scale,
                                           norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    ours = make_sigmoid_gate(hidden, experts, k=k, groups=groups, topk_groups=topk_groups, capacity_factor=1.0,
                             eval_capacity_factor=1.0, min_capacity=0, noisy_gate_policy=None, drop_tokens=False,
                             use_rts=False)
    with torch.no_grad():
        theirs.weight.copy_(ours.wg.weight)
        bias = torch.randn(experts) * 0.2
        theirs.e_score_correction_bias.copy_(bias)
        ours.e_score_correction_bias.copy_(bias)
    tokens = torch.randn(128, hidden)
    _, their_weights, their_ids = theirs(tokens)
    chosen, logits = ours.route(tokens)
    assert torch.equal(chosen.sort(1).values, their_ids.sort(1).values)
    # what DeepSpeed's gating makes of the logits it is handed: the chosen experts' renormalised scores
    gates = torch.softmax(logits, dim=1)
    mine = gates.gather(1, their_ids) * scale
    assert torch.allclose(mine, their_weights, rtol=1e-6, atol=0)
    # the groups bind: every token's experts lie in at most topk_groups groups, and the bias moved choices
    assert int((chosen // (experts // groups)).sort(1).values.diff(dim=1).ne(0).sum(1).max()) + 1 <= topk_groups
    plain, _ = __import__("ds_pipe_ext.models.routers", fromlist=["x"]).sigmoid_group_topk(
        torch.nn.functional.linear(tokens, ours.wg.weight), torch.zeros(experts), top_k=k, groups=groups,
        topk_groups=topk_groups)
    assert not torch.equal(plain.sort(1).values, chosen.sort(1).values)


def test_deepspeeds_layer_with_the_sigmoid_router_equals_the_reference():
    """DeepSpeed's capacity, dispatch and combine on the sigmoid gate's choice against the reference's own
    gathering; the router's weight and the experts learn through the renormalised scores."""
    cfg = load_model("moe-tiny", top_k=3, experts=8, router="sigmoid", router_groups=4, router_topk_groups=2,
                     routed_scaling_factor=2.0, norm_topk_prob=True)
    ours = MOE.sequential(MOE.layer_specs(cfg), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    ref = MOE.sequential(MOE.layer_specs(cfg, reference=True), MOE.loss_fn(cfg), base_seed=3, recompute=False)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    gate = ours.layers[2].mlp.moe.deepspeed_moe.gate
    assert "e_score_correction_bias" in dict(gate.named_buffers())
    x, y = next(SyntheticTokens(cfg.vocab_size, 2, cfg.seq_len, seed=1))
    loss_a, loss_b = ours(x, y), ref(x, y)
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    ga = torch.cat([p.grad.reshape(-1) for p in ours.parameters() if p.grad is not None])
    gb = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
    assert ga.shape == gb.shape and ((ga - gb).norm() / gb.norm()).item() < 1e-5
    assert gate.wg.weight.grad is not None and gate.wg.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("fields, match", [
    ({"router": "sigmoid", "router_groups": 3}, "router_groups .* must divide experts"),
    ({"router": "sigmoid", "router_groups": 4, "router_topk_groups": 5}, "router_topk_groups .5. exceeds"),
    ({"router": "sigmoid", "router_groups": 8}, "two best experts"),
    ({"router": "topk"}, "router = 'topk'"),
    ({"router": "sigmoid", "router_groups": 4, "router_topk_groups": 1, "top_k": 3}, "top_k .3. exceeds the experts"),
])
def test_bad_router_fields_are_named(fields, match):
    with pytest.raises(ModelConfigError, match=match):
        load_model("moe-tiny", experts=8, **fields)
