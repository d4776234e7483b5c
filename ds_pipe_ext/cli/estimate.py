"""`ds-pipe-ext estimate`: analytic per-op, per-layer and per-stage costs, no device needed; with
``--compare``, the per-rank memory of every layout `compare` would launch, on any cluster.

    ds-pipe-ext estimate --model gpt3-175b --tp 8 --sp --device a100 --micro-batch 1 --seq 2048 [--json]
    ds-pipe-ext estimate --compare --model gpt3-175b --world 64 --tp 8 --device a100-80gb [--json]
"""

from __future__ import annotations

import sys

from .common import check_shape, emit


def cmd_estimate(args) -> int:
    import json

    if args.compare:
        return cmd_estimate_compare(args)

    from ..costs.analytic import AnalyticError
    from ..costs.estimate import EstimateRequest, estimate_layers, layer_ops, op_rows, shape_for
    from ..costs.hardware import get_device
    from ..models import family_of, load_model
    from ..partition.report import render_table

    check_shape(args)
    cfg = load_model(args.model)
    req = EstimateRequest(micro_batch=args.micro_batch, seq=args.seq or cfg.seq_len, tp=args.tp, sp=args.sp,
                          dtype=args.dtype, selective_recompute=args.selective_recompute)
    try:
        device = get_device(args.device)
        if args.calibrate:

            device = family_of(cfg).calibrate(cfg, req, device)
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
        from ..costs.estimate import DTYPE_BYTES, analytic_layer_costs, stage_memory
        from ..partition import partition_min_max

        costs = analytic_layer_costs(cfg, req, device)
        m = args.micro_batches or args.stages
        parts = partition_min_max(costs, args.stages, micro_batches=m, recompute=args.full_recompute)
        stages = {"parts": parts, "micro_batches": m, "dp": args.dp, "zero": args.zero,
                  "stages": stage_memory(costs, parts, micro_batches=m, dp=args.dp, zero=args.zero,
                                         full_recompute=args.full_recompute,
                                         element_bytes=DTYPE_BYTES[req.dtype])}
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


def cmd_estimate_compare(args) -> int:
    """The memory side of ``compare`` from the analytic model alone: no launch, any model and cluster."""
    import json

    from .compare import comparison_configs_for
    from ..compare.predict import KINDS, model_shape, predicted_ranks
    from ..costs.estimate import DTYPE_BYTES, EstimateRequest, analytic_layer_costs
    from ..costs.hardware import get_device
    from ..models import family_of, load_model
    from ..compat.zero import deepspeed_estimate_bytes
    from ..partition import partition_min_max
    from ..partition.methods import decide_offline
    from ..partition.report import render_table

    if not args.world:
        raise ValueError("estimate --compare needs --world N (the number of GPUs)")
    cfg = load_model(args.model)
    device = get_device(args.device)
    shape = model_shape(cfg)
    configs = comparison_configs_for(args, args.micro_batch)
    req = EstimateRequest(micro_batch=args.micro_batch, seq=args.seq or cfg.seq_len, tp=args.tp, sp=args.sp,
                          dtype=args.dtype, selective_recompute=args.selective_recompute)
    costs = analytic_layer_costs(cfg, req, device)
    acts = [c.activation_bytes for c in costs]
    rows = []
    for c in configs:
        parts = None
        if c.kind == "pipeline":
            if len(costs) < c.layout.pp:
                continue  # more stages than layers
            # "profiled" needs the device: the analytic min-max split stands in for it here (a memory
            # table: not the step search, which takes seconds per layout on a 96-block model)
            lay = c.layout
            parts = (partition_min_max(costs, lay.pp, micro_batches=lay.micro_batches) if c.method == "profiled"
                     else decide_offline(c.method, costs, lay.pp, micro_batches=lay.micro_batches))
        stages = predicted_ranks(c, shape, acts, parts=parts, element_bytes=DTYPE_BYTES[args.dtype])
        if c.layout.offload:  # optimizer states and parameter partitions live in CPU memory
            for st in stages:
                st["total_bytes"] -= st["optimizer_bytes"] + st["param_bytes"]
                st["optimizer_bytes"] = st["param_bytes"] = 0
        worst = max(stages, key=lambda st: st["total_bytes"])
        # DeepSpeed's own model-state estimate, beside ours (its estimators assume 16-bit, no pipeline)
        lay = c.layout
        ds_estimate = (deepspeed_estimate_bytes(shape.params, shape.largest_module_params, dp=lay.dp, stage=lay.zero)
                       if c.kind != "pipeline" and not lay.offload and lay.tp == 1 and args.dtype != "fp32" else None)
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


def add_parser(sub) -> None:
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
