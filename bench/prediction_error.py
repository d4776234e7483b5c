"""How well the partition's prediction matches what training measures, per stage and per step.

Two setups: the spine benchmark (bench-cpu, 2 stages on 2 ranks) and tiny on 4 ranks
(4 stages).  Each runs twice with instrumentation: run A predicts from the per-layer
profile alone; run B predicts from the profile refined with run A's measured stage
times (pipeline.refine_from), which folds in what per-layer profiling misses (engine
overhead, p2p waits, the optimizer step).  Targets apply to the refined prediction.

    python bench/prediction_error.py [--smoke]

Last line: RESULT step_time_error_pct=X worst_stage_error_pct=Y  (targets: X <= 10, Y <= 15)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.instrument.plot import write_png  # noqa: E402
from ds_pipe_ext.instrument.report import build_report, render_report_table  # noqa: E402
from ds_pipe_ext.runner import ROOT, SMOKE_HELP, launch, write_config  # noqa: E402

SETUPS = [
    # name, ranks, config, steps
    ("bench-cpu 2x1", 2, ROOT / "launch_scripts" / "bench_cpu_pipeline.json", 5),
    ("tiny 4x1", 4, None, 40),
]
SMOKE_SETUPS = [("tiny 2x1", 2, None, 3)]  # --smoke: both runs (A, then B refined from A), 3 steps each


def run(ranks, cfg, steps, run_dir, workdir, *extra):
    proc, _ = launch(ranks, cfg, "--steps", str(steps), "--instrument", str(run_dir), *extra,
                     out_dir=run_dir.parent, cwd=workdir, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed:\n{proc.stderr[-3000:]}")
    return build_report(run_dir)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_pred_"))
    worst_step, worst_stage = 0.0, 0.0
    for name, ranks, cfg, steps in SMOKE_SETUPS if args.smoke else SETUPS:
        if cfg is None:
            cfg = write_config(workdir / f"tiny{ranks}.json", pipeline={"stages": ranks})
        tag = name.split()[0]
        a = run(ranks, cfg, steps, workdir / f"{tag}-A" / "run", workdir)
        b = run(ranks, cfg, steps, workdir / f"{tag}-B" / "run", workdir,
                "--refine-from", str(workdir / f"{tag}-A" / "run"))
        for label, rep in (("A: per-layer profile", a), ("B: refined from A", b)):
            print(f"\n=== {name}, {label}")
            print(render_report_table(rep))
        worst_step = max(worst_step, abs(b["summary"]["step_error_pct"]))
        worst_stage = max(worst_stage, b["summary"]["worst_stage_error_pct"])
        if tag == "bench-cpu":
            png = ROOT / "docs" / "report_bench_cpu.png"
            write_png(b, png)
            print(f"wrote {png}")
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"RESULT step_time_error_pct={worst_step:.1f} worst_stage_error_pct={worst_stage:.1f}")


if __name__ == "__main__":
    main()
