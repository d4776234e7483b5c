"""The vocabulary of the analytic model: one micro-batch's ``Shape`` on one tensor-parallel rank, and the
``OpCost`` of one op on it (FLOPs, bytes moved, saved activations, weights, collectives, allocations).  The ops
themselves are ``costs.analytic``'s; a device prices an ``OpCost`` (``costs.hardware.DeviceSpec.op_time``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple


class AnalyticError(ValueError):
    """Shapes or degrees the analytic model cannot use; the message names the fix."""


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Shape:
    """One micro-batch of a GPT layer on one TP rank."""

    b: int
    s: int
    h: int
    a: int  # attention heads
    f: int  # ffn hidden (4h for GPT)
    V: int
    e: int = 2  # bytes per activation / weight element (16-bit)
    m: int = 1  # bytes per dropout-mask element (1: fused GPU dropout; CPU torch saves a float mask, m = e)
    t: int = 1  # tensor-parallel degree
    sp: bool = False  # sequence parallelism (needs t > 1 to mean anything)
    dropout: bool = True  # dropout layers present (they save masks)
    ep: int = 1  # expert-parallel degree (Mixture-of-Experts blocks: costs/moe_ops.py)
    d: int = 0  # one head's width where it is not h / a (Qwen3, Megatron's kv_channels); 0: h / a
    # bytes per element of the buffer an embedding's backward sums the table's gradient in before casting it
    # to the weight's dtype (4: CUDA's kernel in 16-bit; 0: none, the CPU's and any fp32 backward)
    table_grad_accum: int = 0
    # a biased linear's backward on a GPU sums the bias gradient through a buffer of its output gradient's size
    # (an H200: ``AddmmBackward0 > aten::sum``, 64 MiB live at gpt2-medium's bf16 block peak); a CPU's holds none
    bias_grad_buffer: bool = False
    # a sliding window goes to the attention kernel as a dense s x s mask (a CPU's SDPA), not flex_attention's
    # block mask (a GPU's: a few bytes a block)
    dense_window_mask: bool = True
    # the out projection is torch's own linear, run eagerly on a GPU (TP 1; not DeepSpeed ZeRO-3's linear, not
    # Megatron's, not compiled; the attention kept, not recomputed): handed a view it cannot flatten, it saves a
    # flattened copy (``attn_out_copy``)
    autograd_linear: bool = False
    # this block's out projection saves its own copy of the attention output: torch's memory-efficient SDPA
    # kernel returns it (b, s, heads, d) in memory, whose (s, b, h) view autograd's linear flattens into a copy
    # and keeps beside the kernel's own (H200 fp32 records: +1 b s h e a block; DeepSpeed's ZeRO-3 linear and
    # megatron-core's keep the view they are handed, cuDNN's and flash's outputs follow the query's order)
    attn_out_copy: bool = False

    def __post_init__(self) -> None:
        for name in ("b", "s", "h", "a", "f", "V", "e", "t", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise AnalyticError(f"{name} = {v!r}: sizes must be positive integers")
        if self.m < 0:
            raise AnalyticError(f"m = {self.m}: mask bytes must be >= 0")
        for what, n in (("heads", self.a), ("hidden", self.h), ("ffn hidden", self.f)):
            if n % self.t:
                raise AnalyticError(f"tensor parallel degree {self.t} does not divide {what} ({n}); pick t dividing it")
        if isinstance(self.d, bool) or not isinstance(self.d, int) or self.d < 0:
            raise AnalyticError(f"d = {self.d!r}: a head's width is a positive integer (0: h / a)")
        if not self.d and self.h % self.a:
            raise AnalyticError(f"heads ({self.a}) do not divide hidden ({self.h})")
        if self.sp and self.t == 1:
            raise AnalyticError("sequence parallelism needs tensor parallelism (t > 1)")
        if self.sp and self.s % self.t:
            raise AnalyticError(f"sequence parallelism: t={self.t} must divide the sequence length {self.s}")

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def head_dim(self) -> int:
        return self.d or self.h // self.a

    @property
    def attn_width(self) -> int:
        """The queries' (and the attention output's) width, a x d: h unless the heads are wider."""
        return self.a * self.head_dim if self.d else self.h

    @property
    def sbA(self) -> int:
        """Elements of the queries (or the attention output) of one micro-batch: s b a d."""
        return self.s * self.b * self.attn_width

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def replicated_sbh(self) -> float:
        """Elements of a (s, b, h) tensor outside the TP region: sharded by SP, else replicated."""
        return self.sbh / self.t if self.sp else self.sbh


class AttentionShape(NamedTuple):
    """An attention core as its kernel sees it: what picks the kernel (``arch.attention_backend``) and prices it
    on a GPU (``costs.gpu_pricing``).  Per TP rank."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    keys: int  # the keys each query sees: the window's, or the sequence
    head_dim: int
    masked: int  # 1: a window's mask beside the causal one
    dropout: int  # 1: attention dropout
    sinks: bool = False  # gpt-oss's learned sinks: the kernel's output rescaled after it (``models.sinks``)


