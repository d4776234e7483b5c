"""Calibration: fit a device's efficiency factors to profiled layers.

The roofline's peaks are datasheet numbers; real kernels reach a fraction of them,
and that fraction differs between matrix work, elementwise work and memory
traffic.  ``calibrate`` takes profiled forward/backward times of a few layers (an
embedding, a block, the head) and finds the (matrix, vector, memory) efficiencies
that make the analytic model reproduce them, minimising the squared log error.
The calibrated spec then predicts shapes that were never profiled (a longer
sequence, a wider model) on the same device.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .analytic import OpCost
from .hardware import DeviceSpec

GRID = np.geomspace(0.02, 4.0, 48)  # efficiencies relative to the spec's peaks


def _layer_time(ops: list[OpCost], device: DeviceSpec, dtype: str, backward: bool,
                eff_m: np.ndarray, eff_v: np.ndarray, eff_mem: np.ndarray) -> np.ndarray:
    """Σ_op max(compute, memory) for every combination of efficiencies (broadcast arrays)."""
    total = np.zeros(np.broadcast(eff_m, eff_v, eff_mem).shape)
    for op in ops:
        flops = op.bwd_flops if backward else op.fwd_flops
        moved = op.bwd_bytes if backward else op.fwd_bytes
        if op.kind == "matrix":
            compute = flops / (device.matrix_flops[dtype] * eff_m)
        else:
            compute = flops / (device.vector_flops[dtype] * eff_v)
        total = total + np.maximum(compute, moved / (device.hbm_bandwidth * eff_mem))
    return total


def calibrate(device: DeviceSpec, layers: list[tuple[list[OpCost], float, float]], *, dtype: str) -> DeviceSpec:
    """``layers``: (ops, measured forward s, measured backward s) per profiled layer.

    Returns the spec with fitted ``matrix_efficiency``, ``vector_efficiency`` and
    ``memory_efficiency`` (communication is not fitted: profiling one rank has none).
    """
    em, ev, emem = np.meshgrid(GRID, GRID, GRID, indexing="ij")
    loss = np.zeros(em.shape)
    for ops, fwd, bwd in layers:
        for backward, measured in ((False, fwd), (True, bwd)):
            if measured <= 0:
                continue
            predicted = _layer_time(ops, device, dtype, backward, em, ev, emem)
            loss += np.log(np.maximum(predicted, 1e-12) / measured) ** 2
    i = np.unravel_index(int(np.argmin(loss)), loss.shape)
    return replace(device, matrix_efficiency=float(em[i]), vector_efficiency=float(ev[i]),
                   memory_efficiency=float(emem[i]), name=f"{device.name}-calibrated")


def profile_and_calibrate(cfg, req, device: DeviceSpec, *, cache_dir: str | None = ".ds_pipe_ext_cache",
                          warmup: int = 1, repeats: int = 3) -> DeviceSpec:
    """Profile one embedding, one block and the head (+ loss) of ``cfg`` on this machine, then fit."""
    import torch

    from ..models.gpt import gpt_layer_specs, lm_loss
    from .estimate import layer_ops, shape_for
    from .profiler import ProfileSettings, profile_layers

    if cfg.tie_embeddings:
        from ..models.config import GPTConfig

        cfg = GPTConfig.from_dict({**cfg.to_dict(), "tie_embeddings": False}, name=cfg.name)
    specs = gpt_layer_specs(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (req.micro_batch, req.seq + 1), generator=torch.Generator().manual_seed(0))
    measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss,
                              settings=ProfileSettings(warmup=warmup, repeats=repeats, cache_dir=cache_dir, progress=False),
                              key_fields={"model": cfg.to_dict(), "purpose": "calibration"})
    ops = layer_ops(cfg, shape_for(cfg, req, device))
    layers = [(ops[0][2], measured[0].forward_s, measured[0].backward_s),
              (ops[1][2], measured[1].forward_s, measured[1].backward_s),
              (ops[-1][2], measured[2].forward_s, measured[2].backward_s)]
    return calibrate(device, layers, dtype=req.dtype)
