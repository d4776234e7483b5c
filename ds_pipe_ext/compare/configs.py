"""The configurations a comparison runs, all at one global batch, and the ds.json of each.

Pipelines: every pp x dp factorisation of the world (over the TP degree) with pp >= 2,
partitioned ``profiled`` and ``uniform``, under ZeRO-0 and, where a stage has data-parallel
replicas, ZeRO-1 (DeepSpeed refuses ZeRO-2/3 under a pipeline).  Data parallel: ZeRO-1, 2
and 3 over the whole world, and ZeRO-3 with its states offloaded to CPU memory (a GPU-only
row: on a CPU-only machine there is nothing to offload to).

A Mixture-of-Experts model (``experts`` > 0) adds each row's expert-parallel variants (ep dividing the
stage's dp and the experts, ``-epN`` in the name); its ZeRO-3 row stays, refused with DeepSpeed's reason
when it would run (``Layout.check``), never dropped.

Every ZeRO config states DeepSpeed's memory-relevant settings explicitly (``layout.ZERO_SETTINGS``)
so that the analytic side predicts what DeepSpeed really allocates.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace

from ..layout import Layout, expert_degrees


class CompareError(ValueError):
    """A comparison that cannot be set up; the message names the argument to change."""


@dataclass(frozen=True)
class CompareConfig:
    """One row of a comparison: a named layout and, for a pipeline, its partition method."""

    name: str
    layout: Layout
    method: str | None = None  # the pipeline's partition_method

    @property
    def kind(self) -> str:
        return "pipeline" if self.layout.pipelined else "zero"

    def with_micro_batch(self, micro_batch: int) -> "CompareConfig":
        """The same layout and accumulation at another micro-batch (the global batch follows)."""
        return replace(self, layout=self.layout.replace(micro_batch=micro_batch))

    def to_dict(self) -> dict:
        lay = self.layout
        return {"name": self.name, "kind": self.kind, "pp": lay.pp, "tp": lay.tp, "dp": lay.dp, "ep": lay.ep,
                "zero": lay.zero,
                "micro_batch": lay.micro_batch, "grad_accum": lay.micro_batches, "method": self.method,
                "offload": lay.offload, "global_batch": lay.global_batch}


def _accumulation(global_batch: int, micro_batch: int, dp: int, name: str) -> int:
    if global_batch % (micro_batch * dp):
        raise CompareError(f"--global-batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                           f"dp {dp} ({name}); choose a multiple of {micro_batch * dp}")
    return global_batch // (micro_batch * dp)


def comparison_configs(world: int, *, global_batch: int, micro_batch: int, tp: int = 1,
                       patterns: list[str] | None = None, experts: int = 0) -> list[CompareConfig]:
    """Every configuration of the comparison (those matching ``patterns``, shell-style, if given);
    ``experts``: a Mixture-of-Experts model's experts per layer (its EP variants)."""
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
                for ep in expert_degrees(tp * dp, experts):
                    name = (f"pipe-{method}-pp{pp}" + (f"-tp{tp}" if tp > 1 else "") + f"-dp{dp}"
                            + (f"-ep{ep}" if ep > 1 else "") + f"-z{zero}")
                    m = _accumulation(global_batch, micro_batch, dp, name)
                    out.append(CompareConfig(name, Layout(pp=pp, tp=tp, dp=dp, zero=zero, micro_batch=micro_batch,
                                                          micro_batches=m, schedule="1f1b", ep=ep), method))
    for zero in (1, 2, 3):
        for ep in expert_degrees(world, experts) if zero < 3 else [1]:
            name = f"zero{zero}" + (f"-tp{tp}" if tp > 1 else "") + (f"-ep{ep}" if ep > 1 else "")
            out.append(CompareConfig(name, Layout(tp=tp, dp=rest, zero=zero, micro_batch=micro_batch, ep=ep,
                                                  micro_batches=_accumulation(global_batch, micro_batch, rest, name))))
    name = "zero3-offload" + (f"-tp{tp}" if tp > 1 else "")
    out.append(CompareConfig(name, Layout(tp=tp, dp=rest, zero=3, micro_batch=micro_batch, offload=True,
                                          micro_batches=_accumulation(global_batch, micro_batch, rest, name))))
    if patterns:
        unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(c.name, p) for c in out)]
        if unknown:
            raise CompareError(f"--configs {unknown} match no configuration; the configurations are "
                               f"{[c.name for c in out]} (shell patterns such as 'pipe-*' work)")
        out = [c for c in out if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return out


def ds_config(cfg: CompareConfig, *, model: str, steps: int, seed: int = 1234,
              memory_cap_gib: float | None = None) -> dict:
    """The ds.json that trains ``cfg`` (the layout's own writer, with the run's settings).  With 3 steps or
    more the last step's live-tensor peak is traced (``instrument.peak_step``; its time is left out of the
    run's median, which then has the steps between the warm-up and it)."""
    instrument = {"peak_step": steps} if steps >= 3 else {}
    pipelined = cfg.layout.pipelined
    return cfg.layout.ds_config(
        train={"model": model, "steps": steps, "seed": seed, "log": "json", "memory_cap_gib": memory_cap_gib},
        pipeline={"partition_method": cfg.method, "instrument": instrument} if pipelined else None,
        steps_per_print=10**6, **({} if pipelined else {"instrument": instrument}))
