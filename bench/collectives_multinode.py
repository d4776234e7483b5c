"""NCCL's cost model (``costs.nccl``) against published multi-node and NVSwitch measurements: a check, not a fit.

Every collective a plan prices goes through ``costs.nccl.collective`` on the cluster's network
(``costs.network``): NCCL 2.30.7's tuning model over the channels its search builds on the nodes' rails.
This bench sets it beside what was published (``bench/data/published_nccl_tests.csv``: nccl-tests results
posted with their systems, and figures NCCL's maintainers stated for DGX nodes), each row with its source.
Nothing here fitted anything: no constant of the model was set from these rows.  An error is the model's
bus bandwidth (or latency) over the published one, minus one.

    python bench/collectives_multinode.py [--smoke]

Then the steps of published sharded data-parallel runs at several node counts (``SCALING``), each layout priced
by `plan --only` (the CLI's own route) at every node count, as the ratio step(N nodes) / step(fewest): the
target is each predicted ratio within 10% of the measured one.  Both runs are FSDP (torchtitan's FSDP2:
a block's parameters gathered at once, the next block prefetched, gradients reduce-scattered a block at a
time); the model prices DeepSpeed's ZeRO-3 (a module at a time, one module ahead) on the same layout, and
bf16 where the Trainy run gathered Float8 weights.  Beside each, the one-NIC rule the model replaced
(``--nics-per-node 1``: the group's ring on one NIC).

Ends ``RESULT rows=N busbw_median_abs_err_pct=... busbw_max_abs_err_pct=... latency_err_pct=...
scaling_ratio_err_pct=A/B one_nic_ratio_err_pct=C/D``.
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
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

DATA = ROOT / "bench" / "data" / "published_nccl_tests.csv"

# (name, source, device, [(gpus, measured tokens/s a GPU)], plan arguments, --only)
SCALING = [
    ("torchtitan-llama3.1-8b-fsdp", "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 "
     "(Grand Teton: 8 H100 a host, 400 Gb/s a GPU; FSDP, local batch 2, selective AC, no compile)", "h100",
     [(8, 5762.0), (128, 5605.0)], "--execution eager", "pp=1,tp=1,mb=2,recompute=selective,zero=3,overlap=on"),
    ("trainy-llama3.1-8b-fsdp-h200", "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
     "(8 H200 a host, 400 Gb/s a GPU; FSDP, local batch 2, torch.compile, Float8 linears and all-gathers)", "h200",
     [(32, 10938.0), (64, 10753.0)], "--execution compiled", "pp=1,tp=1,mb=2,recompute=none,zero=3,overlap=on"),
]


def plan_step(device: str, gpus: int, extra: str, only: str, *cluster: str) -> float:
    """`ds-pipe-ext plan --only` of the layout on ``gpus`` GPUs, local batch 2, sequence 8192: its step."""
    from ds_pipe_ext.cli import build_parser
    from ds_pipe_ext.cli.plan import build_model
    from ds_pipe_ext.plan.space import parse_only

    args = build_parser().parse_args(["plan", "--model", "llama3-8b", "--gpus", str(gpus), "--device", device,
                                      "--global-batch", str(2 * gpus), "--seq", "8192", *extra.split(), *cluster,
                                      "--only", f"{only},dp={gpus}"])
    _, model = build_model(args)
    return model.evaluate_named(parse_only(args.only, gpus=gpus, global_batch=2 * gpus)).step_s


def scaling_rows() -> list[dict]:
    out = []
    for name, source, device, runs, extra, only in SCALING:
        (g0, tps0), (g1, tps1) = runs
        measured = tps0 / tps1  # tokens a GPU fixed: the step grows as the throughput falls
        new = plan_step(device, g1, extra, only) / plan_step(device, g0, extra, only)
        one = (plan_step(device, g1, extra, only, "--nics-per-node", "1")
               / plan_step(device, g0, extra, only, "--nics-per-node", "1"))
        out.append({"name": name, "source": source, "gpus": f"{g0} -> {g1}", "measured": measured, "model": new,
                    "one_nic": one, "err_pct": 100 * (new / measured - 1), "one_nic_err_pct": 100 * (one / measured - 1)})
    return out


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
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the whole table: it launches nothing)")
    ap.parse_args()
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
    scaling = scaling_rows()
    print("\nsharded data parallel, step(more nodes) / step(fewer), tokens a GPU fixed (predicted: plan --only):")
    print(f"{'run':30s} {'GPUs':>10s} {'measured':>9s} {'model':>7s} {'err %':>7s} {'one NIC':>8s} {'err %':>7s}")
    for r in scaling:
        print(f"{r['name']:30s} {r['gpus']:>10s} {r['measured']:9.3f} {r['model']:7.3f} {r['err_pct']:+7.1f} "
              f"{r['one_nic']:8.3f} {r['one_nic_err_pct']:+7.1f}")
    for r in scaling:
        print(f"  {r['name']}: {r['source']}")
    ratio_err = "/".join(f"{r['err_pct']:+.1f}" for r in scaling)
    one_nic_err = "/".join(f"{r['one_nic_err_pct']:+.1f}" for r in scaling)
    print(f"\nRESULT rows={len(results)} busbw_median_abs_err_pct={statistics.median(bw):.1f} "
          f"busbw_max_abs_err_pct={max(bw):.1f} latency_err_pct={'/'.join(f'{x:+.0f}' for x in lat)} "
          f"scaling_ratio_err_pct={ratio_err} one_nic_ratio_err_pct={one_nic_err}")


if __name__ == "__main__":
    main()
