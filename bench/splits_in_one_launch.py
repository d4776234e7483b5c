"""Measure several pipeline splits inside one deepspeed launch, one after another.

On a shared machine, separate launches drift: one split measured 0.39 and 0.73 samples/s half an
hour apart.  Splits measured inside one launch sit a minute apart, and the launch's start-up
(10-20 s) is paid once.  Each method is built afresh, as its own launch would build it (the
engine, the optimizer, and for `profiled` a fresh profile and decision), trained for `train.steps`
steps (step 1 pays for warm-up; the figure is the median of the others), then freed.  The first
method is built and trained once more, unrecorded, before the others: a launch's first build is
slower (``--no-warm-build`` skips it, for a launch of one build whose first step is its warm-up).

    deepspeed --num_gpus 2 bench/splits_in_one_launch.py --deepspeed_config ds.json \\
        --methods "profiled;parts:0,1,14;parts:0,2,14" --metrics-out DIR/metrics.json

Rank 0 writes --metrics-out: {"measured": [{"method", "parts", "samples_per_s", "step_s", "step_s_each"}, ...]}
in the order measured; every rank writes NAME.rankR.json (what bench/ and the runner read).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.train.build import build  # noqa: E402
from ds_pipe_ext.train.config import build_run_config, read_ds_json  # noqa: E402
from ds_pipe_ext.train.trainer import Trainer, exit_process, leave_together  # noqa: E402


def measure(ds: dict, method: str) -> dict:
    built = build(build_run_config(ds, pipeline={"partition_method": method}))
    summary = Trainer(built).run()
    release(built)
    return {"method": method, "parts": summary["parts"], "samples_per_s": summary["samples_per_s"],
            "step_s": summary["step_s_median"], "step_s_each": summary["step_s_each"], "steps": summary["steps"],
            "rss_after_bytes": resident_bytes()}


def release(built) -> None:
    """Free a build before the next one.  On the last stage something outside the garbage
    collector's view (a reference held in C++) keeps the engine alive, and with it the stage's
    weights and optimizer states (+1 GiB a build on bench-cpu); emptying the engine, the model and
    the build lets their tensors go whatever still points at the shells."""
    engine = built.engine
    engine.destroy()
    for obj in (engine.optimizer, engine, built.model, built):
        if obj is not None and hasattr(obj, "__dict__"):
            vars(obj).clear()
    gc.collect()


def resident_bytes() -> int:
    """This process's resident set now (a build that leaks shows here as the methods go on)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--methods", required=True, help="partition methods separated by ';', measured in this order")
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--no-warm-build", action="store_true",
                    help="measure the first build as it comes, as a user's own launch would (one build a launch)")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    ds = read_ds_json(args.deepspeed_config)
    measured = []
    methods = args.methods.split(";")
    if not args.no_warm_build:  # unrecorded: the launch's first build pays for imports, allocator and thread warm-up
        measure(ds, methods[0])
    for method in methods:
        measured.append(measure(ds, method))
        if int(os.environ.get("RANK", 0)) == 0:
            m = measured[-1]
            print(f"MEASURED {m['method']} parts={m['parts']} {m['samples_per_s']:.4f} samples/s "
                  f"rss {m['rss_after_bytes'] / 2**30:.2f} GiB", flush=True)
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.metrics_out)
    result = {"measured": measured, "rank": rank}
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    leave_together()
    exit_process(0)


if __name__ == "__main__":
    main()
