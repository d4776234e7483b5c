"""`ds-pipe-ext`: plan pipeline partitions from the command line.

    ds-pipe-ext partition --model bench-cpu --stages 2 --micro-batch 4 [--method profiled] [--json]
    ds-pipe-ext estimate --model gpt3-175b --tp 8 --sp --device a100 --micro-batch 1 --seq 2048 [--json]
    ds-pipe-ext report RUN_DIR [--json] [--png FILE]
    ds-pipe-ext compare --model tiny --world 4 [--global-batch G] [--micro-batch B] [--memory-cap-gib X] [--json]
    ds-pipe-ext estimate --compare --model gpt3-175b --world 64 --tp 8 --device a100-80gb [--json]
    ds-pipe-ext simulate --model gpt3-small --stages 3 --schedule gpipe [--latency-ms L] [--bandwidth-gbs B] [--grid]
    ds-pipe-ext step-model fit RUN_DIR [RUN_DIR] --out step_model.json [--cores 2 --shared-memory]   (then pipeline.step_model)
    ds-pipe-ext step-model predict RUN_DIR ... --step-model step_model.json
    ds-pipe-ext sweep --model tiny --stages 1,2,4 --micro-batches 1,2,4,8 --checkpointing off,on [--out DIR] [--json]
    ds-pipe-ext plan --model gpt3-175b --gpus 1024 --device a100 --global-batch 1536 [--top 10] [--json] [--emit-ds-config F]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from pydantic import Field

from .config_model import ConfigError, ConfigModel, parse_section
from .partition import PartitionError
from .pipe.config import PipelineSettings


class ShapeArgs(ConfigModel):
    """The shape arguments of ``partition`` and ``estimate``, checked like ds.json's keys."""

    micro_batch: int = Field(1, ge=1)
    micro_batches: int | None = Field(None, ge=1)
    seq: int | None = Field(None, ge=1)
    tp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)


_stdout = sys.stdout


def emit(*args, **kwargs) -> None:
    """The command's result, on standard output; everything else a command prints (DeepSpeed's
    start-up warnings, progress) goes to standard error, so ``--json`` output stays parseable."""
    print(*args, file=_stdout, **kwargs)


def check_shape(args) -> ShapeArgs:
    return parse_section(ShapeArgs, {k: getattr(args, k) for k in ShapeArgs.model_fields if hasattr(args, k)}, "")


def pipeline_settings(args) -> PipelineSettings:
    """The command line's pipeline options as the "pipeline" section of ds.json would give them."""
    return parse_section(PipelineSettings, {
        "stages": args.stages, "partition_method": args.method, "memory_cap_gib": args.memory_cap_gib,
        "link_bandwidth_gbs": args.link_bandwidth_gbs,
        "profile": {"warmup": args.warmup, "repeats": args.repeats, "cache_dir": args.cache_dir,
                    "progress": not args.json}}, "")


def _profiled_costs(args, shape: ShapeArgs, settings: PipelineSettings):
    """Profile the model's layers on this machine (cached like training does)."""
    from .models.config import load_model_config
    from .models.gpt_costs import profile_gpt_layers

    return profile_gpt_layers(load_model_config(args.model, seq_len=shape.seq), shape.micro_batch, settings.profile)


def cmd_partition(args) -> int:
    from .partition.methods import decide_offline
    from .partition.report import build_plan

    shape, settings = check_shape(args), pipeline_settings(args)  # before any profiling
    costs = _profiled_costs(args, shape, settings)
    micro_batches = shape.micro_batches or args.stages
    bandwidth = settings.link_bandwidth
    parts = decide_offline(args.method, costs, args.stages, micro_batches=micro_batches,
                           memory_cap_gib=settings.memory_cap_gib, link_bandwidth=bandwidth)
    plan = build_plan(args.method, parts, costs, micro_batches=micro_batches, link_bandwidth=bandwidth)
    emit(plan.to_json() if args.json else plan.to_table())
    return 0


