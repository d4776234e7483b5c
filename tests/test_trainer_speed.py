"""What keeps a GPU busy, checked on the CPU: torch's fused AdamW (what CUDA gets) updates as the CPU loop
does; the GPT's attention kernel is a model setting whose two kernels train the same model; the analytic
model charges the kernel that runs on the device it costs."""

from dataclasses import replace

import pytest
import torch

from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.models.config import ModelConfigError
from ds_pipe_ext.models.gpt_config import GPTConfig, load_model_config
from ds_pipe_ext.models.gpt import SequentialGPT, gpt_layer_specs
from ds_pipe_ext.train.build import make_adamw


def test_cuda_gets_torchs_fused_adamw_and_it_updates_as_the_cpu_loop_does(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]

    def train(optimizer_for) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = optimizer_for(params)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        return params

    ours = train(lambda ps: make_adamw(ps, lr=1e-2))  # the CPU: a plain loop over the tensors
    assert ours and make_adamw([torch.nn.Parameter(torch.ones(1))], lr=1e-2).defaults["foreach"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_cuda = make_adamw([torch.nn.Parameter(torch.ones(1))], lr=1e-2)
    assert isinstance(on_cuda, torch.optim.AdamW) and on_cuda.defaults["fused"] is True
    fused = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))  # torch runs it on the CPU too
    for a, b in zip(ours, fused):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def _loss_and_grads(cfg: GPTConfig, tokens: torch.Tensor):
    model = SequentialGPT(gpt_layer_specs(cfg), base_seed=7)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_the_two_attention_kernels_train_the_same_gpt():
    """tiny with attention written out and through torch's SDPA: one loss (1e-5) and one gradient at dropout 0."""
    tiny = load_model_config("tiny")
    tokens = torch.randint(0, tiny.vocab_size, (2, tiny.seq_len + 1), generator=torch.Generator().manual_seed(3))
    eager, eager_grads = _loss_and_grads(replace(tiny, attention="eager"), tokens)
    sdpa, sdpa_grads = _loss_and_grads(replace(tiny, attention="sdpa"), tokens)
    assert sdpa == pytest.approx(eager, abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager_grads, sdpa_grads))


def test_sdpa_applies_the_attention_dropout_in_training_only():
    cfg = replace(load_model_config("tiny"), attention="sdpa", dropout=0.5)
    block = gpt_layer_specs(cfg)[1].build()
    x = torch.randn(cfg.seq_len, 2, cfg.hidden, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    assert not torch.equal(block(x), block(x))  # two dropout masks
    block.eval()
    assert torch.equal(block(x), block(x))


def test_auto_runs_sdpa_on_cuda_and_eager_on_a_cpu_and_the_setting_is_checked():
    cfg = load_model_config("tiny")
    assert cfg.attention == "auto" and cfg.attention_kernel("cuda") == "sdpa" and cfg.attention_kernel("cpu") == "eager"
    assert replace(cfg, attention="eager").attention_kernel("cuda") == "eager"
    with pytest.raises(ModelConfigError, match="attention = 'flash'; use one of eager, sdpa, auto"):
        GPTConfig.from_dict({**cfg.to_dict(), "attention": "flash"})
    block = gpt_layer_specs(cfg)[1].build()
    assert block.attn.sdpa is torch.cuda.is_available() and hasattr(block.attn, "causal_mask") is not block.attn.sdpa


def test_the_analytic_model_charges_the_kernel_that_runs_on_the_device_it_costs():
    """A GPU spec costs "auto" as the fused kernel (no s x s probabilities kept), the CPU spec as written out;
    an explicit setting is costed as set on any device."""
    cfg = replace(load_model_config("gpt2-medium"), dropout=0.0)
    req = EstimateRequest(micro_batch=1, seq=1024, dtype="bf16")
    a100 = get_device("a100")
    s, a = 1024, cfg.heads
    fused = analytic_layer_costs(cfg, req, a100)[1].activation_bytes
    eager = analytic_layer_costs(cfg, req, a100, runs_on="cpu")[1].activation_bytes
    assert eager == analytic_layer_costs(replace(cfg, attention="eager"), req, a100)[1].activation_bytes
    # fused: the s x s probabilities (2 bytes each, a heads) are not kept; the fp32 log-sum-exp per row is
    assert eager - fused == 2 * a * s * s - 4 * a * s
    assert analytic_layer_costs(replace(cfg, attention="sdpa"), req, a100, runs_on="cpu")[1].activation_bytes == fused


def test_compiling_the_layers_in_place_keeps_every_state_dict_key():
    """train.compile compiles each layer as it is (nn.Module.compile): a checkpoint loads compiled or not."""
    from ds_pipe_ext.train.build import compile_layers

    model = SequentialGPT(gpt_layer_specs(load_model_config("tiny")), base_seed=1)
    keys = list(model.state_dict())
    assert compile_layers(model, pipelined=False) == len(model.layers)
    assert list(model.state_dict()) == keys
    assert all(layer._compiled_call_impl is not None for layer in model.layers)  # compiled on the first call
