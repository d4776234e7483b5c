"""Analytic costs of a Mamba-2 mixer (``models.mamba2.Mamba2Mixer``), op by op, one micro-batch on one TP rank.

Notation: T = b s tokens; on a rank H = heads / t heads of P = head_dim, I = H P inner channels, G = groups / t
groups of N = state, C = I + 2 G N conv channels, Q the chunk, K the conv's kernel; c = ceil(s / Q) chunks.

What autograd keeps (fp32: counted from the code and checked against the profiler's saved tensors,
tests/test_mamba_costs.py): in_proj's input (h) and, through the views of z (torch code) or the conv kernel's
input, its whole output (I + C + H); the conv's input padded with K - 1 steps (torch code; the kernel: its
output, padding included), and the conv's output, which SiLU keeps; SiLU's output, of which the scan keeps x, B
and C as views; dt three times (dt + dt_bias, softplus, the clamp); the scan nothing else (its
intermediates are recomputed in the backward, as ``mamba_ssm``'s fused scan recomputes them); the gated norm
y, SiLU(z), y SiLU(z), its reciprocal RMS per group and its output; out_proj's input.  In 16-bit the scan and
the norm run in fp32: their inputs' fp32 copies are kept too (counted from the code; no 16-bit check yet).

FLOPs: the linears 2 T k n (backward twice); the conv 2 T C K; the scan per chunk C^T B (2 Q^2 G N), the decay
weights (Q^2 H), their product with x dt (2 Q^2 H P), each chunk's state (2 Q H P N) and its read-out
(2 Q H P N), the carry (2 H P N a chunk); its backward recomputes the forward, then twice it.

The scan runs as one of two things.  ``mamba_ssm``'s fused kernels (a GPU with the optional extra, what Megatron
runs) keep the chunk's intermediates on chip: one op, its inputs and output its only traffic.  ``models.ssd``'s
torch code (a CPU; a GPU without the extra) runs its products as batched GEMMs of the chunk's size and, between
them, elementwise passes over whole tensors: the decay weights (b x chunks x Q x Q x H), x dt and its copies
(T x H x P) and the chunks' states (b x chunks x H x P x N), each written and read back from memory
(``torch_scan_ops``; counted from the code, checked against a dispatch-level count of what runs,
tests/test_mamba_costs.py).
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
                 bias: bool = False, conv_bias: bool = True, torch_code: bool = False) -> list[OpCost]:
    """The mixer's ops in execution order (no norm or residual around it: the block adds them); ``torch_code``:
    the conv and the scan as ``models.mamba2``'s and ``models.ssd``'s torch code runs them (a CPU), else as
    ``causal_conv1d``'s and ``mamba_ssm``'s kernels."""
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
    if torch_code:  # models.mamba2.causal_depthwise_conv: x padded, then K shifted multiply-adds
        conv_op = torch_conv_op(shp, channels=conv, kernel=K, bias=conv_bias, weights=conv_w)
        silu_keeps = T * conv  # its input, the conv's output
    else:  # causal_conv1d's kernel, handed a view of in_proj's output (which it keeps, all of it)
        conv_op = OpCost("mamba_conv1d", "vector", fwd_flops=2.0 * T * conv * K, bwd_flops=4.0 * T * conv * K,
                         fwd_bytes=2 * T * conv * e + sum(conv_w) * e,
                         bwd_bytes=3 * T * conv * e + 2 * sum(conv_w) * e, activation_bytes=T * proj * e,
                         weight_bytes=sum(conv_w) * e, weights=conv_w, kernels=(1, 3))
        silu_keeps = shp.b * (shp.s + K - 1) * conv  # the kernel's output, its K - 1 padded steps included
    silu = OpCost("mamba_conv_silu", "vector", fwd_flops=4.0 * T * conv, bwd_flops=8.0 * T * conv,
                  fwd_bytes=2 * T * conv * e, bwd_bytes=3 * T * conv * e,
                  fwd_exps=T * conv, bwd_exps=T * conv,  # the sigmoid, recomputed by silu_backward
                  activation_bytes=silu_keeps * e)
    dt = OpCost("mamba_dt", "vector", fwd_flops=6.0 * T * H, bwd_flops=8.0 * T * H, fwd_bytes=6 * T * H * e,
                bwd_bytes=6 * T * H * e, activation_bytes=(2 if up else 3) * T * H * e, weights=(H, H, H),
                weight_bytes=3 * H * e, fwd_exps=2 * T * H, bwd_exps=T * H,  # softplus: exp and log1p; its sigmoid
                kernels=(3, 3))  # + dt_bias, softplus, clamp (in 16-bit the scan keeps the clamp's fp32 copy); it holds
    # dt_bias, A_log and D, the mixer's per-head weights
    scan_in = T * (conv + H)
    # x, B and C: views of SiLU's output in fp32, their fp32 copies (and dt's) in 16-bit
    kept = scan_in * f32 if up else T * conv * e
    if torch_code:
        scan = torch_scan_ops(shp, heads=H, head_dim=P, state=N, groups=G, chunk=Q, activation_bytes=kept)
    else:  # the products, the decay weights (Q^2 H a chunk) and the carry (2 H P N a chunk) in one kernel
        scan_flops = (scan_product_flops(shp.b, chunks, heads=H, head_dim=P, state=N, groups=G, chunk=Q)
                      + chunks * shp.b * (Q * Q * H + 2.0 * H * P * N))
        scan = [OpCost("mamba_ssd_scan", "attention", fwd_flops=scan_flops, bwd_flops=3.0 * scan_flops,
                       fwd_bytes=(scan_in + T * inner) * f32 + T * inner * e,
                       bwd_bytes=(2 * scan_in + 2 * T * inner) * f32, activation_bytes=kept,
                       kernels=(8 + 4 * chunks, 24 + 8 * chunks))]
    # the norm as models.mamba2.GroupedGatedRMSNorm runs it, eagerly everywhere: forward silu(z), its product
    # with y, the square, the mean, the product by the reciprocal RMS and by the weight, 12 passes' reads and
    # writes of T x I fp32 elements (in 16-bit, y's and z's fp32 copies and the cast back besides); backward 32
    # (each product's two gradients, the broadcasts' sums, silu_backward): counted at dispatch
    casts = (2 * (e + f32) + f32 + e) * T * inner if up else 0
    # z for SiLU: in fp32 a view of in_proj's whole output, which the torch conv does not keep (the kernel does)
    z_view = T * proj * e if torch_code and not up else 0
    gated_norm = OpCost("mamba_gated_norm", "vector", fwd_flops=8.0 * T * inner, bwd_flops=16.0 * T * inner,
                        fwd_bytes=12 * T * inner * f32 + casts, bwd_bytes=32 * T * inner * f32 + casts,
                        fwd_exps=T * inner, bwd_exps=T * inner,
                        # y, SiLU(z), y SiLU(z), the RMS per group, the output; in 16-bit z's fp32 copy too, and
                        # the output kept in 16-bit
                        activation_bytes=(4 * T * inner * f32 + T * G * f32 + (T * inner * e if up else 0)
                                          + z_view),
                        weights=(inner,), weight_bytes=inner * e, kernels=(8, 14))
    out_proj = linear("mamba_out_proj", T, inner, shp.h, shp, bias=bias)
    return [in_proj, conv_op, silu, dt, *scan, gated_norm, out_proj]


def torch_conv_op(shp: Shape, *, channels: int, kernel: int, bias: bool, weights: tuple) -> OpCost:
    """``models.mamba2.causal_depthwise_conv`` as eager torch runs it, in elements of T x C (C channels, T = b s
    tokens; counted at dispatch, tests/test_mamba_costs.py).  Forward: the padded copy (2), the first tap's
    multiply (2), K - 1 multiply-adds (3 each): 3 K + 1.  Backward, per tap: addcmul's scaled gradient (2), the
    input's gradient (grad x tap, 2), the tap's (grad x input, 3, and its sum, 1), the slice's gradient written
    into a zeroed padded buffer (2); K - 1 adds of those (3 each), the padding's slice (2) and the bias's sum (1):
    13 K + 1, less 3 without a bias (the first tap a plain multiply).  It keeps x padded (b (s + K - 1) C) and
    the taps."""
    e, K, TC = shp.e, kernel, shp.b * shp.s * channels
    return OpCost("mamba_conv1d", "vector", fwd_flops=2.0 * TC * K, bwd_flops=4.0 * TC * K,
                  fwd_bytes=(3 * K + 1) * TC * e, bwd_bytes=(13 * K + (1 if bias else -2)) * TC * e,
                  activation_bytes=shp.b * (shp.s + K - 1) * channels * e,
                  weight_bytes=sum(weights) * e, weights=weights, kernels=(K + 1, 5 * K + 2))


def scan_product_flops(b: int, chunks: int, *, heads: int, head_dim: int, state: int, groups: int,
                       chunk: int) -> float:
    """The scan's products, forward: per chunk C^T B once a group (2 Q^2 G N), the weighted scores by x dt
    (2 Q^2 H P), each chunk's state (2 Q H P N) and its read-out (2 Q H P N)."""
    Q = chunk
    return chunks * b * (2.0 * Q * Q * groups * state + 2.0 * Q * Q * heads * head_dim
                         + 4.0 * Q * heads * head_dim * state)


