"""`ds-pipe-ext estimate`: analytic per-op, per-layer and per-stage costs, no device needed; with
``--compare``, the per-rank memory of every layout `compare` would launch, on any cluster.

    ds-pipe-ext estimate --model gpt3-175b --tp 8 --sp --device a100 --micro-batch 1 --seq 2048 [--json]
    ds-pipe-ext estimate --compare --model gpt3-175b --world 64 --tp 8 --device a100-80gb [--json]
"""

from __future__ import annotations

import sys
from dataclasses import replace

from .common import (EXPERT_IMBALANCE_HELP, add_execution_argument, add_model_argument, check_shape, emit,
                     execution_of, expert_imbalance)


def cmd_estimate(args) -> int:
    import json

    if args.compare:
        return cmd_estimate_compare(args)

    from ..costs.op_cost import AnalyticError
    from ..costs.estimate import EstimateRequest, estimate_layers, op_rows, shape_for
    from ..costs.layer_ops import assumed_attention, layer_ops
    from ..models import family_of, load_model
    from ..partition.report import render_table
    from ..plan.machine import cluster_from_args, plan_device

    check_shape(args)
    cfg = load_model(args.model)
    req = EstimateRequest(micro_batch=args.micro_batch, seq=args.seq or cfg.seq_len, tp=args.tp, sp=args.sp,
                          dtype=args.dtype, selective_recompute=args.selective_recompute,
                          expert_imbalance=args.expert_imbalance, execution=execution_of(args))
    try:
        device = plan_device(args.device)
        device = replace(device, network=cluster_from_args(device, args))  # TP's collectives on the cluster given
        if args.calibrate:

            device = family_of(cfg).calibrate(cfg, req, device)
            print(f"calibrated on this machine: matrix {device.matrix_efficiency:.3f}, attention "
                  f"{device.attention_efficiency:.3f}, vector "
                  f"{device.vector_efficiency:.3f}, memory {device.memory_efficiency:.3f} of the spec's peaks",
                  file=sys.stderr)
        layers = estimate_layers(cfg, req, device)
        ops = layer_ops(cfg, shape_for(cfg, req, device), expert_imbalance=req.expert_imbalance, device=device.name)
        block = op_rows(ops[1][2], device, req)
    except AnalyticError as e:
        raise ValueError(str(e)) from None
    stages = None
    if args.stages:
        lay = _estimate_layout(args)
        cost = _layout_model(cfg, device, lay, seq=req.seq, dtype=req.dtype,
                             execution=req.execution).evaluate_named(lay)
        stages = {"parts": cost.parts, "micro_batches": lay.micro_batches, "dp": args.dp, "zero": args.zero,
                  "step_s": cost.step_s, "notes": cost.notes, "stages": _rank_rows(cost)}
    if args.json:
        emit(json.dumps({"model": cfg.name, "device": device.name, "request": req.__dict__,
                          "attention": assumed_attention(cfg, device.name),
                          "layers": layers, "block_ops": block, "pipeline": stages}, indent=1))
        return 0
    mib, ms = 2**20, 1e3
    emit(f"{cfg.name}: one block, per op (b={req.micro_batch} s={req.seq} tp={req.tp} sp={req.sp} "
          f"dtype={req.dtype} device={device.name} attention={assumed_attention(cfg, device.name)}"
          + (f" on {backend}" if (backend := _block_backend(cfg, req, device)) else "")
          + (f", {req.execution}" if device.gpu is not None else "") + ")")
    if device.gpu is not None:
        from ..costs.kernel_table import table_note

        emit(table_note(device))
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
        emit(f"\nmemory per rank, {args.stages} stages (the plan's split {stages['parts']}), "
              f"m={stages['micro_batches']} micro-batches, dp={args.dp}, ZeRO-{args.zero}"
              + (", full recompute" if args.full_recompute else "") + ":")
        emit("\n".join(render_table(
            ["stage", "layers", "in flight", "peak in", "params GiB", "grads", "optimizer", "buffers", "gathered",
             "activations", "temporaries", "peak GiB", "at step GiB"],
            [[str(r["stage"]), f"{r['layers'][0]}-{r['layers'][1] - 1}", str(r["inflight"]), r.get("phase", "-"),
              *(f"{r.get(k, 0.0) / gib:.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes",
                                                       "gathered_bytes", "activation_bytes", "temporary_bytes")),
              f"{r['total_bytes'] / gib:.2f}", f"{r.get('at_step_bytes', 0.0) / gib:.2f}"] for r in stages["stages"]])))
        emit("  (each rank's peak over the step by kind and when, costs/peak.py; at step: its model states then)")
        for note in stages["notes"]:
            emit(f"  - {note}")
    return 0