def cmd_estimate(args) -> int:
    import json

    if args.compare:
        return cmd_estimate_compare(args)

    from .costs.analytic import AnalyticError
    from .costs.estimate import EstimateRequest, estimate_layers, layer_ops, op_rows, shape_for
    from .costs.hardware import get_device
    from .models.config import load_model_config
    from .partition.report import render_table

    check_shape(args)
    cfg = load_model_config(args.model)
    req = EstimateRequest(micro_batch=args.micro_batch, seq=args.seq or cfg.seq_len, tp=args.tp, sp=args.sp,
                          dtype=args.dtype, selective_recompute=args.selective_recompute)
    try:
        device = get_device(args.device)
        if args.calibrate:
            from .models.gpt_costs import profile_and_calibrate

            device = profile_and_calibrate(cfg, req, device)
            print(f"calibrated on this machine: matrix {device.matrix_efficiency:.3f}, attention "
                  f"{device.attention_efficiency:.3f}, vector "
                  f"{device.vector_efficiency:.3f}, memory {device.memory_efficiency:.3f} of the spec's peaks",
                  file=sys.stderr)
        layers = estimate_layers(cfg, req, device)
        block = op_rows(layer_ops(cfg, shape_for(cfg, req, device))[1][2], device, req)
    except AnalyticError as e:
        raise ValueError(str(e)) from None
    stages = None
    if args.stages:
        from .costs.estimate import analytic_layer_costs, stage_memory
        from .partition import partition_min_max

        costs = analytic_layer_costs(cfg, req, device)
        m = args.micro_batches or args.stages
        parts = partition_min_max(costs, args.stages, micro_batches=m, recompute=args.full_recompute)
        stages = {"parts": parts, "micro_batches": m, "dp": args.dp, "zero": args.zero,
                  "stages": stage_memory(costs, parts, micro_batches=m, dp=args.dp, zero=args.zero,
                                         full_recompute=args.full_recompute)}
    if args.json:
        emit(json.dumps({"model": cfg.name, "device": device.name, "request": req.__dict__,
                          "layers": layers, "block_ops": block, "pipeline": stages}, indent=1))
        return 0
    mib, ms = 2**20, 1e3
    emit(f"{cfg.name}: one block, per op (b={req.micro_batch} s={req.seq} tp={req.tp} sp={req.sp} "
          f"dtype={req.dtype} device={device.name})")
    emit("\n".join(render_table(
        ["op", "fwd GFLOP", "bwd GFLOP", "act MiB", "weight MiB", "comm MiB", "comm type",
         "compute ms", "memory ms", "comm ms", "intensity"],
        [[r["op"], f"{r['fwd_flops'] / 1e9:.2f}", f"{r['bwd_flops'] / 1e9:.2f}", f"{r['activation_bytes'] / mib:.2f}",
          f"{r['weight_bytes'] / mib:.2f}", f"{(r['comm_fwd_bytes'] + r['comm_bwd_bytes']) / mib:.2f}",
          r["comm_type"] or "-", f"{r['compute_fwd_s'] * ms:.3f}", f"{r['memory_fwd_s'] * ms:.3f}",
          f"{r['comm_fwd_s'] * ms:.3f}", f"{r['intensity']:.1f}"] for r in block])))
    emit()
    emit("per layer:")
    emit("\n".join(render_table(
        ["layer", "kind", "fwd TFLOP", "act MiB", "params M", "fwd ms", "bwd ms"],
        [[f"{i}:{r['name']}", r["kind"], f"{r['fwd_flops'] / 1e12:.3f}", f"{r['activation_bytes'] / mib:.1f}",
          f"{r['params'] / 1e6:.1f}", f"{r['fwd_s'] * ms:.3f}", f"{r['bwd_s'] * ms:.3f}"] for i, r in enumerate(layers)])))
    if stages:
        gib = 2**30
        emit(f"\nmemory per rank, {args.stages} stages (analytic min-max split {stages['parts']}), "
              f"m={stages['micro_batches']} micro-batches, dp={args.dp}, ZeRO-{args.zero}"
              + (", full recompute" if args.full_recompute else "") + ":")
        emit("\n".join(render_table(
            ["stage", "layers", "params GiB", "grads GiB", "optimizer GiB", "act GiB x inflight", "total GiB"],
            [[str(r["stage"]), f"{r['layers'][0]}-{r['layers'][1] - 1}", f"{r['param_bytes'] / gib:.2f}",
              f"{r['grad_bytes'] / gib:.2f}", f"{r['optimizer_bytes'] / gib:.2f}",
              f"{r['activation_bytes'] / r['inflight'] / gib:.2f} x {r['inflight']}", f"{r['total_bytes'] / gib:.2f}"]
             for r in stages["stages"]])))
    return 0


