"""Attention with learned sinks (gpt-oss): each head has one logit beside every query's keys, the softmax is taken
over the keys and the sink, and the sink's share is dropped, so a head may attend to nothing:

    p = softmax([q k^T / sqrt(d) + mask, sink])[..., :-1];   y = p v

Which kernel: a fused attention kernel's, its output rescaled.  A sink only adds exp(sink) to each row's softmax
denominator, and a fused kernel returns, beside o = softmax(q k^T / sqrt(d) + mask) v, each row's log-sum-exp L:

    y = o exp(L) / (exp(L) + exp(sink)) = o w,   w = sigmoid(L - sink)

Backward, the same kernel's backward gives q's, k's and v's exact gradients when it is handed g w for the output's
gradient and y for the output: it forms dS = P (dO v^T - D) with D = rowsum(dO * out) = w^2 rowsum(g * o), which is
the sink softmax's own w P (g v^T - rowsum(g * y)); its dV = P^T dO = (w P)^T g.  The sink's gradient is
-sum over the rows of (1 - w) rowsum(g * y).  It saves q, k and v (the key/value heads, not repeated), y (laid
out as the out projection reads it, so that it is that projection's saved input too) and L: nothing s x s.  The
kernels (``arch.attention_backend(..., sinks=True)``, which the cost model asks too):

- a CPU: torch's CPU flash kernel, causal, or a window as an s x s mask in the query's dtype (made once a shape);
- a GPU, 16-bit: FlashAttention-2 as torch ships it (``aten._flash_attention_forward`` / ``_backward``, called as
  ``torch.nn.attention.varlen`` calls them: the batch as sequences of equal length), the window native
  (``window_size_left``: the blocks outside it are skipped);
- a GPU in fp32 (FlashAttention-2 takes 16-bit only), or ``sink_attention = "eager"`` in the model config:
  written out (``eager_sink_attention``), as transformers runs gpt-oss; it saves the s x (s + 1) probabilities.

Tensor parallelism as the Llama block's: q, k and v column-parallel by heads, o row-parallel; each rank holds
its heads' sinks.  The biases on q, k, v and o are gpt-oss's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import attention_backend
from .layers import INIT_STD, LayerImpl
from .llama import LlamaAttention, causal_allowed

FLASH_OPS = torch.ops.aten  # FlashAttention-2's two ops (a CPU test hands in a stand-in of their conventions)


def eager_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         window: int | None) -> torch.Tensor:
    """The written-out core, as transformers' gpt-oss: the repeated key/value heads, the scores with their mask,
    the sink's column, the softmax, its slice times v."""
    b, n, s, d = q.shape
    groups = n // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * d**-0.5 + _additive_mask(s, window, q.dtype, str(q.device))
    logits = torch.cat((scores, sinks.to(q.dtype).view(1, n, 1, 1).expand(b, n, s, 1)), dim=-1)
    return torch.matmul(F.softmax(logits, dim=-1)[..., :-1], v)


@functools.lru_cache(maxsize=8)
def _additive_mask(s: int, window: int | None, dtype: torch.dtype, device: str) -> torch.Tensor:
    """0 where query i sees key j (``llama.causal_allowed``), -inf elsewhere."""
    allowed = causal_allowed(s, window, device)
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


class _CpuFlash:
    """torch's CPU flash kernel on (b, heads, s, d) tensors; it takes fewer key/value heads as they are."""

    @staticmethod
    def _mask(q, window):
        """A window's additive mask in q's dtype (made once a shape); None: causal, the kernel's own."""
        return _additive_mask(q.shape[2], window, q.dtype, str(q.device)) if window else None

    @staticmethod
    def forward(q, k, v, window):
        mask = _CpuFlash._mask(q, window)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mask is None,
                                                                            attn_mask=mask)
        return (q, k, v), o, lse

    @staticmethod
    def lse(raw: torch.Tensor, b: int, n: int, s: int) -> torch.Tensor:
        return raw  # (b, heads, s) already

    @staticmethod
    def backward(grad, saved, y, raw_lse, window):
        q, k, v = saved
        mask = _CpuFlash._mask(q, window)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, y, raw_lse, 0.0, mask is None, attn_mask=mask)


