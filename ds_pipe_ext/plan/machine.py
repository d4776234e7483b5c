"""What a plan runs on: a device (a named one, "cpu" measured here, or a SPEC.toml) and its cluster's network."""

from __future__ import annotations

from dataclasses import replace

from ..costs import analytic as A
from ..costs.hardware import DeviceSpec, get_device
from ..costs.network import ClusterNetwork, NetworkError, system_for, with_overrides
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


def Cluster(gpus_per_node: int, intra_node_bandwidth: float, inter_node_bandwidth: float, **kwargs) -> ClusterNetwork:
    """A cluster of ``gpus_per_node`` GPUs a node joined by ``intra_node_bandwidth`` (bytes/s a GPU) inside a node
    and one NIC of ``inter_node_bandwidth`` a GPU between nodes (DGX's rails); ``kwargs``: ``ClusterNetwork``'s
    other fields (fabric, compute capability, name, NCCL version)."""
    return ClusterNetwork(gpus_per_node, intra_node_bandwidth, kwargs.pop("nics_per_node", gpus_per_node),
                          inter_node_bandwidth, **kwargs)


def plan_cluster(device: DeviceSpec, *, gpus=None, gpus_per_node=None, intra_node_gbs=None, nics_per_node=None,
                 inter_node_gbs=None, fabric=None, nccl=None) -> ClusterNetwork:
    """The system ``device`` implies (``costs.network.system_for``) with the user's options applied; a CPU's
    ranks are one node of ``gpus`` unless told otherwise.  A bad option is refused naming it."""
    network = system_for(device)
    if device.name == "cpu" and gpus_per_node is None and gpus:
        gpus_per_node = gpus
    try:
        return with_overrides(network, gpus_per_node=gpus_per_node, intra_node_gbs=intra_node_gbs,
                              nics_per_node=nics_per_node, inter_node_gbs=inter_node_gbs, fabric=fabric, nccl=nccl)
    except NetworkError as e:
        raise PlanError(str(e)) from None


def add_cluster_arguments(parser) -> None:
    """The options that describe the cluster, shared by plan, estimate and simulate."""
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs a node (default: the device's system, 8; "
                                                                        "cpu: all ranks)")
    parser.add_argument("--intra-node-gbs", type=float, default=None,
                        help="GB/s a GPU, one direction, inside a node (default: the device's NVLink or PCIe)")
    parser.add_argument("--nics-per-node", type=int, default=None,
                        help="NICs a node (default: one a GPU, as DGX A100 / H100 / H200 have)")
    parser.add_argument("--inter-node-gbs", type=float, default=None,
                        help="GB/s a NIC, one direction (default: the device's, 25 on A100 HDR, 50 on H100 NDR)")
    parser.add_argument("--fabric", default=None, choices=["nvswitch", "nvlink-pairs", "pcie"],
                        help="what joins a node's GPUs (default: the device's system)")
    parser.add_argument("--nccl", default=None, choices=["2.30", "2.8"],
                        help="whose NCCL tuning model prices the collectives (default 2.30; 2.8: 2021's runs)")


def cluster_from_args(device: DeviceSpec, args) -> ClusterNetwork:
    return plan_cluster(device, gpus=getattr(args, "gpus", None),
                        **{k: getattr(args, k, None) for k in ("gpus_per_node", "intra_node_gbs", "nics_per_node",
                                                               "inter_node_gbs", "fabric", "nccl")})
