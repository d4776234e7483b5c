"""`ds-pipe-ext simulate`: one training step of a model under a schedule and a network, simulated.

    ds-pipe-ext simulate --model gpt3-small --stages 3 --micro-batches 16 --schedule gpipe \\
        --latency-ms 5 --bandwidth-gbs 0.25 [--costs analytic|profiled|RUN_DIR] [--png FILE]
    ds-pipe-ext simulate --model gpt3-small --stages 3 --grid      # seed-004's table

Costs: ``analytic`` (the one cost model of a layout, ``plan.model.PlanModel``, on ``--device``:
the step `plan --only` predicts for this pipeline, on the flags' links), ``profiled`` (every layer
measured here, cached) or a run directory of an instrumented launch (its measured per-stage times
and optimizer step, at the run's stages and micro-batch size).  The layers are split by
``--method`` (default: the split a run with that partition method chooses) into stages, or into
chunks for interleaved and DualPipeV.  Bandwidth is in GB/s (gigabytes).  Interleaved and ZB-H1 are
simulated only: DeepSpeed has no engine for them.  The step is ``StepModel.predict``'s, the one
prediction every command makes, in ``--runtime``'s order: DeepSpeed's engine order of 1F1B and
GPipe (its transfers block where the engine places them), or the schedule's own with eager
transfers (``megatron``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..layout import RUNTIMES
from ..simulate.events import Link, Network, StepSimulation
from ..simulate.render import text_timeline, write_gantt
from ..simulate.schedules import SCHEDULES, SIMULATED_ONLY, parse_schedule
from ..simulate.step_model import StepModel
from .common import add_execution_argument, add_model_argument, execution_of

# seed 004's four settings (delay, Gb/s) in GB/s: default ~0.1 ms / 10 Gb/s, 1 ms / 5, 5 ms / 2, 10 ms / 1
SEED_NETWORKS = ((0.1, 1.25), (1.0, 0.625), (5.0, 0.25), (10.0, 0.125))


@dataclass(frozen=True)
class SimulatedStep:
    schedule: str
    micro_batch: int
    micro_batches: int
    parts: list
    latency_ms: float
    bandwidth_gbs: float | None
    runtime: str
    sim: StepSimulation

    def to_dict(self) -> dict:
        s = self.sim
        return {"schedule": self.schedule, "simulated_only": self.schedule in SIMULATED_ONLY,
                "runtime": self.runtime,
                "micro_batch": self.micro_batch, "micro_batches": self.micro_batches, "parts": self.parts,
                "latency_ms": self.latency_ms, "bandwidth_gbs": self.bandwidth_gbs, "step_ms": 1e3 * s.step_s,
                "bubble_fraction": s.bubble_fraction, "rank_busy_ms": [1e3 * b for b in s.stage_busy_s],
                "rank_held_peak_micro_batches": s.held_peak,
                "rank_held_peak_bytes": s.held_peak_bytes}


def network_for(latency_ms: float, bandwidth_gbs: float | None, ranks_per_node: int) -> Network:
    """The flags' link between nodes; inside a node of ``ranks_per_node`` ranks transfers are free."""
    link = Link(latency_ms / 1e3, bandwidth_gbs * 1e9 if bandwidth_gbs else None)
    if ranks_per_node <= 1:
        return Network(link)
    return Network(Link(), inter=link, ranks_per_node=ranks_per_node)