def _comparison_configs(args, micro_batch: int):
    from .compare.configs import comparison_configs

    global_batch = args.global_batch or 2 * args.world // args.tp * micro_batch
    return comparison_configs(args.world, global_batch=global_batch, micro_batch=micro_batch, tp=args.tp,
                              patterns=args.configs)


def cmd_compare(args) -> int:
    import os
    from pathlib import Path

    import torch

    from .compare import render
    from .compare.run import Comparison, DeepSpeedLauncher, run_comparison
    from .compare.predict import model_shape
    from .models.config import load_model_config

    check_shape(args)
    model = str(Path(args.model).resolve()) if Path(args.model).suffix else args.model
    model_cfg = load_model_config(model)
    configs = _comparison_configs(args, args.micro_batch)
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: use at least 2 (the first step pays for warm-up and is not timed)")
    out = Path(args.out or f"runs/compare-{model_cfg.name}-w{args.world}")
    cpu_only = not torch.cuda.is_available()
    comparison = Comparison(out, model=model, model_cfg=model_cfg, shape=model_shape(model_cfg), steps=args.steps,
                            memory_cap_gib=args.memory_cap_gib,
                            launcher=DeepSpeedLauncher(timeout=args.timeout, compact_malloc=args.compact_malloc),
                            cpu_only=cpu_only)
    done = [c.name for c in configs if comparison.row_path(c).is_file()]
    if done:
        print(f"resuming {out}: {len(done)} of {len(configs)} rows already finished ({', '.join(done)})",
              file=sys.stderr)
    rows = run_comparison(configs, comparison, find_max=args.find_max_micro_batch, progress=not args.json)
    (out / "rows.json").write_text(render.rows_json(rows))
    png = render.write_png(rows, args.png or out / "compare.png",
                           title=f"{model_cfg.name} on {args.world} ranks" + (f", cap {args.memory_cap_gib} GiB"
                                                                                  if args.memory_cap_gib else ""))
    if args.json:
        emit(render.rows_json(rows))
        return 0
    emit(f"{model_cfg.name}: {len(rows)} configurations on {args.world} ranks, {args.steps} steps each "
         f"(samples/s: median of steps 2..{args.steps})")
    emit(render.render_rows(rows))
    for line in render.notes(rows, world=args.world, cores=os.cpu_count(), cpu_only=cpu_only,
                             compact_malloc=args.compact_malloc):
        emit(f"  - {line}")
    emit(f"wrote {out / 'rows.json'} and {png}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: write integers separated by commas, e.g. 1,2,4") from None


