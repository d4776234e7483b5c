"""One place that decides the PP x TP x DP layout, for DeepSpeed and megatron-core alike.

DeepSpeed's ``PipeModelDataParallelTopology`` orders ranks (pipe, data, model) with the
model (TP) axis fastest; megatron-core's ``initialize_model_parallel`` with its default
order "tp-cp-ep-dp-pp" also puts TP fastest, then DP, then PP.  ``check_agreement``
proves the two give the same groups for a layout, without any process group.
The layout itself (``layout.Layout``) is validated before any process group exists.
"""

from __future__ import annotations

from ..layout import Layout, LayoutError

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


class TopologyError(LayoutError):
    """DeepSpeed's and megatron's process groups disagree, or the launch is not the layout's size."""


def rank_groups(pp: int, tp: int, dp: int, ep: int = 1) -> dict[str, list[list[int]]]:
    """Every process group of a PP x TP x DP (x EP) layout, without DeepSpeed or a process group: ranks ordered
    (pipe, data, model), TP fastest, as ``PipeModelDataParallelTopology`` orders them; the expert groups as
    DeepSpeed's MoE layer builds them by default (``groups._create_expert_and_data_parallel`` without expert
    tensor parallelism, expert parallel before data): an EP group is ``ep`` consecutive ranks of a stage, an
    expert-data-parallel group the stage's ranks ``ep`` apart.  Under TP the consecutive ranks are TP ranks
    first, as Megatron folds its TP ranks into EP at expert TP 1; without TP, consecutive members of a DP group.  ``tied``: the first and last stage's ranks at the
    same data and model index (DeepSpeed's tied-weight groups); ``pp``: the pipeline's ranks of one data and
    model index, neighbours ``tp x dp`` apart."""
    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    dp_groups = [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    groups = {"tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
              "dp": dp_groups,
              "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
              "tied": [[rank(0, d, t), rank(pp - 1, d, t)] for d in range(dp) for t in range(tp)] if pp > 1 else []}
    if ep > 1:
        if (tp * dp) % ep:
            raise TopologyError(f"ep {ep} must divide tp x dp {tp * dp}")
        stages = [list(range(p * dp * tp, (p + 1) * dp * tp)) for p in range(pp)]
        groups["ep"] = [s[i:i + ep] for s in stages for i in range(0, tp * dp, ep)]
        groups["expert_dp"] = [s[i::ep] for s in stages for i in range(ep)]
    return groups


def topology_for_deepspeed(dims: Layout):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


def deepspeed_groups(dims: Layout) -> dict[str, list[list[int]]]:
    topo = topology_for_deepspeed(dims)
    return {"tp": topo.get_axis_comm_lists("model") or [[r] for r in range(dims.world_size)],
            "dp": topo.get_axis_comm_lists("data") or [[r] for r in range(dims.world_size)],
            "pp": topo.get_axis_comm_lists("pipe") or [[r] for r in range(dims.world_size)]}


def megatron_groups(dims: Layout) -> dict[str, list[list[int]]]:
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=1, order=MEGATRON_ORDER)
    return {axis: gen.get_ranks(axis) for axis in ("tp", "dp", "pp")}


def check_agreement(dims: Layout) -> None:
    """Raise if DeepSpeed's and megatron's groups differ for this layout."""
    ours = {k: sorted(map(sorted, v)) for k, v in deepspeed_groups(dims).items()}
    theirs = {k: sorted(map(sorted, v)) for k, v in megatron_groups(dims).items()}
    if ours != theirs:
        raise TopologyError(f"DeepSpeed and megatron disagree on the groups for {dims}: {ours} vs {theirs}")


def initialize(dims: Layout, world_size: int):
    """Create megatron's groups to match DeepSpeed's topology (after torch.distributed is up).

    Returns the DeepSpeed topology to pass to ``PipelineModule(topology=...)``.
    """
    if dims.world_size != world_size:
        raise TopologyError(f"pp {dims.pp} x tp {dims.tp} x dp {dims.dp} = {dims.world_size}, "
                            f"but {world_size} processes were launched")
    check_agreement(dims)
    from megatron.core import parallel_state

    from ..compat import cpu_shims

    cpu_shims.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dims.tp,
                                             pipeline_model_parallel_size=dims.pp, order=MEGATRON_ORDER)
    return topology_for_deepspeed(dims)
