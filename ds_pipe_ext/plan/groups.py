"""Where a layout's process groups sit on the cluster, and what each kind of collective costs there.

The groups are DeepSpeed's (``parallel.topology.rank_groups``: TP fastest, then data, then pipe; its expert
groups); each kind's slowest-placed group (``costs.network.ClusterNetwork.worst``) is what a step waits for.
``PlanModel`` prices every collective on these placements; ``collectives_of`` lists them for `plan --only`.
"""

from __future__ import annotations

from functools import lru_cache

from ..layout import Layout


@lru_cache(maxsize=512)
def placements(cluster, pp: int, tp: int, dp: int, ep: int) -> dict:
    """The slowest-placed group of each kind of a pp x tp x dp (x ep) layout on ``cluster``: "tp", "dp", "ep" and
    "expert_dp" (DeepSpeed's expert groups; without EP none and the DP group), "tied" (first and last stage),
    "pp_pair" (neighbouring stages); a kind the layout lacks is one rank."""
    from ..parallel.topology import rank_groups

    groups = rank_groups(pp, tp, dp, ep if ep > 1 and (tp * dp) % ep == 0 else 1)
    pairs = [(g[i], g[i + 1]) for g in groups["pp"] for i in range(len(g) - 1)]
    one = cluster.worst([[0]])
    out = {axis: cluster.worst(groups[axis]) if groups.get(axis) else one
           for axis in ("tp", "dp", "tied", "ep", "expert_dp")}
    out["pp_pair"] = cluster.worst(pairs) if pairs else one
    if ep <= 1:
        out["ep"], out["expert_dp"] = one, out["dp"]
    return out


def collectives_of(model, lay: Layout) -> list[tuple[str, str, object, object]]:
    """For `plan --only`: each collective kind ``lay`` runs under ``model`` (a ``PlanModel``), as (what, group,
    ``Placement``, ``costs.nccl.Collective`` for a representative size: a layer's gradients, a boundary's
    activations)."""
    place = model.placements(lay)
    costs = model.costs_of(lay)
    device = model.device
    grads, act = max(c.param_bytes for c in costs), max(c.output_bytes for c in costs)
    out = []
    if lay.tp > 1:
        out.append(("TP all-reduce (a block's output)", "tp", place["tp"],
                    device.group_collective("all-reduce", act, place["tp"])))
    if lay.dp > 1:
        # as ``RankUpdate`` prices them: DeepSpeed reduce-scatters under ZeRO-3 only (ZeRO-1/2 all-reduce
        # their buckets), Megatron with its distributed optimizer
        scatters = lay.zero == 3 or (lay.runtime == "megatron" and lay.zero >= 1)
        kind = "reduce-scatter" if scatters else "all-reduce"
        out.append((f"DP {kind} (a layer's gradients)", "dp", place["dp"],
                    device.group_collective(kind, grads, place["dp"])))
        if lay.zero >= 1 or lay.runtime == "megatron":
            out.append(("DP all-gather (a layer's weights)", "dp", place["dp"],
                        device.group_collective("all-gather", grads, place["dp"])))
    if lay.ep > 1:
        out.append(("EP all-to-all (a block's tokens)", "ep", place["ep"],
                    device.group_collective("all-to-all", act, place["ep"])))
    if lay.pp > 1:
        out.append(("PP send (a boundary)", "pp_pair", place["pp_pair"],
                    device.group_collective("p2p", act, place["pp_pair"])))
    return out


__all__ = ["collectives_of", "placements"]
