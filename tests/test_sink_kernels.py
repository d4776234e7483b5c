"""Attention with sinks through a fused kernel (``models.sinks.FusedSinkAttention``): the kernel's output rescaled
by sigmoid(L - sink) forward, the kernel's own backward on the rescaled gradient and output.  Against the
written-out core (transformers' gpt-oss math): on this CPU's flash kernel, and through a stand-in of
FlashAttention-2's varlen conventions for the GPU path's layouts (the batch flattened into equal sequences, the
log-sum-exp as heads x tokens, the window as ``window_size_left``)."""

import pytest
import torch

from ds_pipe_ext.arch import attention_backend
from ds_pipe_ext.models import sinks as sink_module
from ds_pipe_ext.models.sinks import FusedSinkAttention, eager_sink_attention

B, HEADS, KV_HEADS, S, D = 2, 6, 2, 33, 16


def _inputs(dtype=torch.float32):
    torch.manual_seed(0)
    # q, k and v as the block hands them over: (b, heads, s, d) views of an (s, b, heads, d) projection
    qkv = torch.randn(S, B, HEADS + 2 * KV_HEADS, D, dtype=dtype)
    q, k, v = (t.permute(1, 2, 0, 3).detach().requires_grad_() for t in qkv.split([HEADS, KV_HEADS, KV_HEADS], 2))
    return q, k, v, torch.randn(HEADS, dtype=dtype, requires_grad=True)


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _check_against_eager(window, kernel, dtype=torch.float32, rel=1e-5):
    q, k, v, sinks = _inputs(dtype)
    want = eager_sink_attention(q, k, v, sinks, window)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v, sinks), grad)
    got = FusedSinkAttention.apply(q, k, v, sinks, window, kernel)
    got_grads = torch.autograd.grad(got, (q, k, v, sinks), grad)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _relative(got.float(), want.float()) <= rel
    for name, g, w in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        assert g.shape == w.shape, name
        assert _relative(g.float(), w.float()) <= rel, name


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window 5"])
def test_fused_sinks_on_the_cpu_kernel_equal_the_written_out_core(window):
    _check_against_eager(window, "cpu")


def test_fused_sinks_in_bf16_stay_within_bf16s_rounding_of_the_written_out_core():
    _check_against_eager(5, "cpu", dtype=torch.bfloat16, rel=2e-2)


class _FlashStandIn:
    """FlashAttention-2's varlen ops as their conventions say (torch.nn.attention.varlen calls them so): q, k, v
    as (total tokens, heads, d) with sequences at ``cu_seq``; keys j in [i - left, i] of a causal call with
    ``window_size_left`` (-1: unbounded); the log-sum-exp as (heads, total tokens).  Each sequence runs through
    this CPU's flash kernel."""

    calls: list = []

    @staticmethod
    def _batch(t, b, s):
        return t.view(b, s, t.shape[1], t.shape[2]).transpose(1, 2)

    @staticmethod
    def _mask(s, left, dtype):
        i = torch.arange(s)
        allowed = i[None, :] <= i[:, None]
        if left >= 0:
            allowed &= i[None, :] >= i[:, None] - left
        return torch.zeros(s, s, dtype=dtype).masked_fill(~allowed, float("-inf"))

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *,
                                 window_size_left, window_size_right):
        assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k and causal
        assert window_size_right in (0, -1) and dropout == 0.0
        b, s = len(cu_q) - 1, max_q
        assert torch.equal(cu_q, torch.arange(0, (b + 1) * s, s, dtype=torch.int32))
        self.calls.append(("forward", window_size_left))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(self._batch(t, b, s) for t in (q, k, v)), 0.0, False, attn_mask=self._mask(s, window_size_left, q.dtype))
        return (o.transpose(1, 2).reshape(q.shape), lse.transpose(0, 1).reshape(q.shape[1], b * s),
                torch.empty(0), torch.empty(0), torch.empty(0))

    def _flash_attention_backward(self, grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal,
                                  rng_state, unused, *, window_size_left, window_size_right):
        b, s = len(cu_q) - 1, max_q
        assert lse.shape == (q.shape[1], b * s) and grad.shape == q.shape == out.shape
        self.calls.append(("backward", window_size_left))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(self._batch(t, b, s) for t in (grad, q, k, v, out)), lse.view(q.shape[1], b, s).transpose(0, 1),
            0.0, False, attn_mask=self._mask(s, window_size_left, q.dtype))
        return tuple(g.transpose(1, 2).reshape(t.shape) for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("window, left", [(None, -1), (5, 4)], ids=["causal", "window 5"])
def test_the_gpu_path_lays_out_flash_attentions_varlen_call(monkeypatch, window, left):
    stand_in = _FlashStandIn()
    stand_in.calls = []
    monkeypatch.setattr(sink_module, "FLASH_OPS", stand_in)
    _check_against_eager(window, "flash")
    assert stand_in.calls == [("forward", left), ("backward", left)]


def test_the_sinks_kernel_each_device_runs():
    """A CPU runs its flash kernel; a GPU FlashAttention-2 in 16-bit to head dim 256, else the written-out core;
    "eager" is written out everywhere."""
    assert attention_backend("fused", "cpu", dtype="fp32", sinks=True) == "cpu"
    assert attention_backend("fused", "h100-sxm", dtype="bf16", head_dim=64, masked=True, sinks=True) == "flash"
    assert attention_backend("fused", "h100-sxm", dtype="fp32", head_dim=64, sinks=True) == "eager"
    assert attention_backend("fused", "h100-sxm", dtype="bf16", head_dim=320, sinks=True) == "eager"
    assert attention_backend("eager", "h100-sxm", dtype="bf16", sinks=True) == "eager"


@pytest.mark.parametrize("sink_attention, device, dtype, core", [
    ("fused", "cpu", "fp32", "fused"), ("fused", "h100-sxm", "bf16", "fused"), ("fused", "h100-sxm", "fp32", "eager"),
    ("eager", "cpu", "fp32", "eager")])
def test_the_cost_model_prices_the_core_the_config_runs(sink_attention, device, dtype, core):
    """``sink_attention`` in the model config, the device and the dtype pick the core (``attention_backend``), and the
    cost model prices that one: the fused kernel and its rescale, or the written-out products and passes."""
    from ds_pipe_ext.costs.estimate import EstimateRequest, shape_for
    from ds_pipe_ext.costs.layer_ops import layer_ops
    from ds_pipe_ext.models import load_model

    cfg = load_model("moe-tiny", qkv_bias=True, attention_sinks=True, sink_attention=sink_attention)
    shape = shape_for(cfg, EstimateRequest(2, cfg.seq_len, dtype=dtype), runs_on=device)
    names = {op.name for op in layer_ops(cfg, shape, device=device)[1][2]}
    fused, eager = {"sink_attention", "sink_rescale"}, {"sink_repeat_kv", "sink_scale_mask_concat", "softmax"}
    assert (fused <= names, eager <= names) == (core == "fused", core == "eager"), names
