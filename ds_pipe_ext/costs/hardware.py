"""Device specs as data, and the roofline that turns an ``OpCost`` into seconds.

Peak numbers are the vendors' dense (no sparsity) datasheet figures; link
bandwidths are per direction.  The efficiency factors are what a real kernel
reaches of the peak; ``--calibrate`` (profiling on the device) is meant to
replace them with measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .gpu_pricing import GpuKernels, gpu_kernels
from .kernel_table import load_kernel_table
from .op_cost import DTYPE_BYTES, AnalyticError, OpCost


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    matrix_flops: dict  # dtype -> peak FLOP/s on matrix units
    vector_flops: dict  # dtype -> peak FLOP/s elementwise
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per direction (NVLink)
    inter_node_bandwidth: float  # bytes/s per direction (one NIC)
    memory_bytes: float
    gpus_per_node: int = 8
    matrix_efficiency: float = 0.7
    attention_efficiency: float = 0.5  # per-head matmuls are small (head dim 64-128): a lower share of peak
    vector_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    comm_efficiency: float = 0.8
    # GEMMs with a small dimension d (the tokens, or h/t under TP) fill the device less: matrix
    # efficiency x d / (d + matrix_half_dim); 0 leaves it flat.  Fitted on published runs on GPUs
    # (bench/calibrate_at_scale.py), on profiled layers on a CPU (``calibrate.fit_device``).
    matrix_half_dim: float = 0.0
    # A CPU's allocator (glibc) maps every block above its mmap threshold afresh and returns it on
    # free, so each such buffer pays a page fault per page, every step; GPUs' caching allocators
    # reuse memory (0: no such cost).  Measured by ``measure_cpu``.
    fresh_page_bandwidth: float = 0.0  # bytes/s of first touches
    fresh_alloc_min_bytes: float = 32 * 2**20  # glibc's largest dynamic mmap threshold (64-bit)
    # bytes/s of zeroing a fresh buffer (a dense gradient table); 0: the memory bandwidth.  Measured by
    # measure_cpu: on a CPU it runs at half to two thirds of what a copy moves
    fill_bandwidth: float = 0.0
    # random elements/s a dropout mask draws; 0: free beyond the op's memory traffic (GPUs draw them in
    # the fused kernel).  A CPU draws them one thread at a time, ~7 ns each: more than the op's traffic
    random_rate: float = 0.0
    # seconds per row of a large table touched at random (an embedding's lookup forward, its gradient
    # row backward): a CPU waits on memory for each, ~0.35 us, beyond the bytes' streaming time (bench-cpu
    # at 1,024 tokens: 0.35 ms each way, 5% of the layer); 0: none (a GPU keeps thousands in flight)
    row_op_s: float = 0.0
    # A forward GEMM whose output rows are not 64-byte aligned (a width that is not a multiple of 16 fp32
    # elements: GPT-2's 50,257-token vocabulary) runs at this fraction of an aligned one's speed on a CPU
    # (0.67-0.75 measured here, at any size; its backward, whose outputs are the input and weight widths,
    # does not).  Measured by ``measure_cpu``; 1: not measured (Megatron pads vocabularies to 128 on GPUs).
    misaligned_output_efficiency: float = 1.0
    # Measured collectives, {kind: [latency_s, bus bandwidth]} for "all-reduce", "all-gather",
    # "reduce-scatter" and "p2p"; None: the ring formulas on the link bandwidth.  CPU ranks talk
    # through gloo at a tenth of a memory copy's speed (``cpu_comm.measure_cpu_ranks``).
    collectives: dict | None = None
    # How this GPU runs each kernel class (``costs.gpu_pricing``): when set, an op's compute is priced per
    # kernel (GEMM shapes, the attention backend, memory passes, launches) in place of the class roofline
    gpu: GpuKernels | None = None

    def fresh_alloc_time(self, sizes) -> float:
        """Seconds of page faults for buffers of these sizes (bytes)."""
        if not self.fresh_page_bandwidth:
            return 0.0
        return sum(b for b in sizes if b > self.fresh_alloc_min_bytes) / self.fresh_page_bandwidth

    def op_time(self, op: OpCost, *, dtype: str, tp: int, backward: bool = False, ep: int = 1,
                execution: str = "eager", attention_backend: str | None = None) -> dict:
        """Roofline: max(compute, memory) plus the op's collective (ring formulas): over the TP group, or
        an all-to-all over the expert-parallel group, whose tp x ep GPUs share a node while they fit one.
        A GPU spec (``gpu`` set) prices the op's kernels instead (``costs.gpu_pricing``), as they run under
        ``execution``, a fused attention core on ``attention_backend`` (``arch.attention_backend``)."""
        flops = op.bwd_flops if backward else op.fwd_flops
        moved = op.bwd_bytes if backward else op.fwd_bytes
        peak = (self.vector_flops if op.kind == "vector" else self.matrix_flops).get(dtype)
        if peak is None:
            raise AnalyticError(f"device {self.name} has no {op.kind} peak for dtype {dtype!r}")
        if self.gpu is not None:
            compute, memory = self._gpu_kernels_s(op, dtype=dtype, backward=backward, execution=execution,
                                                  attention_backend=attention_backend), 0.0
        else:
            compute = flops / (peak * self.efficiency(op.kind) * self.shape_factor(op, dtype=dtype, backward=backward))
            filled = op.bwd_fill_bytes if backward else 0.0
            memory = ((moved - filled) / self.hbm_bandwidth
                      + filled / (self.fill_bandwidth or self.hbm_bandwidth)) / self.memory_efficiency
        comm_bytes = op.comm_bwd_bytes if backward else op.comm_fwd_bytes
        kinds = op.comm_type
        if "+" in kinds:  # under SP: the forward's collectives, then the backward's
            kinds = kinds.split("+")[1 if backward else 0]
        kinds = kinds.split(",")
        group, span = (ep, tp * ep) if kinds == ["all-to-all"] else (tp, tp)
        bandwidth = self.link_bandwidth(span) * self.comm_efficiency
        comm = sum(self.collective_time(comm_bytes / len(kinds), kind, group, bandwidth) for kind in kinds)
        fresh = self.fresh_alloc_time(op.bwd_allocs if backward else op.fwd_allocs)
        random = op.random_elems / self.random_rate if self.random_rate and not backward else 0.0
        random += op.row_ops * self.row_op_s
        return {"compute_s": compute, "memory_s": memory, "comm_s": comm, "fresh_s": fresh, "random_s": random,
                "time_s": max(compute, memory) + random + fresh + comm,
                "intensity": flops / moved if moved else float("inf")}

    def _gpu_kernels_s(self, op: OpCost, *, dtype: str, backward: bool, execution: str,
                       attention_backend: str | None) -> float:
        from . import gpu_pricing as G

        if execution not in G.EXECUTIONS:
            raise AnalyticError(f"execution {execution!r}: use one of {', '.join(G.EXECUTIONS)}")
        accumulate = G.grad_accumulate_s(op, dtype=dtype, spec=self, execution=execution) if backward else 0.0
        if op.kind == "matrix" and op.gemm:
            return G.gemm_s(op, dtype=dtype, backward=backward, spec=self, execution=execution) + accumulate
        if op.kind == "attention" and op.attn_shape:
            return G.attention_s(op, dtype=dtype, backward=backward, spec=self, backend=attention_backend or "flash")
        if op.gemm:  # a written-out attention's batched products
            return G.gemm_s(op, dtype=dtype, backward=backward, spec=self)
        if not (op.fwd_flops or op.bwd_flops or op.fwd_bytes or op.bwd_bytes):
            return 0.0  # a record of saved bytes only
        return G.streaming_s(op, dtype=dtype, backward=backward, spec=self, execution=execution) + accumulate

    def collective_time(self, payload_bytes: float, kind: str, n: int, bandwidth: float) -> float:
        """One collective over ``n`` ranks: the measured latency and bus bandwidth where this device
        has them, else the ring formula on ``bandwidth``.  "p2p" is one send of the payload."""
        if n <= 1 or payload_bytes == 0:
            return 0.0
        if self.collectives and kind in self.collectives:
            latency, busbw = self.collectives[kind]
            return latency + (payload_bytes / busbw if kind == "p2p" else ring_time(payload_bytes, kind, n, busbw))
        return payload_bytes / bandwidth if kind == "p2p" else ring_time(payload_bytes, kind, n, bandwidth)

    def shape_factor(self, op: OpCost, *, dtype: str, backward: bool = False) -> float:
        """The share of its class's efficiency an op's shape lets it reach: a GEMM with a small dimension
        fills the device less (``matrix_half_dim``); a forward GEMM whose output rows are not 64-byte
        aligned is slower on a CPU (``misaligned_output_efficiency``)."""
        factor = 1.0
        if op.kind == "matrix" and self.matrix_half_dim > 0 and op.gemm_dim > 0:
            factor = op.gemm_dim / (op.gemm_dim + self.matrix_half_dim)
        if not backward and op.gemm_out and op.gemm_out * DTYPE_BYTES.get(dtype, 4) % 64:
            factor *= self.misaligned_output_efficiency
        return factor

    def efficiency(self, kind: str) -> float:
        """The class's share of its peak (what an op's shape allows beside it: ``shape_factor``)."""
        return {"matrix": self.matrix_efficiency, "attention": self.attention_efficiency,
                "vector": self.vector_efficiency}[kind]

    def link_bandwidth(self, group_size: int) -> float:
        """TP groups inside a node use NVLink; larger ones cross the network."""
        return self.intra_node_bandwidth if group_size <= self.gpus_per_node else self.inter_node_bandwidth


def adam_step_s(params: float, device: DeviceSpec, *, bytes_per_param: float = 30.0, fresh_sizes=()) -> float:
    """A memory-bound Adam step over ``params`` parameters: in mixed precision a fused one reads param,
    grad, m, v and writes param, m, v and the 16-bit copy (~30 bytes a parameter; 28 in fp32).
    ``fresh_sizes``: bytes of temporaries mapped afresh (a CPU's page faults, ``fresh_alloc_time``)."""
    return bytes_per_param * params / (device.hbm_bandwidth * device.memory_efficiency) + device.fresh_alloc_time(fresh_sizes)


def ring_time(payload_bytes: float, comm_type: str, n: int, bandwidth: float) -> float:
    """Bandwidth term of ring collectives over n ranks (Thakur et al. 2005; NCCL's bus-bandwidth model):
    all-reduce 2(n-1)/n * bytes, all-gather and reduce-scatter (n-1)/n * bytes each; an all-to-all sends
    (n-1)/n of a rank's bytes to the others (each link busy once: NCCL's all-to-all bus bandwidth)."""
    if n <= 1 or payload_bytes == 0:
        return 0.0
    steps = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0}
    if comm_type not in steps:
        raise AnalyticError(f"unknown collective {comm_type!r}")
    return steps[comm_type] * (n - 1) / n * payload_bytes / bandwidth


