"""A Mamba-2 mixer layer in plain torch: what a hybrid model's ``M`` blocks run.

    in_proj -> [z | x B C | dt]; causal depthwise conv over (x B C), SiLU; dt = softplus(dt + dt_bias);
    y = SSD(x, dt, A = -exp(A_log), B, C) + D x;  y = RMSNorm_grouped(y * SiLU(z));  out_proj

The parameter names and layout are those of Hugging Face's ``NemotronHMamba2Mixer`` (and Megatron-core's
``MambaMixer``), so a checkpoint's tensors load as they are.  The conv and the scan are plain torch
(``causal_depthwise_conv``, ``ssd.ssd_scan``) on any device; on CUDA, ``causal_conv1d``'s and ``mamba_ssm``'s
kernels run them where those packages are installed, and ``kernel`` records which ran.  (No GPU run has
exercised the kernel path yet.)

Tensor parallelism (``tp_group``) splits it as Megatron-core's ``MambaMixer`` does: each rank holds whole
heads and whole groups (TP must divide ``n_groups``), so its share of z, x, B, C and dt, of the conv's channels,
of A, D and dt_bias and of the grouped norm; the conv, the scan and the norm need nothing from the other ranks.
in_proj is column-parallel (its input's gradient summed over the group), out_proj row-parallel (its output
summed, its bias added once).  The parameters carry ``tensor_model_parallel`` / ``partition_dim`` /
``shard_sections``, so ``tensor_parallel.shard_like`` slices a one-process state dict for a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .ssd import ssd_scan


@dataclass(frozen=True)
class Mamba2Shape:
    hidden: int
    heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    state: int  # ssm_state_size
    groups: int = 1  # n_groups: heads share B and C within a group
    conv_kernel: int = 4
    chunk: int = 128
    conv_bias: bool = True
    bias: bool = False
    eps: float = 1e-5
    time_step_min: float = 0.0

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def check(self) -> None:
        if self.heads % self.groups:
            raise ValueError(f"mamba: {self.heads} heads do not split into n_groups = {self.groups}")


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm of y * SiLU(z) over each group's channels (Mamba-2's norm before out_proj), in fp32."""

    def __init__(self, channels: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (self.groups, -1))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(dtype)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv over x (b, l, channels) with ``nn.Conv1d``'s (channels, 1, K) weight, as K
    shifted multiply-adds in x's own layout: y_t = bias + sum_k w_k x_(t - K + 1 + k).  conv1d wants (b, channels,
    l): a CPU then transposes x in, runs oneDNN's depthwise backward (1.5-1.9 ns an output and tap here), and the
    SiLU after it runs its backward across two layouts; this took 25-35% less time (bench-cpu-hybrid's, b 1 and 4),
    equal to conv1d's within rounding.  What it keeps: x padded with K - 1 zero steps, and the taps."""
    K, l = weight.shape[-1], x.shape[1]
    taps = weight[:, 0].t()  # (K, channels)
    padded = F.pad(x, (0, 0, K - 1, 0))
    y = padded[:, :l] * taps[0] if bias is None else torch.addcmul(bias, padded[:, :l], taps[0])
    for k in range(1, K):
        y = torch.addcmul(y, padded[:, k:k + l], taps[k])
    return y


def _split(p: nn.Parameter, dim: int, sections: tuple[int, ...] | None = None) -> None:
    p.tensor_model_parallel, p.partition_dim = True, dim
    if sections:
        p.shard_sections = sections


class Mamba2Mixer(nn.Module):
    def __init__(self, shape: Mamba2Shape, *, tp_group=None):
        super().__init__()
        shape.check()
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if shape.groups % tp:
            raise ValueError(f"mamba: tensor parallelism {tp} must divide n_groups = {shape.groups} (each rank holds "
                             f"whole groups of heads, as Megatron-core's MambaMixer)")
        self.full, self.tp_group = shape, tp_group if tp > 1 else None
        self.shape = s = replace(shape, heads=shape.heads // tp, groups=shape.groups // tp)  # this rank's
        self.in_proj = nn.Linear(s.hidden, s.inner + s.conv_channels + s.heads, bias=s.bias)
        self.conv1d = nn.Conv1d(s.conv_channels, s.conv_channels, s.conv_kernel, groups=s.conv_channels,
                                padding=s.conv_kernel - 1, bias=s.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(s.heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, s.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(s.heads))
        self.norm = GroupedGatedRMSNorm(s.inner, s.groups, s.eps)
        self.out_proj = nn.Linear(s.inner, s.hidden, bias=s.bias)  # under TP its bias is added after the sum
        if tp > 1:
            f = shape
            bc = f.groups * f.state
            for p in (self.in_proj.weight, self.in_proj.bias):
                if p is not None:
                    _split(p, 0, (f.inner, f.inner, bc, bc, f.heads))  # z, x, B, C, dt
            for p in (self.conv1d.weight, self.conv1d.bias):
                if p is not None:
                    _split(p, 0, (f.inner, bc, bc))
            for p in (self.dt_bias, self.A_log, self.D, self.norm.weight):
                _split(p, 0)
            _split(self.out_proj.weight, 1)
        self.kernel = "torch"  # what the last forward ran: "torch", or "mamba_ssm" (its conv and scan kernels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if self.tp_group is not None:  # the input's gradient: the sum of every rank's share
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        z, xbc, dt = self.in_proj(hidden).split([s.inner, s.conv_channels, s.heads], dim=-1)
        kernels = cuda_kernels() if hidden.is_cuda else None
        self.kernel = "mamba_ssm" if kernels else "torch"
        if kernels:
            conv_fn, scan_fn = kernels
            xbc = conv_fn(xbc.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                          activation="silu").transpose(1, 2)
        else:
            xbc = F.silu(causal_depthwise_conv(xbc, self.conv1d.weight, self.conv1d.bias))
        x, B, C = xbc.split([s.inner, s.groups * s.state, s.groups * s.state], dim=-1)
        x = x.unflatten(-1, (s.heads, s.head_dim))
        B, C = B.unflatten(-1, (s.groups, s.state)), C.unflatten(-1, (s.groups, s.state))
        A = -torch.exp(self.A_log.float())
        if kernels:
            y = scan_fn(x, dt, A, B, C, s.chunk, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                        dt_limit=(s.time_step_min, float("inf")))
        else:
            dt = F.softplus(dt + self.dt_bias).clamp(min=s.time_step_min)
            x32 = x.float()  # one fp32 copy in 16-bit, which the scan and the skip share
            y, _ = ssd_scan(x32, dt.float(), A, B.float(), C.float(), s.chunk)
            y = y + self.D[:, None] * x32
        y = self.norm(y.to(hidden.dtype).flatten(-2), z)
        if self.tp_group is None:
            return self.out_proj(y)
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        out = reduce_from_tensor_model_parallel_region(F.linear(y, self.out_proj.weight), group=self.tp_group)
        return out if self.out_proj.bias is None else out + self.out_proj.bias


def cuda_kernels():
    """(causal_conv1d_fn, mamba_chunk_scan_combined) where both packages are installed, else None."""
    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return causal_conv1d_fn, mamba_chunk_scan_combined
