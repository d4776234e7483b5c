"""A GPT, written as a list of pipeline layers.  Read top-down:

    tokens ─► EmbeddingPipe ─► Block × L ─► HeadPipe (final LayerNorm + LM head) ─► lm_loss

Hidden states are sequence-first, (s, b, h), as in Megatron: sequence parallelism
shards dimension 0, and pipeline stages pass these tensors on unchanged.

Every linear, the vocabulary embedding and the norms come from a ``LayerImpl``
(the role of megatron-core's ``ModuleSpec``): ``LOCAL`` builds plain torch layers;
the tensor-parallel implementation swaps in megatron-core's parallel layers
without touching this file's structure.

The attention core is the config's ``attention``: written out ("eager": what autograd saves is the
textbook set of tensors Korthikanti et al. count, the s x s probabilities among them) or torch's
``scaled_dot_product_attention`` ("sdpa": flash and memory-efficient kernels on a GPU, which keep no
probabilities); "auto" runs sdpa on CUDA and eager on a CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..pipe.sequential import SequentialLayers
from .gpt_config import GPTConfig
from .layers import INIT_STD, LOCAL, LayerImpl, head_output, lm_loss, local_embedding, loss_fn_for  # noqa: F401 (re-exported)

class EmbeddingPipe(nn.Module):
    """tokens (b, s) int64 -> hidden states (s, b, h)."""

    def __init__(self, cfg: GPTConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.word_embeddings = impl.embedding(cfg.padded_vocab, cfg.hidden)
        self.position_embeddings = local_embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.enter_blocks = impl.enter_blocks
        self.tied_head = impl.tied_head
        self.head_output = functools.partial(head_output, cfg, impl)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return self.drop(self.enter_blocks(x.transpose(0, 1).contiguous()))


class CausalSelfAttention(nn.Module):
    """``selective_recompute``: keep only q, k, v and recompute softmax(qk^T)v in backward
    (Korthikanti et al. 2022's selective recomputation: the 5as/h term of a block's activations)."""

    def __init__(self, cfg: GPTConfig, impl: LayerImpl, selective_recompute: bool = False):
        super().__init__()
        self.selective_recompute = selective_recompute
        self.sdpa = cfg.attention_kernel("cuda" if torch.cuda.is_available() else "cpu") == "sdpa"
        self.heads = cfg.heads // impl.tp_size  # heads on this rank
        self.head_dim = cfg.head_dim
        self.qkv = impl.column_linear(cfg.hidden, 3 * cfg.hidden, bias=True)
        self.proj = impl.row_linear(cfg.hidden, cfg.hidden, bias=True)
        self.attn_drop = nn.Dropout(cfg.dropout)
        if not self.sdpa:  # sdpa masks causally itself
            self.register_buffer(
                "causal_mask", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1), persistent=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # under SP the input is a sequence shard; the column-parallel QKV gathers it
        s, b, _ = qkv.shape
        # (s, b, heads, 3 * d) -> (b, heads, s, 3 * d): q, k, v of a head are contiguous (Megatron's layout)
        q, k, v = qkv.view(s, b, self.heads, 3 * self.head_dim).permute(1, 2, 0, 3).chunk(3, dim=-1)
        if self.selective_recompute and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.attn_drop.p if self.training else 0.0)
        s = q.shape[2]
        logits = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        logits = logits.masked_fill(self.causal_mask[:s, :s], float("-inf"))
        return self.attn_drop(torch.softmax(logits, dim=-1)) @ v


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, impl: LayerImpl):
        super().__init__()
        self.fc = impl.column_linear(cfg.hidden, cfg.ffn, bias=True)
        self.proj = impl.row_linear(cfg.ffn, cfg.hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block (GPT-2): x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, impl: LayerImpl = LOCAL, selective_recompute: bool = False):
        super().__init__()
        self.ln_1 = impl.layer_norm(cfg.hidden, cfg.layernorm_eps)
        self.attn = CausalSelfAttention(cfg, impl, selective_recompute)
        self.ln_2 = impl.layer_norm(cfg.hidden, cfg.layernorm_eps)
        self.mlp = MLP(cfg, impl)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.ln_f = impl.layer_norm(cfg.hidden, cfg.layernorm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class HeadPipe(nn.Module):
    """Final LayerNorm + LM head: (s, b, h) -> logits (s, b, V)."""

    def __init__(self, cfg: GPTConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.ln_f = impl.layer_norm(cfg.hidden, cfg.layernorm_eps)
        self.lm_head = impl.column_linear(cfg.hidden, cfg.padded_vocab, bias=False)
        self.head_output = functools.partial(head_output, cfg, impl)

    def forward(self, x: torch.Tensor):
        return self.head_output(self.ln_f(x), self.lm_head.weight, self.lm_head)


def tied_lm_head(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    """LM head that reuses the input embedding matrix (``TiedLayerSpec`` forward_fn).

    Under TP the matrix is this rank's vocabulary rows, so the product is a
    column-parallel linear: the implementation's ``tied_head`` does it.
    """
    weight = embedding.word_embeddings.weight
    return embedding.head_output(x, weight, lambda hidden: embedding.tied_head(hidden, weight))


def gpt_layer_specs(cfg: GPTConfig, impl: LayerImpl = LOCAL, *, selective_recompute: bool = False) -> list:
    """The model as DeepSpeed layer specs, in pipeline order.

    Untied: [embedding, L blocks, final norm + head]            (L + 2 layers)
    Tied:   [embedding, L blocks, final norm, tied head]        (L + 3 layers)
    The loss is ``lm_loss``, passed to the PipelineModule as ``loss_fn``; it
    always runs on the last stage, so its cost belongs to the last layer.
    """
    extra = (True,) if selective_recompute else ()  # the default keeps cache keys stable
    blocks = [LayerSpec(Block, cfg.block_config(i), impl, *extra) for i in range(cfg.layers)]
    if not cfg.tie_embeddings:
        return [LayerSpec(EmbeddingPipe, cfg, impl), *blocks, LayerSpec(HeadPipe, cfg, impl)]
    return [
        TiedLayerSpec("embed", EmbeddingPipe, cfg, impl, tied_weight_attr="word_embeddings.weight"),
        *blocks,
        LayerSpec(FinalNorm, cfg, impl),
        TiedLayerSpec(
            "embed", EmbeddingPipe, cfg, impl, forward_fn=tied_lm_head, tied_weight_attr="word_embeddings.weight"
        ),
    ]


class SequentialGPT(SequentialLayers):
    """The GPT's layers in one process (data parallelism, parity checks); see ``SequentialLayers``."""

    def __init__(self, specs: list, loss_fn: Callable = lm_loss, *, base_seed: int | None = None,
                 recompute: bool = False):
        super().__init__(specs, loss_fn, base_seed=base_seed, recompute=recompute)
