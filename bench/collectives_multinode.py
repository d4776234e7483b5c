"""NCCL's cost model (``costs.nccl``) against published multi-node and NVSwitch measurements: a check, not a fit.

Every collective a plan prices goes through ``costs.nccl.collective`` on the cluster's network
(``costs.network``): NCCL 2.30.7's tuning model over the channels its search builds on the nodes' rails.
This bench sets it beside what was published (``bench/data/published_nccl_tests.csv``: nccl-tests results
posted with their systems, and figures NCCL's maintainers stated for DGX nodes), each row with its source.
Nothing here fitted anything: no constant of the model was set from these rows.  An error is the model's
bus bandwidth (or latency) over the published one, minus one.

    python bench/collectives_multinode.py

Ends ``RESULT rows=N busbw_median_abs_err_pct=... busbw_max_abs_err_pct=... latency_err_pct=...``.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.costs.hardware import DEVICES  # noqa: E402
from ds_pipe_ext.costs.nccl import collective  # noqa: E402
from ds_pipe_ext.costs.network import Placement, system_for, with_overrides  # noqa: E402

DATA = ROOT / "bench" / "data" / "published_nccl_tests.csv"


def load_rows(path: Path = DATA) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def model_row(r: dict) -> dict:
    """The model's collective for a published row: its system as built (nodes, NICs and their speed), the
    group every GPU of every node, NCCL's pick or the algorithm the run forced."""
    nodes, per = int(r["nodes"]), int(r["gpus_per_node"])
    net = with_overrides(system_for(DEVICES[r["device"]]), gpus_per_node=per, nics_per_node=int(r["nics_per_node"]),
                         inter_node_gbs=float(r["nic_gbps"]) / 8)
    one = collective(r["kind"], float(r["bytes"]), Placement(nodes * per, nodes, per, per), net,
                     algorithm=r["algorithm"] or None)
    out = {"name": r["name"], "algorithm": f"{one.algorithm}/{one.protocol}", "model_busbw": one.bus_bandwidth / 1e9,
           "model_latency_us": one.latency_s * 1e6}
    if r["busbw_gbs"]:
        out["busbw_err_pct"] = 100 * (out["model_busbw"] / float(r["busbw_gbs"]) - 1)
    if r["latency_us"]:
        out["latency_err_pct"] = 100 * (out["model_latency_us"] / float(r["latency_us"]) - 1)
    return out


def main() -> None:
    rows = load_rows()
    print(f"{'row':22s} {'system':10s} {'nodes':>5s} {'kind':14s} {'bytes':>11s} {'model algorithm':16s} "
          f"{'published':>10s} {'model':>8s} {'err %':>7s}")
    results = []
    for r in rows:
        m = model_row(r)
        results.append(m)
        if "busbw_err_pct" in m:
            pub, mod, err = f"{float(r['busbw_gbs']):.0f} GB/s", f"{m['model_busbw']:.0f}", m["busbw_err_pct"]
        else:
            pub, mod, err = f"{float(r['latency_us']):.1f} us", f"{m['model_latency_us']:.1f}", m["latency_err_pct"]
        print(f"{r['name']:22s} {r['system']:10s} {r['nodes']:>5s} {r['kind']:14s} {int(r['bytes']):11d} "
              f"{m['algorithm']:16s} {pub:>10s} {mod:>8s} {err:+7.1f}")
    print("\nsources:")
    for r in rows:
        print(f"  {r['name']}: {r['source']}")
    bw = [abs(m["busbw_err_pct"]) for m in results if "busbw_err_pct" in m]
    lat = [m["latency_err_pct"] for m in results if "latency_err_pct" in m]
    print(f"\nRESULT rows={len(results)} busbw_median_abs_err_pct={statistics.median(bw):.1f} "
          f"busbw_max_abs_err_pct={max(bw):.1f} latency_err_pct={'/'.join(f'{x:+.0f}' for x in lat)}")


if __name__ == "__main__":
    main()
