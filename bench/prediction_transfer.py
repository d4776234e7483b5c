"""Does the step model transfer?  Calibrate on two runs, predict every other configuration, measure it.

The grid (CPU, OMP_NUM_THREADS=1 a rank, one rank a stage):
  models bench-cpu (micro-batch 2) and tiny (micro-batch 4)  x  stages 2 and 4
  x  micro-batches 2, 4, 8  x  activation checkpointing off and on          = 24 configurations

Calibration runs (the only measurements the model sees): bench-cpu on 2 stages and tiny on 4
stages, 4 micro-batches, no checkpointing, the `profiled` split.  Every other configuration is
predicted before it is measured, with a split the calibration runs did not use where one exists
(cycling `uniform`, `parameters` and an off-balance `parts:` split).  Every launch profiles its
layers afresh (no profile cache), so a prediction uses the layer costs measured just before that
run trained - as `partition_method: profiled` does - and the model's fitted step terms; nothing
that run measured while training.  The 4-rank runs share the machine's 2 cores and its memory:
the model's `cores` and `shared_memory` terms.

The machine is noisy (the same configuration's step moves by 10-25% between launches), so the
grid runs in rounds, round 1 in the reverse order of round 0: a configuration's error is its
median prediction against its median measurement over the rounds.  The calibration runs are
round 0's only.

    python bench/prediction_transfer.py [--rounds 2] [--out runs/prediction-transfer] [--analyse-only]
    python bench/prediction_transfer.py --smoke     (tiny on 2 stages: two calibration runs, one predicted, one round:
        a check that it runs)

Resumable: a cell whose run directory holds a summary is not launched again.
Last line: RESULT transfer_median_error_pct=X transfer_worst_error_pct=Y  (targets: X <= 10, Y <= 20)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.instrument.rundir import RunDir  # noqa: E402
from ds_pipe_ext.instrument.step_fit import fit_step_model, predict_run, run_stages  # noqa: E402
from ds_pipe_ext.partition.report import render_table  # noqa: E402
from ds_pipe_ext.pipe import schedules as _deepspeed_order  # noqa: E402,F401  (registers DeepSpeed's engine order)
from ds_pipe_ext.runner import SMOKE_HELP, launch, write_config  # noqa: E402

CORES = os.cpu_count() or 2
SMOKE = False
MODELS = {  # name -> (micro-batch size, layers in the pipeline, optimizer steps per launch)
    "bench-cpu": (2, 14, 3),
    "tiny": (4, 6, 48),  # steps of 0.04-0.3 s: 48 so that the median outlasts a burst of the machine's other work
}
CALIBRATION = {("bench-cpu", 2, 4, False), ("tiny", 4, 4, False)}
SMOKE_CELLS = [("tiny", 2, 2, False), ("tiny", 2, 4, False), ("tiny", 2, 2, True)]  # the first two calibrate


def grid() -> list[tuple[str, int, int, bool]]:
    if SMOKE:
        return list(SMOKE_CELLS)
    cells = [(model, stages, m, ckpt) for model in MODELS for stages in (2, 4) for m in (2, 4, 8)
             for ckpt in (False, True)]
    calib = [c for c in cells if c in CALIBRATION]
    rest = [c for c in cells if c not in CALIBRATION]
    # alternate the models so that the machine's drift does not line up with one of them
    rest.sort(key=lambda c: (c[1], c[2], c[3], c[0]))
    return calib + rest


def split_for(cell, index: int) -> str:
    model, stages, _, _ = cell
    if cell in CALIBRATION:
        return "profiled"
    n = MODELS[model][1]
    skewed = [0, *(round(n * (s + 1) / stages) - (1 if s == 0 else 0) for s in range(stages - 1)), n]
    return ["uniform", "parameters", "parts:" + ",".join(map(str, skewed))][index % 3]


def tag(cell) -> str:
    model, stages, m, ckpt = cell
    return f"{model}-pp{stages}-m{m}-{'ckpt' if ckpt else 'nockpt'}"


def run_cell(cell, method: str, out: Path) -> Path:
    """One instrumented launch of ``cell`` (skipped when ``out`` already holds it)."""
    model, stages, m, ckpt = cell
    run_dir = out / tag(cell) / "run"
    if (run_dir / "summary.json").is_file():
        return run_dir
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    micro, _, steps = MODELS[model]
    cfg = write_config(run_dir.parent / "ds.json", train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=m,
                       pipeline={"stages": stages, "partition_method": method,
                                 "activation_checkpoint_interval": 1 if ckpt else 0,
                                 "profile": {"warmup": 2, "repeats": 5, "cache_dir": None, "progress": False}},
                       train={"model": model, "steps": steps, "seed": 1234})
    t0 = time.perf_counter()
    proc, _ = launch(stages, cfg, "--instrument", str(run_dir), out_dir=run_dir.parent, cwd=run_dir.parent,
                     timeout=1200)
    if proc.returncode != 0:
        if not (run_dir / "summary.json").is_file():
            raise SystemExit(f"{tag(cell)}: launch failed\n{proc.stderr[-3000:]}")
        print(f"  {tag(cell)}: exit code {proc.returncode} after training (its summary is complete): "
              f"{proc.stderr.strip().splitlines()[-1][:200]}", flush=True)
    print(f"  measured {tag(cell):<28} {method:<16} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/prediction-transfer")
    ap.add_argument("--analyse-only", action="store_true", help="fit and predict from the runs already in --out")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    global SMOKE, CALIBRATION
    if args.smoke:
        import tempfile

        SMOKE, CALIBRATION = True, set(SMOKE_CELLS[:2])
        MODELS["tiny"] = (2, 6, 3)
        args.rounds, args.out = 1, tempfile.mkdtemp(prefix="ds_pipe_ext_transfer_")
    out = Path(args.out).resolve()
    cells = grid()
    split = {cell: split_for(cell, i) for i, cell in enumerate(cells)}
    print(f"{len(cells)} configurations x {args.rounds} rounds, {CORES} cores, runs in {out}", flush=True)
    runs: dict[tuple, list] = {}
    for rnd in range(args.rounds):
        order = cells if rnd == 0 else [c for c in cells[::-1] if c not in CALIBRATION]
        for cell in order:
            run_dir = out / f"round{rnd}" / tag(cell) / "run"
            if not args.analyse_only:
                run_dir = run_cell(cell, split[cell], out / f"round{rnd}")
            if (run_dir / "summary.json").is_file():
                runs.setdefault(cell, []).append(run_stages(RunDir(run_dir).read(), f"round{rnd}/{tag(cell)}"))

    calibration = [runs[c][0] for c in cells if c in CALIBRATION and c in runs]
    model = fit_step_model(calibration, cores=CORES, shared_memory=True)
    print("\nstep model, fitted on " + ", ".join(r.name for r in calibration) + ":")
    print(json.dumps({k: v for k, v in model.to_dict().items() if k != "calibrated_on"}, indent=1))
    model.save(out / "step_model.json")
    calib_parts = {tuple([0] + [st.stop for st in run.stages]) for run in calibration}

    rows, errors = [], []
    for cell in cells:
        if cell not in runs:
            continue
        launches = runs[cell]
        measured = [r.step_s for r in launches]
        predicted = [predict_run(model, r) for r in launches]
        meas, pred = statistics.median(measured), statistics.median(predicted)
        err = 100.0 * (pred - meas) / meas
        role = "calibration" if cell in CALIBRATION else "predicted"
        if role == "predicted":
            errors.append(err)
        parts = sorted({str([0] + [st.stop for st in r.stages]) for r in launches})
        reused = role == "predicted" and any(tuple(json.loads(p)) in calib_parts for p in parts)
        per_round = " ".join(f"{100 * (p - m) / m:+.0f}" for p, m in zip(predicted, measured))
        rows.append([tag(cell), role, " ".join(parts) + (" (a calibration split)" if reused else ""),
                     " ".join(f"{m:.3f}" for m in measured), f"{meas:.3f}", f"{pred:.3f}", f"{err:+.1f}", per_round])
    print()
    print("\n".join(render_table(["configuration", "role", "parts", "measured s (rounds)", "median", "predicted",
                                  "error %", "per round %"], rows)))
    if not errors:
        raise SystemExit("no predicted configuration has been measured yet")
    med = statistics.median(abs(e) for e in errors)
    worst = max(abs(e) for e in errors)
    print(f"\n{len(errors)} predicted configurations: median |error| {med:.1f}%, worst {worst:.1f}%, "
          f"mean signed {statistics.mean(errors):+.1f}%")
    print(f"RESULT transfer_median_error_pct={med:.1f} transfer_worst_error_pct={worst:.1f}")


if __name__ == "__main__":
    main()
