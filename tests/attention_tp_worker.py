"""Rank worker of tests/test_mla_sinks.py's TP parity: multi-head latent attention and attention with sinks in a
window, each at TP 2 (megatron-core's column- and row-parallel linears) against the one-process module at TP 1.

Every rank builds the TP 1 module from the same seed and its TP 2 shard (``shard_like``), runs both on the same
input, and rank 0 writes the largest relative differences of the output, the input's gradient and each
parameter's gradient (the TP 1 gradient sliced as the parameter is) to --metrics-out.  The replicated down
projections of MLA are built on every rank from the same generator: their weights are compared as built.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_pipe_ext.layout import Layout  # noqa: E402
from ds_pipe_ext.models import load_model  # noqa: E402
from ds_pipe_ext.models.layers import LOCAL  # noqa: E402
from ds_pipe_ext.models.mla import MLAttention  # noqa: E402
from ds_pipe_ext.models.sinks import SinkAttention  # noqa: E402
from ds_pipe_ext.models.tensor_parallel import megatron_layer_impl, shard_like  # noqa: E402
from ds_pipe_ext.parallel import topology  # noqa: E402

CASES = {
    "mla": (dict(kv_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
            lambda cfg, impl: MLAttention(cfg, impl)),
    "sinks, window 6": (dict(qkv_bias=True, attention_sinks=True, sliding_window=6, window_pattern="WFWF"),
                        lambda cfg, impl: SinkAttention(cfg, impl, window=6)),
}


def compare(cfg, build, impl, rank: int, size: int) -> dict:
    torch.manual_seed(0)
    full = build(cfg, LOCAL)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    torch.manual_seed(1)
    split = build(cfg, impl)
    built = {n: p.detach().clone() for n, p in split.named_parameters() if not getattr(p, "tensor_model_parallel", False)}
    split.load_state_dict(shard_like(full.state_dict(), split, rank=rank, size=size))
    x = torch.randn(cfg.seq_len, 2, cfg.hidden)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = full(xa), split(xb)
    a.square().sum().backward()
    b.square().sum().backward()
    grads = shard_like({n: p.grad for n, p in full.named_parameters()}, split, rank=rank, size=size)
    rel = lambda u, v: (u - v).abs().max().item() / v.abs().max().item()  # noqa: E731
    diffs = {"output": rel(b, a), "input_grad": rel(xb.grad, xa.grad)}
    diffs.update({name: rel(p.grad, grads[name]) for name, p in split.named_parameters()})
    gathered = {}
    for name, w in built.items():  # replicated weights: equal on every rank as built (the same draws)
        everyone = [torch.empty_like(w) for _ in range(size)]
        dist.all_gather(everyone, w)
        gathered[name] = all(torch.equal(everyone[0], other) for other in everyone)
    return {"diffs": diffs, "replicated_equal": gathered,
            "local_heads": split.heads, "params": sorted(n for n, _ in split.named_parameters())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    topology.initialize(Layout(tp=size), size)
    impl = megatron_layer_impl(tp=size)
    out = {name: compare(load_model("moe-tiny", **fields), build, impl, rank, size)
           for name, (fields, build) in CASES.items()}
    everyone = [None] * size
    dist.all_gather_object(everyone, {"rank": rank, "cases": out})
    if rank == 0:
        Path(args.metrics_out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
