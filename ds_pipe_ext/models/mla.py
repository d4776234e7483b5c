"""Multi-head latent attention (DeepSeek-V2/V3), the moe family's attention where ``kv_lora_rank`` is set.

    x ─► q_down ─► RMSNorm ─► q_up ──────────────► q: heads x [nope | rope]      (q_lora_rank 0: one q_proj)
    x ─► kv_down ─► [latent | k_rope] ─► RMSNorm(latent) ─► kv_up ─► heads x [k_nope | v]
    rotary on q's rope part and on the one k_rope every head shares; attention; out projection

Tensor parallelism as megatron-core's ``MLASelfAttention`` lays it out: the down projections (to the ranks) are
whole on every TP rank, their norms too; the up projections are column-parallel (each rank its heads) and the
out projection row-parallel.  A column-parallel linear's backward all-reduces its input's gradient, so the
replicated down projections see the whole gradient and stay equal on every rank without a hook; the shared
rotary key, which each rank's heads use alone, passes Megatron's f operator (its gradient all-reduced).  Sequence
parallelism is refused (the down projections would need the sequence gathered first).

The core is torch's fused SDPA.  Its fused kernels take one head width for q, k and v, and MLA's values are
narrower (V3: 128 against 192): v is padded with zeros to the query's width, the kernel run, its output sliced
back, so it saves q, k, the padded v, the padded output and the log-sum-exp (no s x s probabilities; with
unequal widths torch would fall to its math kernel, which keeps them).  ``costs/mla_ops.py`` prices this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .config import ModelConfigError
from .layers import LayerImpl, RMSNorm, normal_init
from .llama import Rotary, rotate
from .llama_config import attention_scale


class MLAttention(nn.Module):
    """(s, b, h) -> (s, b, h); ``cfg`` a moe-family config with ``kv_lora_rank`` > 0."""

    def __init__(self, cfg, impl: LayerImpl, selective_recompute: bool = False):
        super().__init__()
        t = impl.tp_size
        if impl.sequence_parallel:
            raise ModelConfigError("sequence parallelism with multi-head latent attention is not built: its down "
                                   "projections would need the sequence gathered first; use sp = false")
        if cfg.heads % t:
            raise ModelConfigError(f"model config {cfg.name!r}: tensor parallel degree {t} does not divide the "
                                   f"{cfg.heads} attention heads (MLA splits whole heads); pick tp dividing them")
        self.heads, self.nope, self.rope, self.v_dim = (cfg.heads // t, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                       cfg.v_head_dim)
        self.kv_rank, self.selective_recompute = cfg.kv_lora_rank, selective_recompute
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_down = normal_init(nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False))
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_up = impl.column_linear(cfg.q_lora_rank, cfg.heads * qk, bias=False)
        else:
            self.q_down = self.q_norm = None
            self.q_up = impl.column_linear(cfg.hidden, cfg.heads * qk, bias=False)
        self.kv_down = normal_init(nn.Linear(cfg.hidden, cfg.kv_lora_rank + self.rope, bias=False))
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_up = impl.column_linear(cfg.kv_lora_rank, cfg.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = impl.row_linear(cfg.heads * self.v_dim, cfg.hidden, bias=False)
        self.rotary = Rotary(_RopeShape(cfg))
        self.scale = attention_scale(cfg, self.nope + self.rope)  # DeepSeek-V3's yarn mscale^2 where set
        self.copy_to_tp = impl.copy_to_tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        n, qk = self.heads, self.nope + self.rope
        q = self.q_up(self.q_norm(self.q_down(x)) if self.q_down is not None else x).view(s, b, n, qk)
        latent, k_rope = self.kv_down(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).view(s, b, n, self.nope + self.v_dim)
        cos, sin = self.rotary(s, x.dtype)
        q_nope, q_rope = q.permute(1, 2, 0, 3).split([self.nope, self.rope], dim=-1)
        k_nope, v = kv.permute(1, 2, 0, 3).split([self.nope, self.v_dim], dim=-1)
        # (b, 1, s, rope): one for every head; each TP rank's heads give it part of its gradient, summed over TP
        k_rope = rotate(self.copy_to_tp(k_rope).permute(1, 0, 2).unsqueeze(1), cos, sin)
        q = torch.cat((q_nope, rotate(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(b, n, s, self.rope)), dim=-1)
        v = F.pad(v, (0, qk - self.v_dim)) if qk > self.v_dim else v.contiguous()
        if self.selective_recompute and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.o_proj(y[..., : self.v_dim].permute(2, 0, 1, 3).reshape(s, b, n * self.v_dim))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)


class _RopeShape:
    """What ``llama.Rotary`` reads of a config, for MLA's rotary part (``qk_rope_head_dim`` wide)."""

    def __init__(self, cfg):
        self.name, self.head_dim, self.seq_len = cfg.name, cfg.qk_rope_head_dim, cfg.seq_len
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling

