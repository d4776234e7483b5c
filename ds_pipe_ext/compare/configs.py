"""The configurations a comparison runs, all at one global batch, and the ds.json of each.

Pipelines: every pp x dp factorisation of the world (over the TP degree) with pp >= 2,
partitioned ``profiled`` and ``uniform``, under ZeRO-0 and, where a stage has data-parallel
replicas, ZeRO-1 (DeepSpeed refuses ZeRO-2/3 under a pipeline).  Data parallel: ZeRO-1, 2
and 3 over the whole world, and ZeRO-3 with its states offloaded to CPU memory (a GPU-only
row: on a CPU-only machine there is nothing to offload to).

Every ZeRO config states DeepSpeed's memory-relevant settings explicitly (``ZERO_SETTINGS``)
so that the analytic side predicts what DeepSpeed really allocates.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass

# Written into every ZeRO config.  Bucket sizes: DeepSpeed's defaults (5e8 elements) are sized
# for GPUs; these keep the buffers small next to the model on CPU.  Persistence threshold 0:
# DeepSpeed's default (1e5 elements) would keep every parameter of a small model whole on every
# rank under ZeRO-3, which is not ZeRO-3.  overlap_comm off: no second gradient bucket.
ZERO_SETTINGS = {
    "reduce_bucket_size": 5e6,
    "allgather_bucket_size": 5e6,
    "stage3_prefetch_bucket_size": 5e6,
    "stage3_param_persistence_threshold": 0,
    "overlap_comm": False,
    "contiguous_gradients": True,
}


class CompareError(ValueError):
    """A comparison that cannot be set up; the message names the argument to change."""


@dataclass(frozen=True)
class CompareConfig:
    name: str
    kind: str  # "pipeline" | "zero"
    pp: int
    tp: int
    dp: int
    zero: int
    micro_batch: int
    grad_accum: int  # micro-batches per step (a pipeline's m)
    method: str | None = None  # the pipeline's partition_method
    offload: bool = False

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def with_micro_batch(self, micro_batch: int) -> "CompareConfig":
        """The same layout and accumulation at another micro-batch (the global batch follows)."""
        return CompareConfig(**{**asdict(self), "micro_batch": micro_batch})

    def to_dict(self) -> dict:
        return {**asdict(self), "global_batch": self.global_batch}


def _accumulation(global_batch: int, micro_batch: int, dp: int, name: str) -> int:
    if global_batch % (micro_batch * dp):
        raise CompareError(f"--global-batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                           f"dp {dp} ({name}); choose a multiple of {micro_batch * dp}")
    return global_batch // (micro_batch * dp)


def comparison_configs(world: int, *, global_batch: int, micro_batch: int, tp: int = 1,
                       patterns: list[str] | None = None) -> list[CompareConfig]:
    """Every configuration of the comparison (those matching ``patterns``, shell-style, if given)."""
    if world < 2:
        raise CompareError(f"--world {world}: a comparison needs at least 2 ranks")
    if world % tp:
        raise CompareError(f"--tp {tp} does not divide --world {world}")
    out: list[CompareConfig] = []
    rest = world // tp
    for pp in range(rest, 1, -1):
        if rest % pp:
            continue
        dp = rest // pp
        for zero in ((0, 1) if dp > 1 else (0,)):  # ZeRO-1 over one replica partitions nothing
            for method in ("profiled", "uniform"):
                name = f"pipe-{method}-pp{pp}" + (f"-tp{tp}" if tp > 1 else "") + f"-dp{dp}-z{zero}"
                m = _accumulation(global_batch, micro_batch, dp, name)
                out.append(CompareConfig(name, "pipeline", pp, tp, dp, zero, micro_batch, m, method=method))
    for zero in (1, 2, 3):
        name = f"zero{zero}" + (f"-tp{tp}" if tp > 1 else "")
        out.append(CompareConfig(name, "zero", 1, tp, rest, zero, micro_batch,
                                 _accumulation(global_batch, micro_batch, rest, name)))
    name = "zero3-offload" + (f"-tp{tp}" if tp > 1 else "")
    out.append(CompareConfig(name, "zero", 1, tp, rest, 3, micro_batch,
                             _accumulation(global_batch, micro_batch, rest, name), offload=True))
    if patterns:
        unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(c.name, p) for c in out)]
        if unknown:
            raise CompareError(f"--configs {unknown} match no configuration; the configurations are "
                               f"{[c.name for c in out]} (shell patterns such as 'pipe-*' work)")
        out = [c for c in out if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return out


def ds_config(cfg: CompareConfig, *, model: str, steps: int, seed: int = 1234,
              memory_cap_gib: float | None = None) -> dict:
    """The ds.json that trains ``cfg``."""
    ds: dict = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "steps_per_print": 10**6,
        "train": {"model": model, "steps": steps, "seed": seed, "log": "json", "memory_cap_gib": memory_cap_gib},
    }
    if cfg.tp > 1:
        ds["tensor_parallel"] = {"size": cfg.tp}
    if cfg.kind == "pipeline":
        ds["pipeline"] = {"stages": cfg.pp, "partition_method": cfg.method}
        if cfg.zero:
            ds["zero_optimization"] = {"stage": cfg.zero, **ZERO_SETTINGS}
    else:
        ds["zero_optimization"] = {"stage": cfg.zero, **ZERO_SETTINGS}
        if cfg.offload:
            ds["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return ds
