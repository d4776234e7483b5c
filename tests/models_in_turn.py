"""Launched by tests: train.py's own build and loop for several models in turn, in one launch.

    deepspeed --num_gpus 4 tests/models_in_turn.py --deepspeed_config DS --metrics-out OUT/metrics.json \
        --steps 3 --run tiny=INIT.pt --run llama-tiny=INIT2.pt

Each ``--run MODEL=INIT`` is ``train.py --model MODEL --init-from INIT`` on the same ds.json; a
``--run "NAME: ARGS"`` is train.py with ARGS (their own ``--deepspeed_config`` and ``--steps`` win), and a
run whose configuration or checkpoint is refused records {"error": the message} and the launch goes on
(a refusal is decided on rank 0 and raised on every rank, so they stay in step).  megatron's
groups are torn down between runs, and DeepSpeed's forgotten (each build makes them again).  Every rank writes
OUT/metrics.rankR.json: {"rank": R, "runs": {NAME: train.py's summary}}.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402


def fresh_build(argv: list[str]):
    """train.py's build for ``argv``, after the previous run's megatron groups are torn down and DeepSpeed's
    forgotten (each build makes them again)."""
    from megatron.core import parallel_state

    from ds_pipe_ext.compat.engine import forget_deepspeed_groups
    from ds_pipe_ext.train.build import build

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    forget_deepspeed_groups()
    return build(train.run_config(train.parse_args(argv)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--steps", default="3")
    ap.add_argument("--run", action="append", required=True, metavar="MODEL=INIT")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()

    from ds_pipe_ext.train.trainer import Trainer

    from ds_pipe_ext.config_model import ConfigError
    from ds_pipe_ext.pipe.decide import DecisionError
    from ds_pipe_ext.train.checkpoint import CheckpointError

    runs, rank = {}, int(os.environ.get("RANK", 0))
    for run in args.run:
        if ": " in run:
            name, rest = run.split(": ", 1)
            argv = ["--deepspeed_config", args.deepspeed_config, "--steps", args.steps, *rest.split()]
        else:
            name, init = run.split("=", 1)
            argv = ["--deepspeed_config", args.deepspeed_config, "--steps", args.steps, "--model", name,
                    "--init-from", init]
        try:
            built = fresh_build(argv)
            runs[name] = Trainer(built).run()
        except (ConfigError, CheckpointError, DecisionError) as e:
            runs[name] = {"error": str(e)}
            continue
        del built
    out = Path(args.metrics_out)
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps({"rank": rank, "runs": runs}))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
