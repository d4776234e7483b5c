"""Measured throughput of 2-stage splits: `profiled` against every split and DeepSpeed's built-ins.

Two models, 2 pipeline stages on 2 ranks (OMP_NUM_THREADS=1 each), micro-batch 2 (``--micro-batch``),
4 micro-batches:
  bench-cpu         GPT (V=50257, h=512, 12 alike blocks, seq 256): a cheap embedding, a costly head
  bench-cpu-pruned  the same with one FFN width per block (4096 down to 1024): blocks not alike

Every split [0, k, 14] (k = 1..13) is measured, and `profiled`: it profiles its layers afresh (no
cache) and picks the split with the smallest step predicted by the fitted step model
`launch_scripts/step_model_cpu.json` (calibrated on bench/prediction_transfer.py's two calibration
runs; none of these measurements calibrated it).  One launch per model and round measures all 14
methods one after another (bench/splits_in_one_launch.py: each method built afresh, 1 warm-up step
and 1 timed step), so a split and its neighbours are measured about a minute apart: separate
launches drifted by up to 2.1x between rounds on this shared machine.  Rounds alternate: round 0
walks the methods forward, round 1 backward, and so on, the models interleaved; each figure is the
median over rounds, with its spread.

A method is scored by the split it chose, as that split measured beside every other split:
`profiled` by the split it chose, DeepSpeed's `uniform` and `parameters` by theirs (from DeepSpeed's
own functions).  The `profiled` build's own samples/s are printed as a check.

    python bench/partition_speedup.py [--rounds 3] [--micro-batch 2] [--out runs/partition-speedup-v2]

At micro-batch 2 a step's fixed costs (engine, optimizer, p2p) are a large share, and the best
split measured only 1.13x DeepSpeed's built-in one (v2); v3 runs micro-batch 4.

Resumable: a round whose metrics exist in --out is not run again.
Last line: RESULT profiled_vs_builtin=X profiled_vs_best_split=Y second_model_profiled_vs_best_split=Z
(targets: X >= 1.25 on bench-cpu, Y and Z >= 0.98)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.models.config import load_model_config  # noqa: E402
from ds_pipe_ext.models.gpt import gpt_layer_specs  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.runner import ROOT, launch, write_config  # noqa: E402

MODELS = ["bench-cpu", "bench-cpu-pruned"]
STEP_MODEL = ROOT / "launch_scripts" / "step_model_cpu.json"
MICRO_BATCHES, STEPS = 4, 2  # step 1 of each method is warm-up


def builtin_parts(model: str) -> dict[str, list[int]]:
    """What DeepSpeed's uniform and parameters would choose (its own functions, trainable parameters)."""
    from deepspeed.runtime import utils as ds_utils

    specs = gpt_layer_specs(load_model_config(model))
    params = [sum(p.numel() for p in spec.build().parameters()) for spec in specs]
    return {"uniform": [int(b) for b in ds_utils.partition_uniform(len(specs), 2)],
            "parameters": [int(b) for b in ds_utils.partition_balanced(params, 2)]}


