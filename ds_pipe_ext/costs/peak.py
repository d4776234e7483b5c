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
- **gathered** (ZeRO-3): a layer's parameters whole from its forward until its backward (each is
  reused within ``stage3_max_reuse_distance`` elements, DeepSpeed's default 1e9, so it is not released
  between), except parameters at or below the persistence threshold, kept whole anyway.
- **activations**: what each op saves for its backward (the analytic ``OpCost.activation_bytes``),
  from its forward until its own backward, for every micro-batch the schedule holds.
- **temporaries**: an op's outputs forward, its input and weight gradients backward
  (``fwd_allocs`` / ``bwd_allocs``) and the gradient arriving from the op after it; a pipeline
  stage's buffers of sent outputs and received inputs (``max(2, min(stages - stage, micro_batches))``
  of each, DeepSpeed's ``num_pipe_buffers``); the loss's vocabulary-wide gradients on the last layer.
- **the optimizer step**: gradients as at the step, plus Adam's temporaries: two fp32 tensors the size
  of the largest tensor the inner optimizer steps (torch's single-tensor AdamW computes the square
  root of the second moment, then its quotient), which under ZeRO-1/2/3 and 16-bit ZeRO-0 is the flat
  partition.

Pure arithmetic on ``OpCost`` lists: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .zero import zero_model_states

PEAK_KINDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "gathered_bytes",
              "activation_bytes", "temporary_bytes")

# DeepSpeed 0.19's defaults for the settings the peak depends on (``runtime/zero/config.py``)
DEEPSPEED_ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e5,
                           "stage3_max_reuse_distance": 1e9, "contiguous_gradients": True}


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings the peak depends on, as a ds.json's ``zero_optimization`` section sets them."""

    stage: int = 0
    reduce_bucket_size: int = int(DEEPSPEED_ZERO_DEFAULTS["reduce_bucket_size"])
    persistence_threshold: int = int(DEEPSPEED_ZERO_DEFAULTS["stage3_param_persistence_threshold"])
    max_reuse_distance: int = int(DEEPSPEED_ZERO_DEFAULTS["stage3_max_reuse_distance"])
    contiguous_gradients: bool = True
    overlap_comm: bool = False

    @classmethod
    def from_ds_config(cls, ds: dict) -> "ZeroSettings":
        z = ds.get("zero_optimization") or {}
        stage = int(z.get("stage", 0))
        get = lambda key: z.get(key, DEEPSPEED_ZERO_DEFAULTS[key])  # noqa: E731
        return cls(stage=stage, reduce_bucket_size=int(get("reduce_bucket_size")),
                   persistence_threshold=int(get("stage3_param_persistence_threshold")),
                   max_reuse_distance=int(get("stage3_max_reuse_distance")),
                   contiguous_gradients=bool(get("contiguous_gradients")),
                   overlap_comm=bool(z.get("overlap_comm", stage == 3)))


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
    # BF16_Optimizer (16-bit ZeRO-0 under a pipeline) accumulates gradients into a flat buffer of every
    # parameter in the gradients' dtype, held from the start, beside the 16-bit ones autograd makes
    flat_grad_accumulation: bool = False
    # full recompute: each layer keeps only its input (these bytes, per layer) and replays its forward,
    # saving its activations again, at the start of its backward (None: no recompute)
    checkpoint_bytes: tuple | None = None


@dataclass
class PeakMemory:
    """The most bytes a rank holds at once over a step, when, and what they are."""

    phase: str  # "forward 1", "backward 0", "optimizer_step"
    by_kind: dict = field(default_factory=dict)  # PEAK_KINDS

    @property
    def total_bytes(self) -> float:
        return sum(self.by_kind.values())

    def to_dict(self) -> dict:
        return {"phase": self.phase, **self.by_kind, "total_bytes": self.total_bytes}


def _tensors(ops) -> list[int]:
    return [n for op in ops for n in op.weights]


