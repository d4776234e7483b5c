"""ZeRO's model-state bytes in 16-bit training: measured on 2 CPU ranks (bf16) against ``costs.zero``.

    python bench/zero_rules_16bit.py [--world 2]

`ds-pipe-ext compare` checks the allocation rules in fp32, which is what its CPU runs train.  This
bench checks the 16-bit half of the rules (16-bit parameters beside fp32 master weights): for ZeRO-1,
-2 and -3 it launches ``deepspeed --num_gpus WORLD`` on itself with ``"bf16": {"enabled": true}``,
counts the tensors every rank holds around the optimizer step (``instrument.memory.ModelStateProbe``),
and compares each kind with ``costs.zero.zero_model_states(element_bytes=2)``.  The parameter sizes
are odd on purpose, so that ZeRO's padding shows.  DeepSpeed's own estimate is printed beside them.
Nothing is fitted.

Ends with ``RESULT zero_16bit_max_error_pct=X`` (the largest error over kinds, stages and ranks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6, "overlap_comm": False,
            "stage3_param_persistence_threshold": 0}


def build_model():
    import torch

    # 320,000 + 6,175 + 96,000 = 422,175 elements: not a multiple of 2 x dp, so ZeRO pads; on 2
    # ranks the first partition lies inside the embedding (the case fp32 holds whole, 16-bit does not)
    return torch.nn.Sequential(torch.nn.Embedding(5000, 64), torch.nn.Linear(64, 95), torch.nn.ReLU(),
                               torch.nn.Linear(95, 1000))


def worker(stage: int) -> None:
    import deepspeed
    import torch

    from ds_pipe_ext.costs.zero import zero_model_states
    from ds_pipe_ext.instrument.memory import ModelStateProbe

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = build_model()
    numels = [p.numel() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, **SETTINGS}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    probe = ModelStateProbe(engine.module, engine.optimizer)
    for _ in range(2):
        out = engine(torch.randint(0, 1000, (2, 8)))
        engine.backward(out.float().pow(2).mean())
        engine.step()
    dp = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    predicted = zero_model_states(numels, dp=dp, stage=stage, element_bytes=2, rank=rank).to_dict()
    # one write per line: the ranks share the launcher's stdout, unbuffered (python -u), so print's
    # separate write of the newline could let the other rank's line in between
    sys.stdout.write("RESULT-RANK " + json.dumps({"stage": stage, "rank": rank, "params": sum(numels),
                                                 "measured": probe.read(), "predicted": predicted}) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)  # a launched worker
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the launcher adds it
    args = ap.parse_args()
    if args.stage is not None:
        return worker(args.stage)

    from ds_pipe_ext.compat.zero import deepspeed_estimate_bytes

    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in build_model().modules())
    from ds_pipe_ext.runner import launch

    worst, lines = 0.0, []
    for stage in (1, 2, 3):
        proc, _ = launch(args.world, None, "--stage", str(stage), timeout=600, script="bench/zero_rules_16bit.py")
        ranks = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("RESULT-RANK ")]
        if proc.returncode or len(ranks) != args.world:
            sys.exit(f"ZeRO-{stage} launch failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        for r in sorted(ranks, key=lambda r: r["rank"]):
            for kind, want in r["predicted"].items():
                got = r["measured"][kind]
                worst = max(worst, 100 * abs(got - want) / max(got, 1))
            total = sum(r["measured"].values())
            est = deepspeed_estimate_bytes(r["params"], largest, dp=args.world, stage=stage)
            lines.append(f"ZeRO-{stage} rank {r['rank']}: measured {r['measured']}  predicted {r['predicted']}  "
                         f"total {total} B, DeepSpeed's estimate {est if est is not None else 'n/a'} B")
    print(f"bf16 on {args.world} CPU ranks, {ranks[0]['params']} parameters (odd: ZeRO pads):")
    print("\n".join(lines))
    print(f"RESULT zero_16bit_max_error_pct={worst:.3f}")


if __name__ == "__main__":
    main()
