"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) as a list of pipeline layers.  Read top-down:

    tokens ─► LlamaEmbedding ─► LlamaBlock × L ─► LlamaHead (final RMSNorm + LM head) ─► lm_loss

Hidden states are sequence-first, (s, b, h), as in the GPT and Megatron, so the same ``LayerImpl``
gives the family megatron-core's tensor and sequence parallelism:

* q, k and v are one column-parallel linear whose output is [q; k; v]; under TP each rank holds
  heads / t query heads and kv_heads / t key/value heads ([q_r; k_r; v_r], so t must divide the
  key/value heads).  SwiGLU's gate and up projections are one column-parallel linear, [gate_r; up_r]
  per rank, as megatron-core's ``gated_linear_unit`` lays them out.  Qwen3's per-head q/k RMSNorms
  are replicated; their gradients are summed over the TP group (each rank normalised its own heads).
* Attention is torch's fused ``scaled_dot_product_attention`` (grouped-query natively): on a CPU it
  saves q, k, v, its output and the log-sum-exp, no s x s probabilities.  A sliding window (Mistral) is a
  dense mask on a CPU and ``flex_attention``'s block mask on a GPU, where a dense mask would rule out SDPA's
  fast kernels (``arch.attention_backend`` decides, for this code and the cost model).  Rotary positions are
  recomputed from 0..s-1 in every block, so only hidden states cross a stage boundary.
* SiLU(gate) * up is one autograd function that keeps only its input (megatron-core's fused
  ``bias_swiglu`` does the same): eager torch would also keep SiLU(gate), a third f-wide tensor.

Weights follow transformers' naming inside each layer (``q``/``k``/``v`` stacked as ``qkv``), so a
Hugging Face checkpoint maps onto it by concatenation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..arch import attention_backend
from ..layout import Layout
from ..pipe.sequential import SequentialLayers
from .layers import LOCAL, LayerImpl, head_output, lm_loss, mark_sections
from .llama_config import LlamaConfig, rotary_attention_factor, rotary_inv_freq


