"""Saved-activation bytes of TP-sharded layers, measured inside a tensor-parallel group.

Used by the analytic-vs-profiled bench and test: spawns ``tp`` gloo processes on
this machine, builds a family's embedding, one block and the head with megatron's
TP (and SP) layers, and profiles them as a rank runs them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _worker(rank, world, init_file, cases, out_path):
    import torch.distributed as dist

    from ..costs.profiler import ProfileSettings, profile_layers
    from ..layout import Layout
    from ..models import get_family
    from .topology import initialize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    initialize(Layout(tp=world), world)
    rows = []
    for case in cases:
        family = get_family(case.get("family", "gpt"))
        cfg = family.config_type.from_dict(case["model"], name=case["model"]["name"])
        impl = family.tensor_parallel(world, case["sp"])
        specs = family.layer_specs(cfg, impl)
        tokens = torch.randint(0, cfg.vocab_size, (case["b"], cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        costs = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:],
                               loss_fn=family.loss_fn(cfg, impl),
                               settings=ProfileSettings(cache_dir=None, warmup=0, repeats=1, progress=False))
        rows.append([c.activation_bytes for c in costs])
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def tp_activation_bytes(cases: list[dict], tp: int = 2) -> list[list[int]]:
    """For each case {"model": a config's dict, "family": its family (default gpt), "b": int, "sp": bool}:
    [embedding, block, head] bytes on TP rank 0."""
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(_worker, args=(tp, str(Path(d) / "init"), cases, str(Path(d) / "out.json")),
                           nprocs=tp, join=True, start_method="spawn")
        return json.loads((Path(d) / "out.json").read_text())
