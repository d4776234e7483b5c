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

CLASSES = ("matrix", "attention", "vector", "memory")  # the efficiency factors that are fitted


def _layer_time(ops: list[OpCost], device: DeviceSpec, dtype: str, backward: bool, eff: dict) -> np.ndarray:
    """Σ_op max(compute, memory) for every combination of efficiencies (broadcast arrays in ``eff``)."""
    total = 0.0
    for op in ops:
        flops = op.bwd_flops if backward else op.fwd_flops
        moved = op.bwd_bytes if backward else op.fwd_bytes
        peak = device.vector_flops[dtype] if op.kind == "vector" else device.matrix_flops[dtype]
        total = total + np.maximum(flops / (peak * eff[op.kind]), moved / (device.hbm_bandwidth * eff["memory"]))
        # page faults are measured, not fitted
        total = total + device.fresh_alloc_time(op.bwd_allocs if backward else op.fwd_allocs)
    return total


def _fit(layers, device, dtype, axes: dict[str, np.ndarray]) -> dict[str, float]:
    grids = np.meshgrid(*axes.values(), indexing="ij")
    eff = dict(zip(axes, grids))
    loss = np.zeros(grids[0].shape)
    for ops, fwd, bwd in layers:
        for backward, measured in ((False, fwd), (True, bwd)):
            if measured > 0:
                loss += np.log(np.maximum(_layer_time(ops, device, dtype, backward, eff), 1e-12) / measured) ** 2
    i = np.unravel_index(int(np.argmin(loss)), loss.shape)
    return {k: float(g[i]) for k, g in eff.items()}


def calibrate(device: DeviceSpec, layers: list[tuple[list[OpCost], float, float]], *, dtype: str) -> DeviceSpec:
    """``layers``: (ops, measured forward s, measured backward s) per profiled layer.

    Fits the matrix (GEMM), attention-matmul, vector and memory efficiencies by least
    squares on log time: a coarse grid over [0.01, 10] x the spec's peaks, then a finer
    one around the best point.  Communication is not fitted (one rank has none).
    """
    coarse = np.geomspace(0.01, 10.0, 16)
    best = _fit(layers, device, dtype, {k: coarse for k in CLASSES})
    step = coarse[1] / coarse[0]
    fine = {k: best[k] * np.geomspace(1 / step, step, 13) for k in CLASSES}
    best = _fit(layers, device, dtype, fine)
    return replace(device, matrix_efficiency=best["matrix"], attention_efficiency=best["attention"],
                   vector_efficiency=best["vector"], memory_efficiency=best["memory"],
                   name=f"{device.name}-calibrated")