def cmd_sweep(args) -> int:
    """Pipeline depth x micro-batches x checkpointing: real launches, one table, one chart."""
    from pathlib import Path

    from .compare.run import DeepSpeedLauncher
    from .models.config import load_model_config
    from .models.gpt import gpt_layer_specs
    from .sweep import render
    from .sweep.run import Sweep, run_sweep, sweep_cells

    model = str(Path(args.model).resolve()) if Path(args.model).suffix else args.model
    model_cfg = load_model_config(model)
    flags = {"off": False, "on": True}
    ckpt = [flags.get(x.strip()) for x in args.checkpointing.split(",")]
    if None in ckpt:
        raise ValueError(f"--checkpointing {args.checkpointing!r}: write off, on or off,on")
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: use at least 2 (the first step pays for warm-up and is not timed)")
    stages, ms = _int_list(args.stages, "--stages"), _int_list(args.micro_batches, "--micro-batches")
    global_batch = args.global_batch or max(ms)
    cells = sweep_cells(stages, ms, ckpt, global_batch=global_batch, num_layers=len(gpt_layer_specs(model_cfg)))
    out = Path(args.out or f"runs/sweep-{model_cfg.name}")
    sweep = Sweep(out, model=model, steps=args.steps, method=args.method, schedule=args.schedule,
                  launcher=DeepSpeedLauncher(timeout=args.timeout), step_model=args.step_model)
    done = [c.name for c in cells if sweep.cell_path(c).is_file()]
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
         f"K stages on K ranks, {args.steps} steps each (samples/s: median of steps 2..{args.steps}); "
         f"memory measured by the instrumentation (tensors held), predicted by the partitioner; "
         + (f"times predicted by the step model {args.step_model}" if args.step_model else
            "times predicted from the per-layer profiles alone (no engine, optimizer or p2p costs: "
            "pass --step-model FILE from `ds-pipe-ext step-model fit` to include them)"))
    emit(render.render_rows(rows))
    emit(f"wrote {out / 'rows.json'} and {png}")
    return 0


