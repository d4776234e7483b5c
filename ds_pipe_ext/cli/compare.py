"""`ds-pipe-ext compare`: pipeline (profiled, uniform) against ZeRO-1/2/3, real launches, one table.

    ds-pipe-ext compare --model tiny --world 4 [--global-batch G] [--micro-batch B] [--memory-cap-gib X] [--json]
"""

from __future__ import annotations

import sys

from .common import add_model_argument, check_launch_steps, check_shape, emit, launch_model


def comparison_configs_for(args, micro_batch: int):
    """The layouts `compare` launches (and `estimate --compare` costs) for these arguments."""
    from ..arch import as_description
    from ..compare.configs import comparison_configs
    from ..models import load_model

    global_batch = args.global_batch or 2 * args.world // args.tp * micro_batch
    return comparison_configs(args.world, global_batch=global_batch, micro_batch=micro_batch, tp=args.tp,
                              patterns=args.configs, experts=as_description(load_model(args.model)).experts)


def cmd_compare(args) -> int:
    import os
    from pathlib import Path

    import torch

    from ..compare import render
    from ..compare.run import Comparison, DeepSpeedLauncher, run_comparison
    from ..compare.predict import model_shape
    from ..models import load_model

    check_shape(args)
    model = launch_model(args)
    model_cfg = load_model(model)
    configs = comparison_configs_for(args, args.micro_batch)
    check_launch_steps(args)
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
         f"(samples/s: median of steps 2..{args.steps - 1 if args.steps >= 3 else 2}{f'; step {args.steps} traced for the memory peak' if args.steps >= 3 else ', no peak traced: use --steps 3 or more'})")
    emit(render.render_rows(rows))
    for line in render.notes(rows, world=args.world, cores=os.cpu_count(), cpu_only=cpu_only,
                             compact_malloc=args.compact_malloc):
        emit(f"  - {line}")
    emit(f"wrote {out / 'rows.json'} and {png}")
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="pipeline (profiled, uniform) against ZeRO-1/2/3: real launches, one table")
    add_model_argument(c)
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
