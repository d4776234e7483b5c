"""An event simulation of one training step: any ``Schedule`` against costs and links.

Pure Python: per-chunk times, boundary bytes and a ``Network`` in, step time,
bubble, per-rank busy time, peak activations held and a timeline out.

Rules:
* A rank runs its order one item at a time; an item starts when the rank is free and
  its inputs are there.  ``F`` of chunk c needs chunk c - 1's output of that
  micro-batch; ``B``/``I`` of chunk c needs its own ``F`` and chunk c + 1's input
  gradient; ``W`` needs its own ``I``.
* Between ranks a tensor travels on the directed link (src, dst): it leaves when its
  producer finishes, waits for the link's earlier transfers (one at a time per
  direction), takes bytes / bandwidth and arrives ``latency`` later.  Within a rank it
  is there at once.  The gradient is as large as the activation it answers.
* A schedule may instead place its transfers itself (``Schedule.explicit_comm``: DeepSpeed's
  engine, ``pipe.engine_schedule``): send and receive items (``SA``/``RA`` activations,
  ``SG``/``RG`` gradients) that block both ranks until the other side has posted - a
  rendezvous, as gloo and NCCL sends are - and then for the link's time.  Compute items
  then wait only for the items before them on their rank.  ``wake_s[key]`` delays the rank that
  posted first (it slept, and needs a core back: ranks sharing CPU cores, ``step_model``).
* After its last item a rank runs its optimizer step (and gradient reduction); the step
  ends when the last rank has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .links import Link, Network  # noqa: F401 (the simulator's links, imported from here)
from .replay import replay
from .schedules import COMPUTE, Schedule, Work

# a send or receive item -> its rendezvous key: (what, micro-batch, the boundary's upstream chunk)
RENDEZVOUS = {
    "SA": lambda i, c: ("A", i, c),  # chunk c sends its output to c + 1
    "RA": lambda i, c: ("A", i, c - 1),  # chunk c receives its input from c - 1
    "SG": lambda i, c: ("G", i, c - 1),  # chunk c sends its input's gradient to c - 1
    "RG": lambda i, c: ("G", i, c),  # chunk c receives its output's gradient from c + 1
}


@dataclass(frozen=True)
class ChunkCosts:
    """Per chunk (in pipeline order), per micro-batch."""

    forward_s: Sequence[float]
    backward_s: Sequence[float]  # the whole backward (I + W)
    weight_grad_s: Sequence[float] | None = None  # its W part where the schedule splits it; None: half
    output_bytes: Sequence[float] | None = None  # the activation chunk c sends to chunk c + 1
    activation_bytes: Sequence[float] | None = None  # held per micro-batch in flight

    def duration(self, w: Work) -> float:
        c = w.chunk
        if w.kind == "F":
            return self.forward_s[c]
        if w.kind == "B":
            return self.backward_s[c]
        weight = self.weight_grad_s[c] if self.weight_grad_s is not None else self.backward_s[c] / 2
        return weight if w.kind == "W" else self.backward_s[c] - weight


@dataclass(frozen=True)
class Slot:
    rank: int
    work: Work
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StepSimulation:
    step_s: float
    stage_busy_s: list[float]  # compute per rank (its work + optimizer step)
    stage_finish_s: list[float]  # when each rank finished its optimizer step
    bubble_fraction: float  # 1 - busy / (p x step): the idle share of the pipeline
    held_peak: list[float] = field(default_factory=list)  # per rank: micro-batch chunks held at the peak
    held_peak_bytes: list[float] = field(default_factory=list)  # the same in bytes, where known
    timeline: list[Slot] = field(default_factory=list)
    rendezvous: list[tuple] = field(default_factory=list)  # (key, rank that waited, its partner, completion time)


def simulate(schedule: Schedule, costs: ChunkCosts, *, network: Network = Network(),
             optimizer_s: Sequence[float] | None = None,
             slowdown: Mapping[tuple[int, Work], float] | None = None,
             wake_s: Mapping[tuple, float] | None = None, timeline: bool = True) -> StepSimulation:
    """``slowdown[(rank, work)]`` stretches one compute item, ``wake_s[key]`` delays the rank that waited at
    one rendezvous (ranks sharing CPU cores: ``step_model``).
    ``timeline=False`` keeps no per-item slots (the planner simulates thousands of items a layout)."""
    p, n = schedule.num_ranks, schedule.num_chunks
    for name in ("forward_s", "backward_s", "weight_grad_s", "output_bytes", "activation_bytes"):
        values = getattr(costs, name)
        if values is not None and len(values) != n:
            raise ValueError(f"{name} needs one entry per chunk ({n}), got {len(values)}")
    opt = list(optimizer_s) if optimizer_s is not None else [0.0] * p
    if len(opt) != p:
        raise ValueError(f"optimizer_s needs one entry per rank ({p}), got {len(opt)}")
    out_bytes = costs.output_bytes if costs.output_bytes is not None else [0.0] * n
    rank_of = schedule.chunk_rank
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, chunk) -> finish time
    arrive: dict[tuple[str, int, int], float] = {}  # (F|G, micro-batch, consumer chunk) -> arrival
    link_free: dict[tuple[int, int], float] = {}
    links: dict[tuple[int, int], Link] = {}
    clock, pos = [0.0] * p, [0] * p
    slots: list[Slot] = []
    record = slots.append

    def book(src: int, dst: int, nbytes: float, t: float) -> tuple[float, float]:
        """A transfer ready at t on the directed link (src, dst): (its start, its arrival)."""
        pair = (src, dst)
        link = links.get(pair) or links.setdefault(pair, network.link(src, dst))
        start = max(t, link_free.get(pair, 0.0))
        link_free[pair] = free = start + link.busy_s(nbytes)
        return start, free + link.latency_s

    def send(kind: str, mb: int, src_chunk: int, dst_chunk: int, t: float) -> None:
        src, dst = rank_of[src_chunk], rank_of[dst_chunk]
        arrive[(kind, mb, dst_chunk)] = t if src == dst else book(src, dst, out_bytes[min(src_chunk, dst_chunk)], t)[1]

    explicit = schedule.explicit_comm
    durations = {kind: [costs.duration(Work(kind, 0, c)) for c in range(n)] for kind in COMPUTE}
    if not (slowdown or timeline or wake_s):
        return _summary(schedule, costs, replay(schedule, durations, out_bytes, network), opt, slowdown, [])
    stretch = (lambda r, w: slowdown.get((r, w), 1.0)) if slowdown else (lambda r, w: 1.0)  # noqa: E731
    posted: dict[tuple[str, int, int], tuple[int, float]] = {}  # rendezvous key -> (rank, post time)
    waiting = [False] * p  # posted a send or receive whose partner has not
    met: list[tuple] = []  # (key, rank that waited, its partner, completion time)
    wake = wake_s or {}

    def ready(w: Work) -> float | None:
        i, c = w.micro_batch, w.chunk
        if explicit:  # the rank's own receive items come first
            return 0.0
        if w.kind == "F":
            return 0.0 if c == 0 else arrive.get(("F", i, c))
        own = done.get(("F", i, c))
        if w.kind == "W":
            return done.get(("I", i, c))
        if c == n - 1 or own is None:
            return own
        grad = arrive.get(("G", i, c))
        return None if grad is None else max(own, grad)

    def rendezvous(r: int, w: Work) -> bool:
        """Post ``w`` (a send or receive) on rank r; complete it with its partner if that has posted."""
        key = RENDEZVOUS[w.kind](w.micro_batch, w.chunk)
        if key not in posted:
            posted[key] = (r, clock[r])
            waiting[r] = True
            return False
        other, t_other = posted.pop(key)
        waiting[other] = False
        lo = key[2]
        src, dst = (rank_of[lo], rank_of[lo + 1]) if key[0] == "A" else (rank_of[lo + 1], rank_of[lo])
        # the side that posted earlier in time slept until the other came (ties: the one posted first here)
        slept, came = (other, r) if t_other <= clock[r] else (r, other)
        start, clock[r] = book(src, dst, out_bytes[lo], max(clock[r], t_other))
        clock[other] = clock[r]
        clock[slept] += wake.get(key, 0.0)
        met.append((key, slept, came, clock[came]))
        for rank in (r, other):
            if timeline:
                record(Slot(rank, schedule.orders[rank][pos[rank]], start, clock[rank]))
            pos[rank] += 1
        return True

    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for r in range(p):
            order = schedule.orders[r]
            while pos[r] < len(order):
                w = order[pos[r]]
                if w.kind in RENDEZVOUS:
                    if waiting[r] or not rendezvous(r, w):
                        break  # posted: the partner completes it when it posts
                    remaining -= 2
                    progressed = True
                    continue
                t = ready(w)
                if t is None:
                    break
                kind, i, c = w
                start = clock[r] if clock[r] > t else t
                end = start + (durations[kind][c] * stretch(r, w) if slowdown else durations[kind][c])
                clock[r] = done[w] = end  # a Work is the tuple (kind, micro-batch, chunk)
                if timeline:
                    record(Slot(r, w, start, end))
                if explicit:
                    pass
                elif kind == "F":
                    if c < n - 1:
                        send("F", i, c, c + 1, end)
                elif c > 0 and kind != "W":
                    send("G", i, c, c - 1, end)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule.orders[r][pos[r]] for r in range(p) if pos[r] < len(schedule.orders[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: each rank waits on another ({stuck})")
    return _summary(schedule, costs, clock, opt, slowdown, slots, met)


def _summary(schedule: Schedule, costs: ChunkCosts, clock: list[float], opt: list[float],
             slowdown: Mapping | None, slots: list[Slot], met: list[tuple] = ()) -> StepSimulation:
    """The step from each rank's last item's end: its update, busy time, bubble and what it held."""
    p = schedule.num_ranks
    finish = [clock[r] + opt[r] for r in range(p)]
    step = max(finish)
    if slowdown:
        busy = [sum(costs.duration(w) * slowdown.get((r, w), 1.0) for w in schedule.orders[r] if w.kind in COMPUTE)
                + opt[r] for r in range(p)]
    else:  # the same sum, an item kind at a time
        busy = [sum(k * costs.duration(Work(kind, 0, c)) for (kind, c), k in schedule.work_counts[r].items()
                    if kind in COMPUTE) + opt[r] for r in range(p)]
    held = list(schedule.held_peak_counts)
    held_bytes = ([schedule.held_peak(r, costs.activation_bytes) for r in range(p)]
                  if costs.activation_bytes is not None else [])
    return StepSimulation(step, busy, finish, 1.0 - sum(busy) / (p * step) if step > 0 else 0.0, held, held_bytes,
                          slots, list(met))