_T = 1e12
_GB = 1e9
DEVICES: dict[str, DeviceSpec] = {
    "a100-40gb": DeviceSpec("a100-40gb", {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 156 * _T},  # fp32 via TF32
                            {"bf16": 78 * _T, "fp16": 78 * _T, "fp32": 19.5 * _T}, 1555 * _GB, 300 * _GB, 25 * _GB, 40 * 2**30),
    "a100-80gb": DeviceSpec("a100-80gb", {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 156 * _T},
                            {"bf16": 78 * _T, "fp16": 78 * _T, "fp32": 19.5 * _T}, 2039 * _GB, 300 * _GB, 25 * _GB, 80 * 2**30),
    "h100-sxm": DeviceSpec("h100-sxm", {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 494 * _T},
                           {"bf16": 134 * _T, "fp16": 134 * _T, "fp32": 67 * _T}, 3350 * _GB, 450 * _GB, 50 * _GB, 80 * 2**30),
    "h200": DeviceSpec("h200", {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 494 * _T},
                       {"bf16": 134 * _T, "fp16": 134 * _T, "fp32": 67 * _T}, 4800 * _GB, 450 * _GB, 50 * _GB, 141 * 2**30),
    # the other H100s: PCIe (114 SMs at lower clocks, HBM2e, PCIe Gen5 between GPUs) and NVL (94 GB, NVLink
    # bridges between pairs), NVIDIA's H100 datasheet
    "h100-pcie": DeviceSpec("h100-pcie", {"bf16": 756 * _T, "fp16": 756 * _T, "fp32": 378 * _T},
                            {"bf16": 102 * _T, "fp16": 102 * _T, "fp32": 51 * _T}, 2000 * _GB, 64 * _GB, 50 * _GB,
                            80 * 2**30),
    "h100-nvl": DeviceSpec("h100-nvl", {"bf16": 835 * _T, "fp16": 835 * _T, "fp32": 418 * _T},
                           {"bf16": 120 * _T, "fp16": 120 * _T, "fp32": 60 * _T}, 3900 * _GB, 300 * _GB, 50 * _GB,
                           94 * 2**30),
}
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm"}

