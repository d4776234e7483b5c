"""Where a rank sits in DeepSpeed's pipeline (or a data- and tensor-parallel model), and which layers it builds.

Reads ``PipelineModule._topo``, ``._grid``, ``._layer_specs``, ``._local_start``/``._local_stop``,
``.forward_funcs`` and calls ``._set_bounds``: DeepSpeed-private, see ``ds_pipe_ext.compat``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class RankCoordinates:
    """A rank's place in the PP x DP x TP grid."""

    stage: int
    data: int
    model: int  # tensor-parallel rank (0 without TP)


def _has_model_axis(topo) -> bool:
    return "model" in topo.get_axis_names()


def coordinates(module, rank: int | None = None) -> RankCoordinates:
    """Coordinates of ``rank`` (default: this process) in a PipelineModule's topology."""
    topo = module._topo
    coord = topo.get_coord(module.global_rank if rank is None else rank)
    return RankCoordinates(stage=coord.pipe, data=coord.data, model=coord.model if _has_model_axis(topo) else 0)


def tensor_parallel_degree(module) -> int:
    topo = module._topo
    return topo.get_dim("model") if _has_model_axis(topo) else 1


def data_parallel_degree(module) -> int:
    return module._topo.get_dim("data")


def data_parallel_rank(module) -> int:
    return module._grid.get_data_parallel_id()


def parallel_ranks(module, layout) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of this process: a PipelineModule's coordinates, megatron's
    groups for a tensor-parallel model without a pipeline, else (the global rank, 0)."""
    if layout.pipelined:
        where = coordinates(module)
        return where.data, where.model
    if layout.tp > 1:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    return dist.get_rank(), 0


def profiling_peers(module) -> set[int]:
    """Ranks that must run a profile together with rank 0: its tensor-parallel group."""
    if tensor_parallel_degree(module) == 1:
        return {0}
    return set(module._topo.filter_match(pipe=0, data=0))


def layer_specs(module) -> list:
    """The layers as the user passed them (LayerSpec, TiedLayerSpec, nn.Module, callables)."""
    return module._layer_specs


def set_layer_specs(module, specs: list) -> None:
    """Replace the layers DeepSpeed will build (between its partition and its ``_build``)."""
    module._layer_specs = list(specs)


def local_layer_range(module) -> tuple[int, int]:
    """[start, stop) of the layers this rank's stage builds."""
    return module._local_start, module._local_stop


def set_local_layers(module, start: int, stop: int) -> None:
    """Make this rank build layers [start, stop) (before DeepSpeed's ``_build``)."""
    module._set_bounds(start=start, stop=stop)


def layer_index_of(module, func) -> int:
    """The global layer index of one of this stage's forward functions.  DeepSpeed 0.19 (tested 0.19.8)
    asks ``_is_checkpointable(funcs)`` with ``forward_funcs[start:end]`` of a stage (one at a time at
    interval 1, precomputed when the engine is built)."""
    return module._local_start + next(k for k, g in enumerate(module.forward_funcs) if g is func)


def checkpointed_layers(module) -> list[int]:
    """The global indices of this stage's layers DeepSpeed's forward runs under its activation checkpoint:
    ``is_checkpointable_results``, one answer per run of ``activation_checkpoint_interval`` layers, as the
    engine precomputed them (DeepSpeed 0.19, tested 0.19.8)."""
    interval = module.activation_checkpoint_interval
    if not interval:
        return []
    start, _ = local_layer_range(module)
    n = len(module.forward_funcs)
    return [start + k for run, checkpointed in zip(range(0, n, interval), module.is_checkpointable_results)
            if checkpointed for k in range(run, min(run + interval, n))]


def local_layers(module) -> Iterator[tuple[int, nn.Module]]:
    """(global layer index, module) for the layers with parameters this stage built.

    DeepSpeed registers a built ``LayerSpec``/``nn.Module`` layer as submodule ``str(index)``;
    tied modules live in ``tied_modules`` and callables have no module.
    """
    start, stop = local_layer_range(module)
    for idx in range(start, stop):
        layer = getattr(module, str(idx), None)
        if isinstance(layer, nn.Module):
            yield idx, layer


