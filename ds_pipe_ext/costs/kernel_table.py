"""A GPU's measured kernels, as ``bench/gpu_kernels.py`` writes them to ``costs/kernels/<device>.json``.

GEMM throughput is interpolated over log2 M, K and N within a dtype and an alignment class (inverse-distance
weights of the nearest measured shapes, in log space: exact at a measured shape, between its neighbours
elsewhere).  Given the rule's rate as a prior (``gpu_pricing``'s), what is interpolated is each measured
shape's rate over the rule's there, and the query gets the rule's rate times that: the rule carries the shape's
waves and fill between the measured points, the table its level.  On XLA's measured H100 grid (125 shapes, each
left out in turn) that takes the median error of an interpolated shape from 17% to 5%
(``bench/gemm_rule_vs_xla.py``).  Attention throughput is interpolated by backend, dtype and head dim over the
sequence.  A table may carry ``launch_s`` and ``host_kernel_s`` too.  A device without a table is priced by
``gpu_pricing``'s rules, and ``estimate`` / ``plan`` say so (``table_note``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .op_cost import DTYPE_BYTES, AnalyticError

TABLE_DIR = Path(__file__).parent / "kernels"
NEIGHBOURS = 8


def _alignment(k: int, n: int, elem: int) -> int:
    from .gpu_pricing import alignment_bytes

    return alignment_bytes(k, n, elem=elem)


@dataclass
class KernelTable:
    device: str
    source: str
    gemm: list = field(default_factory=list)  # {"dtype", "m", "k", "n", "seconds"}
    # {"backend", "dtype", "s", "d", "gqa", "dropout", "fwd_s", "bwd_s", "fwd_flops"}
    attention: list = field(default_factory=list)
    launch_s: float | None = None
    host_kernel_s: float | None = None
    # an op's host cost with its autograd node, forward and backward (bench/gpu_kernels.py's chain of products)
    host_op_s: float | None = None
    host_op_bwd_s: float | None = None
    bandwidth_fraction: float | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict, where: str = "kernel table") -> "KernelTable":
        try:
            table = cls(device=str(data["device"]), source=str(data.get("source", "")),
                        gemm=[dict(r) for r in data.get("gemm", [])],
                        attention=[dict(r) for r in data.get("attention", [])],
                        launch_s=data.get("launch_s"), host_kernel_s=data.get("host_kernel_s"),
                        host_op_s=data.get("host_op_s"), host_op_bwd_s=data.get("host_op_bwd_s"),
                        bandwidth_fraction=data.get("bandwidth_fraction"),
                        meta={k: data[k] for k in ("date", "torch", "cuda", "device_name") if k in data})
            for r in table.gemm:
                if r["dtype"] not in DTYPE_BYTES or min(r["m"], r["k"], r["n"]) < 1 or r["seconds"] <= 0:
                    raise ValueError(f"bad GEMM row {r}")
            for r in table.attention:
                if r["fwd_s"] <= 0 or r["s"] < 1 or r["d"] < 1:
                    raise ValueError(f"bad attention row {r}")
        except (KeyError, TypeError, ValueError) as e:
            raise AnalyticError(f"{where}: not a kernel table ({type(e).__name__}: {e}); rerun "
                                f"bench/gpu_kernels.py on the device, or delete the file to price it by rules") from None
        return table

    def gemm_flops(self, m: float, k: float, n: float, dtype: str, align: int,
                   prior=None) -> tuple[float, bool] | None:
        """(FLOP/s, whether rows of the query's alignment gave it) for an (m x k)(k x n) product; None where
        the table has no GEMM of this dtype.  ``prior(m, k, n)``: the rule's FLOP/s at a shape, whose ratio to
        the measured rates is interpolated in place of the rates themselves."""
        elem = DTYPE_BYTES[dtype]
        rows = [r for r in self.gemm if r["dtype"] == dtype]
        same = [r for r in rows if _alignment(r["k"], r["n"], elem) == align]
        aligned = [r for r in rows if _alignment(r["k"], r["n"], elem) == 16]
        pick, exact = (same, True) if same else (aligned, False)
        if not pick:
            return None
        point = (math.log2(m), math.log2(k), math.log2(n))
        weighted = []
        for r in pick:
            rate = 2.0 * r["m"] * r["k"] * r["n"] / r["seconds"]
            dist = math.dist(point, (math.log2(r["m"]), math.log2(r["k"]), math.log2(r["n"])))
            if dist < 1e-9:
                return rate, exact
            weighted.append((dist, r, rate))
        weighted.sort(key=lambda x: x[0])
        near = weighted[:NEIGHBOURS]
        weights = [1.0 / d ** 2 for d, _, _ in near]
        if prior is None:
            logs = [math.log(rate) for _, _, rate in near]
            scale = 1.0
        else:
            logs = [math.log(rate / prior(r["m"], r["k"], r["n"])) for _, r, rate in near]
            scale = prior(m, k, n)
        return scale * math.exp(sum(w * x for w, x in zip(weights, logs)) / sum(weights)), exact

    def attention_flops(self, backend: str, dtype: str, *, s: int, d: int, backward: bool, gqa: bool = False,
                        dropout: bool = False) -> float | None:
        """FLOP/s of ``backend``'s kernel at sequence ``s`` and head dim ``d`` (the nearest measured head dim,
        interpolated over log2 s), from the rows of the query's dropout and grouped-query flags (a row without
        the field: off; a grouped-query query takes the backend's other rows where none has it); None where the
        table has no row for the backend, dtype and dropout (a table measured without dropout: the caller
        applies its dropout share)."""
        rows = [r for r in self.attention if r["backend"] == backend and r["dtype"] == dtype
                and (not backward or r.get("bwd_s")) and bool(r.get("dropout")) == dropout]
        rows = [r for r in rows if bool(r.get("gqa")) == gqa] or rows
        if not rows:
            return None
        dim = min({r["d"] for r in rows}, key=lambda x: abs(math.log2(x / d)))
        points = sorted((r["s"], r["fwd_flops"] * (2.5 if backward else 1.0) / (r["bwd_s"] if backward else r["fwd_s"]))
                        for r in rows if r["d"] == dim)
        if s <= points[0][0]:
            return points[0][1]
        if s >= points[-1][0]:
            return points[-1][1]
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if s0 <= s <= s1:
                w = (math.log2(s) - math.log2(s0)) / ((math.log2(s1) - math.log2(s0)) or 1.0)
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        return points[-1][1]


def load_kernel_table(device: str, table_dir: Path | None = None) -> KernelTable | None:
    """The measured table of a datasheet device (``costs/kernels/<device>.json``), None where there is none."""
    path = (table_dir or TABLE_DIR) / f"{device}.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise AnalyticError(f"{path}: not JSON ({e}); rerun bench/gpu_kernels.py or delete the file") from None
    return KernelTable.from_json(data, str(path))


def table_note(spec) -> str:
    """What prices a GPU spec's kernels, for estimate and plan to print."""
    kern = getattr(spec, "gpu", None)
    if kern is None:
        return ""
    if kern.table is None:
        return (f"{spec.name}: no measured kernel table (ds_pipe_ext/costs/kernels/); GEMMs and attention priced "
                f"by rules (run bench/gpu_kernels.py on the GPU to measure one)")
    return f"{spec.name}: kernels from {kern.table.source or 'its measured table'}"
