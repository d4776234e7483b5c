"""What every family's layers are built from: a ``LayerImpl`` (the role of megatron-core's ``ModuleSpec``),
the local one, and the causal-LM loss.

A family's model file asks its ``LayerImpl`` for every linear, the vocabulary embedding and the norms;
``LOCAL`` builds plain torch layers, ``tensor_parallel.megatron_layer_impl`` megatron-core's
parallel ones, so a family gets tensor and sequence parallelism without a second model file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2's initialiser (Llama's initializer_range too)


def normal_init(module: nn.Module) -> nn.Module:
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() > 1:
            nn.init.normal_(p, mean=0.0, std=INIT_STD)
    return module


def _local_linear(in_features: int, out_features: int, *, bias: bool = True) -> nn.Module:
    return normal_init(nn.Linear(in_features, out_features, bias=bias))


def local_embedding(num: int, dim: int) -> nn.Module:
    return normal_init(nn.Embedding(num, dim))


def mark_sections(linear: nn.Module, sections: tuple[int, ...]) -> nn.Module:
    """Say that a column-parallel linear's output is several projections side by side (Llama's q, k and v;
    SwiGLU's gate and up): each TP rank holds its share of every section, [q_r; k_r; v_r], as megatron-core
    lays out GQA and ``gated_linear_unit``.  ``sections`` are the full (unsharded) widths;
    ``tensor_parallel.shard_like`` reads them to slice a single-process state dict."""
    for p in (linear.weight, getattr(linear, "bias", None)):
        if p is not None:
            p.shard_sections = tuple(sections)
    return linear


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), keeping only x and rstd for backward
    (what fused RMSNorm kernels keep; torch's composite one also keeps the normalised copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)  # 16-bit inputs are normalised in fp32
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.to(acc) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (grad.to(rstd.dtype) * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dweight, None


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with a scale and no bias; same parameter name as torch's."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


@dataclass(frozen=True)
class LayerImpl:
    """What builds a model's linears, vocabulary embedding and norms.

    ``column_linear`` may split its output features across tensor-parallel ranks
    and ``row_linear`` its input features (reducing the output), as in Megatron.
    """

    name: str
    column_linear: Callable[..., nn.Module]
    row_linear: Callable[..., nn.Module]
    embedding: Callable[[int, int], nn.Module]
    layer_norm: Callable[[int, float], nn.Module]
    rms_norm: Callable[[int, float], nn.Module] = RMSNorm
    # an RMSNorm over each attention head (Qwen3's q/k norms): replicated, but each TP rank normalises
    # its own heads, so its gradient is summed over the TP group
    head_norm: Callable[[int, float], nn.Module] = RMSNorm
    tp_size: int = 1
    sequence_parallel: bool = False
    # (s, b, h) embeddings -> what the blocks see: the rank's sequence shard under SP
    enter_blocks: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    # (s, b, V or V/t) logits, (b, s) labels -> mean loss (vocab-parallel under TP)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Megatron's f operator: identity forward, the gradient all-reduced over the TP group backward (a replicated
    # tensor each rank uses for its own heads alone: MLA's shared rotary key)
    copy_to_tp: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    # hidden states, the embedding matrix -> logits, for a head tied to the embedding
    tied_head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda x, weight: F.linear(x, weight)

    def __repr__(self) -> str:  # stable, address-free: LayerSpec reprs feed the profile cache key
        return f"LayerImpl({self.name}, tp={self.tp_size}, sp={self.sequence_parallel})"


LOCAL = LayerImpl(
    name="local",
    column_linear=_local_linear,
    row_linear=_local_linear,
    embedding=local_embedding,
    layer_norm=lambda dim, eps: nn.LayerNorm(dim, eps=eps),
)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of (s, b, V) logits; ``labels`` (b, s) are the inputs shifted by one
    (-100 ignored, as transformers' causal-LM loss does)."""
    # cast, then flatten: a view of contiguous logits either way, one fp32 copy of a slice's (RealVocabLoss)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


@dataclass(frozen=True)
class RealVocabLoss:
    """``lm_loss`` over the first ``vocab_size`` columns of a padded head's logits (``vocab_pad_to``): the
    padded columns take no part in the softmax and get no gradient, so a padded model trains as the unpadded
    one (labels never reach them).  Sliced before the fp32 cast, which copies only the real columns."""

    vocab_size: int

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits[..., : self.vocab_size], labels)


def chunks_loss(cfg, impl: LayerImpl) -> bool:
    """Whether the head hands the loss its hidden states and weight (``loss_chunk_tokens``, at tp 1) in place
    of logits."""
    return bool(getattr(cfg, "loss_chunk_tokens", 0)) and impl.loss is None


def head_output(cfg, impl: LayerImpl, hidden: torch.Tensor, weight: torch.Tensor, project: Callable) -> object:
    """What a head layer returns: its logits (``project(hidden)``), or, where the loss is chunked, the hidden
    states and an alias of the head's weight (tied or not) for the loss to multiply a chunk at a time.  An
    alias, not the Parameter: a checkpointed head's outputs are its own, and the gradient reaches the weight
    through it."""
    if chunks_loss(cfg, impl):
        return hidden, weight.view_as(weight)
    return project(hidden)


@dataclass(frozen=True)
class ChunkedLinearLoss:
    """The pipeline's loss over a chunked head's (hidden states, weight): ``linear_cross_entropy`` over the real
    vocabulary, ``chunk_tokens`` tokens at a time."""

    vocab_size: int
    chunk_tokens: int

    def __call__(self, outputs: tuple, labels: torch.Tensor) -> torch.Tensor:
        from .linear_cross_entropy import linear_cross_entropy, liger_loss, padded_head_operands

        hidden, weight = outputs
        fused = liger_loss() if hidden.is_cuda else None
        if fused is not None:  # liger-kernel's triton kernels (the [gpu] extra), every row, the padded ones masked
            weight, bias = padded_head_operands(weight, self.vocab_size)
            return fused(weight, hidden.reshape(-1, hidden.shape[-1]), labels.t().reshape(-1), bias)
        return linear_cross_entropy(hidden, weight, labels, vocab_size=self.vocab_size, chunk_tokens=self.chunk_tokens)


def loss_fn_for(impl: LayerImpl, cfg=None) -> Callable:
    """The loss that matches an implementation's logits: Megatron's vocab-parallel cross-entropy under TP
    (over every column of the rank's shard, padded ones included, as Megatron trains them); at tp 1 over the
    config's real vocabulary where its head is padded."""
    if impl.loss is not None:
        return impl.loss
    if cfg is not None and chunks_loss(cfg, impl):
        return ChunkedLinearLoss(cfg.vocab_size, cfg.loss_chunk_tokens)
    if cfg is not None and getattr(cfg, "padded_vocab", 0) > getattr(cfg, "vocab_size", 0):
        return RealVocabLoss(cfg.vocab_size)
    return lm_loss
