"""ZeRO's model-state bytes in 16-bit training: measured on 2 CPU ranks (bf16) against ``costs.zero``.

    python bench/zero_rules_16bit.py [--world 2] [--smoke]

`ds-pipe-ext compare` checks the allocation rules in fp32, which is what its CPU runs train.  This
bench checks the 16-bit half of the rules (16-bit parameters beside fp32 master weights): for ZeRO-1,
-2 and -3, and for DeepSpeed's ``BF16_Optimizer`` (which DeepSpeed 0.19 picks for bf16 under its
pipeline without ZeRO, accumulating gradients in bf16, and for bf16 ZeRO-1 with ``grad_accum_dtype``
fp32), it launches ``deepspeed --num_gpus WORLD`` on itself with ``"bf16": {"enabled": true}``, counts
the tensors every rank holds around the optimizer step (``instrument.memory.ModelStateProbe``), and
compares each kind with ``costs.zero.zero_model_states(element_bytes=2)`` (``bf16_optimizer_states``
and its accumulation buffer for BF16_Optimizer).  The parameter sizes are odd on purpose, so that the
padding shows.  DeepSpeed's own estimate is printed beside them.  Nothing is fitted.

Ends with ``RESULT zero_16bit_max_error_pct=X bf16_optimizer_max_error_pct=Y`` (the largest error over
kinds and ranks: ZeRO-1/2/3; BF16_Optimizer's two cases).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402
SETTINGS = {"reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6, "overlap_comm": False,
            "stage3_param_persistence_threshold": 0}


def build_model():
    import torch

    # 320,000 + 6,175 + 96,000 = 422,175 elements: not a multiple of 2 x dp, so ZeRO pads; on 2
    # ranks the first partition lies inside the embedding (the case fp32 holds whole, 16-bit does not)
    return torch.nn.Sequential(torch.nn.Embedding(5000, 64), torch.nn.Linear(64, 95), torch.nn.ReLU(),
                               torch.nn.Linear(95, 1000))


CASES = {  # name: (the engine's ZeRO stage, grad_accum_dtype, under DeepSpeed's pipeline)
    "zero1": (1, None, False), "zero2": (2, None, False), "zero3": (3, None, False),
    "bf16-pipeline": (0, None, True),  # BF16_Optimizer, gradients accumulated in bf16
    "bf16-zero1-fp32-accum": (1, "fp32", False),  # BF16_Optimizer, gradients accumulated in fp32
}


def worker(cases: str) -> None:
    """Each of ``cases`` (comma-separated) in turn, in this launch."""
    import deepspeed
    import torch

    from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op

    skip_deepspeed_shm_op()  # CPU only: DeepSpeed's shared-memory op would be compiled at start-up
    deepspeed.init_distributed(dist_backend="gloo")
    for case in cases.split(","):
        one_case(case)
    torch.distributed.barrier()  # leave together: a rank tearing gloo down under another can abort it
    torch.distributed.destroy_process_group()


def one_case(case: str) -> None:
    import deepspeed
    import torch

    from ds_pipe_ext.costs.zero import bf16_accumulation_bytes, bf16_optimizer_states, zero_model_states
    from ds_pipe_ext.instrument.memory import ModelStateProbe

    stage, accum, pipelined = CASES[case]
    torch.manual_seed(0)
    model = build_model()
    numels = [p.numel() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, **SETTINGS}}
    if accum:
        config["data_types"] = {"grad_accum_dtype": accum}
    if pipelined:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layers=list(model), num_stages=1, loss_fn=lambda out, _: out.float().pow(2).mean())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    probe = ModelStateProbe(engine.module, engine.optimizer)
    batches = iter(lambda: (torch.randint(0, 1000, (2, 8)), torch.zeros(2)), None)
    for _ in range(2):
        if pipelined:
            engine.train_batch(data_iter=batches)
        else:
            out = engine(next(batches)[0])
            engine.backward(out.float().pow(2).mean())
            engine.step()
    dp = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    bf16_optimizer = type(engine.optimizer).__name__ == "BF16_Optimizer"
    if bf16_optimizer:
        accum_bytes = 4 if accum == "fp32" else 2
        predicted = bf16_optimizer_states(numels, dp=dp, accum_bytes=accum_bytes).to_dict()
        predicted["grad_bytes"] += bf16_accumulation_bytes(numels, dp=dp, accum_bytes=accum_bytes)
    else:
        predicted = zero_model_states(numels, dp=dp, stage=stage, element_bytes=2, rank=rank).to_dict()
    # one write per line: the ranks share the launcher's stdout, unbuffered (python -u), so print's
    # separate write of the newline could let the other rank's line in between
    sys.stdout.write("RESULT-RANK " + json.dumps({"case": case, "stage": stage, "rank": rank, "params": sum(numels),
                                                 "optimizer": type(engine.optimizer).__name__,
                                                 "measured": probe.read(), "predicted": predicted}) + "\n")
    sys.stdout.flush()
    engine.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a launched worker: its cases, comma-separated
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP + " (every case in one launch)")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the launcher adds it
    args = ap.parse_args()
    if args.case is not None:
        return worker(args.case)

    from ds_pipe_ext.compat.zero import deepspeed_estimate_bytes
    from ds_pipe_ext.runner import launch

    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in build_model().modules())
    worst = {"zero": 0.0, "bf16": 0.0}
    lines = []
    launches = [",".join(CASES)] if args.smoke else list(CASES)  # a launch a case: nothing one case leaves behind
    records = []
    for cases in launches:
        proc, _ = launch(args.world, None, "--case", cases, timeout=600, script="bench/zero_rules_16bit.py")
        ranks = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("RESULT-RANK ")]
        if proc.returncode or len(ranks) != args.world * len(cases.split(",")):
            sys.exit(f"{cases} launch failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        records += ranks
    for case, (stage, _, _) in CASES.items():
        ranks = [r for r in records if r["case"] == case]
        for r in sorted(ranks, key=lambda r: r["rank"]):
            group = "bf16" if r["optimizer"] == "BF16_Optimizer" else "zero"
            if case.startswith("bf16") != (group == "bf16"):
                sys.exit(f"{case}: DeepSpeed chose {r['optimizer']}, not the optimizer this case is for")
            for kind, want in r["predicted"].items():
                got = r["measured"][kind]
                worst[group] = max(worst[group], 100 * abs(got - want) / max(got, 1))
            total = sum(r["measured"].values())
            est = deepspeed_estimate_bytes(r["params"], largest, dp=args.world, stage=stage) if group == "zero" else None
            lines.append(f"{case} ({r['optimizer']}) rank {r['rank']}: measured {r['measured']}  predicted "
                         f"{r['predicted']}  total {total} B, DeepSpeed's estimate {est if est is not None else 'n/a'} B")
    print(f"bf16 on {args.world} CPU ranks, {ranks[0]['params']} parameters (odd: the flat buffers pad):")
    print("\n".join(lines))
    print(f"RESULT zero_16bit_max_error_pct={worst['zero']:.3f} bf16_optimizer_max_error_pct={worst['bf16']:.3f}")


if __name__ == "__main__":
    main()
