"""Per-stage recompute for the planner's top layouts: after the search (not a dimension of it, so planning
keeps its speed), each runnable pipelined layout's split and every layer's recompute mode are chosen
together under the memory cap (``partition.partition_jointly``, on the layout's costs without recompute),
and kept beside the layout where the step that gives is shorter than the layout's own global setting's."""

from __future__ import annotations

from dataclasses import replace

from ..costs.peak import walks_schedule
from ..partition import InfeasibleMemoryCap, partition_jointly
from .model import LayoutCost, PlanModel


def stage_recompute(model: PlanModel, cost: LayoutCost) -> LayoutCost | None:
    """``cost``'s layout under the split and modes chosen together; None where that does not apply (no
    pipeline, several chunks a rank, a schedule the peak rule does not walk) or no split fits the cap."""
    lay = cost.layout
    if not (lay.pipelined and lay.runnable and lay.chunks_per_rank == 1 and walks_schedule(lay.schedule_spec)):
        return None
    plain = replace(lay, recompute="none")
    try:
        joint = partition_jointly(list(model.costs_of(plain)), lay.pp, memory_cap_gib=model.memory_cap / 2**30,
                                  micro_batches=lay.micro_batches, schedule=lay.schedule_spec.name,
                                  peak_rule=model.peak_rule(plain))
    except InfeasibleMemoryCap:
        return None
    out = model.evaluate(plain, joint.parts, check_memory=False, modes=joint.modes)
    out.layer_recompute = joint.modes
    return out


def apply_stage_recompute(model: PlanModel, top: list[LayoutCost]) -> None:
    """Attach to each top layout its per-stage recompute where that is faster and recomputes something
    (``LayoutCost.stage_recompute``); layouts alike but for their global recompute share one decision."""
    seen: dict = {}
    for cost in top:
        key = replace(cost.layout, recompute="none")
        if key not in seen:
            seen[key] = stage_recompute(model, cost)
        better = seen[key]
        # kept where some layer recomputes (a faster split without any is a matter of the split, not of this)
        if better is not None and better.step_s < cost.step_s and set(better.layer_recompute) != {"none"}:
            cost.stage_recompute = better


def describe(modes: list[str], parts: list[int]) -> list[str]:
    """Per stage that recomputes, which layers: "stage 0: full 1-4, selective 5-6"."""
    out = []
    for s, (i, j) in enumerate(zip(parts, parts[1:])):
        by_mode = {}
        for k in range(i, j):
            if modes[k] != "none":
                by_mode.setdefault(modes[k], []).append(k)
        if by_mode:
            out.append(f"stage {s}: " + ", ".join(f"{mode} {_ranges(ks)}" for mode, ks in by_mode.items()))
    return out or ["no layer recomputes"]


def _ranges(ks: list[int]) -> str:
    runs, start = [], ks[0]
    for a, b in zip(ks, ks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)
