"""Each op priced as a GPU runs it: its GEMMs, its attention kernel, its memory passes, its launches.

A CPU rank is priced by the roofline of ``DeviceSpec.op_time``; a GPU's error is per kernel, so a GPU spec
carries ``GpuKernels`` and ``op_time`` hands its ops here:

* GEMM: each product of the op (forward ``M x K x N``; backward ``dX`` and ``dW``) at the throughput the
  device's kernel table gives for its shape (``costs.kernel_table``), else by rule: the measured GEMM ceiling,
  wave quantization of its output tiles over the SMs, and the alignment of its leading dimensions (a width
  that is not a multiple of 16 bytes takes cuBLAS's slower paths: GPT-2's 50,257-word head).
* Attention: the backend ``arch.attention_backend`` selects (the one the model code runs), at that backend's
  share of the dense peak, on the work the kernel does (half the score matrix under a causal mask).
* Memory-bound ops: the bytes their kernels move at the device's achieved streaming bandwidth.
* Every kernel at least a launch; a layer in eager mode at least its host's dispatch (``layer_floor_s``).

``execution`` says how the layers run: "eager" (train.py's default: each torch op its kernels, the extra
passes of fp32 casts), "compiled" (``train.compile``: inductor fuses elementwise chains into one pass of
the op's own traffic and leaves the host far fewer launches) or "megatron" (Megatron-LM's fused kernels,
one pass an op, no host floor; its 2021-2022 runs' attention is the written-out core, its fused softmax
over the s x s scores).  "megatron-2021" is Megatron-LM's kernels before ``gradient_accumulation_fusion``
(February 2022): each weight gradient is added into the accumulated one by a pass of its own, as Megatron's
``main_grad`` hook and DeepSpeed's engine (autograd's ``AccumulateGrad``) then did.  Every figure's source is
in docs/CALIBRATION.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .op_cost import DTYPE_BYTES, OpCost

EXECUTIONS = ("eager", "compiled", "megatron", "megatron-2021")
MEGATRON = ("megatron", "megatron-2021")  # Megatron-LM's fused kernels, with and without the fused accumulation


@dataclass(frozen=True)
class GpuKernels:
    """How one GPU generation runs each kernel class (figures and sources: docs/CALIBRATION.md)."""

    sms: int
    # the best aligned GEMM's share of the datasheet's dense peak: what cuBLAS measurably reaches
    gemm_efficiency: float
    # an aligned GEMM's output tiles (rows x columns) that fill the SMs a wave at a time
    tile: tuple = (128, 256)
    # a GEMM's speed against an aligned one by the alignment of its leading dimensions in bytes (the
    # largest power of two dividing each, at most 16), forward and backward
    alignment_fwd: dict = field(default_factory=dict)
    alignment_bwd: dict = field(default_factory=dict)
    # each attention backend's share of the dense peak at head dims 64 and 128 (forward, backward)
    attention: dict = field(default_factory=dict)
    # a streaming kernel's share of the datasheet's memory bandwidth
    bandwidth_fraction: float = 0.88
    launch_s: float = 2.5e-6  # the least a kernel takes, back to back on the stream
    host_kernel_s: float = 6e-6  # eager dispatch of one kernel's op (forward), on the host
    host_kernel_bwd_s: float = 9e-6  # an autograd node's dispatch (backward)
    layer_call_s: float = 30e-6  # a layer's module call (hooks, autograd graph) each pass
    table: object = None  # a ``kernel_table.KernelTable`` measured on this device, or None: the rules
    # fp32 GEMMs on tensor cores (TF32: ``torch.backends.cuda.matmul.allow_tf32``); off, they run on the CUDA
    # cores at the fp32 vector peak, whose loads need no 16-byte alignment
    tf32: bool = True
    # a GEMM's fill: K / (K + k_half) of its ceiling (the pipeline's prologue and epilogue weigh more on a
    # short inner dimension)
    k_half: float = 0.0
    # an attention kernel with dropout runs at this share of its speed without
    attention_dropout: float = 1.0


def alignment_bytes(*widths: int, elem: int) -> int:
    """The alignment in bytes of a GEMM whose leading dimensions are ``widths`` elements of ``elem`` bytes:
    the largest power of two dividing every width x elem, at most 16 (cuBLAS's vectorised loads)."""
    best = 16
    for w in widths:
        b = int(w) * elem
        best = min(best, b & -b if b else 16)
    return best


def wave_efficiency(m: float, n: float, kern: GpuKernels) -> float:
    """Of the SMs' time, the share a GEMM's output tiles fill: tiles / (waves x SMs), for the better of the
    kernel's tile and its transpose (cuBLAS picks among tile shapes)."""
    best = 0.0
    for tr, tc in (kern.tile, kern.tile[::-1]):
        tiles = math.ceil(m / tr) * math.ceil(n / tc)
        best = max(best, tiles / (math.ceil(tiles / kern.sms) * kern.sms))
    return best


def product_s(m: float, k: float, n: float, *, dtype: str, align: int, backward: bool, spec) -> float:
    """One (m x k)(k x n) product: its FLOPs at the table's throughput for the shape, else the rule's, and
    no faster than its operands' traffic or a launch."""
    kern: GpuKernels = spec.gpu
    e = DTYPE_BYTES.get(dtype, 4)
    cuda_cores = dtype == "fp32" and not kern.tf32
    alignment = 1.0 if cuda_cores else (kern.alignment_bwd if backward else kern.alignment_fwd).get(align, 1.0)

    def floors_s(m, k, n, rate):  # no faster than the operands' traffic or a launch
        memory = (m * k + k * n + m * n) * e / (spec.hbm_bandwidth * kern.bandwidth_fraction)
        return max(2.0 * m * k * n / rate, memory, kern.launch_s)

    def rule_flops(m, k, n):  # the rule's aligned rate with its floors: a table's prior between its shapes
        return 2.0 * m * k * n / floors_s(m, k, n, _rule_rate(m, k, n, dtype=dtype, spec=spec))

    looked_up = (kern.table.gemm_flops(m, k, n, dtype, align, prior=rule_flops)
                 if kern.table is not None and not cuda_cores else None)
    if looked_up is not None:
        rate, exact = looked_up
        return 2.0 * m * k * n / (rate * (1.0 if exact else alignment))
    return floors_s(m, k, n, _rule_rate(m, k, n, dtype=dtype, spec=spec) * alignment)


def _rule_rate(m: float, k: float, n: float, *, dtype: str, spec) -> float:
    """An aligned (m x k)(k x n) product's FLOP/s by rule: the GEMM ceiling, its waves of tiles and its fill
    (fp32 without TF32: the CUDA cores' peak, whose main loop is long beside its ends)."""
    kern: GpuKernels = spec.gpu
    if dtype == "fp32" and not kern.tf32:
        return spec.vector_flops["fp32"] * kern.gemm_efficiency * wave_efficiency(m, n, kern)
    fill = k / (k + kern.k_half)
    return spec.matrix_flops[dtype] * kern.gemm_efficiency * wave_efficiency(m, n, kern) * fill


def gemm_s(op: OpCost, *, dtype: str, backward: bool, spec, execution: str = "eager") -> float:
    """An op's GEMMs: forward M x K x N; backward dX (M x N x K) and dW (K x M x N).  Compiled, inductor pads
    a misaligned GEMM's dimensions to aligned ones (``torch._inductor.config.shape_padding``, on by default)."""
    m, k, n = op.gemm
    align = alignment_bytes(k, n, elem=DTYPE_BYTES.get(dtype, 4))
    if execution == "compiled" and align < 16:
        pad = 16 // DTYPE_BYTES.get(dtype, 4)
        k, n, align = -(-k // pad) * pad, -(-n // pad) * pad, 16
    if not backward:
        return product_s(m, k, n, dtype=dtype, align=align, backward=False, spec=spec)
    return (product_s(m, n, k, dtype=dtype, align=align, backward=True, spec=spec)
            + product_s(k, m, n, dtype=dtype, align=align, backward=True, spec=spec))


def attention_s(op: OpCost, *, dtype: str, backward: bool, spec, backend: str) -> float:
    """A fused attention core on ``backend``: the kernel's work (causal: half the scores) at the backend's
    share of the dense peak for the head dim, interpolated between 64 and 128."""
    kern: GpuKernels = spec.gpu
    b, heads, kv, s, keys, d, masked, dropout, _sinks = op.attn_shape  # the sinks' rescale is an op of its own
    flops = op.bwd_flops if backward else op.fwd_flops
    if not masked and keys >= s:  # causal: the kernel skips the tiles above the diagonal
        flops *= 0.5
    if kern.table is not None:
        query = dict(s=s, d=d, backward=backward, gqa=kv < heads)
        rate = kern.table.attention_flops(backend, dtype, **query, dropout=bool(dropout))
        if rate is None and dropout:  # a table measured without dropout: the dropout share applies
            rate = kern.table.attention_flops(backend, dtype, **query)
            rate = rate * kern.attention_dropout if rate is not None else None
        if rate is not None:
            return max(flops / rate, kern.launch_s)
    # fp32 cores: the memory-efficient kernel's fp32 path multiplies on tensor cores in three TF32 passes
    # (cutlass's fast-fp32 mode, whatever allow_tf32 says): its share is of the TF32 peak, at most 1/3
    key = f"{backend}-fp32" if dtype == "fp32" else backend
    effs = kern.attention.get(key)
    if effs is None:
        raise ValueError(f"no attention efficiency for backend {key!r} on this GPU")
    (f64, b64), (f128, b128) = effs[64], effs[128]
    w = min(max((d - 64) / 64, 0.0), 1.0)
    eff = (b64 + w * (b128 - b64)) if backward else (f64 + w * (f128 - f64))
    if dropout:  # the kernel draws and applies its mask in the loop, forward and again backward
        eff *= kern.attention_dropout
    peak = spec.matrix_flops[dtype]
    return max(flops / (peak * eff), kern.launch_s * op.kernels[1 if backward else 0])


def streaming_s(op: OpCost, *, dtype: str, backward: bool, spec, execution: str) -> float:
    """A memory-bound op: the bytes its kernels move (the eager passes where they differ from the op's own
    traffic) at the achieved bandwidth, at least a launch per kernel."""
    kern: GpuKernels = spec.gpu
    moved = op.bwd_bytes if backward else op.fwd_bytes
    if execution == "eager" and op.gpu_bytes:
        moved = op.gpu_bytes[1 if backward else 0]
    flops = op.bwd_flops if backward else op.fwd_flops
    compute = flops / spec.vector_flops[dtype] if flops else 0.0
    launches = op.kernels[1 if backward else 0] if execution == "eager" else min(op.kernels[1 if backward else 0], 1)
    return max(moved / (spec.hbm_bandwidth * kern.bandwidth_fraction), compute, kern.launch_s * launches)


def grad_accumulate_s(op: OpCost, *, dtype: str, spec, execution: str) -> float:
    """Autograd adding an op's weight gradients into those the micro-batch before left (``AccumulateGrad``:
    both read, one written, a kernel a tensor), as m - 1 of a step's m micro-batches and the profiler's
    timing loops run it.  Megatron's GEMMs accumulate into ``main_grad`` themselves
    (``gradient_accumulation_fusion``): no pass.  Before that fusion ("megatron-2021") the same pass ran:
    Megatron-LM's local DDP hook added each gradient into ``main_grad`` (``main_grad.add_(grad)``, 16-bit
    without ``accumulate_allreduce_grads_in_fp32``), torch DDP and DeepSpeed's fp16 ZeRO-1 left it to
    ``AccumulateGrad`` (DeepSpeed 0.5's ZeRO-1 registers no gradient hooks without ``overlap_comm``)."""
    if not op.weights or execution == "megatron":
        return 0.0
    kern: GpuKernels = spec.gpu
    moved = 3 * sum(op.weights) * DTYPE_BYTES.get(dtype, 4)
    return max(moved / (spec.hbm_bandwidth * kern.bandwidth_fraction), kern.launch_s * len(op.weights))


# Hopper (H100 SXM / NVL / PCIe, H200: one compute die; the H200 has more memory and bandwidth).  Each figure's
# source is in docs/CALIBRATION.md, "GPU kernels": the GEMM ceiling is stas00/ml-engineering's maximum achievable
# bf16 matmul (794.5 of 989 TFLOP/s; the planner's fitted 0.779 replaces it, hardware.CALIBRATED); the fill is
# read off XLA's measured B200 table; the 4-byte alignment is ml-engineering's SwiGLU pair (273 against 398
# TFLOP/s), 8 bytes taken halfway; cuDNN's d64 forward is the H200 `cuda` spec's causal SDPA, d128 scaled by
# FlashAttention-3's d128 / d64 ratio, backward at 0.75 of the forward (Shah et al. 2024); flash is
# FlashAttention-2's H100 rows there, memory-efficient half of flash (Dao 2023), flex_attention 90% / 85% of
# flash forward / backward (PyTorch's FlexAttention write-up, 2024); the streaming share is the H200
# `cuda` spec's 1 GiB copy.  Fitted on the H200 records (bench/gpu_fidelity.py names them): the 2-byte
# alignment (the bf16 GPT heads), attention with dropout (gpt2-medium's bf16 block), fp32 memory-efficient
# attention (its fp32 block, a share of the TF32 peak: cutlass's three-pass fp32), the host dispatch (its
# bf16 embedding).
HOPPER = dict(
    gemm_efficiency=0.80,
    k_half=480.0,
    alignment_fwd={16: 1.0, 8: 0.828, 4: 0.686, 2: 0.166},
    alignment_bwd={16: 1.0, 8: 0.828, 4: 0.686, 2: 0.186},
    attention={"cudnn": {64: (0.342, 0.257), 128: (0.53, 0.40)},
               "flash": {64: (0.24, 0.17), 128: (0.29, 0.22)},
               "efficient": {64: (0.12, 0.085), 128: (0.145, 0.11)},
               "math": {64: (0.06, 0.045), 128: (0.08, 0.06)},
               "efficient-fp32": {64: (0.213, 0.160), 128: (0.213, 0.160)},
               "math-fp32": {64: (0.03, 0.02), 128: (0.04, 0.03)},
               # flex_attention (a sliding window's block mask): 90% of FlashAttention-2 forward, 85% backward
               "flex": {64: (0.216, 0.145), 128: (0.261, 0.187)},
               "flex-fp32": {64: (0.213, 0.160), 128: (0.213, 0.160)}},
    attention_dropout=0.343,
    bandwidth_fraction=0.88,
    host_kernel_s=12.35e-6,
    host_kernel_bwd_s=18.5e-6,
)
# Ampere (A100): the GEMM ceiling is ml-engineering's (271.2 of 312 TFLOP/s); FlashAttention-2 reaches up to
# 73% of the peak forward and 63% backward at d128 (Dao 2023), ~60% / 50% at d64; cuDNN's SDPA is taken as
# flash's; the rest as Hopper's
AMPERE = dict(HOPPER, gemm_efficiency=0.87,
              attention={"cudnn": {64: (0.60, 0.50), 128: (0.73, 0.63)},
                         "flash": {64: (0.60, 0.50), 128: (0.73, 0.63)},
                         "efficient": {64: (0.30, 0.25), 128: (0.36, 0.31)},
                         "math": {64: (0.10, 0.08), 128: (0.12, 0.10)},
                         "efficient-fp32": HOPPER["attention"]["efficient-fp32"],
                         "math-fp32": HOPPER["attention"]["math-fp32"],
                         "flex": {64: (0.54, 0.425), 128: (0.657, 0.536)},
                         "flex-fp32": HOPPER["attention"]["flex-fp32"]})


def gpu_kernels(name: str, *, table=None) -> GpuKernels | None:
    """The kernel figures of a datasheet spec's GPU (None for a spec that is no GPU known here)."""
    sms = {"a100-40gb": 108, "a100-80gb": 108, "h100-sxm": 132, "h100-nvl": 132, "h100-pcie": 114, "h200": 132}
    if name not in sms:
        return None
    figures = dict(AMPERE if name.startswith("a100") else HOPPER)
    if table is not None:  # what the device's own table measured replaces the rules' figures
        measured = {"launch_s": table.launch_s, "bandwidth_fraction": table.bandwidth_fraction}
        figures.update({k: v for k, v in measured.items() if v})
    return GpuKernels(sms=sms[name], table=table, **figures)