def torch_scan_ops(shp: Shape, *, heads: int, head_dim: int, state: int, groups: int, chunk: int,
                   activation_bytes: float) -> list[OpCost]:
    """``models.ssd``'s scan as its torch code runs it, fp32 (this rank's heads and groups): its batched products,
    then its elementwise passes.  In elements, with T = b c Q padded tokens: the decay weights D = T H Q, x dt's
    kind X = T H P, the chunks' states S = b c H P N, a group's scores W = b c G Q^2, the log-decays L = T H.

    Forward, each pass's reads and writes (counted from ``ssd._scan``): x dt, x dt's decay to the chunk's end, its
    per-group copy that matmul makes of a strided operand, the read-outs' stack, their decay, the inside terms'
    cat and the final add: 15 X; the decay's differences, mask, exp and product with the scores: 7 D (and 2 W);
    the states' stack, the carry (a multiply and an add a chunk) and the entering states' stack: 9 S; the
    log-decays' cumsum, exps and broadcasts: about 10 L.  The backward recomputes that forward, then autograd's
    passes: each product's and exp's gradients (the operands read with the incoming gradient, a gradient
    written), the reductions of the broadcast operands, the unbinds' stacks, the accumulation of x dt's three
    uses: 17 D, 28 X, 11 S and about 30 L."""
    b, s, H, P, N, G, Q = shp.b, shp.s, heads, head_dim, state, groups, chunk
    chunks = math.ceil(s / Q)
    T = b * chunks * Q
    D, X, S, W, L = T * H * Q, T * H * P, b * chunks * H * P * N, b * chunks * G * Q * Q, T * H
    f32 = 4
    products = scan_product_flops(b, chunks, heads=H, head_dim=P, state=N, groups=G, chunk=Q)
    # each product's operands and output: scores (C, B -> W), inside (weights, x dt -> X), the states
    # (x dt, B -> S), the read-out (C, states -> X)
    operands = 2 * T * G * N + W + D + 2 * X + X + T * G * N + S + T * G * N + S + X
    pad = (T - b * s) and 2 * (b * s * (H * P + 2 * G * N + H))  # the last chunk's padded copies of x, B, C, dt
    skip = 5 * T * H * P  # the mixer's D skip, y + D x (mamba_ssm's kernel fuses it): a product and an add
    forward = 15 * X + 7 * D + 2 * W + 9 * S + 10 * L + pad + skip
    flops = 3.0 * D + 6.0 * X + 3.0 * S  # a flop a pass, the exps apart
    # the exps run as kernels of their own, compute-bound where the other passes are memory-bound: an op apart, so
    # that their times add (the decay weights, the decays to each chunk's end, from its start, across it), forward
    # and again in the backward's recomputed forward (exp's gradient is its output)
    exps = D + 3 * L
    exp_bytes = 2 * exps
    return [OpCost("mamba_ssd_products", "matrix", fwd_flops=products, bwd_flops=3.0 * products,
                   fwd_bytes=operands * f32, bwd_bytes=3 * operands * f32, gemm_dim=min(Q, P, N)),
            OpCost("mamba_ssd_exps", "vector", fwd_exps=exps, bwd_exps=exps, fwd_bytes=exp_bytes * f32,
                   bwd_bytes=exp_bytes * f32, kernels=(4, 4)),
            OpCost("mamba_ssd_passes", "vector", fwd_flops=flops, bwd_flops=3.0 * flops,
                   fwd_bytes=(forward - exp_bytes) * f32,
                   # the recomputed forward, autograd's passes, the padding's and the skip's gradients
                   bwd_bytes=(forward - exp_bytes + 17 * D + 28 * X + 11 * S + 30 * L + pad + 2 * skip) * f32,
                   activation_bytes=activation_bytes, kernels=(20 + 3 * chunks, 76 + 8 * chunks))]
