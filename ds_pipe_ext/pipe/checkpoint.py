"""Checkpoints that survive a change of partition.

DeepSpeed's pipeline checkpoint already stores the weights one file per layer
(``layer_XX-model_YY-model_states.pt``), so any partition can load them.  Its
optimizer state, though, is one file per stage in parameter order, which only
fits the partition that wrote it.  Here the optimizer state is saved the same way
as the weights: one file per layer and TP rank, keyed by parameter name, so a
checkpoint written under ``uniform`` resumes under ``profiled`` with every Adam
moment where it belongs.  The step counter travels in ``client_state``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..compat.engine import coordinates, local_layers
from ..compat.optimizer import unwrap_optimizer


def _optim_path(ckpt_dir: Path, idx: int, tp_rank: int) -> Path:
    return ckpt_dir / f"layer_{idx:02d}-tp_{tp_rank:02d}-optim_states.pt"


def save(engine, save_dir: str | Path, *, step: int, tag: str = "ckpt") -> Path:
    """Weights through DeepSpeed, optimizer state per layer; every rank calls it."""
    engine.save_checkpoint(str(save_dir), tag=tag, client_state={"step": step})
    ckpt_dir = Path(save_dir) / tag
    module, opt = engine.module, unwrap_optimizer(engine.optimizer)
    where = coordinates(module)
    if where.data == 0:  # DP replicas hold identical state
        for idx, layer in local_layers(module):
            states = {name: opt.state[p] for name, p in layer.named_parameters() if p in opt.state}
            torch.save(states, _optim_path(ckpt_dir, idx, where.model))
    dist.barrier()
    return ckpt_dir


def load(engine, load_dir: str | Path, *, tag: str = "ckpt") -> int:
    """Load weights (any partition) and per-layer optimizer state; returns the step to resume after."""
    _, client_state = engine.load_checkpoint(str(load_dir), tag=tag, load_module_only=True)
    ckpt_dir = Path(load_dir) / tag
    module, opt = engine.module, unwrap_optimizer(engine.optimizer)
    tp_rank = coordinates(module).model
    for idx, layer in local_layers(module):
        path = _optim_path(ckpt_dir, idx, tp_rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by ds_pipe_ext "
                                    f"(or with another tensor-parallel degree)")
        saved = torch.load(path)
        for name, p in layer.named_parameters():
            if name in saved:
                opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved[name].items()}
    return int((client_state or {}).get("step", 0))
