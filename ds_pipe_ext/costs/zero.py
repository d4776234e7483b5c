"""Model-state bytes per rank as DeepSpeed's ZeRO optimizers allocate them (not as the paper's formula).

The measured side counts the tensors a rank holds at the optimizer step
(``compat.zero.held_model_state_bytes``); this module predicts the same three
figures from the parameter sizes and the ZeRO settings, allocation rule by
allocation rule (DeepSpeed 0.19, Adam; one parameter group, or the groups of DeepSpeed's MoE layers:
``expert_parallel_states``):

- ZeRO-0: the parameters, their gradients, Adam's two moments.  In fp32 the
  parameters are the optimizer's own (no master copy).
- ZeRO-1 and -2 (``stage_1_and_2.py``): the parameters live in one flat buffer
  padded to a multiple of ``2 * dp`` elements (``nccl_start_alignment_factor``), every
  rank keeps all of it; each rank owns a partition of ``padded / dp`` elements with an
  fp32 master copy (a copy even when the model is fp32), the two moments and, at the
  step, its fp32 gradient.  Gradients are reduced in buckets during the backward pass
  and the non-owned ones freed, so ZeRO-1 and ZeRO-2 hold the same at the step.  One
  exception depends on the rank: in fp32, a partition that lies inside a single larger
  parameter (a wide embedding over many ranks) gets its gradient as a view of that
  parameter's whole gradient (``get_flat_partition`` flattens a one-tensor list without
  copying), so that rank holds the whole gradient.
- ZeRO-3 (``stage3.py``, ``partition_parameters.py``): each parameter is padded to a
  multiple of ``dp`` and split, so a rank holds ``sum(ceil(n_i / dp))`` elements of
  parameters, the same again of reduced gradients (``grad_partitions_flat_buffer``),
  and an fp32 master partition with its gradient and two moments.  A parameter at or
  below ``stage3_param_persistence_threshold`` elements also stays whole on every
  rank; `ds-pipe-ext compare` writes the threshold into every ZeRO-3 config.

- ``BF16_Optimizer`` (``bf16_optimizer_states``), which DeepSpeed picks for bf16 under its pipeline
  without ZeRO (and for bf16 ZeRO-1 accumulating in fp32): the bf16 weights and their gradients whole,
  a flat accumulation buffer in ``grad_accum_dtype``, fp32 master weights and moments on 1/dp as ZeRO-1.

16-bit training keeps 16-bit parameters beside the fp32 master copies, by the same rules;
under ZeRO-3 its reduced-gradient buffer is 16-bit too.  Both precisions are measured:
fp32 in `ds-pipe-ext compare` (tests/test_compare.py), bf16 on 2 CPU ranks under ZeRO-1/2/3
and BF16_Optimizer in ``bench/zero_rules_16bit.py``.

DeepSpeed's own estimators (``estimate_zero2/3_model_states_mem_needs``, cross-checked in
tests/test_compare.py) assume 16-bit training and differ from these rules in two terms: ZeRO-2's
counts a 16-bit gradient partition (2 bytes x N/dp) that is not held at the step, and ZeRO-3's adds
a working set of the largest module in 32 bits (4 bytes x its parameters) and leaves out the
16-bit reduced-gradient buffer (2 bytes x N/dp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache


@dataclass(frozen=True)
class ModelStates:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, int]:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _flat_padded(n: int, dp: int) -> int:
    """Elements of a flat buffer of ``n`` parameters padded to ``2 dp`` (``nccl_start_alignment_factor`` x dp),
    as ZeRO-1/2 and BF16_Optimizer flatten a parameter group."""
    return _ceil_div(n, 2 * dp) * 2 * dp


def _holding_parameter(param_numels: list[int], lo: int, hi: int) -> int | None:
    """The size of the one parameter the flat range [lo, hi) lies inside; None where it spans several."""
    start = 0
    for n in param_numels:
        if start <= lo and hi <= start + n:
            return n
        start += n
    return None


def _partition_grad_elements(param_numels: list[int], lo: int, hi: int) -> int:
    """Elements of fp32 gradient a ZeRO-1/2 rank holds for its partition [lo, hi) of the flat buffer."""
    whole = _holding_parameter(param_numels, lo, hi)  # inside one parameter: a view of its whole gradient
    return hi - lo if whole is None else whole


def zero_model_states(param_numels: list[int], *, dp: int, stage: int, element_bytes: int = 4,
                      persistence_threshold: int = 0, rank: int | None = None) -> ModelStates:
    """Bytes data-parallel rank ``rank`` holds for parameters of these sizes (a stage's, or the whole
    model's); ``rank=None``: the heaviest rank."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: use 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp}: the data-parallel degree must be >= 1")
    if rank is not None and not 0 <= rank < dp:
        raise ValueError(f"rank {rank}: a data-parallel rank is in [0, {dp})")
    e, n = element_bytes, sum(param_numels)
    master = 0 if e == 4 else 4  # 16-bit training keeps fp32 master weights
    if stage == 0:
        return ModelStates(param_bytes=e * n, grad_bytes=e * n + master * n, optimizer_bytes=(8 + master) * n)
    if stage in (1, 2):
        padded = _flat_padded(n, dp)
        part = padded // dp
        grads = part
        if e == 4:  # in 16-bit the conversion to fp32 copies, and the view's source is freed
            ranks = range(dp) if rank is None else (rank,)
            grads = max(_partition_grad_elements(param_numels, r * part, (r + 1) * part) for r in ranks)
        return ModelStates(param_bytes=e * padded, grad_bytes=4 * grads, optimizer_bytes=12 * part)
    part = sum(_ceil_div(k, dp) for k in param_numels)
    persistent = sum(k for k in param_numels if k <= persistence_threshold)
    return ModelStates(param_bytes=e * (part + persistent), grad_bytes=e * part + 4 * part, optimizer_bytes=12 * part)


def runs_bf16_optimizer(*, pipelined: bool, zero_stage: int, bf16: bool) -> bool:
    """Whether DeepSpeed (0.19) trains with its ``BF16_Optimizer`` in place of ZeRO's: a bf16 pipeline
    without ZeRO (``_do_optimizer_sanity_check``).  The plan and ``compare`` both ask this."""
    return pipelined and zero_stage == 0 and bf16


def bf16_optimizer_states(param_numels: list[int], *, dp: int, accum_bytes: int) -> ModelStates:
    """Bytes a rank holds at the step under DeepSpeed's ``BF16_Optimizer`` (bf16 under a pipeline without
    ZeRO, ``runtime/bf16_optimizer.py``): the bf16 weights in one flat buffer padded to ``2 dp`` elements and
    their gradients (made by autograd, zeroed, never freed), whole; fp32 master weights and Adam's two
    moments on the rank's ``padded / dp`` partition, as ZeRO-1; and, where the gradients accumulate in
    bf16 (``accum_bytes`` 2), the partition cast to fp32 for the step.  The flat accumulation buffer
    (``accum_bytes`` x padded, held from the start) is counted apart, as the peak rule holds it."""
    if dp < 1:
        raise ValueError(f"dp = {dp}: the data-parallel degree must be >= 1")
    n = sum(param_numels)
    padded = _flat_padded(n, dp)
    part = padded // dp
    return ModelStates(param_bytes=2 * padded, grad_bytes=2 * n + (4 * part if accum_bytes < 4 else 0),
                       optimizer_bytes=12 * part)


def bf16_accumulation_bytes(param_numels: list[int], *, dp: int, accum_bytes: int) -> int:
    """``BF16_Optimizer``'s flat gradient-accumulation buffer: every (padded) parameter in ``accum_bytes``."""
    return accum_bytes * _flat_padded(sum(param_numels), dp)


def expert_parallel_states(dense_numels: list[int], expert_numels: list[int], *, dp: int, ep: int, stage: int,
                           element_bytes: int = 4, rank: int | None = None, tp: int = 1) -> ModelStates:
    """``zero_model_states`` of a rank holding DeepSpeed MoE experts: DeepSpeed keeps them in their own
    parameter groups, each partitioned (and padded) over its own group: dense parameters over the dp
    ranks, a rank's experts over the tp x dp / ep ranks of its stage that hold the same experts (its
    expert-data-parallel group, ``Layout.expert_dp``: ranks ep apart).  ``rank``: the data-parallel rank (at TP
    rank 0).  Gradients in fp32 under ZeRO-1/2: the most held over the groups' steps
    (``_fp32_grads_over_group_steps``), not the sum of the groups' partitions."""
    expert_dp = _expert_dp(tp, dp, ep)
    dense = zero_model_states(dense_numels, dp=dp, stage=stage, element_bytes=element_bytes, rank=rank)
    if not expert_numels:
        return dense
    expert_rank = None if rank is None else rank * tp // ep
    experts = zero_model_states(expert_numels, dp=expert_dp, stage=stage, element_bytes=element_bytes,
                                rank=expert_rank)
    summed = ModelStates(*(getattr(dense, k) + getattr(experts, k) for k in ("param_bytes", "grad_bytes",
                                                                             "optimizer_bytes")))
    if stage not in (1, 2) or element_bytes != 4:
        return summed
    ranks = range(dp) if rank is None else (rank,)
    grads = max(_fp32_grads_over_group_steps([(dense_numels, dp, r), (expert_numels, expert_dp, r * tp // ep)])
                for r in ranks)
    return replace(summed, grad_bytes=4 * grads)


def _expert_dp(tp: int, dp: int, ep: int) -> int:
    if (tp * dp) % ep:
        raise ValueError(f"ep = {ep} does not divide tp x dp = {tp * dp}")
    return tp * dp // ep


def overlapping_partition(param_numels: list[int], dp: int, rank: int) -> int:
    """Elements of the parameters that overlap ZeRO-1/2's partition ``rank`` of the flat buffer (padded
    to 2 dp), whole: what DeepSpeed sizes ``grads_in_partition`` by, and what a rank's gradients of a
    group hold before its step."""
    part = _ceil_div(sum(param_numels), 2 * dp) * 2
    lo, hi = rank * part, (rank + 1) * part
    held, start = 0, 0
    for n in param_numels:
        if start < hi and start + n > lo:
            held += n
        start += n
    return held


def _fp32_grads_over_group_steps(groups: list[tuple[list[int], int, int]]) -> int:
    """The most fp32 gradient elements a ZeRO-1/2 rank holds while DeepSpeed steps its parameter groups
    one at a time (dense first, then each expert group), ``groups``: (parameter sizes, the group's
    data-parallel degree, the rank's place in it) in that order.

    After the backward the rank holds, in one storage for all groups, the whole gradients of every
    parameter overlapping its partitions; group k's step flattens its partition into a fresh copy and
    frees its parameters' gradients, but the storage lives on until the last group's are freed.  So
    the most is at an early step: that storage plus the group's copy; at the last step only the last
    copy remains (a partition inside one parameter is a view, no copy: ``zero_model_states``'s rule).
    Measured on 2 and 4 CPU ranks (moe-tiny, ZeRO-1 and -2, data and pipeline parallel)."""
    storage, copies = 0, []
    for numels, dp, r in groups:
        n = sum(numels)
        part = _ceil_div(n, 2 * dp) * 2
        lo, hi = r * part, (r + 1) * part
        storage += overlapping_partition(numels, dp, r)
        copies.append(0 if _holding_parameter(numels, lo, hi) is not None else part)
    last = storage if copies[-1] == 0 else copies[-1]
    return max([storage + c for c in copies[:-1]] + [last])


def state_bytes_by_kind(stage: int, dp: int, element_bytes: int = 4) -> tuple[float, float, float]:
    """``zero_model_states`` of the heaviest rank as (parameter, gradient, optimizer) bytes per parameter:
    the additive form per-layer sums need (a stage's bytes are the sum of its layers').  Equal to the
    rule wherever its two non-linear terms vanish: a parameter count with no padding (a multiple of
    2 dp, or of dp per tensor under ZeRO-3) and, in fp32 under ZeRO-1/2, no rank's partition lying
    inside one tensor (tests/test_layout.py checks the equality on such counts)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: use 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp}: the data-parallel degree must be >= 1")
    e = element_bytes
    master = 0 if e == 4 else 4
    if stage == 0:
        return float(e), float(e + master), float(8 + master)
    if stage in (1, 2):
        return float(e), 4 / dp, 12 / dp
    return e / dp, (e + 4) / dp, 12 / dp


def state_bytes_per_param(stage: int, dp: int, element_bytes: int = 4) -> float:
    """All of ``state_bytes_by_kind``: model-state bytes per parameter on the heaviest rank."""
    return sum(state_bytes_by_kind(stage, dp, element_bytes))


def layer_states_by_rule(costs: list, *, stage: int, dp: int, element_bytes: int = 4, ep: int = 1,
                         tp: int = 1) -> list:
    """``LayerCost`` records whose parameter, gradient and optimizer bytes follow this rule for ZeRO
    ``stage`` over ``dp`` ranks (``state_bytes_by_kind``), from their parameters (``param_bytes`` in
    ``element_bytes`` each).  A frozen layer (no gradient bytes) keeps only its weights, partitioned
    under ZeRO-3.  The states are Adam's, whatever the profile's ``optimizer_bytes_per_param`` said.
    Expert parameters (``expert_param_bytes``, this rank's experts) follow the same rule over their
    expert-data-parallel group, tp x dp / ep ranks: DeepSpeed partitions each MoE parameter group over it."""
    expert_dp = _expert_dp(tp, dp, ep)
    dense = state_bytes_by_kind(stage, dp, element_bytes)
    experts = state_bytes_by_kind(stage, expert_dp, element_bytes) if expert_dp != dp else dense
    return [_by_rule(c, dense, experts, element_bytes) for c in costs]


@lru_cache(maxsize=4096)  # alike blocks are equal records: the planner's thousands of layouts share a few
def _by_rule(c, dense: tuple, experts: tuple, element_bytes: int):
    n_expert = c.expert_param_bytes / element_bytes
    n_dense = c.param_bytes / element_bytes - n_expert
    trainable = c.grad_bytes > 0
    p, g, o = (n_dense * d + n_expert * x for d, x in zip(dense, experts))
    return replace(c, param_bytes=round(p), grad_bytes=round(g) if trainable else 0,
                   optimizer_bytes=round(o) if trainable else 0)


# -- a rank's memory by kind: the one rule every memory figure of a layout reads ------------------

MEMORY_KINDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "gathered_bytes",
                "activation_bytes", "temporary_bytes")


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at its peak, by kind, and when (``phase``): model states, ZeRO's buckets,
    ZeRO-3's gathered parameters, saved activations and the moment's temporaries (``costs.peak``), with
    the model states at the optimizer step beside (``at_step_bytes``, what ZeRO's rule alone says)."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    gathered_bytes: float = 0.0
    buffer_bytes: float = 0.0
    temporary_bytes: float = 0.0
    phase: str = "optimizer_step 0"
    at_step_bytes: float = 0.0

    @property
    def states_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return sum(getattr(self, k) for k in MEMORY_KINDS)

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in MEMORY_KINDS}, "total_bytes": self.total_bytes, "phase": self.phase,
                "at_step_bytes": self.at_step_bytes}

    @classmethod
    def from_peak(cls, peak) -> "RankMemory":
        """A ``costs.peak.PeakMemory`` (its kinds are these)."""
        return cls(**{k: float(peak.by_kind.get(k, 0.0)) for k in MEMORY_KINDS}, phase=peak.phase,
                   at_step_bytes=float(peak.at_step_bytes))


def layer_tensors(cost, element_bytes: int) -> list[int]:
    """A layer's parameter tensors' element counts: its ``param_numels``, or where unknown the layer as
    one tensor of ``param_bytes / element_bytes`` elements."""
    if cost.param_numels:
        return list(cost.param_numels)
    n = round(cost.param_bytes / element_bytes)
    return [n] if n else []


def rank_memory(layers, *, activation_bytes: float, zero: int, dp: int, element_bytes: int,
                persistence_threshold: int = 0, dp_rank: int | None = None, offload: bool = False) -> RankMemory:
    """The memory of a rank that holds ``layers`` (``LayerCost`` records, one per pipeline layer it
    runs: every chunk's) and whose schedule holds ``activation_bytes`` at its peak, in the additive form
    used where the peak rule (``costs.peak``) does not walk the schedule: several model chunks a rank
    (interleaved, DualPipeV) or a split backward (zero-bubble).

    Model states: ``zero_model_states`` over the layers' tensors.  Under ZeRO-3 the layer being computed
    and the next one, prefetched, are gathered whole: twice the rank's largest layer.  ``offload``:
    the optimizer's states (and ZeRO-3's parameter partitions) live in host memory, not the device's."""
    tensors = [n for c in layers for n in layer_tensors(c, element_bytes)]
    states = zero_model_states(tensors, dp=dp, stage=zero, element_bytes=element_bytes, rank=dp_rank,
                               persistence_threshold=persistence_threshold)
    gathered = 0.0
    if zero == 3:
        gathered = 2.0 * element_bytes * max((sum(layer_tensors(c, element_bytes)) for c in layers), default=0)
    params, optimizer = states.param_bytes, states.optimizer_bytes
    if offload:
        optimizer = 0
        if zero == 3:
            params = 0
    return RankMemory(params, states.grad_bytes, optimizer, float(activation_bytes), gathered,
                      at_step_bytes=params + states.grad_bytes + optimizer)
