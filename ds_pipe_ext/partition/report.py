"""What a partition predicts, per stage: `StageReport`, `PartitionPlan`, table and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

MIB = 2**20


@dataclass(frozen=True)
class StageReport:
    stage: int
    layers: tuple[int, int]  # [start, stop)
    layer_names: str
    forward_ms: float
    backward_ms: float
    comm_ms: float  # p2p at this stage's boundaries, per micro-batch (fwd + bwd)
    static_bytes: int  # params + grads + optimizer states
    activation_bytes: int  # one micro-batch
    inflight: int  # micro-batches held under 1F1B
    param_bytes: int

    @property
    def time_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.comm_ms

    @property
    def memory_bytes(self) -> int:
        return self.static_bytes + self.inflight * self.activation_bytes


@dataclass(frozen=True)
class PartitionPlan:
    method: str
    parts: list[int]
    micro_batches: int
    stages: list[StageReport]

    @property
    def slowest_over_fastest(self) -> float:
        times = [s.time_ms for s in self.stages]
        return max(times) / min(times) if min(times) > 0 else float("inf")

    @property
    def predicted_step_ms(self) -> float:
        """1F1B: one pass through every stage (fill + drain), then m - 1 more at the bottleneck."""
        times = [s.time_ms for s in self.stages]
        return sum(times) + (self.micro_batches - 1) * max(times)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "parts": self.parts,
            "micro_batches": self.micro_batches,
            "imbalance_slowest_over_fastest": self.slowest_over_fastest,
            "predicted_step_ms": self.predicted_step_ms,
            "stages": [
                {**asdict(s), "layers": list(s.layers), "time_ms": s.time_ms, "memory_bytes": s.memory_bytes}
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
                f"{s.layers[0]}-{s.layers[1] - 1}",
                s.layer_names,
                f"{s.forward_ms:.1f}",
                f"{s.backward_ms:.1f}",
                f"{s.comm_ms:.1f}",
                f"{s.time_ms:.1f}",
                f"{s.static_bytes / MIB:.1f}",
                f"{s.activation_bytes / MIB:.1f} x {s.inflight}",
                f"{s.memory_bytes / MIB:.1f}",
            ]
            for s in self.stages
        ]
        lines = [f"partition_method={self.method} parts={self.parts} micro_batches={self.micro_batches}"]
        lines += render_table(header, rows)
        lines.append(
            f"imbalance (slowest/fastest) = {self.slowest_over_fastest:.3f}   "
            f"predicted 1F1B step = {self.predicted_step_ms:.1f} ms"
        )
        return "\n".join(lines)


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned columns: text left, numbers right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = []
        for i, cell in enumerate(row):
            cell = str(cell)
            numeric = cell.replace(".", "", 1).replace("-", "", 1).replace(" x ", "").replace("e", "").isdigit()
            cells.append(cell.rjust(widths[i]) if numeric else cell.ljust(widths[i]))
        return "  ".join(cells).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return [fmt(header), sep, *(fmt(r) for r in rows)]


def _summarise_names(names: Sequence[str]) -> str:
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
) -> PartitionPlan:
    from . import held_activation_bytes

    p = len(parts) - 1
    held = held_activation_bytes(costs, recompute=recompute)
    stages = []
    for s in range(p):
        i, j = parts[s], parts[s + 1]
        layer = costs[i:j]
        comm = 0.0
        if link_bandwidth:
            # 1F1B: activation in + its gradient out, activation out + its gradient in
            if i > 0:
                comm += 2 * costs[i - 1].output_bytes / link_bandwidth
            if j < len(costs):
                comm += 2 * costs[j - 1].output_bytes / link_bandwidth
        stages.append(
            StageReport(
                stage=s,
                layers=(i, j),
                layer_names=_summarise_names([c.name for c in layer]),
                forward_ms=1e3 * sum(c.forward_s for c in layer),
                backward_ms=1e3 * sum(c.backward_s + (c.recompute_s if recompute else 0.0) for c in layer),
                comm_ms=1e3 * comm,
                static_bytes=sum(c.static_bytes for c in layer),
                activation_bytes=int(sum(held[i:j])),
                inflight=min(p - s, micro_batches),
                param_bytes=sum(c.param_bytes for c in layer),
            )
        )
    return PartitionPlan(method=method, parts=list(parts), micro_batches=micro_batches, stages=stages)
