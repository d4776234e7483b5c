"""What a plan runs on: a device (a named one, "cpu" measured here, or a SPEC.toml) and its cluster's links."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..costs import analytic as A
from ..costs.hardware import DeviceSpec, get_device
from .space import PlanError


def plan_device(name: str) -> DeviceSpec:
    """A named device (``get_device``: with its calibrated efficiencies), "cpu" (measured here), or a
    SPEC.toml whose keys are ``DeviceSpec``'s fields (a ``base`` key starts from a named device)."""
    if name.endswith(".toml"):
        import tomllib
        from pathlib import Path

        try:
            data = tomllib.loads(Path(name).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise PlanError(f"--device {name}: cannot read the device spec ({e})") from None
        base = data.pop("base", None)
        try:
            return replace(plan_device(base), **data) if base else DeviceSpec(**data)
        except TypeError as e:
            raise PlanError(f"--device {name}: {e}; the keys are DeviceSpec's fields "
                            f"({', '.join(DeviceSpec.__dataclass_fields__)}) or base = \"a100\"") from None
    try:
        device = get_device(name)
    except A.AnalyticError as e:
        raise PlanError(f"--device: {e}, or a SPEC.toml") from None
    return device


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    intra_node_bandwidth: float  # bytes/s per GPU, one direction
    inter_node_bandwidth: float

    def bandwidth(self, span: int) -> float:
        """A group whose ranks span ``span`` consecutive GPUs stays inside a node only if they fit."""
        return self.intra_node_bandwidth if span <= self.gpus_per_node else self.inter_node_bandwidth
