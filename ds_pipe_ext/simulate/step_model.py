"""The step model: one training step of a partition, from per-layer costs to seconds.

Per-layer costs (profiled or analytic) describe one micro-batch through one layer, alone.
A step on DeepSpeed's engine costs more, and not only on the slowest stage:

    stage forward  = forward_scale  x (its layers' forward)  + forward_fixed_s  + forward_per_layer_s  x layers
    stage backward = backward_scale x (its layers' backward) + backward_fixed_s + backward_per_layer_s x layers
                     + (forward_per_layer_s + recompute_per_layer_s) x layers it replays
      (fixed: the engine's own work per instruction; per layer: Python's call into each module, hooks,
       and DeepSpeed's reseeding of every layer (``seed_layers``).  Under activation checkpointing the
       engine replays its per-layer forward work too, which the profiler, calling the bare layer under
       the checkpoint function, does not see; recompute_per_layer_s is any further cost, fitted only
       when a calibration run checkpoints)
      -> the engine's order of compute and p2p (``pipe.schedules.engine_schedule``; any
         ``simulate.schedules`` name otherwise), with transfers of p2p_latency_s + bytes / p2p_bandwidth
      -> ranks that share ``cores`` CPU cores slow each other down while they compute together,
         and a rank that slept in a send or receive waits p2p_wake_s for a core when its partner
         arrives while the other ranks hold every core (the OS scheduler's wake-up)
      -> CPU ranks slow each other even with a core each (one memory system, shared caches): costs are
         for ranks computing together, and an item during which no other rank computes takes
         alone_share of its time (the ranks of one stage, its TP and DP group, compute in lockstep:
         ``predict``'s ``peers``; so only a pipeline's items can run alone)
      -> + each rank's optimizer step right after its last backward (optimizer_fixed_s +
         optimizer_s_per_param_byte x its parameter bytes); on a CPU the ranks' updates share one
         memory system (``shared_memory``: updates that overlap split its bandwidth)
      -> + step_fixed_s (the loss broadcast that ends every step: every rank waits for the last)

Every term is a function of the configuration (which layers a stage holds, micro-batches,
schedule, recompute, ranks per core), so a model fitted on one or two instrumented runs
(``instrument.step_fit``) predicts others.  Without a fit (``StepModel()``) it is the
layer costs alone through the schedule.  Pure Python: the ``deepspeed`` runtime's order of
instructions is handed in by the DeepSpeed adapter (``pipe.schedules`` registers it in
``ENGINE_ORDERS`` when imported); this module never imports DeepSpeed.

``StepModel.predict`` is the one step prediction: the step search, ``PipelineModule``'s plan, the
planner (``PlanModel.evaluate``), ``simulate``, ``report``, ``sweep`` and the three fits
(``instrument.step_fit``, ``plan.speed``, ``bench/calibrate_at_scale.py``) all call it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

from .events import ChunkCosts, Link, Network, StepSimulation, simulate
from .schedules import COMPUTE, RUNTIMES, Schedule, parse_schedule

CONTENTION_ROUNDS = 6  # fixed-point rounds of the shared-core slowdown (converges in 3-4 on 2-8 ranks)


class StepModelError(ValueError):
    """A step model file or fit that cannot be used; the message says why and what to do."""


# runtime -> (schedule name, chunks, micro-batches) -> the Schedule its engine runs, for the schedules
# it runs itself; registered by the runtime's adapter (DeepSpeed's: ``pipe.schedules``), which is imported
# the first time a step asks for that runtime's order (this module never imports DeepSpeed itself)
ENGINE_ORDERS: dict = {}
ENGINE_SCHEDULES = {"deepspeed": ("1f1b", "gpipe")}
ENGINE_ADAPTERS = {"deepspeed": "ds_pipe_ext.pipe.schedules"}


def register_engine_order(runtime: str, order) -> None:
    ENGINE_ORDERS[runtime] = order
    _schedule.cache_clear()


@dataclass(frozen=True)
class StepModel:
    forward_scale: float = 1.0
    backward_scale: float = 1.0
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    forward_per_layer_s: float = 0.0
    backward_per_layer_s: float = 0.0
    recompute_per_layer_s: float = 0.0
    p2p_latency_s: float = 0.0
    p2p_bandwidth: float | None = None  # bytes/s; None: transfers take no time
    p2p_wake_s: float = 0.0  # shared cores: a rank woken from a send/recv while every core is taken waits this
    optimizer_fixed_s: float = 0.0
    optimizer_s_per_param_byte: float = 0.0
    step_fixed_s: float = 0.0
    cores: float | None = None  # ranks share this many cores (CPU); None: a device per rank
    shared_memory: bool = False  # CPU: the ranks' optimizer updates (memory-bound) share one memory bandwidth
    # CPU: the share of its time a compute item takes while no other rank computes (1: ranks do not slow
    # each other, a device each); ``plan.speed.fit_speed`` sets it on CPU ranks
    alone_share: float = 1.0
    calibrated_on: tuple[str, ...] = ()  # the runs it was fitted on

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("calibrated_on", "shared_memory") or (v is None and f.name in ("p2p_bandwidth", "cores")):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise StepModelError(f"StepModel.{f.name} = {v!r}: must be a finite number >= 0")
        if self.cores is not None and self.cores <= 0 or self.p2p_bandwidth is not None and self.p2p_bandwidth <= 0:
            raise StepModelError("StepModel.cores and p2p_bandwidth must be positive (or null)")
        if not 0 < self.alone_share <= 1:
            raise StepModelError(f"StepModel.alone_share = {self.alone_share}: a share of an item's time, in (0, 1]")

    # --- the terms --------------------------------------------------------------------------
    def stage_forward_s(self, stage) -> float:
        return self.forward_scale * stage.forward_s + self.forward_fixed_s + self.forward_per_layer_s * _layers(stage)

    def stage_backward_s(self, stage) -> float:
        """``stage.backward_s`` includes the replayed forward under activation checkpointing."""
        return (self.backward_scale * stage.backward_s + self.backward_fixed_s
                + self.backward_per_layer_s * _layers(stage)
                + (self.forward_per_layer_s + self.recompute_per_layer_s) * stage.recomputed_layers)

    def optimizer_s(self, param_bytes: float) -> float:
        return self.optimizer_fixed_s + self.optimizer_s_per_param_byte * param_bytes

    def optimizer_finish_s(self, start_s: Sequence[float], work_s: Sequence[float]) -> list[float]:
        """When each rank's update ends, started at ``start_s`` (its last backward): at once alone, or
        with the memory bandwidth split among the updates running together (processor sharing)."""
        if not self.shared_memory:
            return [t + w for t, w in zip(start_s, work_s)]
        return processor_sharing(start_s, work_s)

    # --- one step ---------------------------------------------------------------------------
    def predict(self, stages: Sequence, micro_batches: int, *, schedule: str = "1f1b", runtime: str = "deepspeed",
                network: Network | None = None, update_s: Sequence[float] | None = None,
                timeline: bool = True, peers: int = 1) -> "StepPrediction":
        """One step of ``stages`` (``costs.stage.StageCost``, one per chunk in pipeline order).

        ``runtime``: "deepspeed" runs DeepSpeed's engine order and its blocking transfers where its
        engine runs the schedule (1f1b, gpipe); "megatron" (and every other schedule) the schedule's
        own order with eager transfers.  ``network``: the links (default: this model's p2p link).
        ``update_s``: per rank, work after its last backward beyond this model's optimizer term (what
        a layout's DP collectives and update add, or what a refined run measured).  ``timeline=False``
        keeps no per-item slots (the planner predicts thousands of layouts).  ``schedule`` "none" (no
        pipeline) is one stage.  ``peers``: the ranks that compute each stage in lockstep (its TP x DP
        group), which keep one another from ever computing alone (``alone_share``).
        """
        if runtime not in RUNTIMES:
            raise StepModelError(f"runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
        sched = _schedule("1f1b" if schedule == "none" else schedule, len(stages), micro_batches, runtime)
        costs = ChunkCosts([self.stage_forward_s(st) for st in stages], [self.stage_backward_s(st) for st in stages],
                           weight_grad_s=[self.backward_scale * st.weight_grad_s for st in stages],
                           output_bytes=[st.boundary_out_bytes for st in stages],
                           activation_bytes=[st.activation_bytes for st in stages])
        network = network or Network(Link(self.p2p_latency_s, self.p2p_bandwidth))
        sim, slowdown = simulate_shared_cores(sched, costs, network, self.cores, wake_s=self.p2p_wake_s,
                                              timeline=timeline, alone_share=self.alone_share if peers == 1 else 1.0)
        params = [0.0] * sched.num_ranks
        for c, st in enumerate(stages):
            params[sched.chunk_rank[c]] += st.param_bytes
        pipeline = max(sim.stage_finish_s)
        work = [self.optimizer_s(b) + (update_s[r] if update_s is not None else 0.0) for r, b in enumerate(params)]
        finish = self.optimizer_finish_s(sim.stage_finish_s, work)
        step = max(finish)
        busy = [b + w for b, w in zip(sim.stage_busy_s, work)]
        # the simulation as returned ends with each rank's update (its timeline shows it)
        sim = replace(sim, step_s=step, stage_finish_s=finish, stage_busy_s=busy,
                      bubble_fraction=max(0.0, 1.0 - sum(busy) / (len(busy) * step)) if step > 0 else 0.0)
        return StepPrediction(step_s=step + self.step_fixed_s, pipeline_s=pipeline, optimizer_s=step - pipeline,
                              simulation=sim, slowdown=slowdown)

    def split_bound(self, stages: Sequence, micro_batches: int, *, chunk_rank: Sequence[int] | None = None,
                    update_s: Sequence[float] | None = None) -> "FixedStages":
        """A whole split as the lower bound's fixed stages, in this model's terms, as ``predict`` times it:
        chunk c on rank ``chunk_rank[c]`` (default: one chunk a rank), each rank's update its optimizer
        term plus ``update_s[rank]``."""
        if not stages:
            return FixedStages(micro_batches)
        chunk_rank = list(range(len(stages))) if chunk_rank is None else list(chunk_rank)
        params = [0.0] * (max(chunk_rank) + 1)
        for r, st in zip(chunk_rank, stages):
            params[r] += st.param_bytes
        forward = [self.stage_forward_s(st) for st in stages]
        return FixedStages.of_split(forward, [f + self.stage_backward_s(st) for f, st in zip(forward, stages)],
                                    chunk_rank, [self.optimizer_s(b) + (update_s[r] if update_s is not None else 0.0)
                                                 for r, b in enumerate(params)], micro_batches)

    # --- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {**asdict(self), "calibrated_on": list(self.calibrated_on)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepModel":
        if not isinstance(d, dict):
            raise StepModelError(f"a step model must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise StepModelError(f"unknown step model fields {sorted(set(d) - known)}; expected {sorted(known)}")
        return cls(**{**d, "calibrated_on": tuple(d.get("calibrated_on", ()))})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "StepModel":
        p = Path(path)
        if not p.is_file():
            raise StepModelError(f"step model {p} does not exist: write one with "
                                 f"`ds-pipe-ext step-model fit RUN_DIR [RUN_DIR] --out {p}`")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise StepModelError(f"step model {p} is not valid JSON ({e})") from None
        except TypeError as e:
            raise StepModelError(f"step model {p} is malformed ({e})") from None


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    pipeline_s: float  # forward + backward of every micro-batch, transfers and bubbles included
    optimizer_s: float
    simulation: StepSimulation
    slowdown: dict  # (rank, Work) -> the shared-core stretch of that item


@dataclass(frozen=True)
class FixedStages:
    """The first stages of a split, fixed: what the step's lower bound needs of them.  ``then`` adds
    the next stage on its own rank (the step search's incremental case); ``of_split`` takes a whole
    split whose ranks may hold several chunks (the planner's)."""

    micro_batches: int
    count: int = 0  # stages fixed
    before: float = 0.0  # one micro-batch's forward + backward through them
    ahead: float = 0.0  # one micro-batch's forward through them: when micro-batch 0 reaches the next
    drained: float = 0.0  # max_s (before_s + m t_s): the last input gradient still goes back down
    own: float = 0.0  # max over their ranks of (micro-batch 0's way in + m x its work + its update)
    first_update: float = 0.0  # rank 0's update, after that descent

    def then(self, forward_s: float, time_s: float, update_s: float) -> "FixedStages":
        m = self.micro_batches
        return FixedStages(m, self.count + 1, self.before + time_s, self.ahead + forward_s,
                           max(self.drained, self.before + m * time_s),
                           max(self.own, self.ahead + m * time_s + update_s),
                           self.first_update if self.count else update_s)

    @classmethod
    def of_split(cls, forward_s: Sequence[float], time_s: Sequence[float], chunk_rank: Sequence[int],
                 update_s: Sequence[float], micro_batches: int) -> "FixedStages":
        """Every chunk fixed, chunk c on rank ``chunk_rank[c]``; ``update_s`` per rank."""
        m, p = micro_batches, len(update_s)
        head, work = [None] * p, [0.0] * p
        before = ahead = drained = 0.0
        for f, t, r in zip(forward_s, time_s, chunk_rank):
            head[r] = ahead if head[r] is None else head[r]
            work[r] += m * t
            drained = max(drained, before + m * t)
            before, ahead = before + t, ahead + f
        own = max((h or 0.0) + w + u for h, w, u in zip(head, work, update_s))
        return cls(m, len(time_s), before, ahead, drained, own, update_s[0])


def step_lower_bound(fixed: FixedStages, *, rest_s: float = 0.0, rest_update_s: float = 0.0, stages_left: int = 0,
                     drains: bool = True, fixed_s: float = 0.0) -> float:
    """The one lower bound on a step: no simulation of a split whose first stages are ``fixed``, with
    ``stages_left`` stages still to take layers whose forward + backward of one micro-batch is
    ``rest_s`` in all, goes below it (tests/test_step_model.py, tests/test_plan.py).

    Each rank cannot start before micro-batch 0 has come forward through the ranks before it, then
    runs its m forwards and backwards and its update; under schedules that drain (1F1B, GPipe) the
    last input gradient also goes back through every earlier stage before rank 0 updates.  For the
    stages left, the least value of those terms over every real split of ``rest_s``: their drain is
    at least ``least_drain_s``, and the busiest takes at least the mean (``rest_update_s``: the update
    of a mean share of their parameters, which is affine in them).  Shared cores and memory only slow
    work down and transfers only add, so the bound holds for every runtime.  Its cases: nothing
    fixed (the planner's bound before a split), a prefix (the step search), everything (a split).
    """
    m = fixed.micro_batches
    own = fixed.own
    drained = fixed.drained
    if stages_left:
        drained = max(drained, fixed.before + least_drain_s(rest_s, m, stages_left))
        own = max(own, fixed.ahead + m * rest_s / stages_left + rest_update_s)
    return max(drained + fixed.first_update if drains else 0.0, own) + fixed_s


def least_drain_s(total_s: float, micro_batches: int, stages: int) -> float:
    """The least value of max_r (T_0 + ... + T_{r-1} + m T_r), the drain term of ``step_lower_bound``,
    over every real split of ``total_s`` = sum T_r into ``stages`` stages.  It is least when every
    term is equal: T_{r+1} = (1 - 1/m) T_r, which makes it T / (1 - (1 - 1/m)^stages) (>= m T / stages)."""
    return total_s / (1.0 - (1.0 - 1.0 / micro_batches) ** stages)


def _layers(stage) -> int:
    return stage.stop - stage.start


@lru_cache(maxsize=128)
def _schedule(name: str, num_chunks: int, micro_batches: int, runtime: str) -> Schedule:
    """The order ``runtime`` runs: its engine's own where it runs the schedule (and has more than one
    stage: one stage has no transfers to place), else the schedule's, with eager transfers."""
    if name in ENGINE_SCHEDULES.get(runtime, ()) and num_chunks > 1:
        if runtime not in ENGINE_ORDERS:
            _load_adapter(runtime, name)
        return ENGINE_ORDERS[runtime](name, num_chunks, micro_batches)
    return parse_schedule(name).for_chunks(num_chunks, micro_batches)


def _load_adapter(runtime: str, name: str) -> None:
    """Import ``runtime``'s adapter, which registers its engine's order (``ENGINE_ADAPTERS``)."""
    import contextlib
    import importlib
    import sys

    module = ENGINE_ADAPTERS[runtime]
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout when imported
            importlib.import_module(module)
    except ImportError as e:
        raise StepModelError(f"the {runtime} runtime runs its engine's order of {name}, which {module} registers, "
                             f"and it cannot be imported ({e}): install DeepSpeed") from None
    if runtime not in ENGINE_ORDERS:
        raise StepModelError(f"{module} registered no engine order for the {runtime} runtime")


def processor_sharing(start_s: Sequence[float], work_s: Sequence[float]) -> list[float]:
    """Finish times of jobs that arrive at ``start_s`` and share one server equally while they overlap."""
    n = len(start_s)
    left = list(work_s)
    finish = [0.0] * n
    order = sorted(range(n), key=lambda i: start_s[i])
    t, running, k = 0.0, [], 0
    while k < n or running:
        if not running:
            t = max(t, start_s[order[k]])
        while k < n and start_s[order[k]] <= t:
            running.append(order[k])
            k += 1
        rate = 1.0 / len(running)
        first = min(running, key=lambda i: left[i])
        done_at = t + left[first] / rate
        nxt = start_s[order[k]] if k < n else float("inf")
        if nxt < done_at:  # another job arrives first: share until then
            for i in running:
                left[i] -= (nxt - t) * rate
            t = nxt
            continue
        gone = left[first]
        for i in running:
            left[i] -= gone
        t = done_at
        for i in [i for i in running if i == first or left[i] <= 1e-12 * max(1.0, work_s[i])]:
            finish[i] = t
            running.remove(i)
    return finish


def simulate_shared_cores(schedule: Schedule, costs: ChunkCosts, network: Network, cores: float | None, *,
                          wake_s: float = 0.0, timeline: bool = True,
                          alone_share: float = 1.0) -> tuple[StepSimulation, dict]:
    """The step where ranks share ``cores`` cores: an item that runs while k ranks compute takes
    max(1, k / cores) times as long (processor sharing), and a rank that slept at a rendezvous waits
    ``wake_s`` for a core when, besides its partner, enough other ranks compute to fill the cores.
    The share of an item's time during which no other rank computes runs ``alone_share`` as long.
    Found as a fixed point: simulate, measure each compute item's mean overlap with the others and
    who computes at each rendezvous, stretch and delay, simulate again."""
    shares_cores = bool(cores) and schedule.num_ranks > cores
    if not shares_cores and alone_share == 1.0:
        return simulate(schedule, costs, network=network, timeline=timeline), {}
    cores = cores if shares_cores else float(schedule.num_ranks)  # a core each: no stretch, no wake-up wait
    sim = simulate(schedule, costs, network=network)
    slowdown: dict = {}
    wake: dict = {}
    for _ in range(CONTENTION_ROUNDS):
        slots = [s for s in sim.timeline if s.work.kind in COMPUTE and s.end_s > s.start_s]
        target = {}
        for s in slots:
            overlap = sum(max(0.0, min(s.end_s, o.end_s) - max(s.start_s, o.start_s))
                          for o in slots if o.rank != s.rank)
            together = overlap / (s.end_s - s.start_s)  # mean count of other ranks computing alongside
            alone = 1.0 - min(1.0, together)
            target[(s.rank, s.work)] = max(1.0, (1.0 + together) / cores) * (1.0 - alone * (1.0 - alone_share))
        # damped, so that two items do not take turns being slowed
        slowdown = {k: (slowdown.get(k, 1.0) + v) / 2 for k, v in target.items()}
        if wake_s:
            for key, waiter, partner, t in sim.rendezvous:
                busy = 1 + sum(1 for s in slots if s.rank not in (waiter, partner) and s.start_s <= t < s.end_s)
                wake[key] = (wake.get(key, 0.0) + (wake_s if busy >= cores else 0.0)) / 2
        sim = simulate(schedule, costs, network=network, slowdown=slowdown, wake_s=wake)
    return sim, slowdown
