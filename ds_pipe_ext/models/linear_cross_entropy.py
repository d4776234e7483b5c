"""The LM head and its cross-entropy in token chunks: the logits are never held whole.

The plain head + loss makes (tokens x V) logits, casts them to fp32 and keeps the log-probabilities for the
backward: three fp32 copies of the logits at its peak (1,570 MiB each for gpt2-medium at 8 x 1,024 tokens).
Here the forward computes, a chunk of tokens at a time, the chunk's logits, its fp32 log-softmax, its loss and
at once its gradients (the hidden states' and the head weight's, as liger-kernel's fused linear
cross-entropy and torchtune's chunked loss do); the backward only scales what the forward kept.  What lives
past a chunk is the hidden states' gradient (tokens x h) and the weight's (V x h, fp32); a chunk's logits,
(chunk x V) in fp32, are the transient.

A model sets it with ``loss_chunk_tokens`` (at tp 1): its head layer then hands the loss its hidden states and
an alias of its weight (``layers.head_output``; tied or not) and ``layers.ChunkedLinearLoss`` runs this, or, on
CUDA where the ``[gpu]`` extra is installed, liger-kernel's fused kernels.

``vocab_size`` columns take part (a padded head's extra rows get no gradient, as ``layers.RealVocabLoss``): the
chunks here multiply by the real rows; liger-kernel gets every row and a bias of -inf on the padded columns
(``padded_head_operands``), which keeps its GEMMs aligned.  Labels of -100 are ignored; the loss is the mean over
the others (``F.cross_entropy``'s).
"""

from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                chunk: int) -> torch.Tensor:
        real = weight[:vocab_size]
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1).to(torch.float32)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            target = labels[start:start + chunk]
            keep = valid[start:start + chunk]
            logits = (h @ real.t()).float()  # (chunk, V): the only logits alive
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((lse - picked) * keep).sum()
            # d(sum of the chunk's losses) / d logits = softmax - one-hot, zero on ignored rows; / count: the mean
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad[torch.arange(grad.shape[0], device=grad.device), target.clamp(min=0)] -= 1.0
            grad.mul_((keep.to(grad.dtype) / count).unsqueeze(1))
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = grad @ real
            if grad_weight is not None:
                grad_weight[:vocab_size] += (grad.t() @ h).float()
            del logits, grad  # before the next chunk's logits are made: one chunk's alive at a time
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_loss).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                         chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight[:vocab_size].T`` against ``labels``, ``chunk_tokens`` rows at a
    time.  ``hidden``: (s, b, h) sequence-first, as the blocks hand it; ``labels``: (b, s), as the data
    loader's (the next tokens).  ``weight``: the head's (V_padded x h), tied or not."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens = {chunk_tokens}: use a positive number of tokens a chunk")
    if vocab_size > weight.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} exceeds the head's {weight.shape[0]} rows")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, weight, labels.t().reshape(-1), vocab_size, chunk_tokens)


def padded_head_operands(weight: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) for a fused loss over a padded head: every row, so that its GEMMs keep the padded width's
    alignment (GPT-2's 50,257 real rows take cuBLAS's slow paths: 27.6 ms against 7.2 priced for gpt2-medium's bf16
    head on an H200), and a bias of -inf on the padded columns, which gives them no probability and their rows no
    gradient (liger-kernel's own kernel pads its blocks' columns with -inf).  The bias is None where nothing is
    padded."""
    if vocab_size > weight.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} exceeds the head's {weight.shape[0]} rows")
    if vocab_size == weight.shape[0]:
        return weight, None
    return weight, _padded_columns_mask(weight.shape[0], vocab_size, weight.dtype, weight.device)


@functools.lru_cache(maxsize=4)
def _padded_columns_mask(rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(rows, dtype=dtype, device=device)
    mask[vocab_size:] = float("-inf")
    return mask


@functools.lru_cache(maxsize=1)
def liger_loss():
    """liger-kernel's fused linear cross-entropy (called as ``(weight, hidden, labels, bias)``, the mean over labels
    other than -100), where the ``[gpu]`` extra is installed; None otherwise (the chunks above run)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)


__all__ = ["linear_cross_entropy", "liger_loss", "padded_head_operands"]
