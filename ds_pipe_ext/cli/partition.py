"""`ds-pipe-ext partition`: profile a model's layers on this machine and print the per-stage plan.

    ds-pipe-ext partition --model bench-cpu --stages 2 --micro-batch 4 [--method profiled] [--json]
"""

from __future__ import annotations

from .common import ShapeArgs, add_model_argument, check_shape, emit
from ..config_model import parse_section
from ..pipe.config import PipelineSettings


def pipeline_settings(args) -> PipelineSettings:
    """The command line's pipeline options as the "pipeline" section of ds.json would give them."""
    return parse_section(PipelineSettings, {
        "stages": args.stages, "partition_method": args.method, "memory_cap_gib": args.memory_cap_gib,
        "link_bandwidth_gbs": args.link_bandwidth_gbs,
        "profile": {"warmup": args.warmup, "repeats": args.repeats, "cache_dir": args.cache_dir,
                    "progress": not args.json}}, "")


def _profiled_costs(args, shape: ShapeArgs, settings: PipelineSettings):
    """Profile the model's layers on this machine (cached like training does)."""
    from ..models import family_of, load_model

    cfg = load_model(args.model, seq_len=shape.seq)
    return family_of(cfg).profile(cfg, shape.micro_batch, settings.profile)


def cmd_partition(args) -> int:
    from ..partition.methods import decide_offline
    from ..partition.report import build_plan

    shape, settings = check_shape(args), pipeline_settings(args)  # before any profiling
    costs = _profiled_costs(args, shape, settings)
    micro_batches = shape.micro_batches or args.stages
    bandwidth = settings.link_bandwidth
    parts = decide_offline(args.method, costs, args.stages, micro_batches=micro_batches,
                           memory_cap_gib=settings.memory_cap_gib, link_bandwidth=bandwidth)
    plan = build_plan(args.method, parts, costs, micro_batches=micro_batches, link_bandwidth=bandwidth)
    emit(plan.to_json() if args.json else plan.to_table())
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("partition", help="profile a model's layers and print the per-stage plan")
    add_model_argument(p)
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
