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

from .op_cost import OpCost
from .hardware import CEILINGS, DEVICES, DeviceSpec

CLASSES = ("matrix", "attention", "vector", "memory")  # the efficiency factors that are fitted


def _layer_time(ops: list[OpCost], device: DeviceSpec, dtype: str, backward: bool, eff: dict) -> np.ndarray:
    """Σ_op max(compute, memory) for every combination of efficiencies (broadcast arrays in ``eff``)."""
    total = 0.0
    for op in ops:
        flops = op.bwd_flops if backward else op.fwd_flops
        moved = op.bwd_bytes if backward else op.fwd_bytes
        peak = device.vector_flops[dtype] if op.kind == "vector" else device.matrix_flops[dtype]
        # the fitted factor in place of its class's own, times what the op's shape lets it reach
        size = device.shape_factor(op, dtype=dtype, backward=backward)
        compute = device.measured_kernels_s(op, flops / (peak * eff[op.kind] * size), backward=backward)
        total = total + np.maximum(compute, moved / (device.hbm_bandwidth * eff["memory"]))
        # page faults scale with the memory factor: both are the memory system's speed against the
        # micro-benchmark's (on a shared machine, what the neighbours leave of it)
        total = total + device.fresh_alloc_time(op.bwd_allocs if backward else op.fwd_allocs) / eff["memory"]
    return total


def ceilings(device: DeviceSpec) -> dict[str, float]:
    """The most each fitted factor may be: on a datasheet spec what the device measurably reaches of its
    peaks (``hardware.CEILINGS``; the datasheet itself where no measurement is known); a measured spec's
    peaks are this machine's own, so a factor there is not bounded by them."""
    if device.name not in DEVICES:
        return {k: np.inf for k in CLASSES}
    known = CEILINGS.get(device.name, {})
    return {k: known.get(f"{k}_efficiency", 1.0) for k in CLASSES}


def _efficiencies(device: DeviceSpec) -> dict[str, float]:
    """The spec's factor for each fitted class."""
    return {"matrix": device.matrix_efficiency, "attention": device.attention_efficiency,
            "vector": device.vector_efficiency, "memory": device.memory_efficiency}


def _loss(layers, device: DeviceSpec, dtype: str, eff: dict) -> np.ndarray:
    """Σ squared log error of the modelled forward and backward times (broadcast over ``eff``'s arrays)."""
    loss = 0.0
    for ops, fwd, bwd in layers:
        for backward, measured in ((False, fwd), (True, bwd)):
            if measured > 0:
                loss = loss + np.log(np.maximum(_layer_time(ops, device, dtype, backward, eff), 1e-12) / measured) ** 2
    return loss


def _fit(layers, device, dtype, axes: dict[str, np.ndarray]) -> dict[str, float]:
    grids = np.meshgrid(*axes.values(), indexing="ij")
    eff = dict(zip(axes, grids))
    eff.setdefault("attention", eff["matrix"])  # tied: one factor for every matmul
    loss = _loss(layers, device, dtype, eff) + np.zeros(grids[0].shape)
    i = np.unravel_index(int(np.argmin(loss)), loss.shape)
    return {k: float(g[i]) for k, g in zip(axes, grids)}


