"""Lower bounds on a layout's step and memory, which the search prunes with (``plan.search``).

Each is a bound, not an estimate: no partition of the layout simulates to a shorter step or fits
in less memory on its heaviest rank (tests/test_plan.py checks both against evaluating every
layout).  The first two need only per-layer costs; the third knows the split.
"""

from __future__ import annotations

from ..costs.zero import state_bytes_per_param
from ..layout import Layout
from ..simulate.step_model import FixedStages, step_lower_bound
from .model import PlanModel


def layout_step_bound(model: PlanModel, lay: Layout) -> float:
    """No partition's predicted step is shorter: ``step_lower_bound`` with no stage fixed (every rank
    busy at least the mean of the work and of the update, which is affine in the parameters; the
    pipeline's least fill and drain)."""
    whole = model.whole_model(lay.tp, lay.sp, lay.micro_batch, lay.recompute, lay.ep)
    sm, m, p = model.step_model, lay.micro_batches, lay.pp
    rest = (sm.stage_forward_s(whole) + sm.stage_backward_s(whole)
            + (p - 1) * (sm.forward_fixed_s + sm.backward_fixed_s))  # every stage pays the fixed terms
    share = whole.param_bytes / p
    experts = sum(c.expert_param_bytes for c in model.costs_of(lay)) / p  # their own DP group and partition
    update = model.update_s(lay, share / model.e, expert_params=experts / model.e) + sm.optimizer_s(share)
    return step_lower_bound(FixedStages(m), rest_s=rest, rest_update_s=update, stages_left=p,
                            drains=p > 1 and lay.schedule_spec.drains, fixed_s=sm.step_fixed_s)


def memory_lower_bound(model: PlanModel, lay: Layout) -> float:
    """No split needs less on its heaviest rank: the model states spread evenly, or the largest layer."""
    _, params, largest, act = model.totals(lay.tp, lay.sp, lay.micro_batch, lay.recompute, lay.ep,
                                           model.zero3_linear(lay))
    per_param = state_bytes_per_param(lay.zero, lay.dp, model.e)
    return max(params * per_param / lay.pp, largest * per_param + act)


def split_step_bound(model: PlanModel, lay: Layout, parts: list[int]) -> float:
    """Tighter than ``layout_step_bound`` once the split is known: ``step_lower_bound`` with every
    chunk fixed (per rank, micro-batch 0's way to its first chunk, then all its work and its update;
    under 1F1B and GPipe also the last micro-batch's way back down to rank 0 before its update)."""
    if lay.pp == 1:
        return 0.0
    costs = model.costs_of(lay)
    stages = model.columns_of(lay).stages(parts, micro_batches=lay.micro_batches, schedule=lay.schedule_spec.name)
    sm = model.step_model
    order = lay.schedule_spec.chunk_rank(lay.pp)
    params, experts = [0.0] * lay.pp, [0.0] * lay.pp
    for st in stages:
        params[order[st.stage]] += st.param_bytes
        experts[order[st.stage]] += sum(c.expert_param_bytes for c in costs[parts[st.stage]:parts[st.stage + 1]])
    fixed = sm.split_bound(stages, lay.micro_batches, chunk_rank=order,
                           update_s=[model.update_s(lay, b / model.e, expert_params=x / model.e)
                                     for b, x in zip(params, experts)])
    # not under ZB-H1, whose deferred W overlap the descent, or with several chunks a rank
    drains = lay.schedule_spec.drains and lay.chunks_per_rank == 1
    return step_lower_bound(fixed, drains=drains, fixed_s=sm.step_fixed_s)
