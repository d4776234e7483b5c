"""One launch of bench/profiled_generalization.py: a shape's partition methods built one after another, as a
user's script builds them.

    deepspeed --num_gpus 2 bench/generalization_worker.py --shape wide-alt \\
        --methods "profiled;uniform;parameters;parts:0,4,10;train.py" --steps 5 --warmup-steps 2 \\
        --metrics-out DIR/metrics.json

Each build is what a user writes: the model's layers as ``LayerSpec``s, ``ds_pipe_ext.PipelineModule(layers,
num_stages=2, loss_fn=..., partition_method=..., profile_batch=..., micro_batches=...)``, no step model, then
``deepspeed.initialize`` with the shape's optimizer (DeepSpeed's from ds.json, or the script's AdamW), and
``engine.train_batch`` timed per step; a build's figure is the median of its steps after --warmup-steps.  The
script sets nothing up that a user's script would not: no allocator settings, no thread pinning.  The method
"train.py" builds the shape through train.py's own path (``ds_pipe_ext.train.build``, partition_method "profiled")
instead.

Rank 0 writes --metrics-out: {"measured": [{"method", "parts", "step_s_each", "step_s", "samples_per_s",
"warmup_steps", "predicted_step_ms"}, ...]} in the order built; every rank writes NAME.rankR.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from bench.generalization_shapes import BY_NAME, STEPS, WARMUP_STEPS, Shape  # noqa: E402
from ds_pipe_ext import PipelineModule  # noqa: E402
from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op  # noqa: E402
from ds_pipe_ext.models import family_of, load_model  # noqa: E402
from ds_pipe_ext.pipe.config import PipelineSettings  # noqa: E402

SEED = 1234
LR = 1e-4


def ds_config(shape: Shape) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": shape.micro_batches,
           "steps_per_print": 10_000,
           "pipeline": {"stages": 2, "partition_method": "profiled",
                        "profile": {"cache_dir": None, "warmup": 2, "repeats": 5, "progress": False}}}
    if shape.optimizer.startswith("ds:"):
        cfg["optimizer"] = {"type": shape.optimizer[3:], "params": {"lr": LR}}
    return cfg


def batches(cfg, micro_batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_drop_in(shape: Shape, method: str, steps: int) -> dict:
    """The user's script: layers, the drop-in module, DeepSpeed's engine, timed steps."""
    cfg = load_model(shape.model)
    family = family_of(cfg)
    ds = ds_config(shape)
    torch.manual_seed(SEED)
    model = PipelineModule(family.layer_specs(cfg), num_stages=2, loss_fn=family.loss_fn(cfg),
                           partition_method=method, settings=PipelineSettings.from_ds_config(ds),
                           profile_batch=next(batches(cfg, shape.micro_batch, 0)),
                           micro_batches=shape.micro_batches, seed_layers=True, base_seed=SEED)
    optimizer = None if "optimizer" in ds else torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds,
                                      model_parameters=model.parameters() if optimizer is None else None)
    data = batches(cfg, shape.micro_batch, SEED)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.train_batch(data_iter=data)
        times.append(time.perf_counter() - t0)
    plan = model.partition_plan
    record = {"parts": [int(b) for b in model.parts], "step_s_each": times,
              "predicted_step_ms": plan.predicted_step_ms if plan is not None else None}
    release(engine, model)
    return record


def train_via_train_py(shape: Shape, steps: int) -> dict:
    """The same shape through train.py's path: ds.json's train section names the model."""
    from ds_pipe_ext.train.build import build
    from ds_pipe_ext.train.config import build_run_config
    from ds_pipe_ext.train.trainer import Trainer

    ds = {**ds_config(shape), "train": {"model": shape.model, "steps": steps, "seed": SEED, "lr": LR}}
    built = build(build_run_config(ds))
    summary = Trainer(built).run()
    plan = built.model.partition_plan
    record = {"parts": summary["parts"], "step_s_each": summary["step_s_each"],
              "predicted_step_ms": plan.predicted_step_ms if plan is not None else None}
    release(built.engine, built.model)
    vars(built).clear()
    return record


def release(engine, model) -> None:
    """Free a build before the next (bench/splits_in_one_launch.py's reason: something in C++ keeps the shells)."""
    engine.destroy()
    for obj in (engine.optimizer, engine, model):
        if obj is not None and hasattr(obj, "__dict__"):
            vars(obj).clear()
    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(BY_NAME))
    ap.add_argument("--methods", required=True, help="separated by ';', built in this order")
    ap.add_argument("--steps", type=int, default=STEPS, help="per build, warm-up steps included")
    ap.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="per build, not timed")
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--no-warm-build", action="store_true", help="measure the first build as a fresh process runs it")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    skip_deepspeed_shm_op()  # CPU only: DeepSpeed's shared-memory op would be compiled at start-up
    deepspeed.init_distributed()
    shape, rank = BY_NAME[args.shape], torch.distributed.get_rank()
    measured = []
    if not args.no_warm_build:
        # unrecorded: a fresh process's first build runs its first steps several times slower (3.3-6.6 s a step
        # against 2.7 s for the same split built later, while its heap grows), which would score whichever
        # method comes first; later builds all start warm
        train_drop_in(shape, "uniform", 2)
    for method in args.methods.split(";"):
        rec = train_via_train_py(shape, args.steps) if method == "train.py" else train_drop_in(shape, method, args.steps)
        timed = rec["step_s_each"][args.warmup_steps:] or rec["step_s_each"]
        rec.update(method=method, warmup_steps=args.warmup_steps, step_s=statistics.median(timed),
                   samples_per_s=shape.micro_batch * shape.micro_batches / statistics.median(timed))
        measured.append(rec)
        if rank == 0:
            print(f"MEASURED {shape.name} {method} parts={rec['parts']} {rec['step_s']:.3f} s/step "
                  f"(predicted {rec['predicted_step_ms'] or float('nan'):.0f} ms)", flush=True)
    out = Path(args.metrics_out)
    result = {"shape": shape.name, "measured": measured, "rank": rank}
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(result, indent=1))
    if rank == 0:
        out.write_text(json.dumps(result, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
