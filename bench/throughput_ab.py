"""bench-cpu's samples/s under two checkouts of this project, alternating launches (A B, B A, ...).

    python bench/throughput_ab.py --before /path/to/old/checkout [--after .] [--rounds 3] [--out runs/ab]
    python bench/throughput_ab.py --smoke     (this checkout against itself, tiny, one round: a check it runs)

Each launch is the checkout's train.py on 2 CPU ranks (one thread each, as ``deepspeed --num_gpus 2`` runs it),
bench-cpu as a 2-stage pipeline with its split fixed (``parts:0,11,14``, so both checkouts run the same stages),
micro-batch 4 x 4, 4 steps (the median of steps 2-4).  Both checkouts run with this interpreter's environment.
Last line:
RESULT after_vs_before_median=R after_vs_before_min=A after_vs_before_max=B (samples/s, after / before, per round)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.runner import SMOKE_HELP, launch  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 10**6,
          "pipeline": {"stages": 2, "partition_method": "parts:0,11,14"},
          "train": {"model": "bench-cpu", "steps": 4, "seed": 1234, "log": "json"}}
SMOKE_CONFIG = {**CONFIG, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "pipeline": {"stages": 2, "partition_method": "parts:0,3,6"},
                "train": {**CONFIG["train"], "model": "tiny", "steps": 2}}


def one_launch(root: Path, work: Path, config: dict = CONFIG) -> float:
    """samples/s of one 2-rank launch of ``root``'s train.py (the command ``deepspeed`` runs on one node)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds.json").write_text(json.dumps(config))
    proc, _ = launch(2, work / "ds.json", out_dir=work, cwd=work, timeout=900, root=root)
    if proc.returncode != 0:
        raise SystemExit(f"{root}: launch failed\n{proc.stderr[-2000:]}")
    return json.loads((work / "metrics.json").read_text())["samples_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="the other checkout (a git worktree of the older commit)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="runs/throughput-ab")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (--before defaults to this checkout)")
    args = ap.parse_args()
    if args.smoke:
        import tempfile

        args.before, args.rounds, args.out = args.before or args.after, 1, tempfile.mkdtemp(prefix="ds_pipe_ext_ab_")
    if args.before is None:
        ap.error("--before is required: the other checkout (git worktree add /tmp/old COMMIT)")
    roots = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for k, name in enumerate(("before", "after") if r % 2 == 0 else ("after", "before")):
            rate = one_launch(roots[name], Path(args.out) / f"{name}-{r}", SMOKE_CONFIG if args.smoke else CONFIG)
            rates[name].append(rate)
            print(f"round {r} {name}: {rate:.3f} samples/s", flush=True)
    ratios = [a / b for a, b in zip(rates["after"], rates["before"])]
    print(f"after / before per round: {', '.join(f'{x:.3f}' for x in ratios)}; spread {max(ratios) - min(ratios):.3f}")
    print(f"RESULT after_vs_before_median={statistics.median(ratios):.3f} after_vs_before_min={min(ratios):.3f} "
          f"after_vs_before_max={max(ratios):.3f}")


if __name__ == "__main__":
    main()