def _overlapping_partition(numels: list[int], dp: int, rank: int) -> int:
    """Elements of the parameters that overlap ZeRO-1/2's partition ``rank`` of the flat buffer (padded
    to 2 dp): DeepSpeed sizes ``grads_in_partition`` by them, whole."""
    total = sum(numels)
    padded = -(-total // (2 * dp)) * 2 * dp
    part = padded // dp
    lo, hi = rank * part, (rank + 1) * part
    start, out = 0, 0
    for n in numels:
        if start < hi and start + n > lo:
            out += n
        start += n
    return out


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
    kept = [op.activation_bytes for op in ops] if checkpoint is None else [0.0] * len(ops)
    replay = [sum(op.activation_bytes for op in layer) for layer in layers]

    forward: dict = {}
    saved = gathered = 0.0
    for i, (op, g) in enumerate(zip(ops, gather)):
        if checkpoint is not None and (i == 0 or layer_of[i] != layer_of[i - 1]):
            saved += checkpoint[layer_of[i]]  # the layer's input, kept for its replay
        gathered += g  # gathered for its forward and kept for its backward
        forward = _most(forward, {"activation_bytes": saved, "gathered_bytes": gathered,
                                  "temporary_bytes": float(sum(op.fwd_allocs))})
        saved += kept[i]

    # backward, ops in reverse: what stays saved and gathered (ops not yet run back), the gradients made so
    # far (the first backward under ZeRO-0/1), the bucket once a gradient exists
    first: dict = {}
    later: dict = {}
    remaining, held, made, upstream, bucket_on = saved, gathered, 0.0, 0.0, False

    def moment(temporary: float) -> None:
        nonlocal first, later
        now = {"activation_bytes": remaining, "gathered_bytes": held, "temporary_bytes": temporary}
        made_bucket = bucket if bucket_on else 0.0
        first = _most(first, {**now, "grad_bytes": made, "buffer_bytes": made_bucket})
        # ZeRO-1's bucket, once made, is held to the step (counted there); ZeRO-2 makes one each micro-batch
        later = _most(later, {**now, "grad_bytes": 0.0, "buffer_bytes": made_bucket if z.stage == 2 else 0.0})

    for i in range(len(ops) - 1, -1, -1):
        op, g = ops[i], gather[i]
        if checkpoint is not None and (i == len(ops) - 1 or layer_of[i] != layer_of[i + 1]):
            remaining += replay[layer_of[i]]  # the layer's forward replayed: its activations saved again
        allocs = list(op.bwd_allocs) or [upstream]  # an elementwise op writes its input's gradient
        weight_grad = float(e * sum(op.weights))
        if op.weights and not op.bwd_allocs:  # a norm's weight gradients, beside its input's
            allocs.append(weight_grad)
        moment(upstream + sum(allocs))
        if op.weights:
            if z.stage <= 1:
                made += weight_grad
            if not bucket_on and z.stage in (1, 2) and bucket:
                bucket_on = True  # made at the op's first gradient, while its input's gradient is alive
                moment(upstream + allocs[0])
        remaining -= op.activation_bytes
        if checkpoint is not None and (i == 0 or layer_of[i] != layer_of[i - 1]):
            remaining -= checkpoint[layer_of[i]]  # its input, once the layer's backward is done
        held -= g  # released after its backward: its next use is the next step's forward
        upstream = op.bwd_allocs[0] if op.bwd_allocs else upstream
    return _Profile(forward, first, later, saved, gathered, any(op.weights for op in ops))


def step_peak(rank: RankStep) -> PeakMemory:
    """The peak of ``rank``'s step (see the module's docstring for each kind's rule).  One micro-batch's
    pass is profiled once (``_Profile``); the schedule's order then says, at each forward and backward,
    what else is alive: the other micro-batches' activations, the gradients, the buckets, the pipe
    buffers.  Linear in the rank's ops plus its schedule's length."""
    e, z, dp = rank.element_bytes, rank.zero, rank.dp
    numels = [n for layer in rank.layers for op in layer for n in op.weights]
    states = zero_model_states(numels, dp=dp, stage=z.stage, element_bytes=e, rank=rank.dp_rank,
                               persistence_threshold=z.persistence_threshold)
    ranks = range(dp) if rank.dp_rank is None else (rank.dp_rank,)
    bucket = float(e * z.reduce_bucket_size) if z.contiguous_gradients and z.stage else 0.0
    persistent = {i for i, n in enumerate(numels) if z.stage == 3 and n <= z.persistence_threshold}
    prof = _profile(rank.layers, numels, e, z, persistent, bucket, rank.checkpoint_bytes)
    flat = float(e * sum(numels)) if rank.flat_grad_accumulation else 0.0

    # held the whole step: the states; under ZeRO-3 the persistent parameters whole
    fixed = {"param_bytes": float(states.param_bytes), "optimizer_bytes": float(states.optimizer_bytes),
             "gathered_bytes": float(e * sum(numels[i] for i in persistent))}
    # gradients and buffers before the step's first backward: ZeRO-3's flat gradient partitions and
    # bucket, BF16_Optimizer's accumulation buffer
    grads = flat + (float(e * sum(-(-n // dp) for n in numels)) if z.stage == 3 else 0.0)
    buffer = bucket if z.stage == 3 else 0.0
    best = PeakMemory("before", {})

    def see(phase: str, moment: dict, **held: float) -> None:
        nonlocal best
        now = {kind: fixed.get(kind, 0.0) + moment.get(kind, 0.0) + held.get(kind, 0.0) for kind in PEAK_KINDS}
        if not best.by_kind or sum(now.values()) >= best.total_bytes:  # of equal moments, the latest
            best = PeakMemory(phase, now)

    held_mbs = forwards = backwards = 0  # micro-batches whose activations are saved
    pipe: list[float] = []  # sent outputs and received inputs in the pipe buffers, oldest first
    for kind, _ in rank.order:
        others = {"activation_bytes": held_mbs * prof.saved, "grad_bytes": grads, "buffer_bytes": buffer}
        if kind == "F":
            if rank.pipe_buffers:
                pipe.append(rank.input_bytes)
            see(f"forward {forwards}", prof.forward, **others, temporary_bytes=sum(pipe))
            held_mbs += 1
            forwards += 1
            if rank.pipe_buffers:
                pipe.append(rank.output_bytes)
                del pipe[:max(0, len(pipe) - 2 * rank.pipe_buffers)]  # a buffer is reused by a later micro-batch
            continue
        held_mbs -= 1
        others = {"activation_bytes": held_mbs * prof.saved, "grad_bytes": grads, "buffer_bytes": buffer}
        see(f"backward {backwards}", prof.first_backward if backwards == 0 else prof.backward, **others,
            temporary_bytes=sum(pipe))
        backwards += 1
        if prof.weights:
            if z.stage <= 1:
                grads = flat + float(e * sum(numels))  # made by the first backward, kept to the step
            elif z.stage == 2:  # each micro-batch's reduction fills the partition's buffer; its bucket is freed
                grads = float(e * max(_overlapping_partition(numels, dp, r) for r in ranks))
            if z.stage == 1:
                buffer = bucket  # made at the first gradient, freed at the step

    # the optimizer step: gradients as at the step, and Adam's temporaries.  fp32 ZeRO-0 steps each
    # parameter (8 bytes of moments per element); every other rule one flat fp32 partition (12 bytes per
    # element: master, two moments)
    largest = 4.0 * max(numels, default=0) if z.stage == 0 and e == 4 else states.optimizer_bytes / 3
    see("optimizer_step", {"temporary_bytes": 2.0 * largest}, grad_bytes=float(states.grad_bytes) + flat)
    return best


def rank_steps(model, lay, *, parts: list[int] | None = None, seq: int | None = None, dtype: str = "fp32",
               dp_rank: int | None = None, mask_bytes: int | None = None) -> list[RankStep]:
    """Every pipeline rank's ``RankStep`` for ``model`` under ``lay`` (a ``Layout``; one rank without a
    pipeline), its layers' ops from the analytic model and its ZeRO settings from the ds.json the layout
    writes.  ``parts``: the pipeline's split (required with pp > 1)."""
    from ..arch import as_description
    from ..simulate.schedules import build_schedule
    from .estimate import DTYPE_BYTES, EstimateRequest, layer_ops, shape_for

    desc = as_description(model)
    req = EstimateRequest(micro_batch=lay.micro_batch, seq=seq or desc.seq_len, tp=lay.tp, sp=lay.sp, dtype=dtype,
                          mask_bytes=mask_bytes, selective_recompute=lay.recompute == "selective")
    shp = shape_for(desc, req)
    ops = [list(o) for _, _, o in layer_ops(desc, shp)]
    zero = ZeroSettings.from_ds_config({"zero_optimization": lay.zero_section()} if lay.zero else {})
    e = DTYPE_BYTES[dtype]
    if not lay.pipelined:
        order = tuple((kind, mb) for mb in range(lay.micro_batches) for kind in ("F", "B"))
        return [RankStep(ops, order, e, zero, dp=lay.dp, dp_rank=dp_rank)]
    if parts is None or len(parts) != lay.pp + 1:
        raise ValueError(f"a pipeline of {lay.pp} stages needs its split: parts of {lay.pp + 1} boundaries")
    schedule = build_schedule("1f1b", lay.pp, lay.micro_batches)
    boundary = float(shp.tokens * shp.h * e)  # a block's output, sent between stages
    logits = float(shp.tokens * -(-shp.V // shp.t) * e)  # the last stage's output, kept for the loss
    steps = []
    for s in range(lay.pp):
        order = tuple((w.kind, w.micro_batch) for w in schedule.orders[s] if w.kind in ("F", "B"))
        last = s == lay.pp - 1
        steps.append(RankStep(ops[parts[s]:parts[s + 1]], order, e, zero, dp=lay.dp, dp_rank=dp_rank,
                              pipe_buffers=max(2, min(lay.pp - s, lay.micro_batches)),
                              output_bytes=logits if last else boundary, input_bytes=boundary if s else 0.0,
                              flat_grad_accumulation=e < 4 and lay.zero == 0))
    return steps
