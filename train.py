"""Train a GPT with DeepSpeed: pipeline-parallel (ds_pipe_ext partitioning) or plain data parallel (ZeRO).

    deepspeed --num_gpus 4 train.py --deepspeed_config ds.json

ds.json holds DeepSpeed's usual keys and three sections of ours, validated before
any process group starts (ds_pipe_ext/train/config.py):

    "train":           {"model": "tiny", "steps": 10, "seed": 1234, "data": null, "save_interval": 0, ...}
    "tensor_parallel": {"size": 2, "sequence_parallel": true}
    "pipeline":        {"stages": 2, "partition_method": "profiled", ...}   (absent: data parallel, e.g. ZeRO-3)

Tokens are synthetic unless "train.data" names a Megatron indexed dataset.  The
trainer itself lives in ds_pipe_ext/train/: build, one step function, the loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ds_pipe_ext.config_model import ConfigError
from ds_pipe_ext.train.config import RunConfig, build_run_config, read_ds_json

ERROR_GRACE_S = 3.0  # seconds a failing rank waits before exiting: the launcher's poll is 1 s
OOM_EXIT = 3  # out of memory, or stopped at train.memory_cap_gib: a result (an `oom` row), not a success


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspeed_config", required=True, help="ds.json")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    ap.add_argument("--model", default=None, help="train.model: a name in model_configs/, a .toml, or a HF GPT-2 config.json")
    ap.add_argument("--partition-method", default=None, help="pipeline.partition_method")
    ap.add_argument("--instrument", nargs="?", const="runs/latest", default=None, metavar="RUN_DIR",
                    help="record per-rank time and memory into RUN_DIR (pipeline.instrument, or "
                         "the top-level instrument section of a data-parallel run)")
    ap.add_argument("--refine-from", default=None, metavar="RUN_DIR", help="pipeline.refine_from")
    ap.add_argument("--step-model", default=None, metavar="FILE",
                    help="pipeline.step_model: a fitted step model (ds-pipe-ext step-model fit) for profiled/analytic")
    ap.add_argument("--init-from", default=None, metavar="FILE",
                    help="start from a single-process model's state dict (torch.save of SequentialGPT)")
    ap.add_argument("--save", default=None, metavar="DIR", help="checkpoints: every train.save_interval steps and at the end")
    ap.add_argument("--load", default=None, metavar="DIR", help="resume from DIR's latest complete checkpoint "
                    "(on this layout, or another DP size or pipeline split: docs/CONFIG.md)")
    ap.add_argument("--trust-checkpoint", action="store_true",
                    help="--load unpickles whatever the files hold (default: tensors and DeepSpeed's records only)")
    ap.add_argument("--metrics-out", default=None, help="rank 0 writes a JSON summary here, each rank NAME.rankR.json")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return ap.parse_args(argv)


def run_config(args: argparse.Namespace) -> RunConfig:
    """ds.json with the command line's overrides, through the same validation."""
    ds = read_ds_json(args.deepspeed_config)
    pipeline = {"partition_method": args.partition_method, "refine_from": args.refine_from,
                "step_model": args.step_model}
    instrument = {"enabled": True, "run_dir": args.instrument} if args.instrument else None
    return build_run_config(ds, train={"steps": args.steps, "model": args.model}, pipeline=pipeline,
                            instrument=instrument,
                            options={"init_from": args.init_from, "save": args.save, "load": args.load,
                                     "trust_checkpoint": args.trust_checkpoint,
                                     "metrics_out": args.metrics_out})


def main(argv=None, on_engine=None) -> dict:
    """Train; ``on_engine(engine, data)``, if given, runs before the training loop (benches)."""
    from ds_pipe_ext.train.build import build
    from ds_pipe_ext.train.trainer import Trainer, leave_together, write_metrics

    cfg = run_config(parse_args(argv))  # validated before any process group exists
    built = build(cfg)
    if on_engine is not None:
        on_engine(built.engine, built.data)
    summary = Trainer(built).run()
    write_metrics(summary, built.rank, cfg.options.metrics_out)
    leave_together()
    return summary


if __name__ == "__main__":
    import torch

    from ds_pipe_ext.models.config import ModelConfigError
    from ds_pipe_ext.partition import PartitionError
    from ds_pipe_ext.pipe.decide import DecisionError
    from ds_pipe_ext.train.checkpoint import CheckpointError

    from ds_pipe_ext.train.trainer import exit_process, write_metrics

    try:
        summary = main()
    except torch.OutOfMemoryError as e:
        # a result, as the memory cap's stop is: exit 3 at once, and the launcher ends the other ranks
        # (which may wait in a collective this rank will not join)
        rank = int(os.environ.get("RANK", 0))
        error = str(e).splitlines()[0]
        print(f"error: out of memory on rank {rank}: {error} - lower train_micro_batch_size_per_gpu, recompute "
              f"(train.recompute), more stages, or a higher ZeRO stage", file=sys.stderr, flush=True)
        # the record an `oom` row reads; its time lets a caller measure how fast every process is gone
        write_metrics({"status": "oom", "oom": {"rank": rank, "measure": "CUDA out-of-memory error", "error": error,
                                                "at_unix": time.time()}},
                      rank, parse_args().metrics_out)
        exit_process(OOM_EXIT)
    except (ConfigError, ModelConfigError, PartitionError, DecisionError, CheckpointError) as e:
        # the same message on every rank, then a clean non-zero exit (no hang, no traceback)
        print(f"error: {e}", file=sys.stderr, flush=True)
        # DeepSpeed's launcher kills every rank once one exits non-zero (it polls each second): a rank
        # that reached the same error a moment later would die before saying so.  Stay a little.
        time.sleep(ERROR_GRACE_S)
        exit_process(2)
    exit_process(OOM_EXIT if summary.get("status") == "oom" else 0)