@dataclass(frozen=True)
class OpCost:
    name: str
    kind: str  # "matrix" (GEMMs), "attention" (batched per-head matmuls; tensor cores too) or "vector"
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0  # memory traffic: reads + writes
    bwd_bytes: float = 0.0
    activation_bytes: float = 0.0  # saved for backward
    weight_bytes: float = 0.0
    weights: tuple = ()  # element count of each parameter tensor (ZeRO pads and partitions per tensor)
    comm_fwd_bytes: float = 0.0  # per rank, payload of the collective
    comm_bwd_bytes: float = 0.0
    # all-reduce | all-gather | reduce-scatter over the TP group, or FWD+BWD where the two directions differ
    # (SP); a direction may issue several collectives, "a,b", each of an equal share of its bytes;
    # all-to-all runs over the expert-parallel group
    comm_type: str = ""
    recompute: bool = False  # dropped from saved activations under selective recompute
    gemm_dim: float = 0.0  # a GEMM's smallest dimension on this rank (kernels fill the device less when small)
    gemm_out: int = 0  # a GEMM's output width (its rows' length): an unaligned one is slower forward on a CPU
    # sizes of the large buffers the op allocates (outputs forward; input and weight gradients backward):
    # on a CPU each one above the allocator's mmap threshold arrives as fresh pages (see DeviceSpec)
    fwd_allocs: tuple = ()
    bwd_allocs: tuple = ()
    bwd_fill_bytes: float = 0.0  # of bwd_bytes, those a write-only pass moves (zeroing a gradient buffer)
    # of bwd_bytes, those of in-place adds (``add_``: two read, one written where it was just read): a CPU moves
    # them in a copy's time, which its spec's bandwidth counts as two of the three (no read for ownership)
    bwd_inplace_bytes: float = 0.0
    random_elems: float = 0.0  # random numbers drawn forward (a dropout mask)
    row_ops: float = 0.0  # rows of a large table touched at random, each way (an embedding's lookups)
    # exponentials computed forward and backward (SiLU's sigmoid, softplus, a written-out softmax, the scan's
    # decays): a CPU prices them at its measured exp rate, beside the op's other FLOPs
    fwd_exps: float = 0.0
    bwd_exps: float = 0.0
    # what outlives the op's own moment in the backward: bytes its backward makes (or keeps) that stay alive
    # until an op with ``bwd_release`` has run back (the written-out attention's dV, and V's storage, which
    # q and k share, until Q K^T's backward)
    bwd_hold: float = 0.0
    bwd_release: bool = False
    # a residual add: the gradient it hands its skip connection is held while its branch runs back
    residual: bool = False
    # What a GPU runs for the op (``costs.gpu_pricing``): a GEMM's forward product (M, K, N) = (rows, inner,
    # output width); an attention core's ``AttentionShape``; the kernels an eager
    # forward and backward launch; and the bytes those kernels move where they differ from the op's
    # modelled traffic (the fp32 loss's passes over the logits), as (forward, backward).  A CPU spec charges each
    # kernel one op's host dispatch (``DeviceSpec.host_op_s``): an aten op is one kernel, near enough (CUDA's
    # embedding backward's dozen kernels are three ops on a CPU: 0.07 ms at the measured rate)
    gemm: tuple = ()
    attn_shape: AttentionShape | tuple = ()  # () for an op that is no attention core
    kernels: tuple = (1, 1)
    gpu_bytes: tuple = ()
    # the backward waits on the GPU from the host (CUDA's embedding backward reads its segment count back):
    # the host's dispatch and the GPU's kernels then run one after the other, not overlapped
    bwd_sync: bool = False

    def __add__(self, other: "OpCost") -> "OpCost":
        # numbers add; allocation and tensor lists concatenate
        num = {f.name: getattr(self, f.name) + getattr(other, f.name)
               for f in fields(self)
               if f.name not in ("name", "kind", "comm_type", "recompute", "gemm_dim", "gemm_out", "bwd_release",
                                 "residual", "gemm", "attn_shape", "kernels", "gpu_bytes", "bwd_sync")}
        return OpCost(name=self.name, kind=self.kind, comm_type=self.comm_type, bwd_release=self.bwd_release,
                      residual=self.residual, **num)