# The most each efficiency measurably reaches of a datasheet peak: no fit goes above it (a factor above would
# absorb a term the model lacks).  GEMMs: the best bf16 matmul cuBLAS reaches, stas00/ml-engineering's maximum
# achievable matmul FLOPS table (A100 SXM 271.2 of 312 TFLOP/s; H100 SXM 794.5 of 989, "H200 is the same").
# Attention: FlashAttention-2 reaches up to 73% of an A100's peak (Dao 2023), FlashAttention-3 740 TFLOP/s
# in bf16 on an H100 SXM (0.75; Shah et al. 2024).  The rest: the datasheet itself.
CEILINGS = {
    "a100-80gb": {"matrix_efficiency": 0.87, "attention_efficiency": 0.73},
    "a100-40gb": {"matrix_efficiency": 0.87, "attention_efficiency": 0.73},
    "h100-sxm": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h200": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h100-pcie": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
    "h100-nvl": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75},
}

# Efficiency factors fitted on published Megatron-LM runs under the megatron runtime, each at most its
# ceiling (bench/calibrate_at_scale.py; docs/CALIBRATION.md lists the rows); every other number above is
# the datasheet's.  H100's sit at their ceilings: the published rows ask for more.  H200 has no published
# rows: it takes H100's fit.  ``get_device`` applies them, so every command and the analytic partition
# method cost a layout on the same spec.
# ``gemm_efficiency``: the GPU kernels' GEMM ceiling (``costs.gpu_pricing``), fitted the same way on the same rows
# with every op priced as its kernels run (Megatron's fused kernels of each row's era), at most cuBLAS's measured
# best; the class efficiencies beside it price a GPU spec only where its kernel figures are switched off.
CALIBRATED = {
    "a100-80gb": {"matrix_efficiency": 0.671, "comm_efficiency": 1.0, "gemm_efficiency": 0.829},
    "a100-40gb": {"matrix_efficiency": 0.671, "comm_efficiency": 1.0, "gemm_efficiency": 0.829},
    "h100-sxm": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                 "gemm_efficiency": 0.791},
    "h200": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0, "gemm_efficiency": 0.791},
    "h100-pcie": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                  "gemm_efficiency": 0.791},
    "h100-nvl": {"matrix_efficiency": 0.80, "attention_efficiency": 0.75, "comm_efficiency": 1.0,
                 "gemm_efficiency": 0.791},
}


