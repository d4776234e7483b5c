"""Where a layout's layers split into pipeline stages: the exact min-max split under the memory cap, the least memory
any split needs, and the split DeepSpeed's ``PipelineModule`` runs with ``partition_method: "analytic"``.  ``PlanModel``
mixes this in; its methods read the model's layer costs (``costs_of``), memory cap, peak rule, step model and the
link between neighbouring stages (``split_link``)."""

from __future__ import annotations

from functools import lru_cache

from ..costs.peak_rule import PipelinePeakRule
from ..costs.stage import held_activation_bytes
from ..costs.zero import layer_states_by_rule, state_bytes_per_param
from ..layout import Layout
from ..partition.algorithms import InfeasibleMemoryCap, partition_min_max_lists, smallest_feasible_cap_lists
from ..partition.methods import decide_offline
from ..simulate.step_model import StepModel


class OutOfMemory(Exception):
    """No split of the layout fits the memory cap."""

    def __init__(self, needed_bytes: float | None):
        self.needed_bytes = needed_bytes  # what the heaviest rank needs (None: not computed; least_memory)


@lru_cache(maxsize=256)
def _analytic_split(states: tuple, chunks: int, micro_batches: int, recompute: bool, schedule: str,
                    step_model: StepModel, link_bandwidth: float | None, memory_cap_gib: float | None,
                    peak_rule: PipelinePeakRule | None = None) -> list[int]:
    """``decide_offline("analytic", ...)`` under the cap where a split fits it, else with none.  Cached: the
    step search takes seconds on a large model, and `plan` and `estimate` ask it of the same layout."""
    kw = dict(micro_batches=micro_batches, recompute=recompute, schedule=schedule, step_model=step_model,
              link_bandwidth=link_bandwidth, peak_rule=peak_rule)
    if memory_cap_gib is not None:
        try:
            return decide_offline("analytic", list(states), chunks, memory_cap_gib=memory_cap_gib, **kw)
        except InfeasibleMemoryCap:
            pass
    return decide_offline("analytic", list(states), chunks, **kw)


class LayoutSplits:
    """The split terms of ``PlanModel`` (a mixin: ``self`` is the model)."""

    def _memory_lists(self, lay: Layout, costs) -> dict:
        """The partitioner's memory lists for ``lay``: the peak rule's where it applies, else the states at
        the step by ZeRO's additive form, and the activations a layer keeps per micro-batch."""
        full = lay.recompute == "full"
        rule = self.peak_rule(lay)
        if rule is None:
            per_param = state_bytes_per_param(lay.zero, lay.dp, self.e)
            static = [c.param_bytes / self.e * per_param for c in costs]
            reserve = step = None
        else:
            static = [float(c.static_bytes) for c in rule.layer_states(list(costs))]
            reserve = rule.stage_reserves(list(costs), lay.num_chunks, micro_batches=lay.micro_batches)
            step = rule.step_bytes(list(costs))
        return dict(static_bytes=static, activation_bytes=held_activation_bytes(costs, recompute=full),
                    stage_reserve_bytes=reserve, step_bytes=step)

    def partition(self, lay: Layout, *, capped: bool = True) -> list[int]:
        """The exact min-max split under the memory cap (``capped=False``: with none)."""
        costs = self.costs_of(lay)
        full = lay.recompute == "full"
        chunks = lay.num_chunks
        if chunks == 1:
            return [0, len(costs)]
        link = self.split_link(lay)
        try:  # a rank holds chunks_per_rank chunks: each gets its share of the cap
            return partition_min_max_lists(
                [c.time_s(recompute=full) for c in costs], chunks, **self._memory_lists(lay, costs),
                micro_batches=lay.micro_batches, memory_cap=self.memory_cap / lay.chunks_per_rank if capped else None,
                boundary_time=[link.latency_s + c.output_bytes / link.bandwidth for c in costs],
                schedule=lay.schedule_spec.name, explain_infeasible=False)
        except InfeasibleMemoryCap:
            raise OutOfMemory(None) from None

    def least_memory(self, lay: Layout) -> float:
        """The least memory the heaviest rank of this layout needs over every split: the partitioner's
        smallest feasible cap (a chunk's share times the chunks a rank holds), or without a pipeline
        the one rank's states and activations.  Up to 64 feasibility probes: asked only when nothing fits."""
        costs = self.costs_of(lay)
        chunks = lay.num_chunks
        if chunks == 1:
            return self.evaluate(lay, [0, len(costs)], check_memory=False).peak_memory_bytes
        full = lay.recompute == "full"
        return lay.chunks_per_rank * smallest_feasible_cap_lists(
            [c.time_s(recompute=full) for c in costs], chunks, **self._memory_lists(lay, costs),
            micro_batches=lay.micro_batches, schedule=lay.schedule_spec.name)

    def run_split(self, lay: Layout) -> list[int]:
        """The split a ``PipelineModule`` with ``partition_method: "analytic"`` chooses from these costs for
        this layout: the same decision function (``partition.methods.decide_offline``), on the layers'
        model states by the ZeRO rule (as the module counts them), under each chunk's share of the cap
        where a split fits it, else with none (the step search under 1F1B and GPipe, the min-max split
        under the other schedules)."""
        costs = self.costs_of(lay)
        if lay.num_chunks == 1:
            return [0, len(costs)]
        states = tuple(layer_states_by_rule(list(costs), stage=lay.zero, dp=lay.dp, element_bytes=self.e, ep=lay.ep,
                                            tp=lay.tp))
        dualpipev = lay.schedule_spec.kind == "dualpipev"  # it balances each rank's pair by time alone
        return list(_analytic_split(states, lay.num_chunks, lay.micro_batches, lay.recompute == "full",
                                    lay.schedule_spec.name, self.step_model,
                                    None if dualpipev else self.split_link(lay).bandwidth,
                                    None if dualpipev else self.memory_cap / lay.chunks_per_rank / 2**30,
                                    None if dualpipev else self.peak_rule(lay)))
