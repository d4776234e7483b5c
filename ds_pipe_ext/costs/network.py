"""The cluster a layout runs on, described as it is built, and what each collective costs on it.

A ``ClusterNetwork`` is nodes of ``gpus_per_node`` GPUs joined inside a node by a fabric (NVLink through
NVSwitch, NVLink bridges between pairs, PCIe, or a CPU's memory) and between nodes by ``nics_per_node``
NICs of ``nic_bandwidth`` each.  A collective's group is placed on it (``Placement``: how many nodes it
spans, how many of its ranks share each), and NCCL's own cost model prices it (``costs.nccl``): which
channels its topology search builds over those NICs, each algorithm's bus bandwidth and latency, and
the algorithm and protocol it picks.  So a data-parallel group with 8 ranks a node crosses the network
on 8 rails at once, and one with a rank a node on one.

``system_for`` gives the datasheet systems the named devices imply (DGX A100, DGX H100/H200, H100 PCIe
and NVL servers); a plan's ``--gpus-per-node``, ``--intra-node-gbs``, ``--nics-per-node`` and
``--inter-node-gbs`` replace its fields, and every collective (TP and EP inside the layers included)
reads the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

FABRICS = ("nvswitch", "nvlink-pairs", "pcie", "memory")
_GB = 1e9


class NetworkError(ValueError):
    """A cluster description that cannot be built: the message names the field (or option) and the fix."""


@dataclass(frozen=True)
class ClusterNetwork:
    gpus_per_node: int
    link_bandwidth: float  # bytes/s per GPU, one direction, on the fabric inside a node
    nics_per_node: int
    nic_bandwidth: float  # bytes/s per NIC, one direction
    fabric: str = "nvswitch"  # FABRICS
    compute_capability: int = 90  # NCCL's constants by GPU generation (80 Ampere, 90 Hopper); 0: not NCCL (gloo)
    name: str = "custom"
    nccl_version: str = "2.30"  # whose tuning model prices the collectives (``costs.nccl.VERSIONS``)
    host_cpu: str = "intel"  # NCCL's network overhead and LL ceilings across nodes follow the host's CPU vendor

    def __post_init__(self):
        for f, what in (("gpus_per_node", "GPUs a node"), ("nics_per_node", "NICs a node")):
            value = getattr(self, f)
            if not isinstance(value, int) or value < 1:
                raise NetworkError(f"{f} = {value!r}: {what} is a whole number >= 1")
        for f in ("link_bandwidth", "nic_bandwidth"):
            value = getattr(self, f)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise NetworkError(f"{f} = {value!r}: a bandwidth is a positive number of bytes/s")
        if self.fabric not in FABRICS:
            raise NetworkError(f"fabric {self.fabric!r}: use one of {', '.join(FABRICS)}")
        if self.host_cpu not in ("intel", "amd"):
            raise NetworkError(f"host_cpu {self.host_cpu!r}: intel or amd")
        if self.nccl_version not in ("2.30", "2.8"):
            raise NetworkError(f"nccl_version {self.nccl_version!r}: use 2.30 (today's) or 2.8 (2021's)")

    # -- what NCCL's topology search finds on it (src/graph/search.cc, topo.h) ------------------------
    @property
    def nccl(self) -> bool:
        return self.compute_capability > 0

    @property
    def nvls(self) -> bool:
        """NVLink SHARP: NVSwitch multicast, Hopper on (NCCL's NVLS pattern needs an NVSwitch and sm >= 90)."""
        return self.fabric == "nvswitch" and self.compute_capability >= 90

    def rails(self, ranks_per_node: int) -> int:
        """NICs a group with ``ranks_per_node`` ranks on each node reaches: each GPU's own NICs (its share of the
        node's), at least one.  NCCL's search puts a channel on each NIC near the group's GPUs."""
        return max(1, min(self.nics_per_node, ranks_per_node * self.nics_per_node // self.gpus_per_node))

    def intra_bus_bandwidth(self) -> float:
        """The bus bandwidth NCCL's rings reach inside a node, bytes/s: on NVLink, its channels at the search's
        speeds fill the GPU's links at NCCL's per-link figure (``SM80_NVLINK_BW`` 20.0, ``SM90_NVLINK_BW`` 20.6
        GB/s per 25 GB/s link: 240 GB/s on an A100's 12 links, 371 on an H100's 18); PCIe and a CPU's memory
        at the link's own figure."""
        if self.fabric in ("nvswitch", "nvlink-pairs") and self.nccl:
            per_link = 20.6 if self.compute_capability >= 90 else 20.0
            return self.link_bandwidth / (25 * _GB) * per_link * _GB
        return self.link_bandwidth

    def nic_channel_speed(self) -> float:
        """Bytes/s of one channel through one NIC: the fastest of the search's inter-node speeds that the NIC
        carries (``speedArrayInter``, ``sm90SpeedArrayInter``: 48 GB/s on a 400 Gb/s NIC, 24 on a 200 Gb/s one)."""
        if not self.nccl:
            return self.nic_bandwidth
        speeds = search_speeds(self, inter=True)
        return next((s for s in speeds if s <= self.nic_bandwidth / _GB), speeds[-1]) * _GB

    def worst(self, groups) -> "Placement":
        """The slowest-placed of a layout's groups of one kind (the most nodes, then the fewest ranks on a
        node: the fewest rails): every rank of a step waits for its own group, and the step for the slowest."""
        return worst_placement(tuple(tuple(g) for g in groups), self.gpus_per_node)

    def tp_placement(self, tp: int) -> "Placement":
        """A TP group: ``tp`` consecutive ranks from a multiple of ``tp`` (TP is the fastest axis)."""
        return _tp_placement(tp, self.gpus_per_node)

    def ep_placement(self, tp: int, ep: int) -> "Placement":
        """An expert-parallel group: ``ep`` consecutive ranks of a stage (``parallel.topology.rank_groups``), TP
        ranks first; ``tp`` does not move it."""
        return _tp_placement(ep, self.gpus_per_node)


# NCCL 2.30.7's search speeds, GB/s a channel (src/graph/search.cc): the speeds it tries, fastest first, for
# a channel inside a node and across nodes; Hopper's own arrays (``sm90SpeedArrayIntra/Inter``)
INTRA_SPEEDS = {"ampere": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
                "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)}
INTER_SPEEDS = {"ampere": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4,
                           1.2, 0.24, 0.12),
                "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2,
                           0.24, 0.12)}


def search_speeds(net: "ClusterNetwork", *, inter: bool) -> tuple:
    generation = "hopper" if net.compute_capability >= 90 else "ampere"
    return (INTER_SPEEDS if inter else INTRA_SPEEDS)[generation]


@lru_cache(maxsize=256)
def _tp_placement(tp: int, per_node: int) -> "Placement":
    return worst_placement(tuple(tuple(range(s, s + tp)) for s in range(0, tp * per_node, tp)), per_node)


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit: ``size`` ranks over ``nodes`` nodes, between ``min_per_node`` and
    ``max_per_node`` of them on each."""
    size: int
    nodes: int
    min_per_node: int
    max_per_node: int

    @classmethod
    def of(cls, ranks, gpus_per_node: int) -> "Placement":
        counts: dict[int, int] = {}
        for r in ranks:
            counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
        if not counts:
            return cls(0, 0, 0, 0)
        return cls(sum(counts.values()), len(counts), min(counts.values()), max(counts.values()))

    @property
    def ranks_per_node(self) -> float:
        return self.size / self.nodes if self.nodes else 0.0

    def describe(self) -> str:
        if self.size <= 1:
            return "one rank"
        if self.nodes == 1:
            return f"{self.size} ranks in one node"
        per = (f"{self.min_per_node}" if self.min_per_node == self.max_per_node
               else f"{self.min_per_node}-{self.max_per_node}")
        return f"{self.size} ranks over {self.nodes} nodes, {per} a node"


@lru_cache(maxsize=4096)
def worst_placement(groups: tuple, per_node: int) -> Placement:
    worst = None
    seen = set()
    for g in groups:
        key = (g[0] % per_node, len(g), g[1] - g[0] if len(g) > 1 else 0)
        if key in seen and all(b - a == key[2] for a, b in zip(g, g[1:])):
            continue  # a group shifted by whole nodes is placed alike
        seen.add(key)
        p = Placement.of(g, per_node)
        if worst is None or (p.size, p.nodes, -p.min_per_node) > (worst.size, worst.nodes, -worst.min_per_node):
            worst = p
    return worst or Placement(1, 1, 1, 1)


# -- the datasheet systems --------------------------------------------------------------------------
def system_for(device) -> ClusterNetwork:
    """The system a device spec implies, from its datasheets: NVIDIA's DGX A100 (8 GPUs on NVSwitch, NVLink 3
    at 300 GB/s a direction, 8 x 200 Gb/s HDR NICs, AMD hosts), DGX H100 / H200 (Intel hosts) (NVLink 4 at 450 GB/s, 8 x 400 Gb/s NDR),
    H100 PCIe servers (8 GPUs on PCIe Gen5 x16, 64 GB/s) and H100 NVL pairs (NVLink bridges, 300 GB/s, inside
    each pair), both with a 400 Gb/s NIC a GPU as the device spec says; a CPU: its ranks share one memory."""
    return _system(getattr(device, "name", str(device)), int(getattr(device, "gpus_per_node", 8) or 1),
                   float(device.intra_node_bandwidth), float(device.inter_node_bandwidth))


@lru_cache(maxsize=64)
def _system(name: str, per_node: int, link: float, nic: float) -> ClusterNetwork:
    if name == "cpu":
        return ClusterNetwork(per_node, link, 1, nic, fabric="memory", compute_capability=0, name="cpu ranks")
    if name.startswith("a100"):
        return ClusterNetwork(per_node, link, per_node, nic, fabric="nvswitch", compute_capability=80, name="DGX A100",
                              host_cpu="amd")  # DGX A100: AMD EPYC hosts
    if name == "h100-pcie":
        return ClusterNetwork(per_node, link, per_node, nic, fabric="pcie", name="H100 PCIe server")
    if name == "h100-nvl":
        return ClusterNetwork(per_node, link, per_node, nic, fabric="nvlink-pairs", name="H100 NVL server")
    if name in ("h100-sxm", "h200"):
        return ClusterNetwork(per_node, link, per_node, nic, fabric="nvswitch", name=f"DGX {name.split('-')[0].upper()}")
    # a measured GPU ("cuda") or a SPEC.toml: a Hopper-like node of its own figures
    return ClusterNetwork(per_node, link, per_node, nic, fabric="nvswitch", name=f"{name} node")


# the command-line options that set each field, for errors that name what the user typed
OPTIONS = {"gpus_per_node": "--gpus-per-node", "link_bandwidth": "--intra-node-gbs",
           "nics_per_node": "--nics-per-node", "nic_bandwidth": "--inter-node-gbs", "fabric": "--fabric",
           "nccl_version": "--nccl"}


def with_overrides(network: ClusterNetwork, *, gpus_per_node=None, intra_node_gbs=None, nics_per_node=None,
                   inter_node_gbs=None, fabric=None, nccl=None) -> ClusterNetwork:
    """``network`` with the options a user gave (None: keep); a NIC count follows the GPUs a node where only
    those are given (one NIC a GPU, as the datasheet systems have).  A bad value is refused naming its option."""
    given = {"gpus_per_node": gpus_per_node, "link_bandwidth": intra_node_gbs, "nics_per_node": nics_per_node,
             "nic_bandwidth": inter_node_gbs, "fabric": fabric, "nccl_version": nccl}
    for key, value in given.items():
        if value is None or key in ("fabric", "nccl_version"):
            continue
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise NetworkError(f"{OPTIONS[key]} {value}: must be a positive number")
        if key in ("gpus_per_node", "nics_per_node") and int(value) != value:
            raise NetworkError(f"{OPTIONS[key]} {value}: must be a whole number")
    changes = {k: v for k, v in given.items() if v is not None}
    for key in ("link_bandwidth", "nic_bandwidth"):
        if key in changes:
            changes[key] = float(changes[key]) * _GB
    if gpus_per_node is not None and nics_per_node is None and network.nics_per_node == network.gpus_per_node:
        changes["nics_per_node"] = int(gpus_per_node)
    try:
        return replace(network, **changes)
    except NetworkError as e:
        field_name = str(e).split(" ")[0]
        raise NetworkError(f"{OPTIONS.get(field_name, field_name)}: {e}") from None


def describe(network: ClusterNetwork) -> str:
    return (f"{network.name}: {network.gpus_per_node} GPUs a node on {network.fabric} "
            f"({network.link_bandwidth / _GB:g} GB/s a GPU), {network.nics_per_node} x "
            f"{network.nic_bandwidth / _GB:g} GB/s NICs a node")


__all__ = ["ClusterNetwork", "FABRICS", "INTER_SPEEDS", "INTRA_SPEEDS", "NetworkError", "OPTIONS", "Placement",
           "describe", "search_speeds", "system_for", "with_overrides"]
