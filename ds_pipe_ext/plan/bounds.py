"""Lower bounds on a layout's step and memory, which the search prunes with (``plan.search``).

Each is a bound, not an estimate: no partition of the layout simulates to a shorter step or fits
in less memory on its heaviest rank (tests/test_plan.py checks both against evaluating every
layout).  The first two need only per-layer costs; the third knows the split.
"""

from __future__ import annotations

from ..costs.stage import stage_costs
from ..costs.zero import state_bytes_per_param
from ..layout import Layout
from ..simulate.step_model import least_drain_s
from .model import PlanModel


def step_lower_bound(model: PlanModel, lay: Layout) -> float:
    """No partition's simulated step is shorter: the ranks' average busy time (m x their share of
    one micro-batch's work, plus the update of their share of the parameters, which is linear in
    them)."""
    total_s, params, _, _ = model.totals(lay.tp, lay.sp, lay.micro_batch, lay.recompute)
    share = 1.0 / lay.pp
    bound = lay.micro_batches * total_s * share + model.update_s(lay, params * share)
    if lay.pp > 1 and lay.schedule_spec.drains:
        # and the pipeline's fill and drain: with T_r a stage's F + B and P_r the stages before it,
        # the step is at least max_r (P_r + m T_r) (``step_lower_bound_after_partition``), at least
        # its least value over every split of T = sum T_r
        bound = max(bound, least_drain_s(total_s, lay.micro_batches, lay.pp))
    return bound


def memory_lower_bound(model: PlanModel, lay: Layout) -> float:
    """No split needs less on its heaviest rank: the model states spread evenly, or the largest layer."""
    _, params, largest, act = model.totals(lay.tp, lay.sp, lay.micro_batch, lay.recompute)
    per_param = state_bytes_per_param(lay.zero, lay.dp, model.e)
    return max(params * per_param / lay.pp, largest * per_param + act)


def step_lower_bound_after_partition(model: PlanModel, lay: Layout, parts: list[int]) -> float:
    """Tighter than ``step_lower_bound`` once the split is known: per rank, micro-batch 0's way to
    its first chunk, then all its compute and its update; under 1F1B and GPipe also the last
    micro-batch's way back down to rank 0 before rank 0's update.  Valid for every schedule (each
    term is a chain of work that runs one after another)."""
    if lay.pp == 1:
        return 0.0
    costs = model.layer_costs(lay.tp, lay.sp, lay.micro_batch, lay.recompute)
    stages = stage_costs(costs, parts, micro_batches=lay.micro_batches, recompute=lay.recompute == "full",
                         schedule=lay.schedule_spec.name)
    m = lay.micro_batches
    per_rank = [0.0] * lay.pp
    params = [0.0] * lay.pp
    head = [None] * lay.pp  # when micro-batch 0 can first reach the rank: its first chunk's input
    order = lay.schedule_spec.chunk_rank(lay.pp)
    reach = 0.0
    for st in stages:
        r = order[st.stage]
        head[r] = reach if head[r] is None else head[r]
        reach += st.forward_s
        per_rank[r] += m * (st.forward_s + st.backward_s)
        params[r] += st.param_bytes / model.e
    bound = max(h + t + model.update_s(lay, p) for h, t, p in zip(head, per_rank, params))
    if lay.schedule_spec.drains:  # a rank's last item is B of the last micro-batch, whose
        # input gradient then runs down every earlier stage before rank 0's update (not so under
        # ZB-H1, whose deferred W overlap that descent, or with several chunks a rank)
        first_update = model.update_s(lay, params[0])
        before = 0.0
        for st in stages:
            bound = max(bound, before + m * (st.forward_s + st.backward_s) + first_update)
            before += st.forward_s + st.backward_s
    return bound

