"""A list of layer costs split into pipeline stages: ``partition_min_max`` (the bottleneck stage's time,
least, under a memory cap that knows the schedule's in-flight micro-batches) and ``partition_jointly`` (the
split and each layer's recompute mode together).  It takes plain numbers (one time per layer) or ``LayerCost``
records and returns DeepSpeed's ``parts``; the algorithms on plain lists are in ``algorithms``."""

from __future__ import annotations

from collections.abc import Sequence

from ..costs.stage import held_activation_bytes
from .algorithms import InfeasibleMemoryCap, PartitionError, partition_min_max_lists

__all__ = ["partition_min_max", "partition_jointly", "joint_stage_memory", "cost_lists"]

GIB = 2**30


def cost_lists(costs: Sequence, *, recompute: bool = False) -> dict[str, list[float]]:
    """Split LayerCost-like records (or plain numbers) into the solver's plain lists."""
    if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in costs):
        return {"times": [float(c) for c in costs]}
    try:
        return {
            "times": [c.time_s(recompute=recompute) for c in costs],
            "static_bytes": [float(c.static_bytes) for c in costs],
            "activation_bytes": held_activation_bytes(costs, recompute=recompute),
            "output_bytes": [float(c.output_bytes) for c in costs],
        }
    except AttributeError as e:
        raise PartitionError(
            f"costs must be numbers or LayerCost records, got {type(costs[0]).__name__}: {e}"
        ) from None


def partition_min_max(
    costs: Sequence,
    num_stages: int,
    *,
    memory_cap_bytes: float | None = None,
    memory_cap_gib: float | None = None,
    micro_batches: int | None = None,
    link_bandwidth: float | None = None,
    recompute: bool = False,
    schedule: str = "1f1b",
    peak_rule=None,
) -> list[int]:
    """Optimal contiguous split of ``costs`` into ``num_stages`` stages (min of the slowest stage).

    Args:
        costs: one time (seconds) per layer, or one ``LayerCost`` per layer.
        num_stages: pipeline stages p (1 <= p <= number of layers).
        memory_cap_bytes / memory_cap_gib: per-stage cap on static + in-flight
            activation bytes; stage s holds ``costs.stage.in_flight`` micro-batches
            (min(p - s, micro_batches) under 1F1B).
        micro_batches: micro-batches per step (gradient accumulation steps); default p.
        link_bandwidth: bytes/s between neighbouring stages.  When given, a stage
            also pays 2 x (boundary bytes / bandwidth) for each side it has a neighbour.
        recompute: activation checkpointing: time includes the replayed forward and
            a layer keeps no activations in flight.
        schedule: "1f1b" (DeepSpeed's) or "gpipe": how many micro-batches a stage holds.
        peak_rule: a ``costs.peak_rule.PipelinePeakRule``: the cap applies to each stage's peak over the step
            (its layers' states as held during a backward, its in-flight activations and its reserve:
            buckets, pipe buffers, temporaries) instead of the states at the step plus activations.

    Returns:
        ``parts``: num_stages + 1 boundaries; stage s owns layers parts[s]:parts[s+1].
        Among optimal splits, the lexicographically smallest.

    Raises:
        PartitionError: malformed input (with the fix in the message).
        InfeasibleMemoryCap: no split fits; ``.min_feasible_cap`` says what would.
    """
    if memory_cap_bytes is not None and memory_cap_gib is not None:
        raise PartitionError("give memory_cap_bytes or memory_cap_gib, not both")
    cap = memory_cap_bytes if memory_cap_gib is None else memory_cap_gib * GIB
    lists = cost_lists(costs, recompute=recompute)
    boundary = None
    if link_bandwidth is not None:
        if "output_bytes" not in lists:
            raise PartitionError("link_bandwidth needs LayerCost records (output_bytes per layer)")
        if not link_bandwidth > 0:
            raise PartitionError(f"link_bandwidth must be > 0 bytes/s, got {link_bandwidth!r}")
        boundary = [b / link_bandwidth for b in lists["output_bytes"]]
    if cap is not None and "static_bytes" not in lists:
        raise PartitionError("a memory cap needs LayerCost records (bytes per layer), not plain times")
    reserve = step = None
    if cap is not None and peak_rule is not None:
        lists["static_bytes"] = [float(c.static_bytes) for c in peak_rule.layer_states(list(costs))]
        reserve = peak_rule.stage_reserves(list(costs), num_stages, micro_batches=micro_batches or num_stages)
        step = peak_rule.step_bytes(list(costs))
    return partition_min_max_lists(
        lists["times"],
        num_stages,
        static_bytes=lists.get("static_bytes") if cap is not None else None,
        activation_bytes=lists.get("activation_bytes") if cap is not None else None,
        micro_batches=micro_batches,
        memory_cap=cap,
        boundary_time=boundary,
        schedule=schedule,
        stage_reserve_bytes=reserve,
        step_bytes=step,
    )


