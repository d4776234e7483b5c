"""The cost model's collectives inside a node against XLA's measured H100 ones: records that fitted nothing.

Every collective is priced by NCCL's own model (``costs.nccl.collective``, NCCL 2.30.7's tuning: on a DGX
H100 an all-reduce of 8 runs NVLS at 476 GB/s of bus bandwidth with 25 us of latency, all-gather and
reduce-scatter rings at 360 GB/s, LL/LL128 at small sizes).  Beside it, the rule it replaced: the ring formula
on the spec's datasheet NVLink (2 (n - 1) / n or (n - 1) / n of the tensor's bytes over 450 GB/s), with and
without NCCL 2.8's ring latency (``costs.nccl.ring_latency_s``).  XLA publishes what its collectives measured on 8 H100s in one node
(``xla/service/gpu/model/collective_interpolator_data.h``, key ``sm_90``): each of the three from 1 KiB to
2 GiB (F32, doubling), 66 rows in ``bench/data/xla_sm90_collectives.csv``.  No figure of the model was set from
them.  This prints the model's time against each, with and without NCCL's ring latency, the bus bandwidth
each reached, and ends

    RESULT rows=66 tp_sizes_median_err_pct=... tp_sizes_with_latency_median_err_pct=...
           tp_sizes_nccl_median_err_pct=... large_busbw_gbs=AR/AG/RS small_latency_us=AR/AG/RS

(the first two: the datasheet ring, without and with latency; ``nccl``: the model every command prices with).

``tp_sizes``: 4-64 MiB, the tensors a TP group of 8 exchanges each layer (a micro-batch's sequence x hidden
in bf16, from gpt2-medium's 8 x 1,024 x 1,024 to Llama 3 8B's 8,192 x 4,096).  An error is the model's time
over XLA's, minus one: negative where the model is faster than the H100 ran.

Usage: python bench/collectives_vs_xla.py [--device h100-sxm]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.costs.hardware import get_device  # noqa: E402
from ds_pipe_ext.costs.nccl import ring_latency_s  # noqa: E402
from ds_pipe_ext.costs.network import Placement  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

DATA = ROOT / "bench" / "data" / "xla_sm90_collectives.csv"
RANKS = 8
KINDS = ("all-reduce", "all-gather", "reduce-scatter")
TP_SIZES = (4 * 2**20, 64 * 2**20)  # bytes


def load_rows(path: Path = DATA) -> list[dict]:
    """XLA's rows: the collective, its full tensor's bytes (F32) and the seconds it took."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out = []
    for r in rows:
        size = 4 * int(r["elements"])
        out.append({"kind": r["op"], "bytes": size, "seconds": size / float(r["bytes_per_s"])})
    return out


def bus_bandwidth(kind: str, size: float, seconds: float, n: int = RANKS) -> float:
    """NCCL's bus bandwidth: the bytes each link carries over the time (nccl-tests' busbw)."""
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * size / seconds


def compare(device: str = "h100-sxm") -> list[dict]:
    spec = get_device(device, cache_dir=None)
    node = Placement(RANKS, 1, RANKS, RANKS)  # XLA's 8 GPUs: one node
    out = []
    for r in load_rows():
        model = spec.collective_time(r["bytes"], r["kind"], RANKS, spec.cluster.link_bandwidth * spec.comm_efficiency)
        latency = ring_latency_s(r["kind"], RANKS, spec.gpus_per_node)
        nccl = spec.group_collective(r["kind"], r["bytes"], node)
        out.append({**r, "model_s": model, "with_latency_s": model + latency, "nccl_s": nccl.time_s,
                    "nccl_algorithm": f"{nccl.algorithm}/{nccl.protocol}",
                    "busbw": bus_bandwidth(r["kind"], r["bytes"], r["seconds"]),
                    "err_pct": 100.0 * (model / r["seconds"] - 1.0),
                    "with_latency_err_pct": 100.0 * ((model + latency) / r["seconds"] - 1.0),
                    "nccl_err_pct": 100.0 * (nccl.time_s / r["seconds"] - 1.0)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="h100-sxm", help="the spec checked (XLA's rows are an H100 SXM node's)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the whole table: it launches nothing)")
    args = ap.parse_args(argv)
    rows = compare(args.device)
    print(f"{'collective':15s} {'bytes':>12s} {'XLA us':>9s} {'busbw GB/s':>10s} {'ring us':>9s} {'err %':>7s} "
          f"{'+ latency us':>12s} {'err %':>7s} {'NCCL us':>9s} {'err %':>7s}  algorithm")
    for r in rows:
        print(f"{r['kind']:15s} {r['bytes']:12d} {1e6 * r['seconds']:9.1f} {r['busbw'] / 1e9:10.1f} "
              f"{1e6 * r['model_s']:9.1f} {r['err_pct']:+7.1f} {1e6 * r['with_latency_s']:12.1f} "
              f"{r['with_latency_err_pct']:+7.1f} {1e6 * r['nccl_s']:9.1f} {r['nccl_err_pct']:+7.1f}  {r['nccl_algorithm']}")
    tp = [r for r in rows if TP_SIZES[0] <= r["bytes"] <= TP_SIZES[1]]
    large = {k: max(r["busbw"] for r in rows if r["kind"] == k) for k in KINDS}
    small = {k: min(r["seconds"] for r in rows if r["kind"] == k) for k in KINDS}
    print(f"\nat TP's sizes (4-64 MiB, {len(tp)} rows): model median "
          f"{statistics.median(r['err_pct'] for r in tp):+.1f}%, with NCCL's ring latency "
          f"{statistics.median(r['with_latency_err_pct'] for r in tp):+.1f}%; NCCL 2.30's model (what every command "
          f"prices with) {statistics.median(r['nccl_err_pct'] for r in tp):+.1f}%")
    print("largest bus bandwidth reached (GB/s): " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in large.items())
          + f"; the spec's link: {get_device(args.device, cache_dir=None).cluster.link_bandwidth / 1e9:.0f}")
    print("\nRESULT rows=%d tp_sizes_median_err_pct=%.1f tp_sizes_with_latency_median_err_pct=%.1f "
          "tp_sizes_nccl_median_err_pct=%.1f all_rows_nccl_median_abs_err_pct=%.1f "
          "large_busbw_gbs=%s small_latency_us=%s" % (
              len(rows), statistics.median(r["err_pct"] for r in tp),
              statistics.median(r["with_latency_err_pct"] for r in tp),
              statistics.median(r["nccl_err_pct"] for r in tp),
              statistics.median(abs(r["nccl_err_pct"]) for r in rows),
              "/".join(f"{large[k] / 1e9:.0f}" for k in KINDS), "/".join(f"{1e6 * small[k]:.0f}" for k in KINDS)))


if __name__ == "__main__":
    main()
