"""The peak of a rank's memory over a training step, by kind and moment: what runs out of memory.

``costs.zero`` says what a rank holds at the optimizer step.  The allocator's peak comes earlier,
inside a backward pass, and holds things the step does not.  ``step_peak`` walks one rank's step op
by op, in its schedule's order (``Work`` items: the forward and backward of each micro-batch), and
keeps, at every moment, the bytes alive by kind as DeepSpeed 0.19 allocates them (read from
``runtime/zero/stage_1_and_2.py``, ``stage3.py``, ``pipe/engine.py``; measured on CPU ranks by
``bench/peak_memory.py``):

- **parameters, optimizer states**: as at the step (``zero_model_states``), held throughout.
- **gradients**: ZeRO-0 and -1 keep every parameter's gradient from the moment its first backward
  makes it until the step (ZeRO-1 reduces only at the boundary); ZeRO-2 copies each gradient into
  its reduction bucket and, after a micro-batch's reduction, keeps one buffer of the parameters that
  overlap its partition (``grads_in_partition``, in the gradients' dtype); ZeRO-3 keeps its flat
  buffer of gradient partitions from the start.
- **buffers**: the reduction bucket of ``reduce_bucket_size`` elements in the gradients' dtype.
  ZeRO-1 makes it at a step's first gradient and frees it at the step, ZeRO-2 at each micro-batch's
  first gradient and frees it after that micro-batch's reduction, ZeRO-3 holds it always.
- **gathered** (ZeRO-3): a module's parameters whole for its forward and its backward, and in between
  too when the parameters fetched between the two uses (every later module's, forward and back) stay
  within ``stage3_max_reuse_distance`` elements (DeepSpeed's default 1e9: a small model stays gathered
  from its forward to its backward); parameters at or below the persistence threshold are whole always,
  and a group of one rank gathers nothing (its partition is the parameter: the gather is a view of it).
  Prefetching and ``stage3_max_live_parameters`` are not modelled.
- **activations**: what each op saves for its backward (the analytic ``OpCost.activation_bytes``),
  from its forward until its own backward, for every micro-batch the schedule holds.
- **temporaries**: an op's outputs forward, its input and weight gradients backward
  (``fwd_allocs`` / ``bwd_allocs``) and the gradient arriving from the op after it; a pipeline
  stage's buffers of sent outputs and received inputs (``max(2, min(stages - stage, micro_batches))``
  of each, DeepSpeed's ``num_pipe_buffers``, kept through the optimizer step until the next step reuses
  them); the loss's vocabulary-wide gradients on the last layer.
- **the optimizer step**: gradients as at the step, plus Adam's temporaries: two fp32 tensors the size
  of the largest tensor the inner optimizer steps (torch's single-tensor AdamW, train.py's on CPU,
  computes the square root of the second moment, then its quotient), which under ZeRO-1/2/3 and 16-bit
  ZeRO-0 is the flat partition; none for a fused Adam (DeepSpeed's FusedAdam on GPUs).
- **BF16_Optimizer** (bf16 ZeRO-0 under DeepSpeed's pipeline): bf16 weights and gradients whole, a flat
  accumulation buffer in ``grad_accum_dtype`` held from the start, fp32 master weights and moments on
  the rank's 1/dp partition (``costs.zero.bf16_optimizer_states``; measured on CPU ranks by
  ``bench/zero_rules_16bit.py``).

The partitioner's form of the same rules, for any split, is ``costs.peak_rule.PipelinePeakRule``.
Pure arithmetic on ``OpCost`` lists: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .moe_ops import is_expert_op
from .zero import bf16_accumulation_bytes, bf16_optimizer_states, expert_parallel_states, zero_model_states
from .zero import overlapping_partition as _overlapping_partition

PEAK_KINDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "gathered_bytes",
              "activation_bytes", "temporary_bytes")

# DeepSpeed 0.19's defaults for the settings the peak depends on (``runtime/zero/config.py``)
DEEPSPEED_ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e5,
                           "stage3_max_reuse_distance": 1e9, "stage3_max_live_parameters": 1e9,
                           "contiguous_gradients": True}


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings the peak depends on, as a ds.json's ``zero_optimization`` section sets them."""

    stage: int = 0
    reduce_bucket_size: int = int(DEEPSPEED_ZERO_DEFAULTS["reduce_bucket_size"])
    persistence_threshold: int = int(DEEPSPEED_ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    max_reuse_distance: int = int(DEEPSPEED_ZERO_DEFAULTS["stage3_max_reuse_distance"])
    # ZeRO-3 prefetches nothing while the parameters gathered reach this many elements (``plan.zero3``)
    max_live_parameters: int = int(DEEPSPEED_ZERO_DEFAULTS["stage3_max_live_parameters"])
    contiguous_gradients: bool = True
    # DeepSpeed runs its BF16_Optimizer in place of ZeRO's (bf16 ZeRO-0 under its pipeline): the element bytes
    # of its gradient-accumulation buffer (``data_types.grad_accum_dtype``); 0: another optimizer
    bf16_accum_bytes: int = 0

    @property
    def bf16_optimizer(self) -> bool:
        return self.bf16_accum_bytes > 0

    @classmethod
    def from_ds_config(cls, ds: dict) -> "ZeroSettings":
        z = ds.get("zero_optimization") or {}
        stage = int(z.get("stage", 0))
        get = lambda key: z.get(key, DEEPSPEED_ZERO_DEFAULTS[key])  # noqa: E731
        return cls(stage=stage, reduce_bucket_size=int(get("reduce_bucket_size")),
                   persistence_threshold=int(get("stage3_param_persistence_threshold")),
                   max_reuse_distance=int(get("stage3_max_reuse_distance")),
                   max_live_parameters=int(get("stage3_max_live_parameters")),
                   contiguous_gradients=bool(get("contiguous_gradients")))

    @classmethod
    def of_layout(cls, lay, settings: dict | None = None, *, bf16_accum_bytes: int = 0) -> "ZeroSettings":
        """The settings a ``Layout`` writes into its ds.json (``Layout.zero_section``, with ``settings``);
        ``bf16_accum_bytes``: where DeepSpeed runs the layout with its BF16_Optimizer (see the field)."""
        zero = cls.from_ds_config({"zero_optimization": lay.zero_section(settings)} if lay.zero else {})
        return replace(zero, bf16_accum_bytes=bf16_accum_bytes) if bf16_accum_bytes else zero


def walks_schedule(spec) -> bool:
    """Whether ``step_peak`` walks this schedule (a ``ScheduleSpec``): one model chunk a rank, whole
    backwards (not interleaved, DualPipeV or ZB-H1)."""
    return spec.chunks_per_rank == 1 and spec.kind != "zb-h1"


@dataclass(frozen=True)
class RankStep:
    """One rank's step: its layers (each a list of ``OpCost`` in forward order), its schedule order
    (``(kind, micro_batch)``: "F" or "B"), and what surrounds them."""

    layers: list
    order: tuple
    element_bytes: int
    zero: ZeroSettings
    dp: int = 1
    dp_rank: int | None = None  # None: the heaviest data-parallel rank
    pipe_buffers: int = 0  # a pipeline stage's buffers of sent outputs and received inputs (0: no pipeline)
    output_bytes: float = 0.0  # what the rank's last layer outputs per micro-batch (kept in a pipe buffer)
    input_bytes: float = 0.0  # what it receives per micro-batch (0 on the first stage)
    # 16-bit ZeRO-0 under a pipeline accumulates gradients into a flat buffer of every parameter, held from
    # the start beside the 16-bit ones autograd makes: an element's bytes (0: no such buffer; under
    # BF16_Optimizer, ``zero.bf16_accum_bytes`` sizes it)
    flat_grad_bytes: int = 0
    # full recompute: each layer keeps only its input (these bytes, per layer) and replays its forward,
    # saving its activations again, at the start of its backward (None: no recompute; a None entry: that
    # layer recomputes nothing, a mode per layer)
    checkpoint_bytes: tuple | None = None
    offload: bool = False  # ZeRO-Offload: optimizer states (and ZeRO-3's partitions) and Adam in host memory
    fused_adam: bool = False  # a fused Adam (DeepSpeed's FusedAdam, apex) makes no temporaries; torch's unfused does
    ep: int = 1  # expert parallelism: the experts' states partition over tp x dp / ep ranks (``expert_parallel_states``)
    tp: int = 1


@dataclass
class PeakMemory:
    """The most bytes a rank holds at once over a step, when, and what they are."""

    phase: str  # "forward 1", "backward 0", "optimizer_step 0" (numbered as the measured trace numbers them)
    by_kind: dict = field(default_factory=dict)  # PEAK_KINDS
    at_step_bytes: float = 0.0  # the model states at the optimizer step (ZeRO's rule), for comparison

    @property
    def total_bytes(self) -> float:
        return sum(self.by_kind.values())

    def to_dict(self) -> dict:
        return {"phase": self.phase, **self.by_kind, "total_bytes": self.total_bytes}


def _most(a: dict, b: dict) -> dict:
    """Of two moments (bytes by kind), the one with more in all (the later on a tie)."""
    return b if sum(b.values()) >= sum(a.values()) else a


@dataclass(frozen=True)
class _Profile:
    """One micro-batch's pass over a rank's ops: at the worst moment of its forward, of the step's first
    backward (gradients being made) and of a later backward, the bytes it adds by kind; and what its
    forward leaves saved and gathered."""

    forward: dict
    first_backward: dict
    backward: dict
    saved: float
    gathered: float
    weights: bool  # whether any op makes a gradient


def _profile(layers: list, numels: list[int], e: int, z: ZeroSettings, persistent: set[int],
             bucket: float, checkpoint: tuple | None) -> _Profile:
    ops, gather, layer_of = [], [], []  # the rank's ops in forward order; what each gathers under ZeRO-3
    k = 0
    for li, layer in enumerate(layers):
        for op in layer:
            ops.append(op)
            layer_of.append(li)
            tensors = range(k, k + len(op.weights))
            gather.append(e * sum(numels[i] for i in tensors if i not in persistent) if z.stage == 3 else 0.0)
            k += len(op.weights)
    # a layer with a checkpoint entry keeps only that (its input) and replays the rest; None: none
    ckpt = [None] * len(layers) if checkpoint is None else list(checkpoint)
    kept = [0.0 if ckpt[layer_of[i]] is not None else op.activation_bytes for i, op in enumerate(ops)]
    replay = [sum(op.activation_bytes for op in layer) for layer in layers]
    # ZeRO-3 keeps a module gathered from its forward to its backward when the parameters fetched in
    # between (every later module's, forward and back) stay within stage3_max_reuse_distance elements
    after, stays = 0.0, [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        stays[i] = 2 * after <= z.max_reuse_distance
        after += gather[i] / e

    forward: dict = {}
    saved = gathered = 0.0
    for i, (op, g) in enumerate(zip(ops, gather)):
        if ckpt[layer_of[i]] is not None and (i == 0 or layer_of[i] != layer_of[i - 1]):
            saved += ckpt[layer_of[i]]  # the layer's input, kept for its replay
        gathered += g  # gathered for its forward
        forward = _most(forward, {"activation_bytes": saved, "gathered_bytes": gathered,
                                  "temporary_bytes": float(sum(op.fwd_allocs))})
        saved += kept[i]
        if not stays[i]:
            gathered -= g

    # backward, ops in reverse: what stays saved and gathered (ops not yet run back), the gradients made so
    # far (the first backward under ZeRO-0/1), the bucket once a gradient exists
    first: dict = {}
    later: dict = {}
    remaining, held, made, upstream, bucket_on = saved, gathered, 0.0, 0.0, False
    # what outlives an op's moment: ops' held backward outputs (``OpCost.bwd_hold``) and the gradient a
    # residual hands its skip connection, held while its branch runs back (the layer's input gradient merges it)
    hold, skip, layer = 0.0, 0.0, None

    def moment(temporary: float) -> None:
        nonlocal first, later
        now = {"activation_bytes": remaining, "gathered_bytes": held, "temporary_bytes": temporary}
        made_bucket = bucket if bucket_on else 0.0
        first = _most(first, {**now, "grad_bytes": made, "buffer_bytes": made_bucket})
        # ZeRO-1's bucket, once made, is held to the step (counted there); ZeRO-2 makes one each micro-batch
        later = _most(later, {**now, "grad_bytes": 0.0, "buffer_bytes": made_bucket if z.stage == 2 else 0.0})

    for i in range(len(ops) - 1, -1, -1):
        op, g = ops[i], gather[i]
        if layer_of[i] != layer:  # a new layer runs back: the last one's skip merged into its input gradient
            layer, skip = layer_of[i], 0.0
        if ckpt[layer_of[i]] is not None and (i == len(ops) - 1 or layer_of[i] != layer_of[i + 1]):
            remaining += replay[layer_of[i]]  # the layer's forward replayed: its activations saved again
        if not stays[i]:
            held += g  # gathered again for its backward
        allocs = list(op.bwd_allocs) or [upstream]  # an elementwise op writes its input's gradient
        weight_grad = float(e * sum(op.weights))
        if op.weights and not op.bwd_allocs:  # a norm's weight gradients, beside its input's
            allocs.append(weight_grad)
        moment(upstream + sum(allocs) + hold + skip)
        if op.weights:
            if z.stage <= 1:
                made += weight_grad
            if not bucket_on and z.stage in (1, 2) and bucket:
                bucket_on = True  # made at the op's first gradient, while its input's gradient is alive
                moment(upstream + allocs[0] + hold + skip)
        if op.residual:
            skip = upstream
        hold = 0.0 if op.bwd_release else hold + op.bwd_hold
        remaining -= op.activation_bytes
        if ckpt[layer_of[i]] is not None and (i == 0 or layer_of[i] != layer_of[i - 1]):
            remaining -= ckpt[layer_of[i]]  # its input, once the layer's backward is done
        held -= g  # released after its backward: its next use is the next step's forward
        upstream = op.bwd_allocs[0] if op.bwd_allocs else upstream
    return _Profile(forward, first, later, saved, gathered, any(op.weights for op in ops))


def layer_peak_bytes(ops: list, element_bytes: int, *, selective: bool = False, output_bytes: float = 0.0) -> float:
    """The most one layer alone holds above its resting memory over its forward and backward (what a profile
    of the layer measures as its allocator peak: its input was there before, its output is made and held):
    its saved activations, the gradients its backward has made and the moment's temporaries (``_profile``'s
    first backward, without ZeRO), with its ``output_bytes`` and without its input, which its first op saves.
    ``selective``: the ops marked ``recompute`` keep nothing."""
    ops = [replace(op, activation_bytes=0.0) if selective and op.recompute else op for op in ops]
    numels = [n for op in ops for n in op.weights]
    prof = _profile([ops], numels, element_bytes, ZeroSettings(), set(), 0.0, None)
    return (max(sum(prof.forward.values()), sum(prof.first_backward.values())) + output_bytes
            - (ops[0].activation_bytes if ops else 0.0))


def step_peak(rank: RankStep) -> PeakMemory:
    """The peak of ``rank``'s step (see the module's docstring for each kind's rule).  One micro-batch's
    pass is profiled once (``_Profile``); the schedule's order then says, at each forward and backward,
    what else is alive: the other micro-batches' activations, the gradients, the buckets, the pipe
    buffers.  Linear in the rank's ops plus its schedule's length."""
    e, z, dp = rank.element_bytes, rank.zero, rank.dp
    numels = [n for layer in rank.layers for op in layer for n in op.weights]
    expert = [n for layer in rank.layers for op in layer if is_expert_op(op) for n in op.weights]
    if expert and z.stage:
        dense = [n for layer in rank.layers for op in layer if not is_expert_op(op) for n in op.weights]
        states = expert_parallel_states(dense, expert, dp=dp, ep=rank.ep, stage=z.stage, element_bytes=e,
                                        rank=rank.dp_rank, tp=rank.tp)
    elif z.bf16_optimizer:
        states = bf16_optimizer_states(numels, dp=dp, accum_bytes=z.bf16_accum_bytes)
    else:
        states = zero_model_states(numels, dp=dp, stage=z.stage, element_bytes=e, rank=rank.dp_rank,
                                   persistence_threshold=z.persistence_threshold)
    ranks = range(dp) if rank.dp_rank is None else (rank.dp_rank,)
    bucket = float(e * z.reduce_bucket_size) if z.contiguous_gradients and z.stage else 0.0
    # gathered: none at or below the persistence threshold, and none on a group of one rank, whose partition is
    # the whole parameter (DeepSpeed's ``_no_gather_coalesced`` makes the parameter a view of it)
    persistent = {i for i, n in enumerate(numels) if z.stage == 3 and (dp == 1 or n <= z.persistence_threshold)}
    prof = _profile(rank.layers, numels, e, z, persistent, bucket, rank.checkpoint_bytes)
    flat = float(bf16_accumulation_bytes(numels, dp=dp, accum_bytes=z.bf16_accum_bytes) if z.bf16_optimizer
                 else rank.flat_grad_bytes * sum(numels))

    # held the whole step: the states (ZeRO-3's persistent parameters whole among the parameters)
    fixed = {"param_bytes": 0.0 if rank.offload and z.stage == 3 else float(states.param_bytes),
             "optimizer_bytes": 0.0 if rank.offload else float(states.optimizer_bytes)}
    # gradients and buffers before the step's first backward: ZeRO-3's flat gradient partitions and
    # bucket, BF16_Optimizer's accumulation buffer
    grads = flat + (float(e * sum(-(-n // dp) for n in numels)) if z.stage == 3 else 0.0)
    buffer = bucket if z.stage == 3 else 0.0
    best = PeakMemory("before", {})
    best_total = None

    def see(phase: str, index: int, moment: dict, **held: float) -> None:
        nonlocal best, best_total
        now = {kind: fixed.get(kind, 0.0) + moment.get(kind, 0.0) + held.get(kind, 0.0) for kind in PEAK_KINDS}
        total = sum(now.values())
        if best_total is None or total >= best_total:  # of equal moments, the latest
            best, best_total = PeakMemory(f"{phase} {index}", now), total

    held_mbs = forwards = backwards = 0  # micro-batches whose activations are saved
    pipe: list[float] = []  # sent outputs and received inputs in the pipe buffers, oldest first
    for kind, _ in rank.order:
        if kind == "B":
            held_mbs -= 1  # the backward's own activations are in its profile
        others = {"activation_bytes": held_mbs * prof.saved, "grad_bytes": grads, "buffer_bytes": buffer}
        if kind == "F":
            if rank.pipe_buffers:
                pipe.append(rank.input_bytes)
            see("forward", forwards, prof.forward, **others, temporary_bytes=sum(pipe))
            held_mbs += 1
            forwards += 1
            if rank.pipe_buffers:
                pipe.append(rank.output_bytes)
                del pipe[:max(0, len(pipe) - 2 * rank.pipe_buffers)]  # a buffer is reused by a later micro-batch
            continue
        see("backward", backwards, prof.first_backward if backwards == 0 else prof.backward, **others,
            temporary_bytes=sum(pipe))
        backwards += 1
        if prof.weights:
            if z.stage <= 1:
                grads = flat + float(e * sum(numels))  # made by the first backward, kept to the step
            elif z.stage == 2:  # each micro-batch's reduction fills the partition's buffer; its bucket is freed
                grads = float(e * max(_overlapping_partition(numels, dp, r) for r in ranks))
            if z.stage == 1:
                buffer = bucket  # made at the first gradient, freed at the step

    # a pipeline's ZeRO-1 reduction after the last backward: DeepSpeed's ``reduce_gradients(pipeline_parallel=
    # True)`` makes a second reduction bucket beside the one the backward made (both freed as it ends)
    if rank.pipe_buffers and z.stage == 1 and bucket:
        see("reduce_grads", 0, {"temporary_bytes": sum(pipe) + bucket}, grad_bytes=grads, buffer_bytes=buffer)

    # the optimizer step: gradients as at the step, and Adam's temporaries.  fp32 ZeRO-0 steps each
    # parameter (8 bytes of moments per element); every other rule one flat fp32 partition (12 bytes per
    # element: master, two moments)
    largest = 4.0 * max(numels, default=0) if z.stage == 0 and e == 4 else states.optimizer_bytes / 3
    # (the pipe buffers keep the last micro-batches' inputs and outputs until the next step reuses them)
    see("optimizer_step", 0, {"temporary_bytes": sum(pipe) + (0.0 if rank.offload or rank.fused_adam else 2.0 * largest)},
        grad_bytes=float(states.grad_bytes) + flat)
    best.at_step_bytes = fixed["param_bytes"] + float(states.grad_bytes) + fixed["optimizer_bytes"]
    return best
