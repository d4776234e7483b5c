"""The search: every layout, pruned by memory and by a lower bound on its step before it is simulated.

1. Each layout gets two closed-form bounds from per-layer costs alone (no partition): the least
   memory its heaviest rank can need, and the least step time any split can reach
   (``bounds.layout_step_bound``).  A layout whose memory bound exceeds the cap is out (OOM).
2. The rest are taken in order of the step bound.  Once K layouts are simulated and the next bound
   is not below the K-th best step, no later layout can enter the top K: they are "worse", unseen.
3. A layout that is taken gets its exact memory-capped partition (OOM if none fits), a tighter bound
   from that split, and only then the event simulation.  The pick and the best layout DeepSpeed runs
   are then evaluated on the split an ``analytic`` run of them chooses (``PlanModel.run_split``).
4. Only when nothing fits is the least memory any layout needs worked out (exact, per layout, in
   order of the memory bound, stopping once no later layout can need less): the error's figure.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from .bounds import layout_step_bound, memory_lower_bound, split_step_bound
from .model import LayoutCost, OutOfMemory, PlanModel
from ..layout import Layout
from .space import PlanError


@dataclass
class PlanResult:
    top: list[LayoutCost]  # best first
    dropped: Counter = field(default_factory=Counter)  # reason -> layouts
    candidates: int = 0
    simulated: int = 0
    partitioned: int = 0
    smallest_oom_need: float | None = None  # the least memory an OOM layout needed

    def best_runnable(self) -> LayoutCost | None:
        return next((c for c in self.top if c.layout.runnable), None)


def search(model: PlanModel, layouts: list[Layout], *, top_k: int = 10, progress=None) -> PlanResult:
    res = PlanResult(top=[], candidates=len(layouts))
    oom: list[tuple[float, Layout]] = []  # (memory bound, layout) of every layout that did not fit
    bounded = []
    for lay in layouts:
        need = memory_lower_bound(model, lay)
        if need > model.memory_cap:
            res.dropped["OOM (memory bound)"] += 1
            oom.append((need, lay))
            continue
        bounded.append((layout_step_bound(model, lay), lay))
    bounded.sort(key=lambda item: (item[0], item[1].name))
    steps: list[float] = []  # the top K's steps, ascending

    def kth() -> float:
        return steps[top_k - 1] if len(steps) >= top_k else float("inf")

    # the best runnable layout is always kept beside the top K (the ds.json to emit)
    runnable_best: LayoutCost | None = None

    def beaten(bound: float, lay: Layout) -> bool:
        """No split of it can enter the top K, nor (runnable) beat the best runnable layout found."""
        if bound < kth():
            return False
        return not lay.runnable or (runnable_best is not None and bound >= runnable_best.step_s)

    for i, (bound, lay) in enumerate(bounded):
        if progress is not None:
            progress(i, len(bounded))
        if beaten(bound, lay):
            if runnable_best is not None and bound >= runnable_best.step_s:  # so are all later ones
                res.dropped["worse (step bound above the top K)"] += len(bounded) - i
                break
            res.dropped["worse (step bound above the top K)"] += 1
            continue
        try:
            parts = model.partition(lay)
        except OutOfMemory:
            res.dropped["OOM (no split fits)"] += 1
            oom.append((memory_lower_bound(model, lay), lay))
            continue
        res.partitioned += 1
        if beaten(split_step_bound(model, lay, parts), lay):
            res.dropped["worse (step bound above the top K)"] += 1
            continue
        try:
            cost = model.evaluate(lay, parts)
        except OutOfMemory:
            res.dropped["OOM (model states or activations above the cap)"] += 1
            oom.append((memory_lower_bound(model, lay), lay))
            continue
        res.simulated += 1
        if lay.runnable and (runnable_best is None or cost.step_s < runnable_best.step_s):
            runnable_best = cost
        pos = bisect.bisect(steps, cost.step_s)
        steps.insert(pos, cost.step_s)
        res.top.insert(pos, cost)
        if len(res.top) > top_k:
            dropped = res.top.pop()
            steps.pop()
            if dropped is not runnable_best:
                res.dropped["worse (simulated, outside the top K)"] += 1
    if runnable_best is not None and runnable_best not in res.top:
        res.top.append(runnable_best)  # shown last: the best layout DeepSpeed runs
    # ranked by their min-max splits; the pick and the best runnable layout, which `plan` prints and emits,
    # take the split an `analytic` run of them chooses
    for i, cost in enumerate(res.top):
        if i == 0 or cost is runnable_best:
            res.top[i] = model.evaluate(cost.layout, model.run_split(cost.layout), check_memory=False)
    if not res.top:
        res.smallest_oom_need = least_memory_needed(model, oom)
        gib = 2**30
        raise PlanError(
            f"{model.cfg.name} fits in no layout of these GPUs: every one of the {len(layouts)} layouts needs more "
            f"than the {model.memory_cap / gib:.1f} GiB usable per rank; the smallest need is "
            f"{res.smallest_oom_need / gib:.1f} GiB per rank. Use more GPUs, a device with more memory, or a "
            f"smaller global batch / sequence")
    return res


def least_memory_needed(model: PlanModel, oom: list[tuple[float, Layout]]) -> float:
    """The least memory any of these layouts needs on its heaviest rank (exact per layout; a layout
    whose bound is already above the best found is skipped)."""
    best = float("inf")
    for bound, lay in sorted(oom, key=lambda item: item[0]):
        if bound >= best:
            break
        best = min(best, model.least_memory(lay))
    return best
