"""Attention with learned sinks (gpt-oss): each head has one logit beside every query's keys, the softmax is taken
over the keys and the sink, and the sink's share is dropped, so a head may attend to nothing:

    p = softmax([q k^T / sqrt(d) + mask, sink])[..., :-1];   y = p v

Which kernel: written out ("eager"), as transformers runs gpt-oss.  torch's fused SDPA kernels take no extra
logit, and no mask can stand for one.  It saves q, the key and value heads repeated for every query head (as
grouped-query attention written out does), and the softmax's s x (s + 1) output, whose view the product
with v keeps; the mask is added out of place, so nothing s x s is saved for it.  A windowed layer (gpt-oss
alternates 128-token windows with full layers) is the same computation with a banded mask: eager attention
computes every score either way.

Tensor parallelism as the Llama block's: q, k and v column-parallel by heads, o row-parallel; each rank holds
its heads' sinks.  The biases on q, k, v and o are gpt-oss's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import INIT_STD, LayerImpl
from .llama import LlamaAttention


class SinkAttention(LlamaAttention):
    """Grouped-query attention with sinks, causal or in a ``window`` (each query sees the last ``window`` keys)."""

    def __init__(self, cfg, impl: LayerImpl, selective_recompute: bool = False, *, window: int | None = None):
        super().__init__(cfg, impl, selective_recompute)
        t, d = impl.tp_size, cfg.head_dim
        self.o_proj = impl.row_linear(cfg.heads * d, cfg.hidden, bias=cfg.qkv_bias)
        self.sinks = nn.Parameter(torch.randn(cfg.heads // t) * INIT_STD)
        if t > 1:  # each rank its heads' sinks, as a column-parallel weight's rows (tensor_parallel.shard_like)
            self.sinks.tensor_model_parallel, self.sinks.partition_dim, self.sinks.partition_stride = True, 0, 1
        i = torch.arange(cfg.seq_len)
        allowed = i[None, :] <= i[:, None]
        if window is not None and window < cfg.seq_len:
            allowed &= i[None, :] > i[:, None] - window
        self.window = window
        self.register_buffer("additive_mask", torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
                             persistent=False)
        self.window_mask = None  # the Llama attention's dense-mask path is not taken

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, s, d = q.shape
        groups = n // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * d**-0.5 + self.additive_mask[:s, :s].to(q.dtype)
        logits = torch.cat((scores, self.sinks.to(q.dtype).view(1, n, 1, 1).expand(b, n, s, 1)), dim=-1)
        probs = F.softmax(logits, dim=-1)
        return torch.matmul(probs[..., :-1], v)