def partition_jointly(costs: Sequence, num_stages: int, *, memory_cap_gib: float, micro_batches: int | None = None,
                      schedule: str = "1f1b", peak_rule=None):
    """The split and each layer's recompute mode together (``partition.recompute``): the smallest slowest
    stage, layer times plus the forwards replayed, such that every stage's peak fits the cap (with
    ``peak_rule``: its layers' states as held in a backward, its reserve and its optimizer step, as
    ``partition_min_max``'s cap; the modes each layer offers: ``costs.stage.recompute_modes``).  Returns
    a ``partition.recompute.JointSplit`` (parts, a mode per layer, the stages' times and memory)."""
    from ..costs.stage import recompute_modes
    from .recompute import partition_with_recompute

    costs = list(costs)
    static, inflight, reserve, step = _joint_lists(costs, num_stages, micro_batches, schedule, peak_rule)
    return partition_with_recompute([c.time_s() for c in costs], static, recompute_modes(costs), num_stages,
                                    memory_cap=memory_cap_gib * GIB, inflight=inflight, reserve=reserve,
                                    step_bytes=step)


def joint_stage_memory(costs: Sequence, parts: Sequence[int], modes: Sequence[str] | None = None, *,
                       micro_batches: int | None = None, schedule: str = "1f1b", peak_rule=None) -> list[float]:
    """Each stage's peak, by ``partition_jointly``'s rule, of a given split whose layers run ``modes`` (a
    recompute mode's name per layer; None: none recompute): what the joint partitioner holds to its cap."""
    from ..costs.stage import recompute_modes
    from .recompute import stage_memory

    costs, p = list(costs), len(parts) - 1
    static, inflight, reserve, step = _joint_lists(costs, p, micro_batches, schedule, peak_rule)
    modes = list(modes) if modes is not None else ["none"] * len(costs)
    chosen = [{m.name: m for m in layer}[mode] for layer, mode in zip(recompute_modes(costs), modes)]
    return [stage_memory(static[i:j], chosen[i:j], inflight[s], reserve[s] if reserve else 0.0,
                         step[i:j] if step else ())
            for s, (i, j) in enumerate(zip(parts[:-1], parts[1:]))]


def _joint_lists(costs: list, num_stages: int, micro_batches: int | None, schedule: str, peak_rule):
    """(static bytes per layer, in-flight micro-batches per stage, reserve per stage, step bytes per layer)
    for the joint rule: the peak rule's where given, else the layers' own states and no reserve."""
    from ..costs.stage import in_flight

    m = micro_batches or num_stages
    inflight = [in_flight(s, num_stages, m, schedule) for s in range(num_stages)]
    if peak_rule is None:
        return [float(c.static_bytes) for c in costs], inflight, None, None
    return ([float(c.static_bytes) for c in peak_rule.layer_states(costs)], inflight,
            peak_rule.stage_reserves(costs, num_stages, micro_batches=m), peak_rule.step_bytes(costs))