def run_round(model: str, methods: list[str], out: Path, micro_batch: int) -> dict[str, dict]:
    """One launch that measures every method in the given order (bench/splits_in_one_launch.py)."""
    done = out / "metrics.json"
    if not done.is_file():
        out.mkdir(parents=True, exist_ok=True)
        cfg = write_config(out / "ds.json", train_micro_batch_size_per_gpu=micro_batch,
                           gradient_accumulation_steps=MICRO_BATCHES,
                           pipeline={"stages": 2, "step_model": str(STEP_MODEL),
                                     "profile": {"warmup": 2, "repeats": 5, "cache_dir": None, "progress": False}},
                           train={"model": model, "steps": STEPS, "seed": 1234})
        t0 = time.perf_counter()
        proc, ranks = launch(2, cfg, "--methods", ";".join(methods), out_dir=out, cwd=out, timeout=3600,
                             script="bench/splits_in_one_launch.py")
        if proc.returncode != 0 or 0 not in ranks:
            raise SystemExit(f"{model}: launch failed\n{proc.stderr[-3000:]}")
        print(f"  {model}: {len(methods)} methods in one launch ({time.perf_counter() - t0:.0f} s)", flush=True)
    measured = json.loads(done.read_text())["measured"]
    for r in measured:
        print(f"    {r['method']:<14} parts={r['parts']}  {r['samples_per_s']:.3f} samples/s", flush=True)
    return {r["method"]: r for r in measured}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--out", default="runs/partition-speedup-v2")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    n = len(gpt_layer_specs(load_model_config(MODELS[0])))
    methods = ["profiled"] + [f"parts:0,{k},{n}" for k in range(1, n)]
    print(f"{len(MODELS)} models x {args.rounds} rounds, one launch each measuring {len(methods)} methods at micro-batch "
          f"{args.micro_batch} x {MICRO_BATCHES}, in {out}", flush=True)
    measured: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        order = methods if rnd % 2 == 0 else methods[::-1]
        print(f"round {rnd}", flush=True)
        for model in (MODELS if rnd % 2 == 0 else MODELS[::-1]):
            for method, r in run_round(model, order, out / f"round{rnd}" / model, args.micro_batch).items():
                measured.setdefault((model, method), []).append(r)

    results = {}
    for model in MODELS:
        sps = {m: [r["samples_per_s"] for r in measured[(model, m)]] for m in methods}
        med = {m: statistics.median(v) for m, v in sps.items()}
        splits = [m for m in methods if m.startswith("parts:")]
        best = max(splits, key=lambda m: med[m])
        builtin = builtin_parts(model)
        as_split = {name: "parts:" + ",".join(map(str, parts)) for name, parts in builtin.items()}
        best_builtin = max(as_split.values(), key=lambda m: med[m])
        rows = []
        for m in methods:
            names = [k for k, v in as_split.items() if v == m] + (["best split"] if m == best else [])
            parts = sorted({str(r["parts"]) for r in measured[(model, m)]})
            rows.append([m + (f" ({', '.join(names)})" if names else ""), " ".join(parts), spread(sps[m]),
                         f"{med[m] / med[best]:.3f}"])
        print(f"\n{model}: samples/s, median [min-max] over {args.rounds} rounds")
        print("\n".join(render_table(["launch", "parts", "samples/s", "vs best split"], rows)))
        # profiled is scored by the split it chose, measured beside every other split
        chosen = ["parts:" + ",".join(map(str, r["parts"])) for r in measured[(model, "profiled")]]
        ours = statistics.median(measured[(model, c)][rnd]["samples_per_s"] for rnd, c in enumerate(chosen))
        own = [r["samples_per_s"] for r in measured[(model, "profiled")]]
        vs_best = [measured[(model, c)][rnd]["samples_per_s"] / measured[(model, best)][rnd]["samples_per_s"]
                   for rnd, c in enumerate(chosen)]
        vs_builtin = [measured[(model, c)][rnd]["samples_per_s"] / measured[(model, best_builtin)][rnd]["samples_per_s"]
                      for rnd, c in enumerate(chosen)]
        print(f"profiled chose {sorted(set(chosen))}; that split: {ours:.3f} samples/s (median over rounds); "
              f"the profiled launches themselves: {[round(x, 3) for x in own]}")
        print(f"profiled's split / best split {best}: per round {[round(x, 3) for x in vs_best]}; "
              f"/ best built-in {best_builtin}: per round {[round(x, 3) for x in vs_builtin]}")
        noisy = max(max(v) / min(v) for m, v in sps.items() if m.startswith("parts:"))
        print(f"largest round-to-round ratio of one split: {noisy:.2f}x")
        results[model] = {"vs_best": ours / med[best], "vs_builtin": ours / med[best_builtin],
                          "rounds_vs_best": vs_best, "rounds_vs_builtin": vs_builtin}
    (out / "results.json").write_text(json.dumps({f"{k[0]} {k[1]}": v for k, v in measured.items()}, indent=1))
    a, b = results[MODELS[0]], results[MODELS[1]]
    print(f"\nsecond model: profiled / best built-in {b['vs_builtin']:.3f}")
    print(f"RESULT profiled_vs_builtin={a['vs_builtin']:.3f} profiled_vs_best_split={a['vs_best']:.3f} "
          f"second_model_profiled_vs_best_split={b['vs_best']:.3f}")


if __name__ == "__main__":
    main()