class LlamaEmbedding(nn.Module):
    """tokens (b, s) int64 -> hidden states (s, b, h); no position embedding (rotary is in the blocks)."""

    def __init__(self, cfg: LlamaConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.embed_tokens = impl.embedding(cfg.padded_vocab, cfg.hidden)
        self.enter_blocks = impl.enter_blocks
        self.tied_head = impl.tied_head
        self.head_output = functools.partial(head_output, cfg, impl)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.enter_blocks(self.embed_tokens(tokens).transpose(0, 1).contiguous())


class Rotary(nn.Module):
    """cos and sin of positions 0..s-1 x the head's frequencies, (s, head_dim), as transformers computes
    them (fp32, each frequency twice: [f; f])."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(rotary_inv_freq(cfg), dtype=torch.float32), persistent=False)
        self.attention_factor = rotary_attention_factor(cfg)  # yarn's; 1 otherwise

    def forward(self, s: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(s, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)
        return angles.cos().to(dtype), angles.sin().to(dtype)


@functools.lru_cache(maxsize=8)
def _window_block_mask(s: int, window: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(_b, _h, q_idx, kv_idx):  # query i sees keys i - window + 1 .. i
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    return create_block_mask(keep, None, None, s, s, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # flex_attention's fused kernel is its compiled form


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, enable_gqa: bool,
                     compiled: bool = True) -> torch.Tensor:
    """Sliding-window causal attention through ``flex_attention``'s block mask: the blocks outside the window
    are skipped, nothing s x s is made.  ``compiled=False``: the eager reference (a CPU test's)."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled_flex_attention() if compiled else flex_attention
    mask = _window_block_mask(q.shape[2], int(window), str(q.device))
    return attend(q, k, v, block_mask=mask, enable_gqa=enable_gqa)


def causal_allowed(s: int, window: int | None = None, device=None) -> torch.Tensor:
    """s x s bool: query i sees key j where j <= i, and in a ``window`` j > i - window (transformers' sliding-window
    mask)."""
    i = torch.arange(s, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    return allowed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin over the last dimension (transformers' ``apply_rotary_pos_emb``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions, causal or in a sliding window; with
    ``cfg.qk_norm`` each query and key head is RMS-normalised before rotary (Qwen3).

    ``selective_recompute``: keep q, k and v only and rerun the attention kernel in backward (the
    kernel's output and log-sum-exp are not kept)."""

    def __init__(self, cfg: LlamaConfig, impl: LayerImpl, selective_recompute: bool = False):
        super().__init__()
        t, d = impl.tp_size, cfg.head_dim
        Layout(tp=t, sp=impl.sequence_parallel).check_widths(cfg)  # TP splits whole heads
        self.heads, self.kv_heads, self.head_dim = cfg.heads // t, cfg.kv_heads // t, d
        self.selective_recompute = selective_recompute
        sections = (cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
        self.qkv = mark_sections(impl.column_linear(cfg.hidden, sum(sections), bias=cfg.qkv_bias), sections)
        self.o_proj = impl.row_linear(cfg.heads * d, cfg.hidden, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = impl.head_norm(d, cfg.rms_norm_eps), impl.head_norm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # a hybrid's attention layers take no positions (Nemotron-H: its Mamba-2 layers order the sequence)
        self.rotary = Rotary(cfg) if getattr(cfg, "rotary_positions", True) else None
        window = self.window = cfg.window
        if window is not None:  # query i sees keys i - window + 1 .. i, as transformers' sliding-window mask
            self.register_buffer("window_mask", causal_allowed(cfg.seq_len, window), persistent=False)
        else:
            self.window_mask = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under SP the input is a sequence shard; the column-parallel linear gathers it
        s, b, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        # (s, b, n * d) -> (b, n, s, d).  v is copied so that the kernel keeps v alone, not all of qkv;
        # q/k norms keep their inputs, views of qkv, which hold all of it anyway: no copy then (nor without
        # rotary positions, a hybrid's attention: the kernel keeps q and k as views of qkv)
        q, k = q.view(s, b, self.heads, d), k.view(s, b, self.kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
        if self.rotary is not None:
            cos, sin = self.rotary(s, x.dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        v = v.view(s, b, self.kv_heads, d).permute(1, 2, 0, 3)
        if self.q_norm is None and self.rotary is not None:  # without rotary q and k are views of qkv too
            v = v.contiguous()
        if self.selective_recompute and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.o_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * d))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[2]
        gqa = self.kv_heads != self.heads
        if self.window_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        # the kernel the cost model prices: the one selector both ask (a dense mask rules out SDPA's fast
        # kernels on a GPU, so there the window runs as flex_attention's block mask)
        if attention_backend("fused", q.device.type, masked=True) == "flex":
            return window_attention(q, k, v, self.window, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.window_mask[:s, :s], enable_gqa=gqa)


class SwiGLU(torch.autograd.Function):
    """SiLU(gate) * up of [gate; up] along the last dimension, keeping only its input for backward."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        """d gate = grad * up * (sig + silu * (1 - sig)), d up = grad * silu, written into one output: the
        output and the sigmoid are all it allocates (written out, six tensors of the output's half were alive
        at once)."""
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        d_gate, d_up = out.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        torch.mul(gate, sig, out=d_up)  # silu
        d_gate.copy_(sig).neg_().add_(1.0)  # 1 - sig
        d_gate.mul_(d_up).add_(sig).mul_(up).mul_(grad)
        d_up.mul_(grad)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU MLP, ``ffn`` wide (default: the config's); a Mixture-of-Experts block's experts are these too."""

    def __init__(self, cfg: LlamaConfig, impl: LayerImpl, ffn: int | None = None):
        super().__init__()
        ffn = ffn or cfg.ffn
        self.gate_up = mark_sections(impl.column_linear(cfg.hidden, 2 * ffn, bias=False), (ffn, ffn))
        self.down = impl.row_linear(ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(SwiGLU.apply(self.gate_up(x)))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, impl: LayerImpl = LOCAL, selective_recompute: bool = False):
        super().__init__()
        self.input_norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg, impl, selective_recompute)
        self.post_attention_norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class LlamaFinalNorm(nn.Module):
    def __init__(self, cfg: LlamaConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class LlamaHead(nn.Module):
    """Final RMSNorm + LM head: (s, b, h) -> logits (s, b, V)."""

    def __init__(self, cfg: LlamaConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.lm_head = impl.column_linear(cfg.hidden, cfg.padded_vocab, bias=False)
        self.head_output = functools.partial(head_output, cfg, impl)

    def forward(self, x: torch.Tensor):
        return self.head_output(self.norm(x), self.lm_head.weight, self.lm_head)


def tied_lm_head(embedding: LlamaEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The LM head that reuses the input embedding matrix (``TiedLayerSpec`` forward_fn)."""
    weight = embedding.embed_tokens.weight
    return embedding.head_output(x, weight, lambda hidden: embedding.tied_head(hidden, weight))


def llama_layer_specs(cfg: LlamaConfig, impl: LayerImpl = LOCAL, *, selective_recompute: bool = False) -> list:
    """The model as DeepSpeed layer specs, in pipeline order.

    Untied: [embedding, L blocks, final norm + head]            (L + 2 layers)
    Tied:   [embedding, L blocks, final norm, tied head]        (L + 3 layers)
    """
    extra = (True,) if selective_recompute else ()
    blocks = [LayerSpec(LlamaBlock, cfg, impl, *extra) for _ in range(cfg.layers)]
    if not cfg.tie_embeddings:
        return [LayerSpec(LlamaEmbedding, cfg, impl), *blocks, LayerSpec(LlamaHead, cfg, impl)]
    return [
        TiedLayerSpec("embed", LlamaEmbedding, cfg, impl, tied_weight_attr="embed_tokens.weight"),
        *blocks,
        LayerSpec(LlamaFinalNorm, cfg, impl),
        TiedLayerSpec("embed", LlamaEmbedding, cfg, impl, forward_fn=tied_lm_head, tied_weight_attr="embed_tokens.weight"),
    ]


class SequentialLlama(SequentialLayers):
    """The family's layers in one process (data parallelism, parity checks); see ``SequentialLayers``."""

    def __init__(self, specs: list, loss_fn: Callable = lm_loss, *, base_seed: int | None = None,
                 recompute: bool = False):
        super().__init__(specs, loss_fn, base_seed=base_seed, recompute=recompute)