class LayerSource:
    """Layer costs of one model from one source, split and simulated at any micro-batch size."""

    def __init__(self, args):
        from ..models import load_model

        self.args = args
        self.cfg = load_model(args.model, **({"seq_len": args.seq} if args.seq else {}))
        self.run = None
        if args.costs not in ("analytic", "profiled"):
            self.run = _run_stage_costs(args.costs)
        self._layers = {}

    def layer_costs(self, micro_batch: int):
        """The profiled layers at this micro-batch size (cached)."""
        if micro_batch not in self._layers:
            args = self.args
            from ..costs.profiler import ProfileSettings
            from ..models import family_of

            settings = ProfileSettings(warmup=1, repeats=3, cache_dir=args.cache_dir, progress=False)
            self._layers[micro_batch] = family_of(self.cfg).profile(self.cfg, micro_batch, settings)
        return self._layers[micro_batch]

    def step(self, schedule: str, micro_batch: int, micro_batches: int, latency_ms: float,
             bandwidth_gbs: float | None) -> SimulatedStep:
        args = self.args
        network = network_for(latency_ms, bandwidth_gbs, args.ranks_per_node)
        # a bare "interleaved" takes --virtual-stages chunks a rank; "interleaved:V" says it itself
        spec = parse_schedule(f"interleaved:{args.virtual_stages}" if schedule == "interleaved" else schedule)
        chunks = args.stages * spec.chunks_per_rank
        sched = spec.for_chunks(chunks, micro_batches)
        if args.costs == "analytic":  # the one cost model of a layout, on the flags' network
            sim, parts = self._analytic_step(spec, micro_batch, micro_batches, network)
            return SimulatedStep(schedule, micro_batch, micro_batches, parts, latency_ms, bandwidth_gbs, args.runtime, sim)
        if self.run is not None:
            stages, update, parts = self._run_chunks(chunks)
        else:
            from ..costs.stage import stage_costs
            from ..partition.methods import decide_offline

            layers = self.layer_costs(micro_batch)
            method = args.method or args.costs
            parts = decide_offline(method, layers, chunks, micro_batches=micro_batches, schedule=spec.name,
                                   link_bandwidth=bandwidth_gbs * 1e9 if bandwidth_gbs else None)
            stages = stage_costs(layers, parts, micro_batches=micro_batches, schedule=spec.name)
            update = None
            if args.optimizer:
                from ..costs.hardware import adam_step_s, get_device

                device = get_device(args.device)
                update = [0.0] * sched.num_ranks
                for c, st in enumerate(stages):
                    update[sched.chunk_rank[c]] += adam_step_s(st.param_bytes / 4, device)  # profiled: fp32
        pred = StepModel().predict(stages, micro_batches, schedule=spec.name, runtime=args.runtime,
                                   network=network, update_s=update)
        return SimulatedStep(schedule, micro_batch, micro_batches, list(parts), latency_ms, bandwidth_gbs,
                             args.runtime, pred.simulation)

    def _analytic_step(self, spec, micro_batch: int, micro_batches: int, network: Network):
        """The step `plan --only` predicts for this pipeline (one data-parallel rank, ZeRO-0) with the
        flags' links: ``PlanModel.evaluate`` on the split an ``analytic`` run chooses (or ``--method``'s)."""
        from ..costs.hardware import get_device
        from ..layout import Layout, LayoutError
        from ..partition.methods import decide_offline
        from ..plan.model import PlanModel

        args = self.args
        try:
            lay = Layout(pp=args.stages, micro_batch=micro_batch, micro_batches=micro_batches, schedule=spec.name,
                         runtime=args.runtime)
        except LayoutError as e:
            raise ValueError(str(e)) from None
        from dataclasses import replace as _replace

        from ..plan.machine import cluster_from_args

        device = get_device(args.device, cache_dir=args.cache_dir)
        device = _replace(device, network=cluster_from_args(device, args))
        model = PlanModel.on_its_cluster(self.cfg, device, seq=self.cfg.seq_len, global_batch=lay.global_batch,
                                         dtype=args.dtype, network=network,
                                         execution=execution_of(args))
        if args.method in (None, "analytic"):
            parts = model.run_split(lay)
        else:
            costs = list(model.costs_of(lay))
            parts = decide_offline(args.method, costs, lay.num_chunks, micro_batches=micro_batches, schedule=spec.name,
                                   link_bandwidth=model.split_link(lay).bandwidth)
        cost = model.evaluate(lay, parts, check_memory=False, update=args.optimizer, timeline=True)
        return cost.simulation, list(cost.parts)

    def _run_chunks(self, chunks: int):
        run = self.run
        if chunks != len(run["forward_s"]):
            raise ValueError(f"--costs {self.args.costs}: the run has {len(run['forward_s'])} stages; simulate it "
                             f"with --stages {len(run['forward_s'])} and a one-chunk schedule (gpipe, 1f1b, zb-h1)")
        from ..costs.stage import measured_stages

        stages = measured_stages(run["parts"], run["forward_s"], run["backward_s"], run["output_bytes"])
        return stages, run["optimizer_s"], run["parts"]


