"""1F1B pipeline schedule as plain data, and an event simulation of one training step.

Pure Python: stage times in, step time out.  The order of work on each stage is
DeepSpeed's ``TrainSchedule`` (PipeDream-flush 1F1B): stage s runs
min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards.  Dependencies: a forward needs the previous
stage's forward of the same micro-batch (plus the p2p transfer), a backward needs
the next stage's backward of it (plus the transfer).  A step ends when every stage
has finished its backwards and its optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def one_f_one_b_order(stage: int, num_stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """[("F", i) | ("B", i), ...]: the order stage ``stage`` executes its micro-batches."""
    warmup = min(num_stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < micro_batches:
        order.append(("F", f))
        f += 1
        order.append(("B", b))
        b += 1
    order += [("B", i) for i in range(b, micro_batches)]
    return order


@dataclass(frozen=True)
class StepSimulation:
    step_s: float
    stage_busy_s: list[float]  # compute time per stage (fwd + bwd + optimizer)
    stage_finish_s: list[float]  # when each stage finished its optimizer step
    bubble_fraction: float  # 1 - busy / (p * step) : the idle share of the pipeline


def simulate_1f1b(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    micro_batches: int,
    *,
    p2p_s: Sequence[float] | None = None,
    optimizer_s: Sequence[float] | None = None,
) -> StepSimulation:
    """Makespan of one 1F1B step.

    ``forward_s[s]``/``backward_s[s]``: per-micro-batch time of stage s.
    ``p2p_s[s]``: one transfer across the boundary between stage s and s + 1 (p - 1 entries).
    ``optimizer_s[s]``: stage s's optimizer step (and gradient reduction), after its last backward.
    """
    p = len(forward_s)
    if len(backward_s) != p or p == 0:
        raise ValueError("forward_s and backward_s need one entry per stage")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    comm = list(p2p_s) if p2p_s is not None else [0.0] * (p - 1)
    if len(comm) != p - 1:
        raise ValueError(f"p2p_s needs {p - 1} entries (one per boundary), got {len(comm)}")
    opt = list(optimizer_s) if optimizer_s is not None else [0.0] * p
    orders = [one_f_one_b_order(s, p, micro_batches) for s in range(p)]
    done_f = [[None] * micro_batches for _ in range(p)]
    done_b = [[None] * micro_batches for _ in range(p)]
    clock = [0.0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else done_f[s - 1][i]
                    if dep is None:
                        break
                    start = max(clock[s], dep + (comm[s - 1] if s > 0 else 0.0))
                    clock[s] = done_f[s][i] = start + forward_s[s]
                else:
                    dep = done_f[s][i] if s == p - 1 else done_b[s + 1][i]
                    if dep is None:
                        break
                    start = max(clock[s], dep + (comm[s] if s < p - 1 else 0.0))
                    clock[s] = done_b[s][i] = start + backward_s[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the 1F1B order never deadlocks
            raise RuntimeError("schedule deadlocked")
    finish = [clock[s] + opt[s] for s in range(p)]
    step = max(finish)
    busy = [micro_batches * (forward_s[s] + backward_s[s]) + opt[s] for s in range(p)]
    return StepSimulation(step, busy, finish, 1.0 - sum(busy) / (p * step) if step > 0 else 0.0)


def simulate_stages(
    stages: Sequence,
    micro_batches: int,
    *,
    link_bandwidth: float | None = None,
    optimizer_s: Sequence[float] | None = None,
) -> StepSimulation:
    """One step of ``StageCost`` records (``costs.stage.stage_costs``) under 1F1B.

    Each boundary delays its consumer by one transfer of the activation (forward) or
    of its gradient (backward): ``boundary_out_bytes / link_bandwidth``.
    """
    p2p = [st.boundary_out_bytes / link_bandwidth if link_bandwidth else 0.0 for st in stages[:-1]]
    return simulate_1f1b([st.forward_s for st in stages], [st.backward_s for st in stages], micro_batches,
                         p2p_s=p2p, optimizer_s=optimizer_s)
