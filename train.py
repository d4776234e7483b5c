"""Train a GPT with DeepSpeed: pipeline-parallel (ds_pipe_ext partitioning) or plain data parallel (ZeRO).

    deepspeed --num_gpus 4 train.py --deepspeed_config ds.json

ds.json holds DeepSpeed's usual keys, the plugin's settings in its "pipeline"
section (see ds_pipe_ext/pipe/config.py), and this script's own "train" section:

    "train": {"model": "tiny", "steps": 10, "seed": 1234}

With a "pipeline" section the model runs as a ds_pipe_ext.PipelineModule;
without one it runs as one data-parallel module, e.g. under ZeRO-3
(launch_scripts/ds_zero3.json).  Tokens are synthetic by default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ds_pipe_ext.models.config import load_model_config
from ds_pipe_ext.models.gpt import LOCAL, SequentialGPT, gpt_layer_specs, lm_loss
from ds_pipe_ext.pipe.config import ConfigError, InstrumentSettings, PipelineSettings

TRAIN_KEYS = {"model", "steps", "seed", "lr"}
TP_KEYS = {"size", "sequence_parallel"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspeed_config", required=True, help="ds.json")
    ap.add_argument("--steps", type=int, default=None, help="stop after N optimizer steps (default: train.steps or 10)")
    ap.add_argument("--model", default=None, help="override train.model (a name in model_configs/ or a .toml path)")
    ap.add_argument("--partition-method", default=None, help="override pipeline.partition_method")
    ap.add_argument("--instrument", nargs="?", const="runs/latest", default=None, metavar="RUN_DIR",
                    help="record per-stage time and memory into RUN_DIR (default runs/latest); "
                         "same as pipeline.instrument in ds.json")
    ap.add_argument("--refine-from", default=None, metavar="RUN_DIR",
                    help="correct profiled costs with the stage times measured in RUN_DIR (pipeline.refine_from)")
    ap.add_argument("--init-from", default=None, metavar="FILE",
                    help="start from a single-process model's full state dict (torch.save of SequentialGPT), "
                         "sliced for this rank's stage and TP shard (parity checks)")
    ap.add_argument("--save", default=None, metavar="DIR", help="save a checkpoint here after the last step")
    ap.add_argument("--load", default=None, metavar="DIR",
                    help="resume from a checkpoint (written under any partition with the same TP degree)")
    ap.add_argument("--metrics-out", default=None,
                    help="rank 0 writes a JSON summary here; every rank also writes NAME.rankR.json beside it")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return ap.parse_args(argv)


def load_ds_config(path: str) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed_config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--deepspeed_config {path}: expected a JSON object")
    train = cfg.get("train", {})
    if not isinstance(train, dict) or set(train) - TRAIN_KEYS:
        raise ConfigError(f'"train" in {path} must be an object with keys among {sorted(TRAIN_KEYS)}')
    return cfg


def synthetic_batches(vocab: int, micro_batch: int, seq: int, seed: int):
    """Endless (inputs, labels) micro-batches of random tokens; labels are inputs shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_adamw(params, *, lr: float):
    """AdamW: apex's FusedAdam on CUDA when apex is importable (an optional accelerator), torch's otherwise."""
    if torch.cuda.is_available():
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(params, lr=lr, adam_w_mode=True)
        except ImportError:
            pass
    return torch.optim.AdamW(params, lr=lr, foreach=False)


def parallel_dims(ds_cfg: dict, settings, model_cfg):
    """PP x TP x DP from ds.json ("pipeline.stages", "tensor_parallel") and WORLD_SIZE; checked up front."""
    from ds_pipe_ext.parallel.topology import ParallelDims, TopologyError

    tp_cfg = ds_cfg.pop("tensor_parallel", {})
    if not isinstance(tp_cfg, dict) or set(tp_cfg) - TP_KEYS:
        raise ConfigError(f'"tensor_parallel" must be an object with keys among {sorted(TP_KEYS)}')
    tp, sp = int(tp_cfg.get("size", 1)), bool(tp_cfg.get("sequence_parallel", False))
    if settings is None:
        if tp > 1:
            raise ConfigError('"tensor_parallel" needs a "pipeline" section (PP x TP runs as a PipelineModule)')
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        dims = ParallelDims.from_world(world, pp=settings.stages, tp=tp, sp=sp)
        dims.check_model(model_cfg)
    except TopologyError as e:
        raise ConfigError(str(e)) from None
    return dims


def load_full_state(model, path: str, *, tp: int) -> None:
    """Copy a SequentialGPT state dict ("layers.<i>.…") into this stage's layers ("<i>.…"), TP-sliced."""
    full = {k.removeprefix("layers."): v for k, v in torch.load(path).items()}
    if tp > 1:
        from ds_pipe_ext.parallel.tensor_parallel import shard_like

        full = shard_like(full, model)
    missing = [k for k in model.state_dict() if k not in full and not k.endswith("_extra_state")]
    if missing:
        raise ConfigError(f"--init-from {path}: no weights for {missing[:3]}...; it must come from the same model")
    model.load_state_dict({k: full.get(k, v) for k, v in model.state_dict().items()})


