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
from pathlib import Path

from pydantic import Field

from .config_model import ConfigError, ConfigModel, parse_section
from .partition import PartitionError


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


def launch_model(args) -> str:
    """``--model`` of a command that launches train.py: a .toml path made absolute (each launch runs in
    its own directory), else a name in model_configs/."""
    return str(Path(args.model).resolve()) if Path(args.model).suffix else args.model


def check_launch_steps(args) -> None:
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: use at least 2 (the first step pays for warm-up and is not timed)")


def build_parser() -> argparse.ArgumentParser:
    """Each command lives beside what it drives and adds its own sub-parser."""
    from .compare.command import add_parser as add_compare
    from .costs.command import add_parser as add_estimate
    from .instrument.command import add_parser as add_instrument
    from .partition.command import add_parser as add_partition
    from .plan.command import add_parser as add_plan
    from .simulate.command import add_parser as add_simulate
    from .sweep.command import add_parser as add_sweep

    ap = argparse.ArgumentParser(prog="ds-pipe-ext", description="Cost-aware pipeline partitioning for DeepSpeed")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (add_partition, add_estimate, add_compare, add_sweep, add_instrument, add_simulate, add_plan):
        add(sub)
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