def _run_stage_costs(run_dir: str) -> dict:
    """Measured per-stage times of an instrumented run (``ds-pipe-ext report``'s rows)."""
    from pathlib import Path

    from ..instrument.report import build_report

    if not Path(run_dir).is_dir():
        raise ValueError(f"--costs {run_dir!r}: use analytic, profiled or an instrumented run directory")
    rep = build_report(run_dir)
    rows, summary = rep["stages"], rep["summary"]
    return {"forward_s": [r["meas_forward_ms"] / 1e3 for r in rows],
            "backward_s": [r["meas_backward_ms"] / 1e3 for r in rows],
            "output_bytes": [r["boundary_out_bytes"] for r in rows],
            "optimizer_s": [r["meas_optimizer_ms"] / 1e3 for r in rows],
            "parts": summary["parts"], "micro_batches": summary["micro_batches"]}


def parse_networks(text: str | None) -> list[tuple[float, float]]:
    if not text:
        return list(SEED_NETWORKS)
    try:
        return [(float(a), float(b)) for a, b in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise ValueError(f"--networks {text!r}: give LATENCY_MS:BANDWIDTH_GBS pairs, e.g. 0.1:1.25,10:0.125") from None


def cmd_simulate(args) -> int:
    from .common import emit
    from ..partition.report import render_table

    parse_schedule(args.schedule)  # the one vocabulary; its error names the schedules it knows
    if args.stages < 1:
        raise ValueError(f"--stages {args.stages}: need at least 1")
    model = LayerSource(args)
    if args.grid:
        return _grid(args, model)
    default_m = model.run["micro_batches"] if model.run else args.stages
    m = args.micro_batches or (args.global_batch // args.micro_batch if args.global_batch else default_m)
    step = model.step(args.schedule, args.micro_batch, m, args.latency_ms, args.bandwidth_gbs)
    if args.json:
        emit(json.dumps({"model": model.cfg.name, "costs": args.costs, **step.to_dict()}, indent=1))
    else:
        sim = step.sim
        net = (f"{args.latency_ms} ms + {args.bandwidth_gbs} GB/s" if args.bandwidth_gbs else
               f"{args.latency_ms} ms, unlimited bandwidth")
        emit(f"{model.cfg.name}: {args.schedule} on {args.stages} ranks, {m} micro-batches of {args.micro_batch}, "
             f"parts {step.parts}, link {net}, {args.costs} costs, {args.runtime} runtime"
             + ("  [simulated only: DeepSpeed has no engine for it]" if args.schedule in SIMULATED_ONLY else ""))
        emit(f"step {1e3 * sim.step_s:.1f} ms, bubble {100 * sim.bubble_fraction:.1f}%")
        emit("\n".join(render_table(["rank", "busy ms", "idle %", "held (micro-batch chunks)", "held MiB"],
                                    [[str(r), f"{1e3 * b:.1f}", f"{100 * (1 - b / sim.step_s):.1f}",
                                      f"{sim.held_peak[r]:g}",
                                      f"{sim.held_peak_bytes[r] / 2**20:.1f}" if sim.held_peak_bytes else "-"]
                                     for r, b in enumerate(sim.stage_busy_s)])))
        emit("timeline (F forward, B backward, b input grad, w weight grad, o optimizer, . idle):")
        emit("\n".join(text_timeline(sim)))
    if args.png:
        out = write_gantt(step.sim, args.png, f"{model.cfg.name} {args.schedule} p={args.stages} m={m}")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _grid(args, model: LayerSource) -> int:
    """Seed 004's table: schedules x micro-batch sizes x network settings, at one global batch."""
    from .common import emit
    from ..partition.report import render_table

    sizes = [int(x) for x in args.micro_batch_sizes.split(",")]
    schedules = args.schedules.split(",")
    networks = parse_networks(args.networks)
    global_batch = args.global_batch or 64
    cells = []
    for schedule in schedules:
        for lat, bw in networks:
            for b in sizes:
                cells.append(model.step(schedule, b, global_batch // b, lat, bw))
    if args.json:
        emit(json.dumps({"model": model.cfg.name, "global_batch": global_batch, "costs": args.costs,
                         "cells": [c.to_dict() for c in cells]}, indent=1))
        return 0
    for schedule in schedules:
        emit(f"\n{model.cfg.name}, {args.stages} stages, {schedule}, global batch {global_batch}: simulated step (s)"
             + ("  [simulated only]" if schedule in SIMULATED_ONLY else ""))
        rows = []
        for lat, bw in networks:
            mine = [c for c in cells if c.schedule == schedule and c.latency_ms == lat and c.bandwidth_gbs == bw]
            rows.append([f"delay {lat:g} ms, {bw:g} GB/s"] + [f"{c.sim.step_s:.2f}" for c in mine])
        emit("\n".join(render_table(["network"] + [f"micro-batch {b}" for b in sizes], rows)))
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="one training step under a schedule and a network, simulated (no launch)")
    add_model_argument(s)
    s.add_argument("--stages", type=int, required=True, help="pipeline ranks")
    s.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step (default: global batch / micro-batch, else stages)")
    s.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch")
    s.add_argument("--global-batch", type=int, default=None, help="samples per step (--grid default 64, the seed's)")
    s.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    s.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    s.add_argument("--virtual-stages", type=int, default=2, help="interleaved: model chunks per rank")
    s.add_argument("--latency-ms", type=float, default=0.0, help="per transfer between ranks")
    s.add_argument("--bandwidth-gbs", type=float, default=None, help="GB/s between ranks (default: unlimited)")
    s.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks sharing a node: their transfers are free; the link flags apply between nodes")
    s.add_argument("--runtime", default="deepspeed", choices=RUNTIMES,
                   help="whose order of instructions: DeepSpeed's engine (1f1b, gpipe) or the schedule's own")
    s.add_argument("--costs", default="analytic", help="analytic | profiled | RUN_DIR (an instrumented run)")
    s.add_argument("--device", default="cpu", help="analytic costs: a100 | h100 | h200 | cpu (measured) ...")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    s.add_argument("--method", default=None,
                   help="partition method (default: the split a run with --costs as its method chooses)")
    s.add_argument("--no-optimizer", dest="optimizer", action="store_false",
                   help="leave out each rank's work after its last backward (collectives, DeepSpeed's passes, Adam)")
    s.add_argument("--cache-dir", default=".ds_pipe_ext_cache")
    s.add_argument("--grid", action="store_true", help="seed 004's table: schedules x micro-batch sizes x networks")
    s.add_argument("--schedules", default="gpipe,1f1b", help="--grid: schedules")
    s.add_argument("--micro-batch-sizes", default="1,2,4", help="--grid: micro-batch sizes")
    s.add_argument("--networks", default=None, help="--grid: LAT_MS:GBS pairs (default: seed 004's four, in GB/s)")
    s.add_argument("--png", default=None, metavar="FILE", help="a Gantt chart of the step")
    add_execution_argument(s)
    from ..plan.machine import add_cluster_arguments

    add_cluster_arguments(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_simulate)