def global_grad_norm(model, dims) -> float:
    """L2 norm of the whole model's gradient: TP shards summed, TP-replicated and DP-replicated copies once."""
    import torch.distributed as dist

    from ds_pipe_ext.compat.engine import coordinates

    tp_rank = coordinates(model).model
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
            total += p.grad.double().pow(2).sum()
    dist.all_reduce(total)
    return float((total / dims.dp).sqrt())


def start_instrumentation(engine, model, settings, micro_batches: int, rank: int):
    """Rank 0 writes what the partition predicts; every rank records its stage."""
    from ds_pipe_ext.instrument.hooks import instrument_engine
    from ds_pipe_ext.instrument.refine import load_run, measured_overheads
    from ds_pipe_ext.instrument.sink import RunSink

    run_dir = Path(settings.instrument.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        costs = model.layer_costs or model.compute_layer_costs("profiled")  # built-in methods: profile to predict
        predicted = {
            "method": settings.partition_method, "parts": list(model.parts), "micro_batches": micro_batches,
            "recompute": settings.activation_checkpoint_interval > 0,
            "link_bandwidth": settings.link_bandwidth_gbps * 1e9 if settings.link_bandwidth_gbps else None,
            "layer_costs": [c.to_dict() for c in costs],
            "refined_from": settings.refine_from,
            "overheads": measured_overheads(load_run(settings.refine_from)) if settings.refine_from else None,
        }
        (run_dir / "predicted.json").write_text(json.dumps(predicted, indent=1))
    sink = RunSink(run_dir, rank, every=settings.instrument.every, monitor=getattr(engine, "monitor", None))
    instrument_engine(engine, sink.emit)
    return sink


def main(argv=None, on_engine=None) -> dict:
    """Train; ``on_engine(engine, data_iter)``, if given, runs before the training loop (benches)."""
    args = parse_args(argv)
    ds_cfg = load_ds_config(args.deepspeed_config)
    train = ds_cfg.pop("train", {})
    pipelined = "pipeline" in ds_cfg
    if args.partition_method:
        ds_cfg.setdefault("pipeline", {})["partition_method"] = args.partition_method
    settings = PipelineSettings.from_ds_config(ds_cfg) if pipelined else None
    if (args.load or args.save) and not pipelined:
        raise ConfigError("--load/--save handle pipeline checkpoints: use a ds.json with a \"pipeline\" section")
    if args.instrument or args.refine_from:
        if not pipelined:
            raise ConfigError("--instrument/--refine-from measure pipeline stages: use a ds.json with a \"pipeline\" section")
        if args.instrument:
            settings = replace(settings, instrument=InstrumentSettings(True, args.instrument, settings.instrument.every))
        if args.refine_from:
            settings = replace(settings, refine_from=args.refine_from)
    model_cfg = load_model_config(args.model or train.get("model", "tiny"))
    steps = args.steps if args.steps is not None else int(train.get("steps", 10))
    seed = int(train.get("seed", 1234))
    dims = parallel_dims(ds_cfg, settings, model_cfg)  # validated before any process group exists
    if dims is not None and dims.sp:
        # DeepSpeed's pipe/grad partitioning splits each boundary tensor across the TP group and
        # re-gathers it, assuming TP ranks hold the same activation; under SP each holds its own
        # sequence shard, so the shards must travel whole.
        ds_cfg["pipeline"].update(pipe_partitioned=False, grad_partitioned=False)

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()  # CPU only: no C++ JIT build (and no stale build locks) at start-up
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(seed)  # same initial weights on every rank

    micro_batch = int(ds_cfg.get("train_micro_batch_size_per_gpu", 1))
    gas = int(ds_cfg.get("gradient_accumulation_steps", 1))
    impl, loss_fn, topology = LOCAL, lm_loss, None
    if dims is not None and dims.tp > 1:
        from ds_pipe_ext.models.gpt import loss_fn_for
        from ds_pipe_ext.parallel import topology as topo
        from ds_pipe_ext.parallel.tensor_parallel import megatron_layer_impl

        topology = topo.initialize(dims, world)  # megatron's groups, laid out as DeepSpeed's
        impl = megatron_layer_impl(tp=dims.tp, sequence_parallel=dims.sp)
        loss_fn = loss_fn_for(impl)
    specs = gpt_layer_specs(model_cfg, impl)
    if pipelined:
        from ds_pipe_ext.compat.engine import data_parallel_rank
        from ds_pipe_ext.models.gpt_costs import gpt_cost_model
        from ds_pipe_ext.pipe.module import PipelineModule

        if world % settings.stages:
            raise ConfigError(f"pipeline.stages={settings.stages} does not divide the world size {world}")
        dp = dims.dp
        profile_batch = next(synthetic_batches(model_cfg.vocab_size, micro_batch, model_cfg.seq_len, seed=0))
        model = PipelineModule(
            specs,
            num_stages=None if topology is not None else settings.stages,
            topology=topology,
            loss_fn=loss_fn,
            settings=settings,
            profile_batch=profile_batch,
            micro_batches=gas,
            cost_key={"model": model_cfg.to_dict()},
            cost_model=gpt_cost_model(model_cfg, impl),
            seed_layers=True,  # layer i starts from seed + i: the same weights under any partition
            base_seed=seed,
        )
        stage_id = model.stage_id
        dp_rank = data_parallel_rank(model)
        if args.init_from:
            load_full_state(model, args.init_from, tp=dims.tp)
    else:
        model = SequentialGPT(specs, base_seed=seed)
        dp, stage_id, dp_rank = world, 0, rank

    optimizer = None
    if "optimizer" not in ds_cfg:
        optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], lr=float(train.get("lr", 3e-4)))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg,
                                      model_parameters=None if optimizer else model.parameters())
    device = get_accelerator().device_name(engine.local_rank)
    sink = None
    if pipelined and settings.instrument.enabled:
        sink = start_instrumentation(engine, model, settings, gas, rank)
    data = synthetic_batches(model_cfg.vocab_size, micro_batch, model_cfg.seq_len, seed=seed + 1000 + dp_rank)
    start_step = 0
    if args.load:
        from ds_pipe_ext.pipe import checkpoint

        start_step = checkpoint.load(engine, args.load)
        for _ in range(start_step * gas):  # the data stream continues where the checkpoint left it
            next(data)
    grad_norms: list[float] = []
    if pipelined:
        from ds_pipe_ext.compat.optimizer import unwrap_optimizer

        unwrap_optimizer(engine.optimizer).register_step_pre_hook(lambda *_: grad_norms.append(global_grad_norm(model, dims)))
    if on_engine is not None:
        on_engine(engine, data)

    step_times, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        if pipelined:
            loss = engine.train_batch(data_iter=data)
        else:
            micro_losses = []
            for _ in range(gas):
                inputs, labels = next(data)
                micro_loss = engine(inputs.to(device), labels.to(device))
                engine.backward(micro_loss)
                engine.step()
                micro_losses.append(micro_loss.detach())
            loss = torch.stack(micro_losses).mean()  # what the pipeline engine reports: the mean over micro-batches
        step_times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if rank == 0:
            print(json.dumps({"step": start_step + step + 1, "loss": round(losses[-1], 6),
                              "step_s": round(step_times[-1], 4)}), flush=True)
    if args.save:
        from ds_pipe_ext.pipe import checkpoint

        checkpoint.save(engine, args.save, step=start_step + steps)

    if sink is not None:
        sink.gather()  # collective: rank 0 writes RUN_DIR/summary.json
        sink.close()
    # the first step pays for warm-up (allocations, caches); leave it out when we can
    timed = (step_times[1:] if len(step_times) > 1 else step_times) or [float("nan")]
    global_batch = micro_batch * gas * dp
    summary = {
        "mode": "pipeline" if pipelined else f"data-parallel zero={ds_cfg.get('zero_optimization', {}).get('stage', 0)}",
        "model": model_cfg.name,
        "world_size": world,
        "stages": settings.stages if pipelined else 1,
        "partition_method": settings.partition_method if pipelined else None,
        "parts": list(model.parts) if pipelined else None,
        "stage_id": stage_id,
        "steps": steps,
        "losses": losses,
        "step_s_median": statistics.median(timed),
        "samples_per_s": global_batch / statistics.median(timed),
        "global_batch": global_batch,
        "grad_norms": grad_norms,
        "tensor_parallel": dims.tp if dims else 1,
        "sequence_parallel": dims.sp if dims else False,
    }
    if pipelined:
        from ds_pipe_ext.compat.engine import local_layer_range

        summary["local_layers"] = list(local_layer_range(model))
    if args.metrics_out:  # every rank: what it built, so tests can check all ranks agree
        out = Path(args.metrics_out)
        out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps({**summary, "rank": rank}, indent=2))
    if rank == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)
        if args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(summary, indent=2))
    # Leave together: a rank that exits while others still talk to it aborts them
    # ("terminate called without an active exception" from gloo threads).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    from ds_pipe_ext.models.config import ModelConfigError
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.pipe.module import PartitionDecisionError

    try:
        main()
    except (ConfigError, ModelConfigError, PartitionError, PartitionDecisionError) as e:
        # the same message on every rank, then a clean non-zero exit (no hang, no traceback)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