def get_device(name: str, *, cache_dir: str | None = ".ds_pipe_ext_cache", calibrated: bool = True) -> DeviceSpec:
    """A named spec with its calibrated efficiencies (``calibrated=False``: the datasheet's defaults);
    "cpu" and "cuda" are measured on the spot, on this machine's CPU or current GPU (and cached in ``cache_dir``)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        from .cpu_spec import measure_cpu

        return measure_cpu(cache_dir)
    if key == "cuda":
        from .cuda_spec import measure_cuda

        return cuda_device(*measure_cuda(cache_dir))
    if key not in DEVICES:
        raise AnalyticError(f"unknown device {name!r}; use one of {sorted([*DEVICES, *ALIASES, 'cpu', 'cuda'])}")
    fitted = CALIBRATED.get(key, {}) if calibrated else {}
    spec = replace(DEVICES[key], **{k: v for k, v in fitted.items() if k != "gemm_efficiency"})
    kern = gpu_kernels(key, table=load_kernel_table(key))
    if "gemm_efficiency" in fitted:
        kern = replace(kern, gemm_efficiency=fitted["gemm_efficiency"])
    return replace(spec, gpu=kern)


def datasheet_name(device_name: str, memory_bytes: float | None = None) -> str | None:
    """The datasheet spec of a GPU by the name CUDA gives it ("NVIDIA H100 80GB HBM3" -> "h100-sxm"; an A100 by
    its memory, 40 or 80 GB), None for one without a spec here."""
    name = device_name.upper()
    if "H200" in name:
        return "h200"
    if "H100" in name:  # "NVIDIA H100 80GB HBM3" is the SXM part; the PCIe and NVL cards say so
        return "h100-pcie" if "PCIE" in name else "h100-nvl" if "NVL" in name else "h100-sxm"
    if "A100" in name:
        return "a100-40gb" if memory_bytes is not None and memory_bytes < 50e9 else "a100-80gb"
    return None


def cuda_device(device_name: str, measured: dict) -> DeviceSpec:
    """The ``cuda`` spec from its measured fields (``costs.cuda_spec``), with the datasheet's links and
    vector rate where the device is one known by name (NCCL is not measured there, and no torch op measures
    an elementwise op's arithmetic rate), else its own copy bandwidth and measured lower bound."""
    key = datasheet_name(device_name, measured["memory_bytes"])
    known = DEVICES[key] if key else None
    bandwidth = measured["hbm_bandwidth"]
    if known:
        measured = {**measured, "vector_flops": dict(known.vector_flops)}
    spec = DeviceSpec("cuda", intra_node_bandwidth=known.intra_node_bandwidth if known else bandwidth,
                      inter_node_bandwidth=known.inter_node_bandwidth if known else bandwidth,
                      gpus_per_node=known.gpus_per_node if known else 1, **measured)
    return replace(spec, gpu=measured_gpu_kernels(key, spec))


def measured_gpu_kernels(key: str | None, spec: DeviceSpec) -> GpuKernels | None:
    """The kernel figures of a GPU whose GEMM peak and bandwidth were measured (the ``cuda`` spec): its
    datasheet GPU's, with the GEMM ceiling and the streaming share at 1 (they are the measured figures
    themselves) and the attention shares rescaled from the datasheet's peak to the measured one."""
    if key is None:
        return None
    datasheet, kern = DEVICES[key], gpu_kernels(key, table=load_kernel_table(key))
    scale = datasheet.matrix_flops["bf16"] / spec.matrix_flops["bf16"]
    attention = {b: {d: (f * scale, w * scale) for d, (f, w) in effs.items()} for b, effs in kern.attention.items()}
    return replace(kern, gemm_efficiency=1.0, bandwidth_fraction=1.0, attention=attention)
