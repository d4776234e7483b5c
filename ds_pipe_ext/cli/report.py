"""`ds-pipe-ext report` and `ds-pipe-ext step-model`: what instrumented run directories say.

    ds-pipe-ext report RUN_DIR [--json] [--png FILE]
    ds-pipe-ext step-model fit RUN_DIR [RUN_DIR] --out step_model.json [--cores 2 --shared-memory]   (then pipeline.step_model)
    ds-pipe-ext step-model predict RUN_DIR ... --step-model step_model.json
"""

from __future__ import annotations

from .common import emit


def cmd_report(args) -> int:
    from ..instrument.refine import RunDirError
    from ..instrument.report import build_report, render_report_table, report_json

    try:
        rep = build_report(args.run_dir)
    except RunDirError as e:
        raise ValueError(str(e)) from None
    emit(report_json(rep) if args.json else render_report_table(rep))
    if args.png:
        from ..instrument.plot import write_png

        out = write_png(rep, args.png)
        if not args.json:
            emit(f"wrote {out}")
    return 0


def cmd_step_model(args) -> int:
    """fit: a step model from instrumented runs; predict: each run's step with a fitted model."""
    from ..instrument.refine import RunDirError, load_run
    from ..instrument.step_fit import fit_step_model, predict_run, run_stages
    from ..partition.report import render_table
    from ..simulate.step_model import StepModel

    try:
        runs = [run_stages(load_run(d), str(d)) for d in args.run_dirs]
    except RunDirError as e:
        raise ValueError(str(e)) from None
    if args.action == "fit":
        if not args.out:
            raise ValueError("step-model fit needs --out FILE: where to write the fitted model")
        model = fit_step_model(runs, cores=args.cores, shared_memory=args.shared_memory)
        model.save(args.out)
    else:
        if not args.step_model:
            raise ValueError("step-model predict needs --step-model FILE (from `ds-pipe-ext step-model fit`)")
        model = StepModel.load(args.step_model)
    rows = [{"run": r.name, "parts": [0] + [st.stop for st in r.stages], "micro_batches": r.micro_batches,
             "measured_step_s": r.step_s, "predicted_step_s": predict_run(model, r)} for r in runs]
    for row in rows:
        row["error_pct"] = 100.0 * (row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"]
    if args.json:
        import json

        emit(json.dumps({"step_model": model.to_dict(), "runs": rows}, indent=1))
        return 0
    if args.action == "fit":
        emit(f"wrote {args.out}: " + ", ".join(f"{k}={v:.4g}" for k, v in model.to_dict().items()
                                                if isinstance(v, float)))
    emit("\n".join(render_table(["run", "parts", "m", "measured s", "predicted s", "error %"],
                                [[r["run"], str(r["parts"]), str(r["micro_batches"]), f"{r['measured_step_s']:.3f}",
                                  f"{r['predicted_step_s']:.3f}", f"{r['error_pct']:+.1f}"] for r in rows])))
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="predicted vs measured per stage, from an instrumented run directory")
    r.add_argument("run_dir")
    r.add_argument("--json", action="store_true")
    r.add_argument("--png", default=None, metavar="FILE", help="also write per-stage bar charts to FILE")
    r.set_defaults(func=cmd_report)

    m = sub.add_parser("step-model", help="fit the step model to instrumented runs, or predict runs with one")
    m.add_argument("action", choices=["fit", "predict"])
    m.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="instrumented run directories (train.py --instrument)")
    m.add_argument("--out", default=None, help="fit: the JSON file to write (ds.json: pipeline.step_model)")
    m.add_argument("--step-model", default=None, help="predict: a fitted model")
    m.add_argument("--cores", type=float, default=None,
                   help="CPU: the cores the ranks share (their compute slows when more ranks than cores run)")
    m.add_argument("--shared-memory", action="store_true",
                   help="CPU: the ranks' optimizer updates share one memory bandwidth")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_step_model)
