"""A Hugging Face save_pretrained directory as a DeepSpeed pipeline (tests/test_hf.py, bench/gpu_path.py).

    deepspeed --num_gpus 2 examples/hf_pipeline.py --model DIR --steps 2 --checkpoint CKPT --metrics-out OUT/m.json

What a user's script adds is the three lines marked "the user's lines".  First, on every rank, a padded
profile batch must fail with the same error (rank 0 profiles; the error reaches every rank, no hang);
then the pipeline is built with "profiled", trains, evaluates a fixed batch and saves a checkpoint.
"""

import argparse
import json
import os
from pathlib import Path

import deepspeed
import torch

from ds_pipe_ext import PipelineModule, hf
from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op, steady_host_allocator
from ds_pipe_ext.pipe.config import PipelineSettings

MICRO_BATCH, MICRO_BATCHES, SEQ = 2, 4, 16


def batches(vocab: int, seed: int):
    """(input_ids, labels) with labels = input_ids, as a causal-LM data loader yields them."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (MICRO_BATCH, SEQ), generator=gen)
        yield tokens, tokens.clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    steady_host_allocator()
    skip_deepspeed_shm_op()
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    settings = PipelineSettings(stages=args.stages, partition_method="profiled",
                                profile={"cache_dir": None, "warmup": 0, "repeats": 1})
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    metrics = {"rank": rank}

    tokens, labels = next(batches(vocab, 0))
    padded = torch.ones_like(tokens)
    padded[:, -3:] = 0
    try:
        PipelineModule(hf.pipeline_layers(args.model), num_stages=args.stages, loss_fn=hf.causal_lm_loss,
                       settings=settings, profile_batch=((tokens, padded), labels), micro_batches=MICRO_BATCHES)
        metrics["padded_error"] = None
    except Exception as e:  # noqa: BLE001 - the test reads what each rank was told
        metrics["padded_error"] = f"{type(e).__name__}: {e}"

    # the user's lines
    layers = hf.pipeline_layers(args.model)
    model = PipelineModule(layers, num_stages=args.stages, loss_fn=hf.causal_lm_loss, settings=settings,
                           profile_batch=next(batches(vocab, 0)), micro_batches=MICRO_BATCHES)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config={"train_micro_batch_size_per_gpu": MICRO_BATCH,
                                              "gradient_accumulation_steps": MICRO_BATCHES, "steps_per_print": 10**6})

    data = batches(vocab, 1234)
    metrics["losses"] = [float(engine.train_batch(data_iter=data)) for _ in range(args.steps)]
    metrics["eval_loss"] = float(engine.eval_batch(data_iter=batches(vocab, 99)))
    metrics["parts"] = [int(b) for b in model.parts]
    engine.save_checkpoint(args.checkpoint)
    out = Path(args.metrics_out)
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(metrics))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
