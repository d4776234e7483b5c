"""The experts a routed MLP holds (DeepSpeed's MoE layer copies one into every local slot), by the model's kind:

    SwiGLU                 ``llama.LlamaMLP`` (Mixtral, Qwen-MoE, DeepSeek)
    clamped SwiGLU         gpt-oss's, with biases (``ClampedSwiGLUMLP``)
    squared ReLU           Nemotron-H's, up and down alone (``Relu2MLP``)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import LOCAL, LayerImpl
from .llama import LlamaMLP


class ClampedSwiGLUMLP(nn.Module):
    """gpt-oss's expert: [gate; up] = x W + b, gate clamped above and up both ways at ``limit`` (0: no clamp),
    out = ((up + 1) x gate x sigmoid(1.702 gate)) W_down + b (transformers' ``GptOssExperts``, whose gate_up
    interleaves gate and up columns where this keeps them in halves)."""

    ALPHA = 1.702

    def __init__(self, hidden: int, ffn: int, *, bias: bool, limit: float):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)
        self.limit = float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(ClampedSwiGLU.apply(self.gate_up(x), self.limit, self.ALPHA))


class ClampedSwiGLU(torch.autograd.Function):
    """gpt-oss's activation of [gate; up], keeping only its input for backward (as ``llama.SwiGLU``; written out,
    the clamps, the sigmoid and the products keep five more f-wide tensors)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.limit, ctx.alpha = limit, alpha
        gate, up = gate_up.chunk(2, dim=-1)
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        limit, alpha = ctx.limit, ctx.alpha
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        d_gate, d_up = out.chunk(2, dim=-1)
        g = gate.clamp(max=limit) if limit else gate
        u = up.clamp(-limit, limit) if limit else up
        sig = torch.sigmoid(g * alpha)
        torch.mul(g, sig, out=d_up).mul_(grad)  # d up = grad x glu
        d_gate.copy_(sig).mul_(1 - sig).mul_(g * alpha).add_(sig).mul_(u + 1).mul_(grad)
        if limit:  # clamp passes the gradient where the input lies within its bounds (as torch.clamp's)
            d_gate.mul_(gate <= limit)
            d_up.mul_((up >= -limit) & (up <= limit))
        return out, None, None


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2), no gate and no biases: Nemotron-H's MLP layers' and MoE experts' (the hybrid family)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


def expert_mlp(cfg, ffn: int) -> nn.Module:
    """One expert (or the shared experts, ``ffn`` wide) of ``cfg``'s kind: SwiGLU, gpt-oss's clamped SwiGLU with
    biases, or the squared ReLU (``expert_activation = "relu2"``: Nemotron-H)."""
    if getattr(cfg, "expert_activation", "swiglu") == "relu2":
        return Relu2MLP(cfg.hidden, ffn)
    if getattr(cfg, "expert_bias", False) or getattr(cfg, "swiglu_limit", 0.0):
        return ClampedSwiGLUMLP(cfg.hidden, ffn, bias=cfg.expert_bias, limit=cfg.swiglu_limit)
    return LlamaMLP(cfg, LOCAL, ffn)


def shared_mlp(cfg, ffn: int, impl: LayerImpl = LOCAL) -> nn.Module:
    """The always-on shared experts (one MLP ``ffn`` wide): squared ReLU for Nemotron-H, else SwiGLU (gpt-oss has
    none), split over TP as a dense MLP (``impl``; megatron-core's SharedExpertMLP)."""
    if getattr(cfg, "expert_activation", "swiglu") == "relu2":
        return Relu2MLP(cfg.hidden, ffn)
    return LlamaMLP(cfg, impl, ffn)