def cmd_estimate_compare(args) -> int:
    """The memory side of ``compare`` from the analytic model alone: no launch, any model and cluster."""
    import json

    from .compare.predict import KINDS, model_shape
    from .costs.estimate import DTYPE_BYTES, EstimateRequest, analytic_layer_costs
    from .costs.hardware import get_device
    from .models.config import load_model_config
    from .compare.predict import predicted_ranks
    from .compat.zero import deepspeed_estimate_bytes
    from .partition.methods import decide_offline
    from .partition.report import render_table

    if not args.world:
        raise ValueError("estimate --compare needs --world N (the number of GPUs)")
    cfg = load_model_config(args.model)
    device = get_device(args.device)
    shape = model_shape(cfg)
    configs = _comparison_configs(args, args.micro_batch)
    req = EstimateRequest(micro_batch=args.micro_batch, seq=args.seq or cfg.seq_len, tp=args.tp, sp=args.sp,
                          dtype=args.dtype, selective_recompute=args.selective_recompute)
    costs = analytic_layer_costs(cfg, req, device)
    acts = [c.activation_bytes for c in costs]
    rows = []
    for c in configs:
        parts = None
        if c.kind == "pipeline":
            if len(costs) < c.pp:
                continue  # more stages than layers
            # "profiled" needs the device: the analytic min-max split stands in for it here
            parts = decide_offline("analytic" if c.method == "profiled" else c.method, costs, c.pp,
                                   micro_batches=c.grad_accum)
        stages = predicted_ranks(c, shape, acts, parts=parts, element_bytes=DTYPE_BYTES[args.dtype])
        if c.offload:  # optimizer states and parameter partitions live in CPU memory
            for st in stages:
                st["total_bytes"] -= st["optimizer_bytes"] + st["param_bytes"]
                st["optimizer_bytes"] = st["param_bytes"] = 0
        worst = max(stages, key=lambda st: st["total_bytes"])
        # DeepSpeed's own model-state estimate, beside ours (its estimators assume 16-bit, no pipeline)
        ds_estimate = (deepspeed_estimate_bytes(shape.params, shape.largest_module_params, dp=c.dp, stage=c.zero)
                       if c.kind != "pipeline" and not c.offload and c.tp == 1 and args.dtype != "fp32" else None)
        rows.append({"config": c.name if c.method != "profiled" else c.name.replace("profiled", "analytic"),
                     **c.to_dict(), "parts": parts, "stages": stages, "heaviest_stage": worst["stage"],
                     "predicted_bytes": {k: worst[k] for k in KINDS},
                     "predicted_peak_memory_bytes": worst["total_bytes"],
                     "deepspeed_estimate_model_state_bytes": ds_estimate,
                     "status": "oom" if worst["total_bytes"] > device.memory_bytes else "fits"})
    if args.json:
        emit(json.dumps({"model": cfg.name, "device": device.name, "device_memory_bytes": device.memory_bytes,
                          "world": args.world, "dtype": args.dtype, "rows": rows}, indent=1))
        return 0
    gib = 2**30
    emit(f"{cfg.name} ({shape.params / 1e9:.2f} B params) on {args.world} x {device.name} "
         f"({device.memory_bytes / gib:.0f} GiB each), {args.dtype}, micro-batch {args.micro_batch}, seq {req.seq}"
         + (f", tp {args.tp}" + (" + sp" if args.sp else "") if args.tp > 1 else "") + "; analytic, no launch")
    emit("\n".join(render_table(
        ["config", "pp x tp x dp", "ZeRO", "mb x acc", "heaviest stage", "params GiB", "grads GiB", "optimizer GiB",
         "activations GiB", "total GiB", "fits?"],
        [[r["config"], f"{r['pp']}x{r['tp']}x{r['dp']}", str(r["zero"]), f"{r['micro_batch']} x {r['grad_accum']}",
          str(r["heaviest_stage"]), *(f"{r['predicted_bytes'][k] / gib:.1f}" for k in KINDS),
          f"{r['predicted_peak_memory_bytes'] / gib:.1f}", "OOM" if r["status"] == "oom" else "yes"] for r in rows])))
    emit("  - per rank: model states by DeepSpeed's allocation rules for this precision (ZeRO-1/2/3 divide them "
         "over dp), activations for one micro-batch x the stage's 1F1B in-flight count; 'analytic' rows are split "
         "by the analytic min-max partition; zero3-offload keeps its states in CPU memory")
    for r in rows:
        if r["deepspeed_estimate_model_state_bytes"] is not None:
            ours = sum(r["predicted_bytes"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            emit(f"  - {r['config']}: model states {ours / gib:.2f} GiB here, "
                 f"{r['deepspeed_estimate_model_state_bytes'] / gib:.2f} GiB by DeepSpeed's estimate_zero"
                 f"{r['zero']}_model_states_mem_needs (it counts a 16-bit gradient partition under ZeRO-2, the "
                 f"largest module in 32 bits under ZeRO-3)")
    return 0


def cmd_report(args) -> int:
    from .instrument.refine import RunDirError
    from .instrument.report import build_report, render_report_table, report_json

    try:
        rep = build_report(args.run_dir)
    except RunDirError as e:
        raise ValueError(str(e)) from None
    emit(report_json(rep) if args.json else render_report_table(rep))
    if args.png:
        from .instrument.plot import write_png

        out = write_png(rep, args.png)
        if not args.json:
            emit(f"wrote {out}")
    return 0


def cmd_step_model(args) -> int:
    """fit: a step model from instrumented runs; predict: each run's step with a fitted model."""
    from .instrument.refine import RunDirError, load_run
    from .instrument.step_fit import fit_step_model, predict_run, run_stages
    from .partition.report import render_table
    from .simulate.step_model import StepModel

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds-pipe-ext", description="Cost-aware pipeline partitioning for DeepSpeed")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("partition", help="profile a model's layers and print the per-stage plan")
    p.add_argument("--model", required=True, help="a name in model_configs/ (tiny, bench-cpu, ...) or a .toml path")
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--method", default="profiled", help="profiled | uniform | parameters | type:REGEX | parts:0,..,n")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: stages)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's seq_len)")
    p.add_argument("--memory-cap-gib", type=float, default=None, help="per-stage memory cap")
    p.add_argument("--link-bandwidth-gbs", "--link-bandwidth-gbps", dest="link_bandwidth_gbs", type=float, default=None,
                   help="stage-to-stage bandwidth in GB/s (adds p2p time); --link-bandwidth-gbps is its old name")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cache-dir", default=".ds_pipe_ext_cache")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_partition)

    e = sub.add_parser("estimate", help="analytic per-op and per-layer costs (no device needed)")
    e.add_argument("--model", required=True)
    e.add_argument("--micro-batch", type=int, default=1)
    e.add_argument("--seq", type=int, default=None)
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    e.add_argument("--selective-recompute", action="store_true")
    e.add_argument("--device", default="a100", help="a100 | a100-40gb | a100-80gb | h100 | h200 | cpu (measured)")
    e.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    e.add_argument("--stages", type=int, default=None, help="also split into P stages and print memory per stage")
    e.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: stages)")
    e.add_argument("--dp", type=int, default=1, help="data-parallel degree (ZeRO divides model states by it)")
    e.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    e.add_argument("--full-recompute", action="store_true", help="activation checkpointing of every layer")
    e.add_argument("--calibrate", action="store_true",
                   help="profile one embedding, block and head here and fit the device's efficiency factors")
    e.add_argument("--compare", action="store_true",
                   help="per-rank memory by kind of every configuration `compare` would run, on --world devices")
    e.add_argument("--world", type=int, default=None, help="with --compare: the number of devices")
    e.add_argument("--global-batch", type=int, default=None, help="with --compare (default: 2 x dp x micro-batch)")
    e.add_argument("--configs", nargs="*", default=None, help="with --compare: only these (shell patterns)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)

    c = sub.add_parser("compare", help="pipeline (profiled, uniform) against ZeRO-1/2/3: real launches, one table")
    c.add_argument("--model", required=True, help="a name in model_configs/ or a .toml path")
    c.add_argument("--world", type=int, required=True, help="ranks per launch (deepspeed --num_gpus)")
    c.add_argument("--global-batch", type=int, default=None, help="samples per step, the same in every row "
                   "(default: 2 x world/tp x micro-batch)")
    c.add_argument("--micro-batch", type=int, default=4)
    c.add_argument("--tp", type=int, default=1, help="tensor parallelism inside every configuration")
    c.add_argument("--steps", type=int, default=4, help="steps per launch (the first is warm-up, not timed)")
    c.add_argument("--memory-cap-gib", type=float, default=None,
                   help="per-rank cap: a configuration above it is an OOM row (checked after every step against "
                        "the allocator peak on GPU, the tensors the rank holds on CPU)")
    c.add_argument("--compact-malloc", action="store_true",
                   help="CPU: have glibc return every block above 128 KiB at once, so the RSS column follows "
                        "the tensors held; every large allocation then pays its page faults each step "
                        "(slower: for memory runs, not throughput)")
    c.add_argument("--configs", nargs="*", default=None, help="only these configurations (shell patterns, e.g. 'pipe-*' zero3)")
    c.add_argument("--find-max-micro-batch", action="store_true",
                   help="also search each configuration's largest micro-batch under the cap (more launches)")
    c.add_argument("--out", default=None, help="results and launches (default runs/compare-MODEL-wN); "
                   "re-running with the same --out resumes")
    c.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    c.add_argument("--json", action="store_true", help="print the rows as JSON")
    c.add_argument("--png", default=None, metavar="FILE", help="chart (default OUT/compare.png)")
    c.set_defaults(func=cmd_compare, seq=None, dp=1, micro_batches=None)

    w = sub.add_parser("sweep", help="pipeline depth x micro-batches x checkpointing: real launches, a table and a chart")
    w.add_argument("--model", required=True, help="a name in model_configs/ or a .toml path")
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

    from .simulate.command import add_parser as add_simulate

    add_simulate(sub)
    from .plan.command import add_parser as add_plan

    add_plan(sub)
    return ap


def main(argv=None) -> int:
    global _stdout
    args = build_parser().parse_args(argv)
    _stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return args.func(args)
    except (PartitionError, ConfigError, ValueError) as e:
        print(f"ds-pipe-ext: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