def _estimate_layout(args):
    """The layout ``estimate --stages`` describes: a 1F1B pipeline (or, at one stage, none)."""
    from ..layout import Layout, LayoutError

    if args.selective_recompute and args.full_recompute:
        raise ValueError("--selective-recompute and --full-recompute: choose one")
    recompute = "full" if args.full_recompute else "selective" if args.selective_recompute else "none"
    try:
        return Layout(pp=args.stages, tp=args.tp, dp=args.dp, sp=args.sp, zero=args.zero,
                      micro_batch=args.micro_batch, micro_batches=args.micro_batches or args.stages,
                      recompute=recompute)
    except LayoutError as e:
        raise ValueError(f"--stages {args.stages}: {e}") from None


def _block_backend(cfg, req, device) -> str | None:
    """The SDPA backend the first block's fused attention runs on the device, None without one."""
    from ..costs.estimate import op_backend, shape_for
    from ..costs.layer_ops import layer_ops

    ops = layer_ops(cfg, shape_for(cfg, req, device), device=device.name)[1][2]
    return next((b for op in ops if (b := op_backend(op, req, device.name))), None)


def _layout_model(cfg, device, lay, *, seq: int, dtype: str, execution: str = "eager"):
    """The one cost model of a layout (``plan.model.PlanModel``) on ``device``'s own cluster: what `plan
    --only` evaluates ``lay`` with."""
    from ..plan.model import PlanModel

    return PlanModel.on_its_cluster(cfg, device, seq=seq, global_batch=lay.global_batch, dtype=dtype,
                                    execution=execution)


def _rank_rows(cost) -> list[dict]:
    """Each pipeline rank of an evaluated layout: its layers, the micro-batches its schedule holds, its
    bytes by kind (one rank without a pipeline)."""
    from ..costs.stage import in_flight

    lay, parts = cost.layout, cost.parts
    return [{"stage": s, "layers": [parts[s], parts[s + 1]],
             "inflight": in_flight(s, lay.pp, lay.micro_batches, lay.schedule_spec.name) if lay.pipelined else 1,
             **mem} for s, mem in enumerate(cost.ranks)]


