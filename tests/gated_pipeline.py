"""Launched by tests/test_seam.py: the test-only gated family through ds_pipe_ext.PipelineModule on 2 ranks.

    deepspeed --num_gpus 2 tests/gated_pipeline.py --steps 2 --metrics-out OUT/metrics.json

Each rank registers the family (it lives in the tests, not in models/), builds the pipeline from its
layer specs with partition_method "analytic" on its cost model, trains, and writes its split.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gated_family import GatedConfig, register  # noqa: E402

from ds_pipe_ext import PipelineModule  # noqa: E402
from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op, steady_host_allocator  # noqa: E402
from ds_pipe_ext.pipe.config import PipelineSettings  # noqa: E402

MICRO_BATCH, MICRO_BATCHES = 4, 4


def batches(cfg: GatedConfig, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--metrics-out", default=None)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    steady_host_allocator()
    skip_deepspeed_shm_op()
    deepspeed.init_distributed()
    family, cfg = register(), GatedConfig()
    settings = PipelineSettings(stages=2, partition_method="analytic",
                                analytic={"device": "a100", "dtype": "fp32"}, profile={"cache_dir": None})
    model = PipelineModule(family.layer_specs(cfg), num_stages=2, loss_fn=family.loss_fn(cfg), settings=settings,
                           profile_batch=next(batches(cfg, 0)), micro_batches=MICRO_BATCHES,
                           cost_model=family.cost_model(cfg), seed_layers=True, base_seed=1234)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config={"train_micro_batch_size_per_gpu": MICRO_BATCH,
                                              "gradient_accumulation_steps": MICRO_BATCHES, "steps_per_print": 10**6})
    data = batches(cfg, 1234)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(args.steps)]
    rank = torch.distributed.get_rank()
    if args.metrics_out:
        out = Path(args.metrics_out)
        out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "parts": [int(b) for b in model.parts], "losses": losses}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
