"""Frozen layers: `profiled` against DeepSpeed's `parameters` when the first half of the blocks is frozen.

bench-cpu (GPT, V=50257, h=512, 12 blocks, seq 256) with `train.frozen_layers = "1-6"` (blocks 1-6;
the embedding, blocks 7-12 and the head train), 2 pipeline stages on 2 ranks (OMP_NUM_THREADS=1
each), micro-batch 2, 4 micro-batches.  DeepSpeed's `parameters` counts trainable parameters only,
so the frozen blocks weigh nothing to it; `profiled` profiles the frozen layers afresh (no weight
gradient, no gradient or optimizer state) and minimises the step the fitted step model
`launch_scripts/step_model_cpu.json` predicts (calibrated on bench/prediction_transfer.py's two
calibration runs, none of them frozen: every figure here is a prediction, none a calibration).

Each launch measures the two methods alternately, A B A B (bench/splits_in_one_launch.py: each
built afresh, 1 warm-up step and 1 timed step), and launches alternate which comes first, so
every ratio is between two measurements a minute apart.  The figure is the median of those
pairwise ratios, with their spread.

    python bench/frozen_layers.py [--launches 2] [--pairs 2] [--out runs/frozen-layers]
    python bench/frozen_layers.py --smoke     (tiny with blocks 1-2 frozen, one launch of one pair: a check it runs)

Last line: RESULT frozen_profiled_vs_parameters=X  (target > 1.05)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.runner import ROOT, SMOKE_HELP, measure_in_one_launch  # noqa: E402

MODEL, FROZEN = "bench-cpu", "1-6"
STEP_MODEL = ROOT / "launch_scripts" / "step_model_cpu.json"
MICRO_BATCH, MICRO_BATCHES, STEPS = 2, 4, 2  # step 1 of each build is warm-up


def run_launch(methods: list[str], out: Path, model: str = MODEL, frozen: str = FROZEN) -> list[dict]:
    measured = measure_in_one_launch(out, methods, micro_batch=MICRO_BATCH, micro_batches=MICRO_BATCHES,
                                     step_model=STEP_MODEL,
                                     train={"model": model, "steps": STEPS, "seed": 1234, "frozen_layers": frozen})
    for r in measured:
        print(f"    {r['method']:<11} parts={r['parts']}  {r['samples_per_s']:.3f} samples/s", flush=True)
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2, help="profiled/parameters pairs per launch")
    ap.add_argument("--out", default="runs/frozen-layers")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    model, frozen = MODEL, FROZEN
    if args.smoke:
        import tempfile

        args.launches, args.pairs, args.out = 1, 1, tempfile.mkdtemp(prefix="ds_pipe_ext_frozen_")
        model, frozen = "tiny", "1-2"
    out = Path(args.out).resolve()
    ratios, by_method = [], {"profiled": [], "parameters": []}
    parts = {"profiled": set(), "parameters": set()}
    for n in range(args.launches):
        pair = ["profiled", "parameters"] if n % 2 == 0 else ["parameters", "profiled"]
        measured = run_launch(pair * args.pairs, out / f"launch{n}", model, frozen)
        for a, b in zip(measured[0::2], measured[1::2]):
            sps = {a["method"]: a["samples_per_s"], b["method"]: b["samples_per_s"]}
            ratios.append(sps["profiled"] / sps["parameters"])
        for r in measured:
            by_method[r["method"]].append(r["samples_per_s"])
            parts[r["method"]].add(str(r["parts"]))
    print(f"\n{model}, frozen layers {frozen}, 2 stages, micro-batch {MICRO_BATCH} x {MICRO_BATCHES}")
    for m, v in by_method.items():
        print(f"  {m:<11} parts {' '.join(sorted(parts[m]))}  samples/s median {statistics.median(v):.3f} "
              f"[{min(v):.3f}-{max(v):.3f}] over {len(v)} builds")
    print(f"  profiled / parameters, pairwise: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}] over {len(ratios)} pairs")
    print(f"RESULT frozen_profiled_vs_parameters={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
