"""Pipeline schedules as plain data: the order each rank runs its work in.

A schedule is a list per rank of ``Work`` items - forward ``F``, whole backward ``B``,
or the backward split into its input-gradient half ``I`` and weight-gradient half
``W`` (zero-bubble schedules) - each for one micro-batch on one model *chunk*.  Chunks
are the model's slices in pipeline order (chunk c feeds chunk c + 1); a rank may hold
several (interleaved 1F1B holds v, DualPipeV two).  Nothing here knows about time:
``simulate.events`` runs these orders against costs and links.

    gpipe        every forward, then every backward (torch's ``ScheduleGPipe``)
    1f1b         PipeDream-flush, DeepSpeed's ``TrainSchedule`` order
    interleaved  Megatron's interleaved 1F1B, v chunks per rank (chunk c on rank c % p)
    zb-h1        1F1B with the weight gradients deferred into the bubbles (Qi et al. 2023,
                 the order of torch's ZB1P with one chunk per rank)
    dualpipev    DeepSeek's DualPipeV as DeepSpeed 0.19 runs it (``DualPipeVSchedule``): rank r
                 holds chunks r and 2p - 1 - r; weight gradients stay inside ``B``

Interleaved and ZB-H1 are simulated only: DeepSpeed has no engine for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import count
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
RUNTIMES = ("deepspeed", "megatron")  # the engines whose order of work the step model replays
SIMULATED_ONLY = ("interleaved", "zb-h1")  # no DeepSpeed engine runs them
COMPUTE = ("F", "B", "I", "W")


class Work(NamedTuple):  # a tuple: schedules hold m x chunks of them, built by the thousand in a plan
    # "F", "B" (whole backward), "I" (input gradient), "W" (weight gradient); where a schedule places
    # its transfers itself: "SA"/"RA" send/receive an activation, "SG"/"RG" a gradient
    kind: str
    micro_batch: int
    chunk: int = 0  # the model chunk, in pipeline order


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int
    micro_batches: int
    chunk_rank: tuple[int, ...]  # the rank that runs each chunk
    orders: tuple[tuple[Work, ...], ...]  # per rank, in execution order

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rank)

    @property
    def chunks_per_rank(self) -> int:
        return self.num_chunks // self.num_ranks

    @cached_property  # schedules are immutable and cached (``build_schedule``): scan the orders once
    def explicit_comm(self) -> bool:
        return any(w.kind not in COMPUTE for order in self.orders for w in order)

    @cached_property
    def replays(self) -> dict:
        """The event simulator's fast replays of this order, by their costs and links (``replay.replay``)."""
        return {}

    @cached_property
    def splits_backward(self) -> bool:
        return any(w.kind == "W" for order in self.orders for w in order)

    @cached_property
    def compute_items(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per rank, each item as (its kind's index in ``COMPUTE``, micro-batch x chunks + chunk, chunk):
        the event simulator's fast replay indexes flat lists with these."""
        code, n = {k: i for i, k in enumerate(COMPUTE)}, self.num_chunks
        return tuple(tuple((code[w.kind], w.micro_batch * n + w.chunk, w.chunk) for w in order)
                     for order in self.orders)

    @cached_property
    def explicit_items(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per rank, for a schedule that places its transfers itself: a compute item as (its kind's
        index in ``COMPUTE``, chunk, 0); a send or receive as (len(COMPUTE), its rendezvous's flat index,
        0 for an activation or 1 for a gradient x chunks + the boundary's upstream chunk)."""
        code, n, m = {k: i for i, k in enumerate(COMPUTE)}, self.num_chunks, self.micro_batches
        upstream = {"SA": 0, "RA": -1, "SG": -1, "RG": 0}  # the boundary's upstream chunk, from the item's chunk

        def item(w: Work) -> tuple[int, int, int]:
            if w.kind in code:
                return code[w.kind], w.chunk, 0
            what = 0 if w.kind[1] == "A" else 1
            lo = w.chunk + upstream[w.kind]
            return len(COMPUTE), (what * m + w.micro_batch) * n + lo, what * n + lo

        return tuple(tuple(item(w) for w in order) for order in self.orders)

    @cached_property
    def work_counts(self) -> tuple[dict[tuple[str, int], int], ...]:
        """Per rank, how many items of each (kind, chunk) its order runs (busy time without a replay)."""
        out = []
        for order in self.orders:
            counts: dict[tuple[str, int], int] = {}
            for w in order:
                counts[(w.kind, w.chunk)] = counts.get((w.kind, w.chunk), 0) + 1
            out.append(counts)
        return tuple(out)

    @cached_property
    def held_peak_counts(self) -> tuple[float, ...]:
        """``held_peak(r)`` of every rank, in micro-batch chunks."""
        return tuple(self.held_peak(r) for r in range(self.num_ranks))

    @cached_property
    def chunk_held_peak_counts(self) -> tuple[int, ...]:
        """Per chunk, the most of its micro-batches held at once (each chunk counted alone: what
        ``held_peak`` gives with that chunk's weight 1 and the others' 0), in one pass per rank."""
        last = "W" if self.splits_backward else "B"
        held, peak = [0] * self.num_chunks, [0] * self.num_chunks
        for order in self.orders:
            for w in order:
                if w.kind == "F":
                    held[w.chunk] += 1
                    peak[w.chunk] = max(peak[w.chunk], held[w.chunk])
                elif w.kind == last:
                    held[w.chunk] -= 1
        return tuple(peak)

    def held_peak(self, rank: int, chunk_weight=None) -> float:
        """Peak of what ``rank`` holds: a micro-batch's activations on a chunk live from its ``F``
        until its last backward part (``W`` where the backward is split).  Counted in micro-batch
        chunks, or weighted by ``chunk_weight[c]`` (bytes).  The rank runs its order one item at a
        time, so the peak follows from the order alone, whatever the timings."""
        weight = chunk_weight if chunk_weight is not None else [1.0] * self.num_chunks
        last = "W" if self.splits_backward else "B"
        held = peak = 0.0
        for w in self.orders[rank]:
            if w.kind == "F":
                held += weight[w.chunk]
                peak = max(peak, held)
            elif w.kind == last:
                held -= weight[w.chunk]
        return peak


@lru_cache(maxsize=512)  # the planner asks for the same few schedules across thousands of layouts
def build_schedule(name: str, num_ranks: int, micro_batches: int, *, virtual_stages: int = 1) -> Schedule:
    """The ``Schedule`` called ``name`` for ``num_ranks`` ranks and ``micro_batches`` micro-batches."""
    p, m = num_ranks, micro_batches
    if p < 1 or m < 1:
        raise ValueError(f"a schedule needs at least one rank and one micro-batch, got p={p}, m={m}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if virtual_stages != 1 and name != "interleaved":
        raise ValueError(f"--virtual-stages applies to the interleaved schedule, not {name!r}")
    if name == "interleaved":
        v = virtual_stages
        if v < 2:
            raise ValueError("interleaved 1F1B needs virtual_stages >= 2 (with 1 it is 1f1b)")
        if m % p:
            raise ValueError(f"interleaved 1F1B needs micro-batches a multiple of the stages (Megatron's rule): "
                             f"m={m}, p={p}")
        return Schedule(name, p, m, tuple(c % p for c in range(v * p)), tuple(_interleaved(r, p, m, v) for r in range(p)))
    if name == "dualpipev":
        if m < 2 * p:
            raise ValueError(f"DualPipeV needs at least 2 x stages micro-batches (DeepSpeed's rule): m={m}, p={p}")
        chunk_rank = tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))
        return Schedule(name, p, m, chunk_rank, tuple(_dualpipev(r, p, m) for r in range(p)))
    order = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}[name]
    return Schedule(name, p, m, tuple(range(p)), tuple(order(r, p, m) for r in range(p)))


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule by name, apart from the ranks and micro-batches it runs: the one reading of a
    schedule name (``parse_schedule``).  It answers which rank runs each chunk, how many chunks a
    rank holds and how many micro-batches each chunk holds, as DeepSpeed's ``TrainSchedule``
    answers ``num_pipe_buffers`` beside ``steps``."""

    kind: str  # one of SCHEDULES
    virtual_stages: int = 1  # interleaved: model chunks per rank (v >= 2); 1 for every other kind

    @property
    def name(self) -> str:
        """The canonical spelling, which ``parse_schedule`` reads back: ``interleaved:3``, ``1f1b``."""
        return f"{self.kind}:{self.virtual_stages}" if self.kind == "interleaved" else self.kind

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks a rank runs: 2 under DualPipeV, v under interleaved, else 1."""
        return {"dualpipev": 2, "interleaved": self.virtual_stages}.get(self.kind, 1)

    @property
    def simulated_only(self) -> bool:
        """No DeepSpeed engine runs it (ranked and simulated, never emitted as a ds.json)."""
        return self.kind in SIMULATED_ONLY

    @property
    def drains(self) -> bool:
        """Whether the last micro-batch's whole backward runs down every stage before rank 0's update
        (one chunk a rank, no weight gradient deferred): the step search's drain bound holds."""
        return self.kind in ("1f1b", "gpipe")

    def chunk_rank(self, num_ranks: int) -> tuple[int, ...]:
        """The rank that runs each chunk, in pipeline order: round robin, or V-shaped under DualPipeV."""
        p = num_ranks
        if self.kind == "dualpipev":
            return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))
        return tuple(c % p for c in range(self.chunks_per_rank * p))

    def for_ranks(self, num_ranks: int, micro_batches: int) -> Schedule:
        return build_schedule(self.kind, num_ranks, micro_batches, virtual_stages=self.virtual_stages)

    def for_chunks(self, num_chunks: int, micro_batches: int) -> Schedule:
        """The schedule over ``num_chunks`` model chunks (pipeline stages, in the partitioner's sense)."""
        if num_chunks % self.chunks_per_rank:
            raise ValueError(f"the {self.name} schedule runs {self.chunks_per_rank} stages per rank: "
                             f"num_stages={num_chunks} is not a multiple of {self.chunks_per_rank}")
        return self.for_ranks(num_chunks // self.chunks_per_rank, micro_batches)

    @lru_cache(maxsize=512)  # the partitioner asks it per stage of every split it probes
    def in_flight(self, num_chunks: int, micro_batches: int) -> tuple[int, ...]:
        """Per chunk, the most micro-batches whose activations it holds at once, read off the order; for
        one chunk a rank, from the order's form (the planner asks it of layouts it never simulates, and
        building their orders was a tenth of its time): GPipe holds all m, 1F1B min(p - r, m) on rank r
        (its warm-up and the steady forward), ZB-H1 min(p, m) on every rank (each of rank r's first r
        steady input gradients defers its weight gradient).  ``test_in_flight_forms_are_the_orders``."""
        p, m = num_chunks, micro_batches
        if self.kind == "gpipe":
            return (m,) * p
        if self.kind == "1f1b":
            return tuple(min(p - r, m) for r in range(p))
        if self.kind == "zb-h1":
            return (min(p, m),) * p
        return self.for_chunks(num_chunks, micro_batches).chunk_held_peak_counts


@lru_cache(maxsize=64)
def _parse(text: str) -> ScheduleSpec:
    kind, sep, v = text.strip().lower().partition(":")
    if kind in SCHEDULES and not sep:
        return ScheduleSpec(kind, 2 if kind == "interleaved" else 1)
    if kind == "interleaved" and v.isdigit() and int(v) >= 2:
        return ScheduleSpec(kind, int(v))
    raise ValueError(f"unknown pipeline schedule {text!r}; known: {', '.join(SCHEDULES)} "
                     f"(interleaved:V for V >= 2 model chunks a rank; interleaved alone is V = 2)")


def parse_schedule(schedule: "str | ScheduleSpec") -> ScheduleSpec:
    """The one parser of schedule names: ``1f1b``, ``gpipe``, ``zb-h1``, ``dualpipev``, ``interleaved``
    (2 chunks a rank) or ``interleaved:V``.  A ``ValueError`` lists the names it knows."""
    if isinstance(schedule, ScheduleSpec):
        return schedule
    if not isinstance(schedule, str):
        raise ValueError(f"a pipeline schedule is a name such as '1f1b', got {schedule!r}")
    return _parse(schedule)


def _gpipe(rank: int, p: int, m: int) -> tuple[Work, ...]:
    return tuple([Work("F", i, rank) for i in range(m)] + [Work("B", i, rank) for i in range(m)])


def _one_f_one_b(rank: int, p: int, m: int, backward: str = "B") -> tuple[Work, ...]:
    """min(p - r - 1, m) warm-up forwards, then one forward and one backward, then the rest."""
    warmup = min(p - rank - 1, m)
    order = [Work("F", i, rank) for i in range(warmup)]
    for f in range(warmup, m):
        order += [Work("F", f, rank), Work(backward, f - warmup, rank)]
    order += [Work(backward, i, rank) for i in range(m - warmup, m)]
    return tuple(order)


def _zb_h1(rank: int, p: int, m: int) -> tuple[Work, ...]:
    """1F1B with ``I`` for ``B``; rank r runs its first r steady ``I`` without a ``W`` and from then
    on follows each ``I`` with the oldest pending ``W``; the deferred ``W`` fill the tail."""
    order, pending, seen = [], [], 0
    for w in _one_f_one_b(rank, p, m, backward="I"):
        order.append(w)
        if w.kind == "I":
            pending.append(w.micro_batch)
            seen += 1
            if seen > rank:
                order.append(Work("W", pending.pop(0), rank))
    return tuple(order + [Work("W", i, rank) for i in pending])


def _interleaved(rank: int, p: int, m: int, v: int) -> tuple[Work, ...]:
    """Megatron's interleaved 1F1B: work item k of a rank's forwards runs local chunk (k mod pv) // p
    on micro-batch (k // pv) p + k mod p (backwards walk the chunks in reverse); the warm-up is
    2 (p - r - 1) + (v - 1) p forwards."""
    total = m * v

    def item(kind: str, k: int) -> Work:
        local = (k % (p * v)) // p
        if kind == "B":
            local = v - 1 - local
        return Work(kind, (k // (p * v)) * p + k % p, local * p + rank)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [item("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [item("F", warmup + k), item("B", k)]
    order += [item("B", k) for k in range(total - warmup, total)]
    return tuple(order)


def _dualpipev(rank: int, p: int, m: int) -> tuple[Work, ...]:
    """DeepSpeed's ``DualPipeVSchedule`` compute order (phase 0 = chunk r, phase 1 = chunk 2p-1-r)."""
    chunk = (rank, 2 * p - 1 - rank)
    counters = {(k, ph): count() for k in "FB" for ph in (0, 1)}

    def run(*steps: str) -> list[Work]:  # "F0" = forward of phase 0's next micro-batch
        return [Work(s[0], next(counters[(s[0], int(s[1]))]), chunk[int(s[1])]) for s in steps]

    later = p - rank - 1  # ranks after this one
    order = run(*["F0"] * 2 * later)
    for _ in range(rank + 1):
        order += run("F0", "F1")
    for _ in range(later):
        order += run("B1", "F1")
    for _ in range(m - 2 * p + rank + 1):
        order += run("F0", "B1", "F1", "B0")
    for _ in range(later):
        order += run("B1", "F1", "B0")
    for _ in range(rank + 1):
        order += run("B1", "B0")
    order += run(*["B0"] * later)
    return tuple(order)
