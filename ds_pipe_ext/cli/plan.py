"""`ds-pipe-ext plan`: the fastest layout of a model on a cluster, from the analytic model alone.

    ds-pipe-ext plan --model gpt3-175b --gpus 1024 --device a100 --global-batch 1536 [--top 10] [--json]
                     [--gpus-per-node 8] [--intra-node-gbs 300 --inter-node-gbs 25] [--seq S]
                     [--only "pp=8,tp=8,dp=16,mb=1,recompute=full,sp=on,zero=1,schedule=1f1b"]
                     [--emit-ds-config ds.json] [--runtime deepspeed|megatron|both]

``--runtime``: whose runtime runs the layouts: DeepSpeed's engines (the default: what train.py runs),
Megatron-LM's (its own 1F1B and interleaving, overlapped DP reduction, distributed optimizer), or both,
Megatron's table printed after DeepSpeed's with the two picks' steps side by side.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..arch import as_description
from ..layout import LayoutError
from ..plan.space import PlanError, enumerate_layouts, only_settings, parse_only
from ..plan.recompute import apply_stage_recompute, describe
from .common import EXPERT_IMBALANCE_HELP, add_execution_argument, add_model_argument, execution_of, expert_imbalance


def _emit(text: str) -> None:
    print(text, file=sys.__stdout__, flush=True)


def as_cpu_ranks(device, ranks: int):
    """The cpu spec as each of ``ranks`` ranks sees it: gloo's measured collectives (ten times slower
    than the memory copy the spec measures), and GEMM and memory peaks scaled by the share of the
    cores a rank gets while all compute (``costs.cpu_comm``; measured once, cached)."""
    from ..costs.cpu_comm import measure_cpu_ranks

    got = measure_cpu_ranks(ranks)
    mm, mem = got["shared"]["matrix"], got["shared"]["memory"]
    return replace(device.with_streaming_memory(mem), collectives=got["collectives"],
                   matrix_flops={k: v * mm for k, v in device.matrix_flops.items()},
                   vector_flops={k: v * mm for k, v in device.vector_flops.items()},
                   random_rate=device.random_rate * mm)


def profiled_cpu(cfg, device, seq: int):
    """The cpu spec with its GEMM efficiency fitted to this model's embedding, one block and head (+ loss)
    profiled here in one process at micro-batch 1 and 2 (its family's ``calibrate``,
    cached): the micro-benchmarks keep their fastest run, while a step runs at the machine's sustained
    speed on the layers' own shapes.  No launch is involved."""
    from ..costs.estimate import EstimateRequest
    from ..models import family_of

    req = [EstimateRequest(micro_batch=b, seq=seq, dtype="fp32") for b in (1, 2)]
    fitted = family_of(cfg).calibrate(cfg, req[0], device, also=tuple(req[1:]), warmup=1, repeats=5)
    return replace(fitted, name="cpu")


def build_model(args, runtime: str | None = None):
    from ..models import load_model
    from ..plan.machine import cluster_from_args, plan_device
    from ..plan.model import USABLE_MEMORY, PlanModel

    cfg = load_model(args.model)
    device = plan_device(args.device)
    if getattr(args, "profile_layers", False):
        if device.name != "cpu":
            raise PlanError("--profile-layers fits the cpu spec to layers profiled on this machine: use it with "
                            "--device cpu (a GPU's spec is calibrated on published runs)")
        device = profiled_cpu(cfg, device, args.seq or cfg.seq_len)
    if device.name == "cpu" and device.collectives is None and not (args.intra_node_gbs or args.inter_node_gbs):
        device = as_cpu_ranks(device, max(2, min(args.gpus, 8)))
    cluster = cluster_from_args(device, args)
    seq = args.seq or cfg.seq_len
    if seq > cfg.seq_len:
        raise PlanError(f"--seq {seq} exceeds {cfg.name}'s seq_len {cfg.seq_len}")
    dtype = args.dtype or ("fp32" if device.name == "cpu" else "bf16")
    global_batch = args.gpus if args.global_batch is None else args.global_batch
    fraction = getattr(args, "memory_fraction", USABLE_MEMORY)
    if not 0 < fraction <= 1:
        raise PlanError(f"--memory-fraction {fraction}: the share of the device's memory a rank may use, in (0, 1]")
    return cfg, PlanModel(cfg, device, cluster, seq=seq, global_batch=global_batch, dtype=dtype,
                          memory_fraction=fraction, expert_imbalance=getattr(args, "expert_imbalance", None),
                          execution=execution_of(args, runtime))


