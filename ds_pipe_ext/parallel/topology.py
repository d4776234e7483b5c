"""One place that decides the PP x TP x DP layout, for DeepSpeed and megatron-core alike.

DeepSpeed's ``PipeModelDataParallelTopology`` orders ranks (pipe, data, model) with the
model (TP) axis fastest; megatron-core's ``initialize_model_parallel`` with its default
order "tp-cp-ep-dp-pp" also puts TP fastest, then DP, then PP.  ``check_agreement``
proves the two give the same groups for a layout, without any process group.
Everything is validated before a process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

MEGATRON_ORDER = "tp-cp-ep-dp-pp"


class TopologyError(ValueError):
    """A parallel layout that cannot work; the message names the fix."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    tp: int = 1
    dp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TopologyError(f"{name} = {v!r}: parallel degrees are positive integers")
        if self.sp and self.tp == 1:
            raise TopologyError("sequence parallelism needs tensor parallelism: set tensor_parallel > 1 or turn SP off")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @classmethod
    def from_world(cls, world_size: int, *, pp: int, tp: int = 1, sp: bool = False) -> "ParallelDims":
        if pp < 1 or tp < 1 or world_size % (pp * tp):
            raise TopologyError(
                f"world size {world_size} is not pipeline ({pp}) x tensor ({tp}) x data parallel: "
                f"pp * tp must divide the number of processes"
            )
        return cls(pp=pp, tp=tp, dp=world_size // (pp * tp), sp=sp)

    def check_model(self, cfg) -> None:
        """TP must divide heads, hidden, ffn and vocabulary; SP must divide the sequence."""
        for what, n in (("attention heads", cfg.heads), ("hidden", cfg.hidden), ("ffn hidden", cfg.ffn)):
            if n % self.tp:
                raise TopologyError(f"tensor parallel degree {self.tp} does not divide the {what} ({n}) of "
                                    f"model {cfg.name!r}; choose tp dividing it")
        if cfg.padded_vocab % self.tp:
            raise TopologyError(f"tensor parallel degree {self.tp} does not divide the vocabulary ({cfg.padded_vocab}) "
                                f"of model {cfg.name!r}; pad it as Megatron does: vocab_pad_to = {128 * self.tp}")
        if self.sp and cfg.seq_len % self.tp:
            raise TopologyError(f"sequence parallelism splits the sequence ({cfg.seq_len}) {self.tp} ways; "
                                f"choose tp dividing seq_len")


def topology_for_deepspeed(dims: ParallelDims):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)


def deepspeed_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    topo = topology_for_deepspeed(dims)
    return {"tp": topo.get_axis_comm_lists("model") or [[r] for r in range(dims.world_size)],
            "dp": topo.get_axis_comm_lists("data") or [[r] for r in range(dims.world_size)],
            "pp": topo.get_axis_comm_lists("pipe") or [[r] for r in range(dims.world_size)]}


def megatron_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=1, order=MEGATRON_ORDER)
    return {axis: gen.get_ranks(axis) for axis in ("tp", "dp", "pp")}


def check_agreement(dims: ParallelDims) -> None:
    """Raise if DeepSpeed's and megatron's groups differ for this layout."""
    ours = {k: sorted(map(sorted, v)) for k, v in deepspeed_groups(dims).items()}
    theirs = {k: sorted(map(sorted, v)) for k, v in megatron_groups(dims).items()}
    if ours != theirs:
        raise TopologyError(f"DeepSpeed and megatron disagree on the groups for {dims}: {ours} vs {theirs}")


def initialize(dims: ParallelDims, world_size: int):
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
