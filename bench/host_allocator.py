"""Does glibc's malloc state move a CPU step?  Alternating launches with and without the malloc shim.

``compat.cpu_shims.steady_host_allocator`` fixes glibc's mmap and trim thresholds at start-up.
This bench measures what that does to the steps the partition benchmark compares: bench-cpu,
2 stages on 2 ranks (OMP_NUM_THREADS=1 each), micro-batch 1 x 8, in launches of
bench/splits_in_one_launch.py that build `profiled` then `parts:0,11,14` three times (each build
afresh, its steps' median after a warm-up step).  Launches alternate: glibc's own thresholds
(``DS_PIPE_EXT_GLIBC_MALLOC=default``), fixed, glibc, fixed, ...

Reported: per setting, every build's samples/s; the speed-up of fixed over glibc as the median of
the per-pair ratios (launch medians); and the spread of builds inside one launch (largest / smallest
build of one launch, the median over that setting's launches), which is what separated `profiled`'s
builds from `parts:` builds of the same split by 3-12% in bench/partition_speedup.py v5 and v6.
Nothing here calibrates or predicts anything.

    python bench/host_allocator.py [--pairs 2] [--out runs/host-allocator]
    python bench/host_allocator.py --smoke     (tiny, one pair of 2-step launches: a check it runs)

Last line: RESULT fixed_vs_glibc=X glibc_build_spread=Y fixed_build_spread=Z
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.runner import ROOT, SMOKE_HELP, measure_in_one_launch  # noqa: E402

METHODS = ["profiled", "parts:0,11,14", "parts:0,11,14", "parts:0,11,14"]
SMOKE_METHODS = ["profiled", "parts:0,3,6"]  # --smoke: tiny's 6 layers
SETTINGS = {"glibc": {"DS_PIPE_EXT_GLIBC_MALLOC": "default"}, "fixed": {}}
STEP_MODEL = ROOT / "launch_scripts" / "step_model_cpu.json"


def one_launch(setting: str, out: Path, args) -> list[dict]:
    model, methods = ("tiny", SMOKE_METHODS) if args.smoke else ("bench-cpu", METHODS)
    return measure_in_one_launch(out, methods, train={"model": model, "steps": args.steps, "seed": 1234},
                                 micro_batch=1, micro_batches=8, step_model=STEP_MODEL, env=SETTINGS[setting])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="launch pairs (glibc, fixed), alternating")
    ap.add_argument("--steps", type=int, default=3, help="steps per build (the first is warm-up)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "host-allocator")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        args.pairs, args.steps, args.out = 1, 2, Path(tempfile.mkdtemp(prefix="ds_pipe_ext_malloc_"))
    args.out = args.out.resolve()  # the launches run inside their own directories

    launches: dict[str, list[list[dict]]] = {s: [] for s in SETTINGS}
    for p in range(args.pairs):
        for setting in SETTINGS:
            launches[setting].append(one_launch(setting, args.out / f"pair{p}-{setting}", args))

    rows, spreads = [], {}
    for setting, runs in launches.items():
        for p, recs in enumerate(runs):
            sps = [r["samples_per_s"] for r in recs]
            rows.append([setting, str(p), " ".join(f"{r['method'].replace('parts:', '')}={r['samples_per_s']:.3f}"
                                                  for r in recs), f"{statistics.median(sps):.3f}", f"{max(sps) / min(sps):.3f}"])
        spreads[setting] = statistics.median(max(r["samples_per_s"] for r in recs) / min(r["samples_per_s"] for r in recs)
                                             for recs in runs)
    print("\nbench-cpu, 2 stages, micro-batch 1 x 8: samples/s per build, in launch order")
    print("\n".join(render_table(["malloc", "pair", "builds (profiled, then parts:0,11,14 x 3)", "median", "max/min"], rows)))
    med = {s: [statistics.median(r["samples_per_s"] for r in recs) for recs in runs] for s, runs in launches.items()}
    ratios = [f / g for f, g in zip(med["fixed"], med["glibc"])]
    print(f"fixed / glibc per pair: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print(f"RESULT fixed_vs_glibc={statistics.median(ratios):.3f} glibc_build_spread={spreads['glibc']:.3f} "
          f"fixed_build_spread={spreads['fixed']:.3f}")


if __name__ == "__main__":
    main()
