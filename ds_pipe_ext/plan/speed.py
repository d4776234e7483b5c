"""One measured step calibrates a device's speed for the planner.

A shared machine runs a training step slower than the fastest runs its micro-benchmarks keep (on
the 2-core CPU machine, launches ran 1.3-1.6x slower than the spec and a one-process layer profile
implied).  ``fit_speed`` finds the one factor on the device's compute and memory rates that makes a
layout's predicted step equal a measured one; links stay as measured or given.  The layout it is
fitted on is then a calibration run, and every other layout the model predicts is a prediction.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..costs.hardware import DeviceSpec
from .model import PlanModel
from .space import PlanError, PlanLayout


def at_speed(device: DeviceSpec, factor: float) -> DeviceSpec:
    """``device`` with its compute and memory rates times ``factor``; its links (measured or given) unchanged."""
    return replace(device, matrix_flops={k: v * factor for k, v in device.matrix_flops.items()},
                   vector_flops={k: v * factor for k, v in device.vector_flops.items()},
                   hbm_bandwidth=device.hbm_bandwidth * factor,
                   fresh_page_bandwidth=device.fresh_page_bandwidth * factor)


def fit_speed(model: PlanModel, lay: PlanLayout, parts: list[int], measured_step_s: float) -> tuple[float, PlanModel]:
    """The factor on the device's compute and memory rates that makes ``lay``'s predicted step equal one
    measured step, and the plan model at that speed.  The predicted step falls as the factor grows
    (links stay), so bisection on its logarithm finds it."""
    def at(factor: float) -> PlanModel:
        return model.on_device(at_speed(model.device, factor))

    lo, hi = math.log(1 / 16), math.log(16)
    for _ in range(50):
        mid = (lo + hi) / 2
        if at(math.exp(mid)).evaluate(lay, parts, check_memory=False).step_s > measured_step_s:
            lo = mid
        else:
            hi = mid
    factor = math.exp((lo + hi) / 2)
    if not (math.log(1 / 16) + 1e-6 < math.log(factor) < math.log(16) - 1e-6):
        raise PlanError(f"{lay.name}: a measured step of {measured_step_s:.3f} s is beyond 16x of the predicted "
                        f"{model.evaluate(lay, parts, check_memory=False).step_s:.3f} s: not a launch of this layout?")
    return factor, at(factor)


__all__ = ["at_speed", "fit_speed"]
