"""bench-cpu's samples/s under two checkouts of this project, alternating launches (A B, B A, ...).

    python bench/throughput_ab.py --before /path/to/old/checkout [--after .] [--rounds 3] [--out runs/ab]

Each launch is train.py on 2 CPU ranks (one thread each), bench-cpu as a 2-stage pipeline with its split
fixed (``parts:0,11,14``, so both checkouts run the same stages), micro-batch 4 x 4, 4 steps (the median of
steps 2-4).  Both checkouts run with this interpreter's environment.  Last line:
RESULT after_vs_before_median=R after_vs_before_min=A after_vs_before_max=B (samples/s, after / before, per round)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 10**6,
          "pipeline": {"stages": 2, "partition_method": "parts:0,11,14"},
          "train": {"model": "bench-cpu", "steps": 4, "seed": 1234, "log": "json"}}


def launch(root: Path, work: Path, port: int) -> float:
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds.json").write_text(json.dumps(CONFIG))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(root / "train.py"),
           "--deepspeed_config", str(work / "ds.json"), "--metrics-out", str(work / "metrics.json")]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{root}: launch failed\n{proc.stderr[-2000:]}")
    return json.loads((work / "metrics.json").read_text())["samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the other checkout (a git worktree of the older commit)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="runs/throughput-ab")
    args = ap.parse_args()
    roots = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for k, name in enumerate(("before", "after") if r % 2 == 0 else ("after", "before")):
            rate = launch(roots[name], Path(args.out) / f"{name}-{r}", 29600 + 2 * r + k)
            rates[name].append(rate)
            print(f"round {r} {name}: {rate:.3f} samples/s", flush=True)
    ratios = [a / b for a, b in zip(rates["after"], rates["before"])]
    print(f"after / before per round: {', '.join(f'{x:.3f}' for x in ratios)}; spread {max(ratios) - min(ratios):.3f}")
    print(f"RESULT after_vs_before_median={statistics.median(ratios):.3f} after_vs_before_min={min(ratios):.3f} "
          f"after_vs_before_max={max(ratios):.3f}")


if __name__ == "__main__":
    main()