def cmd_estimate_compare(args) -> int:
    """The memory side of ``compare`` from the analytic model alone: no launch, any model and cluster."""
    import json

    from .compare import comparison_configs_for
    from ..compare.predict import model_shape
    from ..compare.render import layout as layout_text
    from ..compare.run import refusal
    from ..compat.zero import deepspeed_estimate_bytes
    from ..costs.zero import MEMORY_KINDS as KINDS
    from ..models import load_model
    from ..partition.methods import decide_offline
    from ..partition.report import render_table
    from ..plan.machine import plan_device

    if not args.world:
        raise ValueError("estimate --compare needs --world N (the number of GPUs)")
    cfg = load_model(args.model)
    device = plan_device(args.device)
    shape = model_shape(cfg)
    configs = comparison_configs_for(args, args.micro_batch)
    seq = args.seq or cfg.seq_len
    rows = []
    for c in configs:
        lay = replace(c.layout, sp=args.sp, recompute="selective" if args.selective_recompute else c.layout.recompute)
        if c.kind == "pipeline" and cfg.describe().num_pipeline_layers < lay.pp:
            continue  # more stages than layers
        refused = refusal(c, cfg)
        if refused is not None:  # shown with the runtime's reason, never dropped
            rows.append({"config": c.name, **c.to_dict(), "status": "refused", "note": refused})
            continue
        model = _layout_model(cfg, device, lay, seq=seq, dtype=args.dtype)
        if c.kind == "pipeline" and c.method not in ("profiled", "analytic"):  # DeepSpeed's own methods
            costs = model.costs_of(lay)
            cost = model.evaluate(lay, decide_offline(c.method, list(costs), lay.pp, micro_batches=lay.micro_batches),
                                  check_memory=False)
        else:  # "profiled" (it needs the device) and "analytic": the plan's split, as `plan --only`
            cost = model.evaluate_named(lay)
        stages = _rank_rows(cost)
        worst = max(stages, key=lambda st: st["total_bytes"])
        # DeepSpeed's own model-state estimate, beside ours (its estimators assume 16-bit, no pipeline)
        ds_estimate = (deepspeed_estimate_bytes(shape.params, shape.largest_module_params, dp=lay.dp, stage=lay.zero)
                       if c.kind != "pipeline" and not lay.offload and lay.tp == 1 and args.dtype != "fp32" else None)
        rows.append({"config": c.name if c.method != "profiled" else c.name.replace("profiled", "analytic"),
                     **c.to_dict(), "parts": cost.parts if c.kind == "pipeline" else None, "stages": stages,
                     "heaviest_stage": worst["stage"], "predicted_bytes": {k: worst[k] for k in KINDS},
                     "predicted_peak_memory_bytes": worst["total_bytes"], "step_s": cost.step_s,
                     "deepspeed_estimate_model_state_bytes": ds_estimate,
                     "status": "oom" if worst["total_bytes"] > device.memory_bytes else "fits"})
    if args.json:
        emit(json.dumps({"model": cfg.name, "device": device.name, "device_memory_bytes": device.memory_bytes,
                          "world": args.world, "dtype": args.dtype, "rows": rows}, indent=1))
        return 0
    gib = 2**30
    emit(f"{cfg.name} ({shape.params / 1e9:.2f} B params) on {args.world} x {device.name} "
         f"({device.memory_bytes / gib:.0f} GiB each), {args.dtype}, micro-batch {args.micro_batch}, seq {seq}"
         + (f", tp {args.tp}" + (" + sp" if args.sp else "") if args.tp > 1 else "") + "; analytic, no launch")
    emit("\n".join(render_table(
        ["config", "pp x tp x dp", "ZeRO", "mb x acc", "heaviest stage",
         *(f"{k.removesuffix('_bytes').replace('param', 'params').replace('grad', 'grads')} GiB" for k in KINDS),
         "peak GiB", "fits?"],
        [[r["config"], layout_text(r), str(r["zero"]), f"{r['micro_batch']} x {r['grad_accum']}",
          *([str(r["heaviest_stage"]), *(f"{r['predicted_bytes'][k] / gib:.1f}" for k in KINDS),
             f"{r['predicted_peak_memory_bytes'] / gib:.1f}", "OOM" if r["status"] == "oom" else "yes"]
            if r["status"] != "refused" else ["-"] * (len(KINDS) + 2) + ["refused"])] for r in rows])))
    emit("  - per rank, as `plan --only` evaluates each layout: model states by DeepSpeed's allocation rules for "
         "this precision (ZeRO-1/2/3 divide them over dp), the activations the schedule holds at its peak, ZeRO-3's "
         "two gathered layers; 'analytic' rows take the plan's split; offload keeps optimizer states in CPU memory")
    for r in rows:
        if r["status"] == "refused":
            emit(f"  - {r['config']}: refused: {r['note']}")
        elif r["deepspeed_estimate_model_state_bytes"] is not None:
            ours = sum(r["predicted_bytes"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            emit(f"  - {r['config']}: model states {ours / gib:.2f} GiB here, "
                 f"{r['deepspeed_estimate_model_state_bytes'] / gib:.2f} GiB by DeepSpeed's estimate_zero"
                 f"{r['zero']}_model_states_mem_needs (it counts a 16-bit gradient partition under ZeRO-2, the "
                 f"largest module in 32 bits under ZeRO-3)")
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("estimate", help="analytic per-op and per-layer costs (no device needed)")
    add_model_argument(e)
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
    e.add_argument("--expert-imbalance", type=expert_imbalance, default=None, metavar="X|RUN_DIR",
                   help=EXPERT_IMBALANCE_HELP)
    add_execution_argument(e)
    from ..plan.machine import add_cluster_arguments

    add_cluster_arguments(e)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)
