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

from ..config_model import ConfigError
from ..partition import PartitionError
from . import common


def build_parser() -> argparse.ArgumentParser:
    """One module per command, each adding its own sub-parser."""
    from . import compare, estimate, partition, plan, report, simulate, sweep

    ap = argparse.ArgumentParser(prog="ds-pipe-ext", description="Cost-aware pipeline partitioning for DeepSpeed")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in (partition, estimate, compare, sweep, report, simulate, plan):
        command.add_parser(sub)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    common.set_result_stream(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger binds to stdout when imported
            from ..pipe import schedules  # noqa: F401 - hands the step model DeepSpeed's order (deepspeed runtime)

            return args.func(args)
    except (PartitionError, ConfigError, ValueError) as e:
        print(f"ds-pipe-ext: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
