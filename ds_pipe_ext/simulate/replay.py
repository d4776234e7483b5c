"""The event simulator's fast replays: ``events.simulate``'s sweep where it records nothing (no timeline,
no slowdown, no wake-ups), on flat lists indexed by integers instead of dicts of tuples, the same
sweep in the same order so every time is the same.  The planner replays tens of thousands of items a
layout; ``tests/test_schedule.py`` holds each replay equal to the recording one."""

from __future__ import annotations

from collections.abc import Sequence
from .links import Network
from .schedules import COMPUTE, Schedule


def replay(schedule: Schedule, durations: dict, out_bytes: Sequence[float], network: Network) -> list[float]:
    """Each rank's clock after its last item, for ``events.simulate`` without a timeline, slowdown or
    wake-ups: the fast replays, remembered on the schedule by what else they depend on (the planner replays one pipeline for layouts that differ in their ZeRO stage alone)."""
    key = (tuple(tuple(durations[k]) for k in COMPUTE), tuple(out_bytes), network.intra, network.inter,
           network.ranks_per_node, tuple(sorted(network.links.items())))
    seen = schedule.replays
    if key not in seen:
        if len(seen) >= 256:
            seen.clear()
        replay = _replay_explicit if schedule.explicit_comm else _replay_compute_only
        seen[key] = tuple(replay(schedule, durations, out_bytes, network))
    return list(seen[key])


def _replay_compute_only(schedule: Schedule, durations: dict, out_bytes: Sequence[float],
                         network: Network) -> list[float]:
    """``simulate``'s replay for a schedule of compute items only, with no slowdown and no timeline: the
    same sweep in the same order (so transfers queue on a link in the same order and every time is
    the same), on flat lists indexed by micro-batch x chunks + chunk instead of dicts of tuples - the
    planner replays tens of thousands of items a layout.  ``test_the_compute_only_replay_is_the_replay``
    holds the two equal."""
    p, n, m = schedule.num_ranks, schedule.num_chunks, schedule.micro_batches
    rank_of = schedule.chunk_rank
    # boundary c -> c + 1: (link index, busy seconds, latency) forward and backward, or None within a rank
    link_ids: dict[tuple[int, int], int] = {}
    fwd, bwd = [None] * n, [None] * n
    for c in range(n - 1):
        a, b = rank_of[c], rank_of[c + 1]
        if a == b:
            continue
        for src, dst, table in ((a, b, fwd), (b, a, bwd)):
            link = network.link(src, dst)
            table[c] = (link_ids.setdefault((src, dst), len(link_ids)), link.busy_s(out_bytes[c]), link.latency_s)
    link_free = [0.0] * len(link_ids)
    size = m * n
    done_f = [None] * size  # when F of (micro-batch, chunk) ended
    done_i = [None] * size  # when its I (or whole B) ended
    arrive_f = [None] * size  # when the input of (micro-batch, chunk) arrived
    arrive_g = [None] * size  # when the gradient of its output arrived
    dur = [durations[k] for k in COMPUTE]
    orders = schedule.compute_items
    clock, pos = [0.0] * p, [0] * p
    last = n - 1
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            order, k, t_r = orders[r], pos[r], clock[r]
            length = len(order)
            while k < length:
                kind, j, c = order[k]
                if kind == 0:  # F: needs its input
                    t = 0.0 if c == 0 else arrive_f[j]
                elif kind == 3:  # W: needs its own I
                    t = done_i[j]
                else:  # B or I: needs its own F and the gradient of its output
                    t = done_f[j]
                    if t is not None and c != last:
                        g = arrive_g[j]
                        t = None if g is None else (g if g > t else t)
                if t is None:
                    break
                end = (t_r if t_r > t else t) + dur[kind][c]
                t_r = end
                if kind == 0:
                    done_f[j] = end
                    if c != last:
                        hop = fwd[c]
                        if hop is None:
                            arrive_f[j + 1] = end
                        else:
                            lid, busy, latency = hop
                            free = link_free[lid]
                            link_free[lid] = free = (end if end > free else free) + busy
                            arrive_f[j + 1] = free + latency
                elif kind != 3:
                    done_i[j] = end
                    if c:
                        hop = bwd[c - 1]
                        if hop is None:
                            arrive_g[j - 1] = end
                        else:
                            lid, busy, latency = hop
                            free = link_free[lid]
                            link_free[lid] = free = (end if end > free else free) + busy
                            arrive_g[j - 1] = free + latency
                k += 1
            if k != pos[r]:
                remaining -= k - pos[r]
                pos[r], clock[r] = k, t_r
                progressed = True
        if not progressed:
            stuck = {r: schedule.orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: each rank waits on another ({stuck})")
    return clock


def _replay_explicit(schedule: Schedule, durations: dict, out_bytes: Sequence[float], network: Network) -> list[float]:
    """``simulate``'s replay for a schedule that places its transfers itself (DeepSpeed's engine), with no
    slowdown, no wake-ups and no timeline, on flat lists: the same sweep in the same order, so every
    rendezvous completes in the same order and every time is the same (the planner replays each
    layout's tens of thousands of sends and receives).  ``test_the_explicit_replay_is_the_replay`` holds
    the two equal."""
    p, n = schedule.num_ranks, schedule.num_chunks
    rank_of = schedule.chunk_rank
    # boundary (0: activation, 1: gradient) x chunks + upstream chunk -> (link index, busy seconds, latency)
    link_ids: dict[tuple[int, int], int] = {}
    hops = [None] * (2 * n)
    for lo in range(n - 1):
        a, b = rank_of[lo], rank_of[lo + 1]
        for what, (src, dst) in enumerate(((a, b), (b, a))):
            link = network.link(src, dst)
            hops[what * n + lo] = (link_ids.setdefault((src, dst), len(link_ids)), link.busy_s(out_bytes[lo]),
                                   link.latency_s)
    link_free = [0.0] * len(link_ids)
    dur = [durations[k] for k in COMPUTE] + [None]
    rendezvous = len(COMPUTE)
    posted_rank = [-1] * (2 * schedule.micro_batches * n)  # rendezvous -> the rank that posted first, or -1
    posted_s = [0.0] * len(posted_rank)
    orders = schedule.explicit_items
    waiting = [False] * p
    clock, pos = [0.0] * p, [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            order = orders[r]
            length = len(order)
            while pos[r] < length:
                code, a, b = order[pos[r]]
                if code != rendezvous:
                    clock[r] += dur[code][a]
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                if waiting[r]:
                    break
                other = posted_rank[a]
                if other < 0:  # posted first: the partner completes it when it posts
                    posted_rank[a], posted_s[a] = r, clock[r]
                    waiting[r] = True
                    break
                posted_rank[a] = -1
                waiting[other] = False
                lid, busy, latency = hops[b]
                t = clock[r] if clock[r] > posted_s[a] else posted_s[a]
                free = link_free[lid]
                link_free[lid] = free = (t if t > free else free) + busy
                clock[r] = clock[other] = free + latency
                pos[r] += 1
                pos[other] += 1
                remaining -= 2
                progressed = True
        if not progressed:
            stuck = {r: schedule.orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: each rank waits on another ({stuck})")
    return clock
