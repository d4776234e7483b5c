"""One measured step calibrates a device's speed for the planner.

A shared machine runs a training step slower than the fastest runs its micro-benchmarks keep (on
the 2-core CPU machine, launches ran 1.3-1.6x slower than the spec and a one-process layer profile
implied).  ``fit_speed`` finds the one factor on the device's rates that makes a layout's predicted
step equal a measured one.  The layout it is fitted on is then a calibration run, and every other
layout the model predicts is a prediction.

Which rates the factor scales: compute and memory always.  Links only where they are the same
cores' work: CPU ranks talk gloo over loopback TCP, copies through the kernel on the cores that also
compute, so a loaded machine slows them alike (scaling compute alone would make the layouts heavy
in collectives look relatively fast; docs/results/2026-11-22-sweep-and-planner.md).  A GPU's NVLink or network does
not slow with its SMs: there the links stay.

CPU ranks with a core each still slow each other while they compute together (one memory system and
its caches): a pipeline's stages ran 1.1-1.25x their one-process profile, data-parallel ranks, always in
the same pass, 1.3-1.6x (docs/results/2026-11-26-predictions-beyond-calibration.md).  So on CPU ranks the factor is the speed of ranks
computing together, and a compute item during which no other rank computes runs at the spec's own
speed, as the layers were profiled, alone (``StepModel.alone_share`` = the factor).  Fitted on a layout
whose ranks always compute together (data or tensor parallel), the factor is the same either way.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..costs.hardware import DeviceSpec
from .model import PlanModel
from ..layout import Layout
from .space import PlanError


def links_are_cpu_work(device: DeviceSpec) -> bool:
    """CPU ranks whose collectives were measured here (gloo over loopback): their links are CPU work."""
    return device.name == "cpu" and device.collectives is not None


def at_speed(device: DeviceSpec, factor: float, *, links: bool = False) -> DeviceSpec:
    """``device`` with its compute and memory rates times ``factor`` (a GPU's launch and dispatch times
    divided by it); with ``links`` its measured
    collectives' bandwidths too (latencies divided by it) and its cluster's links."""
    out = replace(device.with_streaming_memory(factor),
                  matrix_flops={k: v * factor for k, v in device.matrix_flops.items()},
                  vector_flops={k: v * factor for k, v in device.vector_flops.items()},
                  random_rate=device.random_rate * factor,
                  fresh_page_bandwidth=device.fresh_page_bandwidth * factor)
    if device.gpu is not None:  # a GPU's launches and its host's dispatch take their time at the same speed
        kern = device.gpu
        out = replace(out, gpu=replace(kern, launch_s=kern.launch_s / factor, host_kernel_s=kern.host_kernel_s / factor,
                                       host_kernel_bwd_s=kern.host_kernel_bwd_s / factor,
                                       layer_call_s=kern.layer_call_s / factor))
    if links:
        net = device.cluster
        out = replace(out, network=replace(net, link_bandwidth=net.link_bandwidth * factor,
                                           nic_bandwidth=net.nic_bandwidth * factor),
                      collectives={k: [lat / factor, bw * factor] for k, (lat, bw) in (device.collectives or {}).items()}
                      or device.collectives)
    return out


def fit_speed(model: PlanModel, lay: Layout, parts: list[int], measured_step_s: float, *,
              links: bool | None = None) -> tuple[float, PlanModel]:
    """The factor on the device's rates that makes ``lay``'s predicted step equal one measured step,
    and the plan model at that speed.  ``links`` None: scale the links where they are CPU work
    (``links_are_cpu_work``).  The predicted step falls as the factor grows, so bisection on its
    logarithm finds it."""
    scale_links = links_are_cpu_work(model.device) if links is None else links

    def at(factor: float) -> PlanModel:
        out = model.on_device(at_speed(model.device, factor, links=scale_links))
        if scale_links:  # CPU ranks: only computing together runs at the fitted speed
            out.step_model = replace(out.step_model, alone_share=min(1.0, factor))
        return out

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


__all__ = ["at_speed", "fit_speed", "links_are_cpu_work"]
