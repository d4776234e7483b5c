"""What the commands share: the result stream and the argument checks that mirror ds.json's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import Field

from ..config_model import ConfigModel, parse_section


class ShapeArgs(ConfigModel):
    """The shape arguments of ``partition`` and ``estimate``, checked like ds.json's keys."""

    micro_batch: int = Field(1, ge=1)
    micro_batches: int | None = Field(None, ge=1)
    seq: int | None = Field(None, ge=1)
    tp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)


MODEL_HELP = "a name in model_configs/ (tiny, bench-cpu, gpt3-1.3b, llama3-8b, ...) or a .toml path"


def add_model_argument(parser) -> None:
    """Every command's ``--model``: one name, one help."""
    parser.add_argument("--model", required=True, help=MODEL_HELP)


EXECUTION_HELP = ("GPU specs: how the layers run: eager (train.py's default), compiled (train.compile), megatron "
                  "(Megatron-LM's fused kernels, the weight gradients accumulated inside the GEMMs), megatron-2021 "
                  "(the same kernels, accumulated by a pass of their own). Default: eager; megatron under "
                  "--runtime megatron")


def add_execution_argument(parser) -> None:
    """``--execution`` of the commands that price layers on a GPU spec (plan, estimate, simulate)."""
    from ..costs.gpu_pricing import EXECUTIONS

    parser.add_argument("--execution", default=None, choices=EXECUTIONS, help=EXECUTION_HELP)


def execution_of(args, runtime: str | None = None) -> str:
    """How the layers run on a GPU (``EstimateRequest.execution``): as --execution says; else Megatron's kernels
    under Megatron's runtime, eager under DeepSpeed's."""
    given = getattr(args, "execution", None)
    if given:
        return given
    return "megatron" if (runtime or getattr(args, "runtime", None)) == "megatron" else "eager"


_stdout = sys.stdout


def set_result_stream(stream) -> None:
    """Where ``emit`` writes: ``main`` sends everything else a command prints to standard error."""
    global _stdout
    _stdout = stream


def emit(*args, **kwargs) -> None:
    """The command's result, on standard output; everything else a command prints (DeepSpeed's
    start-up warnings, progress) goes to standard error, so ``--json`` output stays parseable."""
    print(*args, file=_stdout, **kwargs)


EXPERT_IMBALANCE_HELP = ("Mixture-of-Experts, dropless: the busiest expert's load over the mean (>= 1), or an "
                         "instrumented run directory to read it from (default: what a uniformly random router "
                         "gives over the EP group, e.g. 1.25 for 256 experts, top 8, 4,096 tokens)")


def expert_imbalance(value: str) -> float:
    """``--expert-imbalance``: a number >= 1, or an instrumented Mixture-of-Experts run directory whose
    measured imbalance it reads (``instrument.report.measured_expert_imbalance``)."""
    import argparse

    try:
        factor = float(value)
    except ValueError:
        if not Path(value).is_dir():
            raise argparse.ArgumentTypeError(f"{value!r} is neither a number >= 1 nor a run directory")
        from ..instrument.report import measured_expert_imbalance

        try:
            return measured_expert_imbalance(value)
        except (OSError, ValueError, KeyError) as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    if not factor >= 1:
        raise argparse.ArgumentTypeError(f"{value}: the busiest expert's load over the mean is at least 1")
    return factor


def check_shape(args) -> ShapeArgs:
    return parse_section(ShapeArgs, {k: getattr(args, k) for k in ShapeArgs.model_fields if hasattr(args, k)}, "")


def launch_model(args) -> str:
    """``--model`` of a command that launches train.py: a .toml path made absolute (each launch runs in
    its own directory), else a name in model_configs/."""
    return str(Path(args.model).resolve()) if Path(args.model).suffix else args.model


def check_launch_steps(args) -> None:
    if args.steps < 2:
        raise ValueError(f"--steps {args.steps}: use at least 2 (the first step pays for warm-up and is not timed)")
