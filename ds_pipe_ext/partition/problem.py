"""A validated partitioning instance: per-layer lists turned into prefix sums.

``stage_time`` and ``stage_memory`` here are *the* definitions of the objective
and the constraint; the solver's probes compute exactly the same subtractions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..costs.stage import in_flight


class PartitionError(ValueError):
    """Bad partitioning input; the message names the problem and the fix."""


class InfeasibleMemoryCap(PartitionError):
    """No partition fits the memory cap; ``min_feasible_cap`` is the smallest that does (None: not
    computed, ``solve(explain_infeasible=False)``)."""

    def __init__(self, cap: float, min_feasible_cap: float | None, detail: str = ""):
        self.cap = cap
        self.min_feasible_cap = min_feasible_cap
        gib = 2.0**30
        least = ("" if min_feasible_cap is None else f": the smallest cap that admits a partition is "
                 f"{min_feasible_cap / gib:.4f} GiB ({min_feasible_cap:.0f} B)")
        super().__init__(
            f"memory cap {cap / gib:.4f} GiB ({cap:.0f} B) per stage is infeasible{least}. "
            f"Raise memory_cap_gib{' to at least that' if least else ''}, add stages, or use fewer "
            f"micro-batches in flight." + (f" {detail}" if detail else "")
        )


@dataclass(frozen=True)
class Problem:
    """Validated numeric form of one partitioning instance (prefix sums, in float64)."""

    times: np.ndarray  # per-layer time, length n
    prefix_time: np.ndarray  # length n+1
    num_stages: int
    static: np.ndarray | None  # prefix sums of static bytes, length n+1
    activation: np.ndarray | None  # prefix sums of activation bytes, length n+1
    micro_batches: int
    memory_cap: float | None
    boundary: np.ndarray | None  # boundary[k] = one-way p2p time across boundary k (k=0..n); 0 at 0 and n
    schedule: str = "1f1b"  # decides how many micro-batches of activations each stage holds
    reserve: np.ndarray | None = None  # per stage: bytes it holds beside its layers' (the peak rule's reserve)
    step: np.ndarray | None = None  # prefix sums of bytes per layer at the optimizer step (the peak rule's)
    _memory_prefix_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.times)

    def inflight(self, stage: int) -> int:
        return in_flight(stage, self.num_stages, self.micro_batches, self.schedule)

    def stage_time(self, i: int, j: int) -> float:
        if self.boundary is None:
            return float(self.prefix_time[j] - self.prefix_time[i])
        # One subtraction of per-boundary keys, exactly as the vectorised probe computes it.
        return float(self.end_key[j] - self.start_key[i])

    @property
    def end_key(self) -> np.ndarray:
        """prefix_time[j] + 2 * boundary[j]: what ending a stage at j costs."""
        return self.prefix_time + 2.0 * self.boundary

    @property
    def start_key(self) -> np.ndarray:
        """prefix_time[i] - 2 * boundary[i]: starting a stage at i, with the inbound p2p."""
        return self.prefix_time - 2.0 * self.boundary

    def memory_prefix(self, inflight: int) -> np.ndarray:
        """Prefix sums of static + inflight * activation bytes (cached per in-flight count)."""
        cache = self._memory_prefix_cache
        if inflight not in cache:
            cache[inflight] = self.static + inflight * self.activation
        return cache[inflight]

    def stage_budget(self, stage: int, cap: float) -> float:
        """What of ``cap`` the stage's layers may take: the cap less the stage's reserve."""
        return cap if self.reserve is None else cap - float(self.reserve[stage])

    def stage_memory(self, stage: int, i: int, j: int) -> float:
        if self.static is None:
            return 0.0
        mem = self.memory_prefix(self.inflight(stage))
        during = float(mem[j] - mem[i]) + (0.0 if self.reserve is None else float(self.reserve[stage]))
        return during if self.step is None else max(during, float(self.step[j] - self.step[i]))


def _as_array(name: str, values: Sequence[float] | None, n: int | None) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.ndim != 1:
        raise PartitionError(f"{name} must be a flat list of numbers, got shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise PartitionError(f"{name} has {len(arr)} entries but there are {n} layers; give one per layer")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
        raise PartitionError(f"{name}[{bad}] = {arr[bad]!r}; costs must be finite and non-negative")
    return arr


def make_problem(
    times: Sequence[float],
    num_stages: int,
    *,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    micro_batches: int | None = None,
    memory_cap: float | None = None,
    boundary_time: Sequence[float] | None = None,
    schedule: str = "1f1b",
    stage_reserve_bytes: Sequence[float] | None = None,
    step_bytes: Sequence[float] | None = None,
) -> Problem:
    """Validate the inputs and precompute prefix sums.

    ``stage_reserve_bytes[s]``: what stage s holds beside its layers' states and activations whatever
    its layers (the peak rule's reserve, ``costs.peak_rule.PipelinePeakRule``), counted in its memory.
    ``step_bytes``: per layer, what its stage holds for it at the optimizer step (states as at the step,
    Adam's temporaries); a stage's memory is then the larger of its backward's and its step's.

    ``boundary_time[k]`` is the one-way p2p time of layer k's output (length n; the
    last entry is ignored because the last layer's output never leaves its stage).
    """
    t = _as_array("times", times, None)
    n = len(t)
    if n == 0:
        raise PartitionError("there are no layers to partition")
    if not isinstance(num_stages, (int, np.integer)) or isinstance(num_stages, bool) or num_stages < 1:
        raise PartitionError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > n:
        raise PartitionError(
            f"cannot split {n} layers into {num_stages} non-empty stages: use at most {n} stages "
            f"(or a model with more layers)"
        )
    static = _as_array("static_bytes", static_bytes, n)
    act = _as_array("activation_bytes", activation_bytes, n)
    if memory_cap is not None:
        if static is None and act is None:
            raise PartitionError("a memory cap needs per-layer static_bytes and/or activation_bytes")
        if not (isinstance(memory_cap, (int, float)) and math.isfinite(memory_cap) and memory_cap > 0):
            raise PartitionError(f"memory_cap must be a positive number of bytes, got {memory_cap!r}")
    if static is not None or act is not None:
        static = np.zeros(n) if static is None else static
        act = np.zeros(n) if act is None else act
    m = num_stages if micro_batches is None else micro_batches
    if not isinstance(m, (int, np.integer)) or m < 1:
        raise PartitionError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    boundary = None
    b = _as_array("boundary_time", boundary_time, n)
    if b is not None and np.any(b[:-1] > 0):
        boundary = np.zeros(n + 1)
        boundary[1:n] = b[:-1]  # boundary k sits between layer k-1 and layer k
    reserve = None
    if stage_reserve_bytes is not None:
        reserve = _as_array("stage_reserve_bytes", stage_reserve_bytes, None)
        if len(reserve) != num_stages:
            raise PartitionError(f"stage_reserve_bytes has {len(reserve)} entries for {num_stages} stages; "
                                 f"give one per stage")
        if static is None:
            static, act = np.zeros(n), np.zeros(n)
    step = _as_array("step_bytes", step_bytes, n)
    prefix = lambda a: None if a is None else np.concatenate(([0.0], np.cumsum(a)))  # noqa: E731
    return Problem(
        times=t,
        prefix_time=prefix(t),
        num_stages=int(num_stages),
        static=prefix(static),
        activation=prefix(act),
        micro_batches=int(m),
        memory_cap=None if memory_cap is None else float(memory_cap),
        boundary=boundary,
        schedule=schedule,
        reserve=reserve,
        step=prefix(step),
    )
