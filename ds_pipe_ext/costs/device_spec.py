"""A device spec as data, and the roofline that turns an ``OpCost`` into seconds on it (a GPU spec prices each
op as its kernels run: ``costs.gpu_pricing``).  The named specs and their fitted efficiencies are in
``costs.hardware``; the measured ``cpu`` and ``cuda`` specs in ``costs.cpu_spec`` and ``costs.cuda_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .gpu_pricing import GpuKernels
from .network import ClusterNetwork, Placement, system_for
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
    # measure_cpu on a warm 256 MiB buffer: 16-20 GB/s here, about a copy's counted rate
    fill_bandwidth: float = 0.0
    # bytes/s of an in-place add of one buffer into another beyond the caches (autograd's accumulation,
    # ``grad += new_grad``), counted as ``hbm_bandwidth`` counts a copy: two bytes per byte of the destination.
    # Measured by measure_cpu: add_ takes 0.80-0.84 of a copy's time over 64-98 MiB here; 0: a copy's rate
    add_bandwidth: float = 0.0
    # random elements/s a dropout mask draws; 0: free beyond the op's memory traffic (GPUs draw them in
    # the fused kernel).  A CPU draws them one thread at a time, ~7 ns each: more than the op's traffic
    random_rate: float = 0.0
    # seconds per row of a large table touched at random (an embedding's lookup forward, its gradient
    # row backward): a CPU waits on memory for each, ~0.35 us, beyond the bytes' streaming time (bench-cpu
    # at 1,024 tokens: 0.35 ms each way, 5% of the layer); 0: none (a GPU keeps thousands in flight)
    row_op_s: float = 0.0
    # seconds per token of a CPU embedding's backward beyond zeroing its table (embedding_dense_backward_cpu:
    # a TensorIterator add dispatched per token, into a row at random): 0.6-0.8 us here against a lookup's
    # 0.4-0.5; 0: the lookup's ``row_op_s``
    row_add_s: float = 0.0
    # A forward GEMM whose output rows are not 64-byte aligned (a width that is not a multiple of 16 fp32
    # elements: GPT-2's 50,257-token vocabulary) runs at this fraction of an aligned one's speed on a CPU
    # (0.67-0.75 measured here, at any size; its backward, whose outputs are the input and weight widths,
    # does not).  Measured by ``measure_cpu``; 1: not measured (Megatron pads vocabularies to 128 on GPUs).
    misaligned_output_efficiency: float = 1.0
    # exponentials/s of an elementwise exp on a CPU (SLEEF's vector exp: 8-10 times an add's time here); an op's
    # ``fwd_exps`` / ``bwd_exps`` are priced at it beside its FLOPs.  0: in its FLOPs (a GPU's special-function
    # units keep up with its memory).  Measured by ``measure_cpu``.
    exp_rate: float = 0.0
    # seconds the host spends issuing one eager op (forward; a Python-level op in a custom backward too) and one
    # autograd node's op (backward) on a CPU, where it runs on the same core as the work, in series: an op's
    # ``kernels`` times it.  A layer of hundreds of small ops (a router's gating, DeepSpeed's per-expert loop)
    # spends milliseconds on it.  Measured by ``measure_cpu``; 0: none (a GPU spec prices its host with its kernels)
    host_op_s: float = 0.0
    host_op_bwd_s: float = 0.0
    # Measured collectives, {kind: [latency_s, bus bandwidth]} for "all-reduce", "all-gather",
    # "reduce-scatter" and "p2p"; None: the ring formulas on the link bandwidth.  CPU ranks talk
    # through gloo at a tenth of a memory copy's speed (``cpu_comm.measure_cpu_ranks``).
    collectives: dict | None = None
    # How this GPU runs each kernel class (``costs.gpu_pricing``): when set, an op's compute is priced per
    # kernel (GEMM shapes, the attention backend, memory passes, launches) in place of the class roofline
    gpu: GpuKernels | None = None
    # The cluster every collective is priced on (``costs.network``): None, the system the device implies
    # (``system_for``: a DGX for the named GPUs); a plan sets its own, options applied, so TP's and EP's
    # collectives inside the layers see the same network as the data-parallel ones
    network: ClusterNetwork | None = None

    @property
    def cluster(self) -> ClusterNetwork:
        return self.network or system_for(self)

    def group_collective(self, kind: str, payload_bytes: float, placement: Placement):
        """One collective over a group placed so (``costs.nccl.Collective``): where this device has measured
        collectives (CPU ranks over gloo), their latency and bus bandwidth; else NCCL's model on ``cluster``."""
        from .nccl import Collective, collective

        n = placement.size
        if self.collectives and kind in self.collectives and n > 1 and payload_bytes:
            latency, busbw = self.collectives[kind]
            seconds = latency + (payload_bytes / busbw if kind == "p2p" else ring_time(payload_bytes, kind, n, busbw))
            return Collective(kind, "measured", "gloo", latency, busbw, seconds)
        out = collective(kind, payload_bytes, placement, self.cluster)
        if self.comm_efficiency != 1.0 and out.time_s:  # a spec's own factor on the bandwidth term (GPUs: 1)
            moving = out.time_s - out.latency_s
            out = replace(out, bus_bandwidth=out.bus_bandwidth * self.comm_efficiency,
                          time_s=out.latency_s + moving / self.comm_efficiency)
        return out

    def group_time(self, kind: str, payload_bytes: float, placement: Placement) -> float:
        return self.group_collective(kind, payload_bytes, placement).time_s

    def fresh_alloc_time(self, sizes) -> float:
        """Seconds of page faults for buffers of these sizes (bytes)."""
        if not self.fresh_page_bandwidth:
            return 0.0
        return sum(b for b in sizes if b > self.fresh_alloc_min_bytes) / self.fresh_page_bandwidth

    def op_time(self, op: OpCost, *, dtype: str, tp: int, backward: bool = False, ep: int = 1,
                execution: str = "eager", attention_backend: str | None = None) -> dict:
        """Roofline: max(compute, memory) plus the op's collective over the TP group, or an all-to-all over
        the expert-parallel group, each placed on ``cluster`` as the ranks are ordered (``group_collective``).
        A GPU spec (``gpu`` set) prices the op's kernels instead (``costs.gpu_pricing``), as they run under
        ``execution``, a fused attention core on ``attention_backend`` (``arch.attention_backend``)."""
        flops = op.bwd_flops if backward else op.fwd_flops
        moved = op.bwd_bytes if backward else op.fwd_bytes
        peak = (self.vector_flops if op.kind == "vector" else self.matrix_flops).get(dtype)
        if peak is None:
            raise AnalyticError(f"device {self.name} has no {op.kind} peak for dtype {dtype!r}")
        accumulate = 0.0
        if self.gpu is not None:
            compute, memory = self._gpu_kernels_s(op, dtype=dtype, backward=backward, execution=execution,
                                                  attention_backend=attention_backend), 0.0
        else:
            compute = flops / (peak * self.efficiency(op.kind) * self.shape_factor(op, dtype=dtype, backward=backward))
            compute = self.measured_kernels_s(op, compute, backward=backward)
            filled, in_place = (op.bwd_fill_bytes, op.bwd_inplace_bytes) if backward else (0.0, 0.0)
            # an in-place add's three transfers a byte (two reads, one write) are timed as its two counted bytes
            memory = ((moved - filled - in_place) / self.hbm_bandwidth + 2 * in_place / 3 / self.in_place_bandwidth
                      + filled / (self.fill_bandwidth or self.hbm_bandwidth)) / self.memory_efficiency
            accumulate = self.grad_accumulate_s(op, dtype=dtype, execution=execution) if backward else 0.0
        comm_bytes = op.comm_bwd_bytes if backward else op.comm_fwd_bytes
        kinds = op.comm_type
        if "+" in kinds:  # under SP: the forward's collectives, then the backward's
            kinds = kinds.split("+")[1 if backward else 0]
        kinds = kinds.split(",")
        comm = 0.0
        if comm_bytes and kinds != [""]:
            net = self.cluster
            group = net.ep_placement(tp, ep) if kinds == ["all-to-all"] else net.tp_placement(tp)
            comm = sum(self.group_time(kind, comm_bytes / len(kinds), group) for kind in kinds)
        fresh = self.fresh_alloc_time(op.bwd_allocs if backward else op.fwd_allocs)
        random = op.random_elems / self.random_rate if self.random_rate and not backward else 0.0
        random += op.row_ops * (self.row_add_s if backward and self.row_add_s else self.row_op_s)
        host = op.kernels[1 if backward else 0] * (self.host_op_bwd_s if backward else self.host_op_s) \
            if self.gpu is None and execution == "eager" else 0.0
        return {"compute_s": compute, "memory_s": memory, "comm_s": comm, "fresh_s": fresh, "random_s": random,
                "accumulate_s": accumulate, "host_s": host,
                "time_s": max(compute, memory) + accumulate + random + fresh + comm + host,
                "intensity": flops / moved if moved else float("inf")}

    def measured_kernels_s(self, op: OpCost, compute_s, *, backward: bool):
        """An op's compute time (``compute_s``, seconds or an array of them) with what a CPU spec measured
        apart from its FLOP rates: its exponentials."""
        exps = op.bwd_exps if backward else op.fwd_exps
        if exps and self.exp_rate:
            compute_s = compute_s + exps / self.exp_rate
        return compute_s

    def grad_accumulate_s(self, op: OpCost, *, dtype: str, execution: str = "eager") -> float:
        """Autograd adding an op's weight gradients into those the micro-batch before left, on the roofline
        (``AccumulateGrad``: ``variable.grad += new_grad`` after the op's own backward), as m - 1 of a step's m
        micro-batches and the profiler's timing loops run it.  On a CPU it is most of an embedding's backward:
        the lookup's dense gradient (``embedding_dense_backward_cpu``: a zeroed V x h table, each token's row
        added into it) is a second table, added into the first.

        The in-place add reads both and writes a line it has just read: three transfers over the memory bus,
        as many as a copy makes (its source read, its destination read for ownership, then written), so it is
        counted as a copy's bytes, 2 x the gradient's, at the rate a measured spec times add_ itself
        (``in_place_bandwidth``): add_ took 0.80-0.88 of a copy's time over 31-98 MiB on the CI machine, and
        a copy's rate priced every embedding 6-19% over its profile (2026-11-30).  A GPU spec prices the same
        pass among its kernels (``gpu_pricing.grad_accumulate_s``); Megatron's fused accumulation makes none."""
        if not op.weights or execution == "megatron":
            return 0.0
        return 2 * sum(op.weights) * DTYPE_BYTES.get(dtype, 4) / (self.in_place_bandwidth * self.memory_efficiency)

    def with_streaming_memory(self, factor: float) -> "DeviceSpec":
        """This spec with every streaming memory rate (copy, zeroing, in-place add) times ``factor``: the rates a
        slower or shared device scales together."""
        return replace(self, hbm_bandwidth=self.hbm_bandwidth * factor, fill_bandwidth=self.fill_bandwidth * factor,
                       add_bandwidth=self.add_bandwidth * factor)

    @property
    def in_place_bandwidth(self) -> float:
        """The rate of an in-place add beyond the caches, counted as a copy's: measured (``add_bandwidth``), else a
        copy's."""
        return self.add_bandwidth or self.hbm_bandwidth

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


def tp_collectives_note(spec: "DeviceSpec", tp: int) -> str:
    """What prices a TP group's collectives on a GPU without measured ones, for plan to print beside a TP
    layout: NCCL's model on the cluster (a 16 MiB all-reduce's algorithm, bus bandwidth and latency), and how it
    compares with XLA's measured H100 collectives at TP's sizes (``bench/collectives_vs_xla.py``)."""
    if spec.gpu is None or spec.collectives is not None or tp <= 1:
        return ""
    one = spec.group_collective("all-reduce", 16 * 2**20, spec.cluster.tp_placement(tp))
    return (f"  TP {tp}'s collectives are priced by NCCL's model on {spec.cluster.name} (a 16 MiB all-reduce: "
            f"{one.describe()}); XLA's measured 8-H100 collectives take longer at 4-64 MiB "
            f"(bench/collectives_vs_xla.py), so this layout's in-layer communication may read optimistic")


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
