"""Multi-token prediction (DeepSeek-V3; megatron-core's ``multi_token_prediction.py``) in DeepSpeed's pipeline.

What it computes, as megatron-core does for ``mtp_num_layers`` = D and ``mtp_loss_scaling_factor`` = lambda:

    ids_k    = the input ids shifted left by k, the last k positions 0          (megatron's roll_tensor, k times)
    h_k      = final_norm_k(block_k(eh_proj_k([enorm_k(embed(ids_k)); hnorm_k(h_{k-1})])))   h_0: the last block's output
    logits_k = the shared output head of h_k
    loss     = lm(logits_0) + lambda / D x sum_k CE(logits_k, labels shifted left by k, the last k positions ignored)

How it runs in the pipeline, which passes a tuple of tensors from stage to stage:

* The ids are needed where the MTP layers run (the last stages), and only DeepSpeed's loss sees the labels.  The
  embedding layer looks the shifted ids up itself, in the one word table, and the D embeddings travel in the
  boundary tuple beside the hidden states (as Megatron-DeepSpeed passes its masks): ``(h, aux, e_1 .. e_D)``.
  MTP layer k takes e_k out and appends h_k: ``(h, aux, e_k+1 .. e_D, h_1 .. h_k)``.
  Why not ids and a tied copy of the table on the MTP stage, as megatron-core builds it: the copy costs the
  table's weights, gradients and optimizer states there (DeepSeek-V3: 0.93 B parameters) and an all-reduce a
  step; the travelling embeddings cost s x b x h a boundary a micro-batch, and the table stays one tensor whose
  gradient comes back through the pipeline's own backward: exact, with no tie to keep.
* The head layer projects the main hidden states (after the final norm) and the D MTP outputs (normed in their
  layers) in one product with its one weight, so the output head is shared by construction: no second tied
  group.  ``MTPLoss`` splits the logits into the 1 + D chunks, as megatron-core's ``torch.chunk``.

Each MTP layer is a pipeline layer of its own: the partitioner prices it, ``plan`` writes Megatron's ``m``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layers import LayerImpl, normal_init


def shifted_ids(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``tokens`` (b, s) shifted left by ``k`` along the sequence, the last k positions 0 (megatron's roll)."""
    out = torch.zeros_like(tokens)
    if k < tokens.shape[1]:
        out[:, : tokens.shape[1] - k] = tokens[:, k:]
    return out


def shifted_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """``labels`` (b, s) shifted left by ``k``, the last k positions ignored (-100: megatron's rolled loss mask)."""
    out = torch.full_like(labels, -100)
    if k < labels.shape[1]:
        out[:, : labels.shape[1] - k] = labels[:, k:]
    return out


class MTPLayer(nn.Module):
    """MTP layer ``k`` (1-based) of ``depth``: ``block`` is the transformer block it holds (an ``MoEBlock``)."""

    def __init__(self, cfg, impl: LayerImpl, block: nn.Module, *, k: int, depth: int):
        super().__init__()
        self.k, self.depth = k, depth
        self.enorm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.hnorm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.eh_proj = normal_init(nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False))
        self.block = block
        self.final_norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)

    def forward(self, inputs: tuple) -> tuple:
        h, aux, *rest = inputs
        embeddings, outputs = rest[: self.depth - self.k + 1], rest[self.depth - self.k + 1:]
        previous = outputs[-1] if outputs else h
        x = self.eh_proj(torch.cat((self.enorm(embeddings[0]), self.hnorm(previous)), dim=-1))
        x, aux = self.block((x, aux))
        return (h, aux, *embeddings[1:], *outputs, self.final_norm(x))


class MTPLoss:
    """``MoELoss`` over the main logits, plus lambda / D x the MTP layers' losses (``depth`` = D) over their chunks."""

    NAMES = ("lm_loss", "moe_aux_loss", "mtp_loss")

    def __init__(self, main, depth: int, scale: float, lm: Callable):
        self.main, self.depth, self.scale, self.lm = main, depth, scale, lm
        self.last: dict[str, torch.Tensor] = {name: torch.zeros(()) for name in self.NAMES}

    def __call__(self, outputs: tuple, labels: torch.Tensor) -> torch.Tensor:
        logits, aux = outputs
        chunks = logits.chunk(1 + self.depth, dim=0)
        loss = self.main((chunks[0], aux), labels)
        mtp = sum(self.lm(chunk, shifted_labels(labels, k)) for k, chunk in enumerate(chunks[1:], start=1))
        self.last = {**self.main.last, "mtp_loss": mtp.detach() / self.depth}
        return loss + self.scale / self.depth * mtp

    def additional_losses(self) -> dict[str, torch.Tensor]:
        return self.last

    def __repr__(self) -> str:  # stable: the profile cache key reads it
        return f"MTPLoss({self.main!r}, depth={self.depth}, scale={self.scale})"

