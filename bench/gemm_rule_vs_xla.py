"""The GPU GEMM rule against XLA's measured H100 matmuls: records that fitted nothing, no GPU needed.

Until a device has its own kernel table (``bench/gpu_kernels.py``), ``costs.gpu_pricing.product_s`` prices a
GEMM by rule: the measured-GEMM ceiling (``gemm_efficiency``; the H100's fitted on Megatron-core's H100 table,
``hardware.CALIBRATED``), wave quantization of the kernel's output tiles (128 x 256, either way round) over the
SMs, the fill K / (K + k_half)
(read off XLA's B200 table) and a launch floor.  XLA publishes what its GEMMs measured on an H100
(``xla/service/gpu/model/matmul_interpolator_data.h``, key ``sm_90``): one bf16 product (b 1) at every
M, N, K in 256-4,096 (powers of two), 125 shapes, in ``bench/data/xla_sm90_matmul_bf16.csv``.  No parameter
of the rule was fitted to them.  This prints the rule's time against each, by how many waves of tiles the
output makes.

The same grid then checks a measured table's interpolation (``costs.kernel_table``): each shape left out in
turn and priced from a table of the other 124, as ``product_s`` prices a device with a table (the measured
rates over the rule's, interpolated, times the rule's), and with the rates interpolated alone.  It ends

    RESULT shapes=125 median_err_pct=... mean_abs_err_pct=... multiwave_shapes=N
           multiwave_median_err_pct=... multiwave_mean_abs_err_pct=... cube4096_err_pct=...
           table_loo_median_abs_err_pct=... table_loo_p90_abs_err_pct=... table_loo_rates_alone_median_abs_err_pct=...

An error is the predicted time over XLA's, minus one: positive where the prediction is slower than the H100 ran.

Usage: python bench/gemm_rule_vs_xla.py [--device h100-sxm]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dataclasses import replace  # noqa: E402

from ds_pipe_ext.costs.gpu_pricing import gpu_kernels, product_s  # noqa: E402
from ds_pipe_ext.costs.hardware import get_device  # noqa: E402
from ds_pipe_ext.costs.kernel_table import KernelTable  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402

DATA = ROOT / "bench" / "data" / "xla_sm90_matmul_bf16.csv"


def load_shapes(path: Path = DATA) -> list[dict]:
    """XLA's rows: m, n, k and the FLOP/s it measured (comment lines skipped)."""
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [{"m": int(r["m"]), "n": int(r["n"]), "k": int(r["k"]), "flops": float(r["flops"])} for r in rows]


def waves(m: int, n: int, kern) -> float:
    """The rule's output tiles over the SMs (the tile's better orientation, as ``gpu_pricing.wave_efficiency``
    picks it): under 1, the rule's one wave leaves SMs idle."""
    rows, cols = kern.tile
    return min(math.ceil(m / tr) * math.ceil(n / tc) for tr, tc in ((rows, cols), (cols, rows))) / kern.sms


def compare(device: str = "h100-sxm") -> list[dict]:
    spec = get_device(device, cache_dir=None)
    out = []
    for r in load_shapes():
        m, n, k = r["m"], r["n"], r["k"]
        measured_s = 2.0 * m * n * k / r["flops"]
        rule_s = product_s(m, k, n, dtype="bf16", align=16, backward=False, spec=spec)
        out.append({**r, "measured_us": 1e6 * measured_s, "rule_us": 1e6 * rule_s,
                    "waves": waves(m, n, spec.gpu), "err_pct": 100.0 * (rule_s / measured_s - 1.0)})
    return out


