"""ds_pipe_ext.PipelineModule on models that are not ours: the drop-in, end to end.

    deepspeed --num_gpus 2 examples/any_model.py --model plain    # nn.Module instances + lambdas
    deepspeed --num_gpus 2 examples/any_model.py --model tied     # TiedLayerSpec, a tuple input

Both train with ``partition_method="profiled"``: rank 0 profiles every layer as
DeepSpeed would run it (whatever its form), splits them exactly, and broadcasts the
split.  Before training, each rank also computes the first step's loss with the same
layers in one process (``SequentialLayers``, no pipeline) so the two can be compared.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ds_pipe_ext import PipelineModule
from ds_pipe_ext.compat.cpu_shims import skip_deepspeed_shm_op, steady_host_allocator
from ds_pipe_ext.compat.engine import coordinates, local_layer_range
from ds_pipe_ext.pipe.sequential import SequentialLayers

SEED = 1234
MICRO_BATCH, MICRO_BATCHES = 4, 4
DS_CONFIG = {  # what a user's ds.json would hold; "pipeline" carries ds_pipe_ext's settings
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": MICRO_BATCHES,
    "steps_per_print": 10_000,
    "pipeline": {"partition_method": "profiled", "profile": {"cache_dir": None, "warmup": 1, "repeats": 3}},
}


# --- model 1: plain nn.Module instances and lambdas, as many DeepSpeed scripts write them -------------
def plain_model() -> tuple[list, callable, callable]:
    torch.manual_seed(SEED)  # instances are built here, identically on every rank
    layers = [
        nn.Linear(16, 64), nn.GELU(),
        lambda x: x.view(x.shape[0], 4, 16),   # a callable DeepSpeed runs as is
        nn.Linear(16, 16), nn.Tanh(),
        lambda x: x.flatten(1),
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10),
    ]

    def batches(seed: int):
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(MICRO_BATCH, 16, generator=gen), torch.randint(0, 10, (MICRO_BATCH,), generator=gen)

    return layers, F.cross_entropy, batches


# --- model 2: a tied embedding/head, an nn.Module instance, and a tuple input (tokens, mask) ---------
VOCAB, DIM, SEQ = 64, 32, 8


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

    def forward(self, inputs):
        tokens, mask = inputs  # the first stage receives the tuple the data iterator yields
        return F.embedding(tokens, self.weight) * mask.unsqueeze(-1)


class ResidualMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def tied_logits(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tied_model() -> tuple[list, callable, callable]:
    layers = [
        TiedLayerSpec("embed", TokenEmbedding, VOCAB, DIM, tied_weight_attr="weight"),
        *[LayerSpec(ResidualMLP, DIM) for _ in range(3)],
        nn.LayerNorm(DIM),
        TiedLayerSpec("embed", TokenEmbedding, VOCAB, DIM, forward_fn=tied_logits, tied_weight_attr="weight"),
    ]

    def batches(seed: int):
        gen = torch.Generator().manual_seed(seed)
        while True:
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
            mask = (torch.rand(MICRO_BATCH, SEQ, generator=gen) > 0.1).float()
            yield (tokens[:, :-1].contiguous(), mask), tokens[:, 1:].contiguous()

    return layers, token_loss, batches


MODELS = {"plain": plain_model, "tied": tied_model}


def reference_first_loss(layers: list, loss_fn, batches) -> float:
    """The first step's loss, the same layers in one process: mean over the step's micro-batches."""
    model = SequentialLayers(copy.deepcopy(layers), loss_fn, base_seed=SEED)
    data = batches(SEED)
    with torch.no_grad():
        return float(torch.stack([model(*next(data)) for _ in range(MICRO_BATCHES)]).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="plain")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--metrics-out", default=None, help="each rank writes NAME.rankR.json beside this path")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()

    steady_host_allocator()  # CPU only: steady malloc thresholds, so steps time alike
    skip_deepspeed_shm_op()  # CPU only: no C++ JIT build at start-up
    deepspeed.init_distributed()
    world = torch.distributed.get_world_size()
    layers, loss_fn, batches = MODELS[args.model]()
    reference = reference_first_loss(layers, loss_fn, batches)

    # The drop-in: DeepSpeed's PipelineModule arguments, plus one micro-batch to profile.
    model = PipelineModule(layers, num_stages=world, loss_fn=loss_fn, partition_method="profiled",
                           profile_batch=next(batches(0)), micro_batches=MICRO_BATCHES,
                           seed_layers=True, base_seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    data = batches(SEED)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(args.steps)]

    rank = torch.distributed.get_rank()
    result = {"rank": rank, "model": args.model, "parts": list(model.parts),
              "stage_id": coordinates(model).stage, "local_layers": list(local_layer_range(model)),
              "layer_names": [c.name for c in model.layer_costs] if model.layer_costs else None,
              "losses": losses, "reference_first_loss": reference}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if args.metrics_out:
        out = Path(args.metrics_out)
        out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
