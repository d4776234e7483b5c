"""Per-layer optimizer state: pipeline checkpoints that survive a change of partition.

DeepSpeed's pipeline checkpoint already stores the weights one file per layer
(``layer_XX-model_YY-model_states.pt``), so any partition can load them.  Its
optimizer state, though, is one file per stage in parameter order, which only
fits the partition that wrote it.  Here the optimizer state is saved the same way
as the weights: one file per layer and TP rank, keyed by parameter name, so a
checkpoint written under ``uniform`` resumes under ``profiled`` with every Adam
moment where it belongs.  (Under ZeRO-1 the state is partitioned flat across the
data-parallel group; those checkpoints go through DeepSpeed's own files instead,
see ``train/checkpoint.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..compat.engine import coordinates, local_layers
from ..compat.optimizer import unwrap_optimizer


def _optim_path(ckpt_dir: Path, idx: int, tp_rank: int) -> Path:
    return ckpt_dir / f"layer_{idx:02d}-tp_{tp_rank:02d}-optim_states.pt"


def save_layer_optimizer_states(engine, ckpt_dir: str | Path, *, after_each: Callable[[Path], None] = lambda p: None
                                ) -> list[Path]:
    """This rank's layers' optimizer state, one file per layer (data-parallel rank 0 only: replicas agree)."""
    module, opt = engine.module, unwrap_optimizer(engine.optimizer)
    where, written = coordinates(module), []
    if where.data == 0:
        for idx, layer in local_layers(module):
            states = {name: opt.state[p] for name, p in layer.named_parameters() if p in opt.state}
            path = _optim_path(Path(ckpt_dir), idx, where.model)
            torch.save(states, path)
            written.append(path)
            after_each(path)
    return written


def load_layer_optimizer_states(engine, ckpt_dir: str | Path) -> None:
    """Put each saved moment back on the parameter of the same name, whatever the partition."""
    module, opt = engine.module, unwrap_optimizer(engine.optimizer)
    tp_rank = coordinates(module).model
    for idx, layer in local_layers(module):
        path = _optim_path(Path(ckpt_dir), idx, tp_rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by ds_pipe_ext "
                                    f"(or with another tensor-parallel degree)")
        saved = read_layer_states(path, engine.device)
        for name, p in layer.named_parameters():
            if name in saved:
                opt.state[p] = dict(saved[name])


def read_layer_states(path: Path, device: torch.device) -> dict:
    """One layer's saved optimizer states, on the loading rank's device (not the saving rank's GPU)."""
    return torch.load(path, map_location=device)