def leave_one_out(device: str = "h100-sxm") -> list[dict]:
    """Each shape priced from a table of the others: through ``product_s`` (the rule as the prior) and from
    the rates alone (``KernelTable.gemm_flops`` without a prior); errors in % of XLA's time."""
    spec = get_device(device, cache_dir=None)
    rows = load_shapes()
    gemm = [{"dtype": "bf16", "m": r["m"], "k": r["k"], "n": r["n"], "seconds": 2.0 * r["m"] * r["n"] * r["k"] / r["flops"]}
            for r in rows]
    out = []
    for i, r in enumerate(rows):
        table = KernelTable(device=device, source="XLA's sm_90 rows but one", gemm=gemm[:i] + gemm[i + 1:])
        with_table = replace(spec, gpu=gpu_kernels(spec.name, table=table))
        m, n, k, measured_s = r["m"], r["n"], r["k"], gemm[i]["seconds"]
        prior_s = product_s(m, k, n, dtype="bf16", align=16, backward=False, spec=with_table)
        alone_s = 2.0 * m * n * k / table.gemm_flops(m, k, n, "bf16", 16)[0]
        out.append({"m": m, "n": n, "k": k, "err_pct": 100.0 * (prior_s / measured_s - 1.0),
                    "rates_alone_err_pct": 100.0 * (alone_s / measured_s - 1.0)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="h100-sxm", help="the spec whose rule is checked (XLA's rows are an H100's)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (the whole table: it launches nothing)")
    args = ap.parse_args(argv)
    rows = compare(args.device)
    print(f"{'m':>5} {'n':>5} {'k':>5} {'waves':>6} {'XLA TFLOP/s':>11} {'XLA us':>8} {'rule us':>8} {'err %':>7}")
    for r in sorted(rows, key=lambda r: (r["waves"], r["k"])):
        print(f"{r['m']:5d} {r['n']:5d} {r['k']:5d} {r['waves']:6.2f} {r['flops'] / 1e12:11.1f} "
              f"{r['measured_us']:8.1f} {r['rule_us']:8.1f} {r['err_pct']:+7.1f}")
    print("\nby waves of output tiles and by K (median error %, shapes):")
    for label, pick in (("< 1 wave", lambda r: r["waves"] < 1), (">= 1 wave", lambda r: r["waves"] >= 1)):
        for k in sorted({r["k"] for r in rows}):
            sel = [r["err_pct"] for r in rows if pick(r) and r["k"] == k]
            if sel:
                print(f"  {label:9s} k {k:5d}: {statistics.median(sel):+6.1f}  ({len(sel)})")
    errs = [r["err_pct"] for r in rows]
    multi = [r["err_pct"] for r in rows if r["waves"] >= 1]
    cube = next(r["err_pct"] for r in rows if r["m"] == r["n"] == r["k"] == 4096)
    loo = leave_one_out(args.device)
    with_prior = sorted(abs(r["err_pct"]) for r in loo)
    alone = sorted(abs(r["rates_alone_err_pct"]) for r in loo)
    print("\na table of the other 124 shapes, each shape left out (|error| %: median, 90th percentile, max):")
    for label, a in (("rates over the rule's (product_s)", with_prior), ("rates alone", alone)):
        print(f"  {label:34s} {statistics.median(a):5.1f} {a[int(0.9 * len(a))]:6.1f} {a[-1]:6.1f}")
    print(f"\nRESULT shapes={len(rows)} median_err_pct={statistics.median(errs):.1f} "
          f"mean_abs_err_pct={statistics.fmean(abs(e) for e in errs):.1f} multiwave_shapes={len(multi)} "
          f"multiwave_median_err_pct={statistics.median(multi):.1f} "
          f"multiwave_mean_abs_err_pct={statistics.fmean(abs(e) for e in multi):.1f} cube4096_err_pct={cube:.1f} "
          f"table_loo_median_abs_err_pct={statistics.median(with_prior):.1f} "
          f"table_loo_p90_abs_err_pct={with_prior[int(0.9 * len(with_prior))]:.1f} "
          f"table_loo_rates_alone_median_abs_err_pct={statistics.median(alone):.1f}")


if __name__ == "__main__":
    main()
