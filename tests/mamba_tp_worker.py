"""Rank worker of tests/test_mamba2.py's TP parity: the mixer at TP 2 against the one-process mixer at TP 1.

Every rank builds the TP 1 mixer from the same seed and its TP 2 shard (``shard_like``), runs both on the same
input, and writes (rank 0) the largest differences of the output, the input's gradient and each parameter's
gradient (the TP 1 gradient sliced as the parameter is) to --metrics-out.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_pipe_ext.models.mamba2 import Mamba2Mixer, Mamba2Shape  # noqa: E402
from ds_pipe_ext.models.tensor_parallel import shard_like  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    shape = Mamba2Shape(hidden=24, heads=8, head_dim=4, state=5, groups=2, conv_kernel=4, chunk=4, bias=True)
    torch.manual_seed(0)
    full = Mamba2Mixer(shape)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    split = Mamba2Mixer(shape, tp_group=dist.group.WORLD)
    split.load_state_dict(shard_like(full.state_dict(), split, rank=rank, size=size))
    x = torch.randn(2, 11, 24)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = full(xa), split(xb)
    a.square().sum().backward()
    b.square().sum().backward()
    grads = shard_like({n: p.grad for n, p in full.named_parameters()}, split, rank=rank, size=size)
    diffs = {"output": (a - b).abs().max().item() / a.abs().max().item(),
             "input_grad": (xa.grad - xb.grad).abs().max().item() / xa.grad.abs().max().item()}
    for name, p in split.named_parameters():
        diffs[name] = (p.grad - grads[name]).abs().max().item() / grads[name].abs().max().item()
    everyone = [None] * size
    dist.all_gather_object(everyone, {"rank": rank, "diffs": diffs, "local_heads": split.shape.heads})
    if rank == 0:
        Path(args.metrics_out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