def calibrate(device: DeviceSpec, layers: list[tuple[list[OpCost], float, float]], *, dtype: str,
              fit: tuple[str, ...] = CLASSES, attention_as_matrix: bool = False) -> DeviceSpec:
    """``layers``: (ops, measured forward s, measured backward s) per profiled layer.

    Fits the efficiencies named in ``fit`` (of matrix/GEMM, attention-matmul, vector, memory;
    the others keep the spec's values) by least squares on log time: a coarse grid over
    [0.01, 10] x the spec's peaks, then a finer one around the best point, each at most its ``ceilings``.  With
    ``attention_as_matrix`` the per-head matmuls share the GEMMs' factor (one fewer unknown).
    Communication is not fitted (one rank has none).  The spec keeps its name: what runs where (a CPU's dropout
    masks, its dense window masks, its attention kernels: ``estimate.shape_for``) is keyed on it, and a fitted
    "cpu" is still this CPU.
    """
    unknown = set(fit) - set(CLASSES)
    if unknown:
        raise ValueError(f"cannot fit {sorted(unknown)}: choose from {CLASSES}")
    held = _efficiencies(device)
    free = [k for k in CLASSES if k in fit and not (attention_as_matrix and k == "attention")]
    ceiling = ceilings(device)
    coarse = np.geomspace(0.01, 10.0, 16)
    step = coarse[1] / coarse[0]
    best = held
    for grid in (lambda k: coarse, lambda k: best[k] * np.geomspace(1 / step, step, 13)):
        axes = {k: np.unique(np.minimum(grid(k), ceiling[k])) if k in free else np.array([held[k]])
                for k in CLASSES if k != "attention" or not attention_as_matrix}
        best = _fit(layers, device, dtype, axes)
        if attention_as_matrix:
            best["attention"] = best["matrix"]
    return replace(device, matrix_efficiency=best["matrix"], attention_efficiency=best["attention"],
                   vector_efficiency=best["vector"], memory_efficiency=best["memory"],
                   fresh_page_bandwidth=device.fresh_page_bandwidth * best["memory"])


# the GEMM sizes at which a CPU's matmul efficiency halves that fit_device tries
HALF_DIMS = (0.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0)


def fit_device(device: DeviceSpec, layers: list[tuple[list[OpCost], float, float]], *, dtype: str) -> DeviceSpec:
    """``calibrate`` with the factors that suit the device: all four on a datasheet spec; on a
    measured ("cpu") one, the two a CPU's layers need, and the rate its embeddings zero their gradient
    tables at (``_fit_fill``).

    A measured spec already has the machine's peaks (the fastest of its micro-benchmark runs), so
    elementwise work and memory traffic keep them: fitting those as well traded them against the
    GEMMs and went to 0.05x and 3x, far from anything physical.  What the 1024^3 micro-benchmark
    cannot know is how a GEMM of the layers' shapes does: its efficiency (the per-head matmuls are
    GEMMs too) and the size at which a small dimension (few tokens, a thin weight) halves it.
    """
    if device.name != "cpu":
        return calibrate(device, layers, dtype=dtype)
    best, best_loss = device, float("inf")
    for half in HALF_DIMS:
        fitted = calibrate(replace(device, matrix_half_dim=half), layers, dtype=dtype, fit=("matrix",),
                           attention_as_matrix=True)
        loss = float(_loss(layers, fitted, dtype, _efficiencies(fitted)))
        if loss < best_loss:
            best, best_loss = fitted, loss
    return _fit_fill(best, layers, dtype)


def _fit_fill(device: DeviceSpec, layers, dtype: str) -> DeviceSpec:
    """The rate at which the layers zero a gradient table, fitted on the calibration layers that do (the
    embeddings): a layer zeroes its table once, after other work, at 13-14 GB/s here, where the
    micro-benchmark's fastest of many back-to-back passes measured 14-17.  Never above that measured rate
    (a factor of 0.5 to 1): the micro-benchmark is the fastest the machine zeroes a table."""
    filled = [(ops, bwd) for ops, _, bwd in layers if bwd > 0 and any(op.bwd_fill_bytes for op in ops)]
    if not filled or not device.fill_bandwidth:
        return device

    def loss(factor: float) -> float:
        spec = replace(device, fill_bandwidth=device.fill_bandwidth * factor)
        return sum(np.log(sum(spec.op_time(op, dtype=dtype, tp=1, backward=True)["time_s"] for op in ops) / bwd) ** 2
                   for ops, bwd in filled)

    factor = min(np.geomspace(0.5, 1.0, 41), key=loss)
    return replace(device, fill_bandwidth=device.fill_bandwidth * float(factor))