def set_train_schedule(engine, schedule_cls, *, losses_per_micro_batch: bool = False) -> None:
    """Have ``engine`` run ``schedule_cls`` (a ``PipeSchedule``) for training: DeepSpeed asks its
    overridable ``_train_schedule()`` for the schedule of every ``train_batch``.

    The engine's last stage backpropagates ``engine.loss``, the loss of its latest forward, which
    is right only when each backward follows its own forward (1F1B).  ``losses_per_micro_batch``
    keeps each forward's loss by buffer and hands it back to that buffer's backward (GPipe runs
    every forward first), through the engine's ``_INSTRUCTION_MAP``, on this instance only.
    """
    from deepspeed.runtime.pipe import schedule as ds

    engine._train_schedule = lambda: schedule_cls(micro_batches=engine.micro_batches, stages=engine.num_stages,
                                                  stage_id=engine.stage_id)
    # switching schedules (benches) starts again from the map the first switch found
    base = engine.__dict__.setdefault("_ds_pipe_ext_schedule_base", engine._INSTRUCTION_MAP)
    engine._INSTRUCTION_MAP = base
    if not (losses_per_micro_batch and engine.is_last_stage()):
        return
    forward, backward = base[ds.ForwardPass], base[ds.BackwardPass]
    losses: dict[int, object] = {}

    def forward_keeping_loss(self, **kw):  # the engine passes the instruction's fields by name
        forward(self, **kw)
        losses[kw["buffer_id"]] = self.loss

    def backward_of_its_loss(self, **kw):
        self.loss = losses.pop(kw["buffer_id"])
        backward(self, **kw)

    engine._INSTRUCTION_MAP = {**base, ds.ForwardPass: forward_keeping_loss, ds.BackwardPass: backward_of_its_loss}


def loss_terms(engine) -> dict | None:
    """The last step's named loss terms (``PipelineModule.get_additional_losses``), averaged over its
    micro-batches and data-parallel ranks, as the engine keeps them (``agg_additional_losses``, on every
    stage since DeepSpeed 0.14); None for a model without them."""
    return getattr(engine, "agg_additional_losses", None)


def ensure_expert_groups(ep: int, pp: int) -> None:
    """DeepSpeed's expert-parallel and expert-data-parallel groups for ``ep``, made on every rank now.

    DeepSpeed makes them when the engine meets its first MoE layer, so a pipeline stage without one (dense
    blocks only) makes none; torch numbers process groups by how many each rank has made, so that rank's
    next new group pairs with another rank's different one and the next build hangs.  Every rank makes them
    here, before the engine, with DeepSpeed's own function (``groups._create_expert_and_data_parallel``,
    private; ``pp_size`` given, as the engine's grid is not there yet); the engine then finds them."""
    from deepspeed.utils import groups

    if f"ep_size_{ep}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep, pp_size=pp)


def tell_deepspeed_megatrons_tp() -> None:
    """DeepSpeed's MoE layer asks its model-parallel unit (``groups.mpu``) for the TP group it drops and gathers
    slots over, forward and backward; the engine sets it, but a layer profiled before the engine exists has none.
    megatron's ``parallel_state`` answers the same questions with the same groups
    (``parallel.topology.check_agreement``) until the engine sets its own grid."""
    from deepspeed.utils import groups

    if groups.mpu is None:
        from megatron.core import parallel_state

        groups.mpu = parallel_state


def forget_deepspeed_groups() -> None:
    """Let the next engine in this process make DeepSpeed's groups afresh: its model-parallel unit (a
    pipeline engine leaves its grid as ``groups.mpu``, which a data-parallel engine after it would read)
    and its expert groups by name (an ``ep_size_2`` made over a whole data-parallel world is the wrong one
    for a pipeline's stages).  For processes that build several engines (tests, benches).  DeepSpeed's
    ``groups._release_process_group_references()`` (private; what it runs after the world group is
    destroyed) drops every reference; the groups themselves stay alive."""
    from deepspeed.utils import groups

    groups._release_process_group_references()
