"""`ds-pipe-ext sweep`: pipeline depth x micro-batches x checkpointing, one launch a cell, resumable.

    ds-pipe-ext sweep --model tiny --stages 1,2,4 --micro-batches 1,2,4,8 --checkpointing off,on [--out DIR] [--json]
"""

from __future__ import annotations

import sys

from .common import add_model_argument, check_launch_steps, emit, launch_model


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: write integers separated by commas, e.g. 1,2,4") from None


def cmd_sweep(args) -> int:
    """Pipeline depth x micro-batches x checkpointing: real launches, one table, one chart."""
    from pathlib import Path

    from ..compare.run import DeepSpeedLauncher
    from ..models import load_model
    from ..sweep import render
    from ..sweep.run import Sweep, cell_name, run_sweep, sweep_cells

    model = launch_model(args)
    model_cfg = load_model(model)
    flags = {"off": False, "on": True}
    ckpt = [flags.get(x.strip()) for x in args.checkpointing.split(",")]
    if None in ckpt:
        raise ValueError(f"--checkpointing {args.checkpointing!r}: write off, on or off,on")
    check_launch_steps(args)
    stages, ms = _int_list(args.stages, "--stages"), _int_list(args.micro_batches, "--micro-batches")
    global_batch = args.global_batch or max(ms)
    cells = sweep_cells(stages, ms, ckpt, global_batch=global_batch, num_layers=model_cfg.describe().num_pipeline_layers,
                        schedule=args.schedule)
    out = Path(args.out or f"runs/sweep-{model_cfg.name}")
    shipped = None if args.step_model else shipped_cpu_terms()
    sweep = Sweep(out, model=model, steps=args.steps, method=args.method,
                  launcher=DeepSpeedLauncher(timeout=args.timeout), step_model=args.step_model,
                  predict_with=shipped[1] if shipped else None)
    done = [cell_name(c) for c in cells if sweep.cell_path(c).is_file()]
    if done:
        print(f"resuming {out}: {len(done)} of {len(cells)} cells already finished ({', '.join(done)})",
              file=sys.stderr)
    rows = run_sweep(cells, sweep, progress=not args.json)
    (out / "rows.json").write_text(render.rows_json(rows))
    png = render.write_png(rows, args.png or out / "sweep.png",
                           title=f"{model_cfg.name}: global batch {global_batch}, {args.schedule}, {args.method}")
    if args.json:
        emit(render.rows_json(rows))
        return 0
    emit(f"{model_cfg.name}: {len(rows)} cells, global batch {global_batch} (M micro-batches of {global_batch}/M), "
         f"K stages on K ranks, {args.steps} steps each (samples/s: median of steps 2..{args.steps - 1 if args.steps >= 3 else 2}{f'; step {args.steps} traced for the memory peak' if args.steps >= 3 else ', no peak traced: use --steps 3 or more'}); "
         f"memory measured by the instrumentation (tensors held), predicted by the partitioner; "
         + (f"times predicted by the step model {args.step_model}" if args.step_model else
            f"times predicted with this machine's engine terms {shipped[0]} (fitted on "
            f"{', '.join(shipped[1].calibrated_on)}; --step-model FILE for your own)" if shipped else
            "times predicted from the per-layer profiles alone (no engine terms fit this machine: no engine, "
            "optimizer or p2p costs; pass --step-model FILE from `ds-pipe-ext step-model fit` to include them)"))
    emit(render.render_rows(rows))
    emit(f"wrote {out / 'rows.json'} and {png}")
    return 0


def shipped_cpu_terms():
    """(path, StepModel) of the engine terms shipped for CPU ranks (launch_scripts/step_model_cpu.json),
    where they fit this machine: no GPU, and as many cores as the ranks they were fitted on shared;
    else None."""
    import os

    import torch

    from ..runner import ROOT
    from ..simulate.step_model import StepModel

    path = ROOT / "launch_scripts" / "step_model_cpu.json"
    if torch.cuda.is_available() or not path.is_file():
        return None
    terms = StepModel.load(path)
    return (path.relative_to(ROOT), terms) if terms.cores == os.cpu_count() else None


def add_parser(sub) -> None:
    w = sub.add_parser("sweep", help="pipeline depth x micro-batches x checkpointing: real launches, a table and a chart")
    add_model_argument(w)
    w.add_argument("--stages", default="1,2,4", help="pipeline depths K (K ranks each), e.g. 1,2,4")
    w.add_argument("--micro-batches", default="1,2,4,8", help="micro-batches per step M, each dividing --global-batch")
    w.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off, on or off,on")
    w.add_argument("--global-batch", type=int, default=None, help="samples per step in every cell (default: the largest M)")
    w.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline.schedule")
    w.add_argument("--method", default="profiled", help="pipeline.partition_method")
    w.add_argument("--step-model", default=None, help="pipeline.step_model: partition by and predict with it")
    w.add_argument("--steps", type=int, default=3, help="steps per launch (the first is warm-up, not timed)")
    w.add_argument("--out", default=None, help="results and launches (default runs/sweep-MODEL); re-running resumes")
    w.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    w.add_argument("--json", action="store_true", help="print the rows as JSON")
    w.add_argument("--png", default=None, metavar="FILE", help="chart (default OUT/sweep.png)")
    w.set_defaults(func=cmd_sweep)
