"""What a partition predicts: `PartitionPlan` (the stage model per stage, the simulated step), table and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..costs.stage import StageCost, imbalance, stage_costs
from ..simulate.stage_step import simulate_stages
from ..simulate.schedules import parse_schedule
from ..simulate.step_model import StepModel

MIB = 2**20


@dataclass(frozen=True)
class PartitionPlan:
    """What a partition predicts: the stage model's ``StageCost`` per stage and the simulated step."""

    method: str
    parts: list[int]
    micro_batches: int
    stages: list[StageCost]
    link_bandwidth: float | None = None  # bytes/s between stages; None: p2p not modelled
    schedule: str = "1f1b"
    step_model: StepModel | None = None  # what a step costs beyond the layers; None: the layers alone

    @property
    def imbalance(self) -> float:
        """Fastest / slowest stage (1.0 is perfect, higher is better): ``costs.stage.imbalance``."""
        return imbalance([s.time_s for s in self.stages])

    @property
    def predicted_step_ms(self) -> float:
        """The event simulator's step for these stages under the schedule (fill, steady state, drain, each stage's
        optimizer step where profiled); with a step model, its prediction (engine costs, optimizer step, shared
        cores)."""
        if self.step_model is not None:
            model = replace(self.step_model, p2p_bandwidth=self.link_bandwidth or self.step_model.p2p_bandwidth)
            return 1e3 * model.predict(self.stages, self.micro_batches, schedule=self.schedule, timeline=False).step_s
        # each stage's optimizer step after its last backward, where the layers measured it (one chunk a rank)
        optimizer = [s.optimizer_s for s in self.stages]
        per_rank = any(optimizer) and parse_schedule(self.schedule).chunks_per_rank == 1
        return 1e3 * simulate_stages(self.stages, self.micro_batches, link_bandwidth=self.link_bandwidth,
                                     schedule=self.schedule, optimizer_s=optimizer if per_rank else None).step_s

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "parts": self.parts,
            "micro_batches": self.micro_batches,
            "imbalance": self.imbalance,
            "predicted_step_ms": self.predicted_step_ms,
            "stages": [
                {"stage": s.stage, "layers": [s.start, s.stop], "layer_names": summarise_names(s.layer_names),
                 "forward_ms": 1e3 * s.forward_s, "backward_ms": 1e3 * s.backward_s, "comm_ms": 1e3 * s.p2p_s, "optimizer_ms": 1e3 * s.optimizer_s,
                 "time_ms": 1e3 * s.time_s, "param_bytes": s.param_bytes, "static_bytes": s.static_bytes,
                 "activation_bytes": s.activation_bytes, "inflight": s.inflight, "memory_bytes": s.memory_bytes}
                for s in self.stages
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_table(self) -> str:
        header = ["stage", "layers", "names", "fwd ms", "bwd ms", "p2p ms", "total ms", "static MiB", "act MiB x inflight", "mem MiB"]
        rows = [
            [
                str(s.stage),
                f"{s.start}-{s.stop - 1}",
                summarise_names(s.layer_names),
                f"{1e3 * s.forward_s:.1f}",
                f"{1e3 * s.backward_s:.1f}",
                f"{1e3 * s.p2p_s:.1f}",
                f"{1e3 * s.time_s:.1f}",
                f"{s.static_bytes / MIB:.1f}",
                f"{s.activation_bytes / MIB:.1f} x {s.inflight}",
                f"{s.memory_bytes / MIB:.1f}",
            ]
            for s in self.stages
        ]
        lines = [f"partition_method={self.method} parts={self.parts} micro_batches={self.micro_batches}"]
        lines += render_table(header, rows)
        lines.append(
            f"imbalance (fastest/slowest, higher is better) = {self.imbalance:.3f}   "
            f"predicted {self.schedule} step = {self.predicted_step_ms:.1f} ms"
            + (" (step model)" if self.step_model is not None else "")
        )
        return "\n".join(lines)


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned columns: text left, numbers right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = []
        for i, cell in enumerate(row):
            cell = str(cell)
            numeric = cell.lstrip("+").replace(".", "", 1).replace("-", "", 1).replace(" x ", "").replace("e", "").isdigit()
            cells.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return [fmt(header), sep, *(fmt(r) for r in rows)]


def summarise_names(names: Sequence[str]) -> str:
    """['EmbeddingPipe', 'Block', 'Block'] -> 'EmbeddingPipe, Block x2'."""
    out: list[list] = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ", ".join(n if k == 1 else f"{n} x{k}" for n, k in out)


def build_plan(
    method: str,
    parts: Sequence[int],
    costs: Sequence,
    *,
    micro_batches: int,
    link_bandwidth: float | None = None,
    recompute: bool = False,
    schedule: str = "1f1b",
    step_model: StepModel | None = None,
) -> PartitionPlan:
    stages = stage_costs(costs, parts, micro_batches=micro_batches, recompute=recompute, link_bandwidth=link_bandwidth,
                         schedule=schedule)
    return PartitionPlan(method=method, parts=list(parts), micro_batches=micro_batches, stages=stages,
                         link_bandwidth=link_bandwidth, schedule=schedule, step_model=step_model)
