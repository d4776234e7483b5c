"""One step of a pipeline of stages (one chunk per rank): the shortcuts the partition
plan, the run report and the iteration model call.  The schedules live in
``schedules.py`` and the simulation in ``events.py``."""

from __future__ import annotations

from collections.abc import Sequence

from .events import ChunkCosts, Link, Network, StepSimulation, simulate
from .schedules import build_schedule, parse_schedule


def simulate_1f1b(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    *,
    p2p_s: Sequence[float] | None = None,
    optimizer_s: Sequence[float] | None = None,
    schedule: str = "1f1b",
) -> StepSimulation:
    """Makespan of one step of ``schedule`` (1F1B unless said) over per-stage times.

    ``p2p_s[s]``: one transfer across the boundary between stage s and s + 1 (p - 1 entries),
    either way.  ``optimizer_s[s]``: stage s's optimizer step, after its last backward.
    """
    p = len(forward_s)
    if len(backward_s) != p or p == 0:
        raise ValueError("forward_s and backward_s need one entry per stage")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    comm = list(p2p_s) if p2p_s is not None else [0.0] * (p - 1)
    if len(comm) != p - 1:
        raise ValueError(f"p2p_s needs {p - 1} entries (one per boundary), got {len(comm)}")
    # one byte per boundary at 1 / seconds bytes/s: the transfer takes p2p_s[s]
    links = {}
    for s, t in enumerate(comm):
        if t > 0:
            links[(s, s + 1)] = links[(s + 1, s)] = Link(bandwidth=1.0 / t)
    return simulate(build_schedule(schedule, p, micro_batches),
                    ChunkCosts(list(forward_s), list(backward_s), output_bytes=[1.0] * p),
                    network=Network(links=links), optimizer_s=optimizer_s)


def simulate_stages(
    stages: Sequence,
    micro_batches: int,
    *,
    link_bandwidth: float | None = None,
    link_latency_s: float = 0.0,
    optimizer_s: Sequence[float] | None = None,
    schedule: str = "1f1b",
) -> StepSimulation:
    """One step of ``StageCost`` records (``costs.stage.stage_costs``): each boundary carries the
    stage's ``boundary_out_bytes`` forward and their gradient back over one link.  Under
    interleaved (``interleaved:V``) and DualPipeV the stages are the model chunks (V, or 2, per rank)."""
    costs = ChunkCosts([st.forward_s for st in stages], [st.backward_s for st in stages],
                       weight_grad_s=[st.weight_grad_s for st in stages],
                       output_bytes=[st.boundary_out_bytes for st in stages],
                       activation_bytes=[st.activation_bytes for st in stages])
    return simulate(parse_schedule(schedule).for_chunks(len(stages), micro_batches), costs,
                    network=Network(Link(link_latency_s, link_bandwidth)), optimizer_s=optimizer_s)