def cmd_plan(args) -> int:
    from ..plan.render import MegatronLayoutChecker

    checker = None if args.json else MegatronLayoutChecker()  # its import overlaps the search
    try:
        return _plan(args, checker)
    finally:
        if checker is not None:
            checker.close()


def _search(args, cfg, model, runtime: str = "deepspeed"):
    from ..plan.search import search

    layouts, dropped = enumerate_layouts(cfg, args.gpus, gpus_per_node=model.cluster.gpus_per_node,
                                         global_batch=model.global_batch)
    if runtime != "deepspeed":  # Megatron-LM shards optimizer states (its distributed optimizer), not more; its
        # MoE layers' TP (with SP and its own dispatcher) is not modelled (``Layout.check``)
        routed = bool(as_description(cfg).experts)
        layouts = [replace(lay, runtime=runtime) for lay in layouts if lay.zero <= 1 and not (routed and lay.tp > 1)]
    bar = None
    if not args.json and len(layouts) > 500:
        from tqdm import tqdm

        bar = tqdm(total=len(layouts), desc="plan", unit="layout", file=sys.stderr, mininterval=0.5)

    def progress(i, n):
        if bar is not None:
            bar.total = n
            bar.n = i + 1
            bar.refresh() if i % 200 == 0 else None

    try:
        res = search(model, layouts, top_k=args.top, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    for reason, n in dropped.items():
        res.dropped[reason] += n
    return res


def _plan(args, checker) -> int:
    from ..plan.render import ds_config, megatron_layout, render_table, rows_json, short_parts
    from ..plan.search import PlanResult

    t0 = time.perf_counter()
    if args.emit_ds_config and args.runtime == "megatron":
        raise PlanError("--emit-ds-config writes a ds.json for DeepSpeed's engine: plan with --runtime deepspeed "
                        "(or both), not megatron")
    cfg, model = build_model(args)
    if args.only:  # the layout the user named is evaluated whatever its memory, and marked if over the cap
        runtime = "megatron" if args.runtime == "megatron" else "deepspeed"
        lay = parse_only(args.only, gpus=args.gpus, global_batch=model.global_batch, runtime=runtime)
        try:
            lay.check(cfg)
        except LayoutError as e:
            raise PlanError(f"--only: {e}") from None
        settings = only_settings(args.only)
        if lay.runtime != runtime and args.execution is None:  # runtime=megatron named in --only: its kernels
            cfg, model = build_model(args, runtime=lay.runtime)
        model.lp_grads_to_none = settings.get("lp_grads") == "none"
        if "grad_accum" in settings:
            model.grad_accum_dtype = settings["grad_accum"]
        model.zero3_synchronized = settings.get("zero3_gather") == "synchronized"
        if settings.get("buckets") == "deepspeed":  # a run that set no buckets ran DeepSpeed's defaults
            from ..layout import DEEPSPEED_ZERO3_DEFAULTS

            model.zero_settings = {**model.zero_settings, **DEEPSPEED_ZERO3_DEFAULTS}
        res = PlanResult(top=[model.evaluate_named(lay, split=settings.get("split", "analytic"))],
                         candidates=1, simulated=1, partitioned=1)
    else:
        res = _search(args, cfg, model, "megatron" if args.runtime == "megatron" else "deepspeed")
    other = None
    if args.runtime == "both" and not args.only:
        # Megatron's runtime with its own kernels, unless --execution names one for both
        other_model = model if args.execution else build_model(args, runtime="megatron")[1]
        other = _search(args, cfg, other_model, "megatron")
    apply_stage_recompute(model, res.top)  # the split and each layer's recompute together, where faster
    seconds = time.perf_counter() - t0
    best = res.best_runnable() if args.runtime != "megatron" else None  # what DeepSpeed runs, if it runs it
    for cost in res.top:
        if cost.stage_recompute is not None:
            sr = cost.stage_recompute
            cost.notes.append(f"per-stage recompute: step {sr.step_s:.3f} s ({cost.step_s / sr.step_s:.2f}x), "
                              f"parts {short_parts(sr.parts)}, {sum(m != 'none' for m in sr.layer_recompute)} layers "
                              f"recompute ({'; '.join(describe(sr.layer_recompute, sr.parts))})")
    emitted = best.stage_recompute if best is not None and best.stage_recompute is not None else best
    if args.emit_ds_config:
        if best is None:
            raise PlanError("no layout DeepSpeed can run made the plan: nothing to emit")
        Path(args.emit_ds_config).write_text(json.dumps(
            ds_config(emitted, model=args.model, dtype=model.dtype, zero_settings=model.zero_settings,
                      compile=model.execution == "compiled"), indent=2) + "\n")
    if args.json:
        if other is None:
            _emit(rows_json(res))
        else:
            _emit(json.dumps({"deepspeed": json.loads(rows_json(res)), "megatron": json.loads(rows_json(other))},
                             indent=1))
        return 0
    from ..costs.layer_ops import assumed_attention

    d = model.device
    if d.collectives:
        links = "gloo measured: " + ", ".join(f"{kind} {bw / 1e9:.2f} GB/s + {lat * 1e3:.2f} ms"
                                              for kind, (lat, bw) in d.collectives.items())
    else:
        from ..costs.network import describe as describe_network

        links = f"{describe_network(model.cluster)}, NCCL {model.cluster.nccl_version}'s model"
    _emit(f"{cfg.name} on {args.gpus} x {d.name} ({links}), global batch "
          f"{model.global_batch}, seq {model.seq}, {model.dtype}; analytic costs "
          + (f"(GPU kernels as they run {model.execution}"
             + (" under DeepSpeed's runtime" if args.runtime == "both" else "")
             + f"; attention {assumed_attention(cfg, d.name)}), "
             if d.gpu is not None else
             f"(roofline, matrix efficiency {d.matrix_efficiency:.3f}, attention {assumed_attention(cfg, d.name)}), ")
          + "step from the event simulator")
    if d.gpu is not None:
        from ..costs.kernel_table import table_note

        _emit(table_note(d))
    if res.top:
        from ..costs.moe_ops import dropless_note

        pick = res.top[0].layout
        if note := dropless_note(cfg, pick.micro_batch * model.seq, model.expert_imbalance, pick.ep, pick.tp):
            _emit(note)
    _emit(render_table(res, memory_cap=model.memory_cap))
    for label, cost in (("pick", res.top[0]), ("best layout DeepSpeed runs", best)):
        if cost is None or (label != "pick" and cost is res.top[0]):
            continue
        text, why = megatron_layout(cost, cfg.layers, checker, mtp_layers=getattr(cfg, "mtp_layers", 0))
        _emit(f"{label}: {cost.layout.name}, parts {cost.parts}")
        if label == "pick":
            from ..costs.device_spec import tp_collectives_note
            from ..plan.shares import render_shares

            _emit(render_shares(model, cost))
            if note := tp_collectives_note(d, cost.layout.tp):
                _emit(note)
        if cost.stage_recompute is not None:
            sr = cost.stage_recompute
            _emit(f"  with per-stage recompute: parts {sr.parts}, step {sr.step_s:.3f} s against "
                  f"{cost.step_s:.3f} s ({cost.step_s / sr.step_s:.2f}x), peak {sr.peak_memory_bytes / 2**30:.1f} GiB; "
                  + "; ".join(describe(sr.layer_recompute, sr.parts))
                  + (" (emitted)" if args.emit_ds_config and sr is emitted else ""))
        if any(b.mamba is not None for b in as_description(cfg).blocks):  # Megatron-core's MambaModel
            from ..plan.render import megatron_hybrid_split

            split, why = megatron_hybrid_split(cost)
            _emit(f"  Megatron-core (hybrid model): {split} ({why})" if split else
                  f"  Megatron-core (hybrid model): none ({why})")
            continue
        _emit(f"  Megatron pipeline_model_parallel_layout: {text!r} ({why})" if text else
              f"  Megatron pipeline_model_parallel_layout: none ({why})")
    if args.only:
        from ..plan.groups import collectives_of
        from ..plan.published import beside, matching

        _emit(f"  collectives ({model.device.cluster.name}, NCCL {model.device.cluster.nccl_version}'s model), "
              f"each at a representative size:")
        for what, _axis, place, one in collectives_of(model, res.top[0].layout):
            _emit(f"    {what:36s} {place.describe():36s} {one.describe()}, {one.time_s * 1e3:.3f} ms")

        lay = res.top[0].layout
        for run in matching(cfg.name, d.name, args.gpus, lay, model.seq, model.global_batch):
            _emit("\n".join(beside(run, res.top[0], d.matrix_flops[model.dtype])))
    if best is None and args.runtime != "megatron":
        _emit("no layout DeepSpeed runs (1F1B, GPipe, DualPipeV or no pipeline) fits: the plan has simulated "
              "alternatives only")
    elif args.emit_ds_config:
        _emit(f"wrote {args.emit_ds_config}: deepspeed --num_gpus {best.layout.world_size} train.py "
              f"--deepspeed_config {args.emit_ds_config}")
    if other is not None and other.top:
        mine, theirs = res.top[0], other.top[0]
        _emit("\nthe same cluster under Megatron-LM's runtime (its 1F1B and interleaving, DP reduction overlapped, "
              f"distributed optimizer; kernels as they run {other_model.execution}):")
        _emit(render_table(other, memory_cap=model.memory_cap))
        _emit(f"pick under megatron: {theirs.layout.name}, step {theirs.step_s:.3f} s; under deepspeed: "
              f"{mine.layout.name}, step {mine.step_s:.3f} s ({mine.step_s / theirs.step_s:.2f}x Megatron's)")
    _emit(f"planned in {seconds:.2f} s")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the fastest PP x TP x DP x ZeRO x micro-batch x recompute layout (no launch)")
    add_model_argument(p)
    p.add_argument("--gpus", type=int, required=True, help="GPUs (or CPU ranks) in the cluster")
    p.add_argument("--device", default="a100", help="a100 | a100-40gb | h100 | h200 | cpu | SPEC.toml")
    p.add_argument("--profile-layers", action="store_true",
                   help="cpu only: fit the spec's GEMM efficiency to this model's layers profiled here (cached)")
    from ..plan.machine import add_cluster_arguments

    add_cluster_arguments(p)
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (default: --gpus)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default bf16 (cpu: fp32)")
    add_execution_argument(p)
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    p.add_argument("--only", default=None, help='evaluate one layout: "pp=8,tp=8,dp=16,mb=1,recompute=full,sp=on,'
                                                 'zero=1,schedule=1f1b" (interleaved:3, zb-h1: simulated only)')
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="the share of a device's memory a rank may use (the rest: CUDA context, NCCL buffers, "
                        "fragmentation); the search prunes by it, --only marks a peak above it")
    p.add_argument("--expert-imbalance", type=expert_imbalance, default=None, metavar="X|RUN_DIR",
                   help=EXPERT_IMBALANCE_HELP)
    p.add_argument("--runtime", default="deepspeed", choices=["deepspeed", "megatron", "both"],
                   help="whose runtime runs the layouts: DeepSpeed's engines (default: what train.py runs), "
                        "Megatron-LM's, or both side by side")
    p.add_argument("--json", action="store_true", help="print the layouts as JSON")
    p.add_argument("--emit-ds-config", default=None, metavar="FILE",
                   help="write the best layout DeepSpeed runs as a ds.json for train.py")
    p.set_defaults(func=cmd_plan)
