"""Mamba-2's mixer in plain torch: the chunked SSD scan against its step-by-step definition, the mixer against
Hugging Face's NemotronHMamba2Mixer (the same weights), forward and backward."""

import json

import pytest
import torch

from ds_pipe_ext.models.mamba2 import Mamba2Mixer, Mamba2Shape
from ds_pipe_ext.models.ssd import ssd_recurrence, ssd_scan


def inputs(b, l, h, p, g, n, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(b, l, h, generator=gen, dtype=dtype))
    A = -torch.rand(h, generator=gen, dtype=dtype) * 2 - 0.1
    B = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    C = torch.randn(b, l, g, n, generator=gen, dtype=dtype)
    state = torch.randn(b, h, p, n, generator=gen, dtype=dtype)
    return x, dt, A, B, C, state


@pytest.mark.parametrize("length, chunk", [(16, 4), (16, 16), (13, 4), (7, 8), (33, 5), (1, 4), (64, 16)])
def test_the_chunked_scan_is_the_recurrence(length, chunk):
    """fp32, within 1e-5 relative: lengths that are and are not multiples of the chunk, a chunk longer than the
    sequence, a carried-in state; the final state too."""
    x, dt, A, B, C, state = inputs(2, length, 4, 3, 2, 5)
    y, last = ssd_scan(x, dt, A, B, C, chunk, state=state)
    want, want_last = ssd_recurrence(x, dt, A, B, C, state=state)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(last, want_last, rtol=1e-5, atol=1e-5 * want_last.abs().max().item())


def test_the_scan_grads_are_the_recurrences():
    args = [t.double().requires_grad_() for t in inputs(1, 11, 2, 3, 1, 4)[:5]]
    y = ssd_scan(*args, 4)[0]
    got = torch.autograd.grad(y.square().sum(), args)
    want = torch.autograd.grad(ssd_recurrence(*args)[0].square().sum(), args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_scan_holds_where_decays_underflow():
    """Decays of e^-800 across a chunk (exp's arguments clamped where the result is no normal float, the scores
    masked above the diagonal where the clamped weights are 1): the recurrence's values and gradients, no nan."""
    x, dt, A, B, C, _ = inputs(2, 24, 4, 3, 2, 5)
    args = [t.double().requires_grad_() for t in (x, dt + 1.0, A * 50, B, C)]
    y = ssd_scan(*args, 8)[0]
    want = ssd_recurrence(*args)[0]
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(y.square().sum(), args)
    for g, w in zip(got, torch.autograd.grad(want.square().sum(), args)):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernel, bias", [(4, True), (3, False)])
def test_the_causal_conv_is_conv1ds_first_steps(kernel, bias):
    """``causal_depthwise_conv`` (shifted multiply-adds in the (b, l, channels) layout) against ``nn.Conv1d``
    padded by K - 1 and cut to the first l outputs, as Hugging Face's torch path runs it: values and gradients."""
    from ds_pipe_ext.models.mamba2 import causal_depthwise_conv

    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel, groups=6, padding=kernel - 1, bias=bias).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64, requires_grad=True)
    got = causal_depthwise_conv(x, conv.weight, conv.bias)
    want = conv(x.transpose(1, 2))[..., :9].transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = [x, *conv.parameters()]
    for g, w in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_heads_must_split_into_groups():
    with pytest.raises(ValueError, match="6 heads do not split into n_groups = 4"):
        Mamba2Mixer(Mamba2Shape(hidden=16, heads=6, head_dim=4, state=4, groups=4))


def test_the_mixer_is_hugging_faces_nemotron_h_mixer():
    """The same state dict in both (its keys load as they are), fp32 on CPU: outputs and every gradient."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = transformers.NemotronHConfig(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=6,
                                       n_groups=2, conv_kernel=4, chunk_size=5, layers_block_type=["mamba"],
                                       num_hidden_layers=1, use_conv_bias=True, use_bias=False,
                                       layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    theirs = NemotronHMamba2Mixer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = Mamba2Mixer(Mamba2Shape(hidden=32, heads=4, head_dim=8, state=6, groups=2, conv_kernel=4, chunk=5,
                                   eps=1e-5, time_step_min=cfg.time_step_min))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 13, 32)
    a, b = theirs(x), ours(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert ours.kernel == "torch"
    a.square().sum().backward()
    b.square().sum().backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        want = theirs_grads[name].grad
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5 * want.abs().max().item(), msg=name)


def test_a_hybrid_pattern_reads_in_both_forms_and_names_what_is_wrong():
    from ds_pipe_ext.models.config import ModelConfigError
    from ds_pipe_ext.models.hybrid_pattern import block_kinds, to_pattern

    kinds = block_kinds(pattern="M-M*-ME", layers=7)
    assert kinds == ("mamba", "mlp", "mamba", "attention", "mlp", "mamba", "moe") and to_pattern(kinds) == "M-M*-ME"
    types = ["linear_attention", "mlp", "mamba", "full_attention", "mlp", "linear_attention", "moe"]  # old and new
    assert block_kinds(block_types=types) == kinds == block_kinds(pattern="M-M*-ME", block_types=types)
    with pytest.raises(ModelConfigError, match=r"hybrid_override_pattern has 'X' at layer 3 \('M-MX'\); its "
                                               r"letters are M \(mamba\), \* \(attention\), - \(mlp\), E \(moe\)"):
        block_kinds(pattern="M-MX")
    with pytest.raises(ModelConfigError, match=r"the pattern describes 7 layers, the config has layers = 8"):
        block_kinds(pattern="M-M*-ME", layers=8)
    with pytest.raises(ModelConfigError, match=r"layers_block_type has 'conv' at layer 1"):
        block_kinds(block_types=["mamba", "conv"])
    with pytest.raises(ModelConfigError, match=r"disagree \(layer 6 first"):
        block_kinds(pattern="M-M*-M-", block_types=types)


@pytest.mark.multiprocess
def test_the_mixer_at_tp_2_is_the_mixer_at_tp_1(tmp_path, forked_ranks):
    """2 ranks, each holding 4 of 8 heads and 1 of 2 groups: the output, the input's gradient and every
    parameter's gradient (as its shard) equal the one-process mixer's within 1e-5 relative (fp32)."""
    from ds_pipe_ext.runner import launch

    proc, _ = launch(2, None, out_dir=tmp_path, cwd=tmp_path, script="tests/mamba_tp_worker.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["local_heads"] for r in ranks] == [4, 4]
    for r in ranks:
        assert len(r["diffs"]) == 12 and all(d <= 1e-5 for d in r["diffs"].values()), r


def test_tensor_parallelism_must_divide_the_groups():
    class Group:  # what the mixer asks of its group before any collective
        pass

    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"tensor parallelism 4 must divide n_groups = 2"):
        original = dist.get_world_size
        try:
            dist.get_world_size = lambda group=None: 4
            Mamba2Mixer(Mamba2Shape(hidden=16, heads=8, head_dim=2, state=4, groups=2), tp_group=Group())
        finally:
            dist.get_world_size = original
