"""Measured throughput of pipeline partitions on the spine benchmark (CPU, 2 ranks).

GPT bench-cpu (V=50257, h=512, 12 blocks, seq 256), micro-batch 4, 4 micro-batches,
2 pipeline stages on 2 ranks with OMP_NUM_THREADS=1 each.  Runs DeepSpeed's
`uniform` and `parameters`, our `profiled`, and every possible 2-stage split,
each as a real `deepspeed --num_gpus 2 train.py` launch, and prints samples/s.

    python bench/partition_speedup.py [--steps 4] [--quick]

Last line: RESULT profiled_vs_builtin=X profiled_vs_best_split=Y
(targets: X >= 1.25, Y >= 0.97)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.runner import ROOT, launch  # noqa: E402

CONFIG = ROOT / "launch_scripts" / "bench_cpu_pipeline.json"
NUM_LAYERS = 14  # embedding + 12 blocks + head


def run(method: str, steps: int, workdir: Path) -> dict:
    out = workdir / method.replace(":", "_").replace(",", "-")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc, ranks = launch(2, CONFIG, "--steps", str(steps), "--partition-method", method,
                         out_dir=out, cwd=workdir, timeout=900)
    if proc.returncode != 0 or 0 not in ranks:
        raise SystemExit(f"{method}: launch failed\n{proc.stderr[-3000:]}")
    r = ranks[0]
    print(f"  {method:<14} parts={r['parts']}  {r['samples_per_s']:.3f} samples/s  "
          f"(step {r['step_s_median']:.2f} s, launch {time.perf_counter() - t0:.0f} s)", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is not timed")
    ap.add_argument("--quick", action="store_true", help="only the splits 6..12 (the plausible ones)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ds_pipe_ext_bench_"))
    print(f"bench-cpu, 2 ranks x OMP_NUM_THREADS=1, {args.steps} steps per run, workdir {workdir}", flush=True)
    results = {m: run(m, args.steps, workdir) for m in ["uniform", "parameters", "profiled"]}
    splits = range(6, 13) if args.quick else range(1, NUM_LAYERS)
    for k in splits:
        results[f"parts:0,{k},14"] = run(f"parts:0,{k},{NUM_LAYERS}", args.steps, workdir)

    builtin = max(results["uniform"]["samples_per_s"], results["parameters"]["samples_per_s"])
    best_split = max(v["samples_per_s"] for m, v in results.items() if m.startswith("parts:"))
    ours = results["profiled"]["samples_per_s"]
    rows = [[m, str(v["parts"]), f"{v['samples_per_s']:.3f}", f"{v['samples_per_s'] / builtin:.3f}",
             f"{v['samples_per_s'] / best_split:.3f}"] for m, v in results.items()]
    print()
    print("\n".join(render_table(["method", "parts", "samples/s", "vs best builtin", "vs best split"], rows)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    print(f"RESULT profiled_vs_builtin={ours / builtin:.3f} profiled_vs_best_split={ours / best_split:.3f}")


if __name__ == "__main__":
    main()