class _CudaFlash:
    """FlashAttention-2 through torch's ops, its inputs as ``varlen_attn`` lays them out: (b s, heads, d), the
    batch's sequences at cu_seq = 0, s, 2s, ... (the ops' schema as torch 2.13 has it; bench/gpu_path.py's
    backends part checks the GPU's torch against the written-out core)."""

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        b, n, s, d = t.shape
        return t.transpose(1, 2).reshape(b * s, n, d)

    @staticmethod
    def _window(window):
        """(window_size_left, window_size_right): keys i - window + 1 .. i; -1, -1 unbounded (causal)."""
        return (window - 1, 0) if window else (-1, -1)

    @staticmethod
    def forward(q, k, v, window):
        b, n, s, d = q.shape
        qf, kf, vf = (_CudaFlash._flat(t) for t in (q, k, v))
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        left, right = _CudaFlash._window(window)
        of, raw_lse, *_ = FLASH_OPS._flash_attention_forward(
            qf, kf, vf, cu, cu, s, s, 0.0, True, False, window_size_left=left, window_size_right=right)
        o = of.view(b, s, n, d).transpose(1, 2)
        return (qf, kf, vf, cu), o, raw_lse

    @staticmethod
    def lse(raw: torch.Tensor, b: int, n: int, s: int) -> torch.Tensor:
        """The log-sum-exp as (b, heads, s): a varlen kernel's is (heads, b s); a padded one's (b, heads, >= s)."""
        if raw.dim() == 2:
            return raw.view(n, b, s).transpose(0, 1)
        return raw[..., :s]

    @staticmethod
    def backward(grad, saved, y, raw_lse, window):
        qf, kf, vf, cu = saved
        b, n, s, d = grad.shape
        left, right = _CudaFlash._window(window)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=grad.device)  # no dropout: no generator state
        unused = torch.empty(0, device=grad.device)
        dq, dk, dv = FLASH_OPS._flash_attention_backward(
            _CudaFlash._flat(grad), qf, kf, vf, _CudaFlash._flat(y), raw_lse, cu, cu, s, s, 0.0, True, rng_state,
            unused, window_size_left=left, window_size_right=right)
        return tuple(t.view(b, s, t.shape[1], d).transpose(1, 2) for t in (dq, dk, dv))


_KERNELS = {"cpu": _CpuFlash, "flash": _CudaFlash}


class FusedSinkAttention(torch.autograd.Function):
    """y = o sigmoid(L - sink) over a fused kernel's output o and log-sum-exp L (the module docstring's
    derivation); ``kernel``: "cpu" or "flash"."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, window, kernel):
        run = _KERNELS[kernel]
        saved, o, raw_lse = run.forward(q, k, v, window)
        b, n, s, _ = q.shape
        w = torch.sigmoid(run.lse(raw_lse, b, n, s) - sinks.float().view(1, -1, 1)).to(q.dtype).unsqueeze(-1)
        # laid out (s, b, heads, d), as the out projection reads it: its input is then a view of y, one tensor
        y = torch.mul(o, w, out=torch.empty(s, b, n, o.shape[-1], dtype=q.dtype, device=q.device).permute(1, 2, 0, 3))
        ctx.save_for_backward(*saved, y, raw_lse, sinks)
        ctx.window, ctx.kernel = window, kernel
        return y

    @staticmethod
    def backward(ctx, grad):
        *saved, y, raw_lse, sinks = ctx.saved_tensors
        run = _KERNELS[ctx.kernel]
        b, n, s, _ = y.shape
        w = torch.sigmoid(run.lse(raw_lse, b, n, s) - sinks.float().view(1, -1, 1))
        dq, dk, dv = run.backward(grad * w.to(grad.dtype).unsqueeze(-1), saved, y, raw_lse, ctx.window)
        dsinks = -((1 - w) * (grad * y).sum(-1, dtype=torch.float32)).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None


class SinkAttention(LlamaAttention):
    """Grouped-query attention with sinks, causal or in a ``window`` (each query sees the last ``window`` keys)."""

    def __init__(self, cfg, impl: LayerImpl, selective_recompute: bool = False, *, window: int | None = None):
        super().__init__(cfg, impl, selective_recompute)
        t, d = impl.tp_size, cfg.head_dim
        self.o_proj = impl.row_linear(cfg.heads * d, cfg.hidden, bias=cfg.qkv_bias)
        self.sinks = nn.Parameter(torch.randn(cfg.heads // t) * INIT_STD)
        if t > 1:  # each rank its heads' sinks, as a column-parallel weight's rows (tensor_parallel.shard_like)
            self.sinks.tensor_model_parallel, self.sinks.partition_dim, self.sinks.partition_stride = True, 0, 1
        self.window = window if window is not None and window < cfg.seq_len else None
        self.window_mask = None  # the Llama attention's dense-mask path is not taken
        self.kernel = cfg.sink_attention

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "fp32")
        kernel = attention_backend(self.kernel, q.device.type, dtype=dtype, head_dim=q.shape[-1], sinks=True)
        if kernel == "eager":
            return eager_sink_attention(q, k, v, self.sinks, self.window)
        return FusedSinkAttention.apply(q, k, v, self.sinks, self.window, kernel)
