"""Pipeline (profiled, uniform) against ZeRO-3 for bench-cpu: throughput on 2 ranks, memory on 4.

    python bench/compare_zero.py [--model bench-cpu] [--rounds 2] [--micro-batch 4] [--out runs/bench-compare]
    python bench/compare_zero.py --smoke     (tiny, one round in one `compare`, memory on 2 ranks: a check it runs)

Throughput: 2 ranks (one core each, so no rank time-slices another's core), the three
configurations launched in alternating order (A B C, then B C A, ...) for ``--rounds`` rounds,
each round in its own directory, with glibc's default malloc as in training; a ratio is taken
within a round and the median over rounds is quoted with its spread.  Memory: 4 ranks at
``--memory-micro-batch``, one 2-step launch per configuration with ``--compact-malloc`` (the
model-state bytes are deterministic; the bench checks them against the prediction on every rank
of every row).  Micro-batch 4 is the spine bench's (bench/partition_speedup.py); at micro-batch 1
a 4-micro-batch step is a third optimizer step, which no partition balances.
Nothing here is calibrated: the memory predictions are DeepSpeed's allocation rules and the
analytic activation model, and no measured run feeds them.

Ends with ``RESULT pipeline_profiled_vs_zero3=X pipeline_profiled_vs_uniform=Y
memory_model_states_max_error_pct=Z``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402
THROUGHPUT = ["pipe-profiled-pp2-dp1-z0", "pipe-uniform-pp2-dp1-z0", "zero3"]
MEMORY = ["pipe-*-z0", "zero1", "zero2", "zero3"]


def compare(model: str, world: int, configs: list[str], out: Path, micro_batch: int, steps: int,
            *extra: str) -> list[dict]:
    cmd = [str(Path(sys.executable).with_name("ds-pipe-ext")), "compare", "--model", model, "--world", str(world),
           "--micro-batch", str(micro_batch), "--steps", str(steps), "--out", str(out), "--json",
           *extra, "--configs", *configs]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"compare failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4, help="throughput runs")
    ap.add_argument("--memory-micro-batch", type=int, default=1, help="memory runs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/bench-compare")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    memory_world, memory = 4, MEMORY
    if args.smoke:
        import tempfile

        args.model, args.rounds, args.steps, args.micro_batch = "tiny", 1, 2, 2
        args.out, memory_world, memory = tempfile.mkdtemp(prefix="ds_pipe_ext_compare_"), 2, ["zero1"]
    from ds_pipe_ext.compare.render import render_rows
    from ds_pipe_ext.compare.run import model_state_error_pct

    out = Path(args.out)
    per_round: list[dict[str, float]] = []
    for k in range(args.rounds):
        order = THROUGHPUT[k % 3:] + THROUGHPUT[:k % 3]  # alternate who goes first
        tput = {}
        # one launch per compare call, so that the order is really the launch order (--smoke: one call)
        for names in [order] if args.smoke else [[name] for name in order]:
            rows = compare(args.model, 2, names, out / f"throughput-round{k}", args.micro_batch, args.steps)
            tput |= {name: row["samples_per_s"] for name, row in zip(names, rows)}
        per_round.append(tput)
        print(f"round {k} ({' '.join(order)}): " + "  ".join(f"{n} {v:.3f} samples/s" for n, v in tput.items()),
              flush=True)
    vs_zero3 = [r[THROUGHPUT[0]] / r["zero3"] for r in per_round]
    vs_uniform = [r[THROUGHPUT[0]] / r[THROUGHPUT[1]] for r in per_round]
    print(f"profiled / zero3 per round: {[round(x, 3) for x in vs_zero3]} "
          f"(median {statistics.median(vs_zero3):.3f}, spread {min(vs_zero3):.3f}-{max(vs_zero3):.3f})")
    print(f"profiled / uniform per round: {[round(x, 3) for x in vs_uniform]} "
          f"(median {statistics.median(vs_uniform):.3f}, spread {min(vs_uniform):.3f}-{max(vs_uniform):.3f})")

    memory_rows = compare(args.model, memory_world, memory, out / f"memory-w{memory_world}", args.memory_micro_batch, 2,
                          "--compact-malloc")
    print(f"\nmemory on {memory_world} ranks (predicted, never calibrated):")
    print(render_rows(memory_rows))
    throughput_rows = [json.loads((out / f"throughput-round{k}" / "rows" / f"{n}.json").read_text())
                       for k in range(args.rounds) for n in THROUGHPUT]
    err = model_state_error_pct(memory_rows + throughput_rows)
    print(f"\nRESULT pipeline_profiled_vs_zero3={statistics.median(vs_zero3):.3f} "
          f"pipeline_profiled_vs_uniform={statistics.median(vs_uniform):.3f} memory_model_states_max_error_pct={err:.3f}")


if __name__ == "__main__":
    main()
