"""Analytic costs of a Mamba-2 mixer (``models.mamba2.Mamba2Mixer``), op by op, one micro-batch on one TP rank.

Notation: T = b s tokens; on a rank H = heads / t heads of P = head_dim, I = H P inner channels, G = groups / t
groups of N = state, C = I + 2 G N conv channels, Q the chunk, K the conv's kernel; c = ceil(s / Q) chunks.

What autograd keeps (fp32: counted from the code and checked against the profiler's saved tensors,
tests/test_mamba_costs.py): in_proj's input (h) and, through the conv's transposed view of it, its whole output
(I + C + H); the conv's output with its K - 1 padded steps, which SiLU keeps; SiLU's output, of which the scan
keeps x, B and C as views; dt three times (dt + dt_bias, softplus, the clamp); the scan nothing else (its
intermediates are recomputed in the backward, as ``mamba_ssm``'s fused scan recomputes them); the gated norm
y, SiLU(z), y SiLU(z), its reciprocal RMS per group and its output; out_proj's input.  In 16-bit the scan and
the norm run in fp32: their inputs' fp32 copies are kept too (counted from the code; no 16-bit check yet).

FLOPs: the linears 2 T k n (backward twice); the conv 2 T C K; the scan per chunk C^T B (2 Q^2 G N), the decay
weights (Q^2 H), their product with x dt (2 Q^2 H P), each chunk's state (2 Q H P N) and its read-out
(2 Q H P N), the carry (2 H P N a chunk); its backward recomputes the forward, then twice it.
"""

from __future__ import annotations

import math

from .analytic import linear
from .op_cost import OpCost, Shape


def _local(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"mamba: tensor parallelism {t} does not divide {what} ({n})")
    return n // t


def mamba2_mixer(shp: Shape, *, heads: int, head_dim: int, state: int, groups: int, conv_kernel: int, chunk: int,
                 bias: bool = False, conv_bias: bool = True) -> list[OpCost]:
    """The mixer's ops in execution order (no norm or residual around it: the block adds them)."""
    t, e, T = shp.t, shp.e, shp.b * shp.s
    H, G = _local(heads, t, "mamba heads"), _local(groups, t, "n_groups")
    P, N, K, Q = head_dim, state, conv_kernel, chunk
    inner, conv = H * P, H * P + 2 * G * N
    proj = inner + conv + H
    up = e < 4  # the scan and the gated norm run in fp32: 16-bit inputs are copied up
    f32 = 4
    chunks = math.ceil(shp.s / Q)
    in_proj = linear("mamba_in_proj", T, shp.h, proj, shp, bias=bias)
    conv_w = (conv * K, conv) if conv_bias else (conv * K,)
    conv_op = OpCost("mamba_conv1d", "vector", fwd_flops=2.0 * T * conv * K, bwd_flops=4.0 * T * conv * K,
                     fwd_bytes=2 * T * conv * e + sum(conv_w) * e, bwd_bytes=3 * T * conv * e + 2 * sum(conv_w) * e,
                     activation_bytes=T * proj * e,  # its input is a view of in_proj's whole output
                     weight_bytes=sum(conv_w) * e, weights=conv_w, kernels=(1, 3))
    silu = OpCost("mamba_conv_silu", "vector", fwd_flops=4.0 * T * conv, bwd_flops=8.0 * T * conv,
                  fwd_bytes=2 * T * conv * e, bwd_bytes=3 * T * conv * e,
                  activation_bytes=shp.b * (shp.s + K - 1) * conv * e)  # the conv's output, padding included
    dt = OpCost("mamba_dt", "vector", fwd_flops=6.0 * T * H, bwd_flops=8.0 * T * H, fwd_bytes=6 * T * H * e,
                bwd_bytes=6 * T * H * e, activation_bytes=(2 if up else 3) * T * H * e, weights=(H, H, H),
                weight_bytes=3 * H * e,
                kernels=(3, 3))  # + dt_bias, softplus, clamp (in 16-bit the scan keeps the clamp's fp32 copy); it holds
    # dt_bias, A_log and D, the mixer's per-head weights
    scan_flops = (chunks * shp.b * (2.0 * Q * Q * G * N + Q * Q * H + 2.0 * Q * Q * H * P + 4.0 * Q * H * P * N)
                  + 2.0 * chunks * shp.b * H * P * N)
    scan_in = T * (conv + H)
    scan = OpCost("mamba_ssd_scan", "attention", fwd_flops=scan_flops, bwd_flops=3.0 * scan_flops,
                  fwd_bytes=(scan_in + T * inner) * f32 + T * inner * e,
                  bwd_bytes=(2 * scan_in + 2 * T * inner) * f32,
                  # x, B and C: views of SiLU's output in fp32, their fp32 copies (and dt's) in 16-bit
                  activation_bytes=scan_in * f32 if up else T * conv * e,
                  kernels=(8 + 4 * chunks, 24 + 8 * chunks))
    gated_norm = OpCost("mamba_gated_norm", "vector", fwd_flops=8.0 * T * inner, bwd_flops=16.0 * T * inner,
                        fwd_bytes=3 * T * inner * f32 + T * inner * e, bwd_bytes=6 * T * inner * f32,
                        # y, SiLU(z), y SiLU(z), the RMS per group, the output; in 16-bit z's fp32 copy too, and
                        # the output kept in 16-bit
                        activation_bytes=4 * T * inner * f32 + T * G * f32 + (T * inner * e if up else 0),
                        weights=(inner,), weight_bytes=inner * e, kernels=(8, 14))
    out_proj = linear("mamba_out_proj", T, inner, shp.h, shp, bias=bias)
    return [in_proj, conv_op, silu, dt, scan, gated_norm, out_proj]
