"""What a NCCL collective costs: NCCL's own cost model, read from its source, not a fitted number.

NCCL picks an algorithm and a protocol for each call from a model of its time (``src/graph/tuning.cc``,
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``), latency + bytes / algorithm bandwidth, over the channels
its topology search built (``src/graph/search.cc``).  This module follows NCCL 2.30.7 (e7fcc7da):

- **channels**: inside a node, rings at the search's intra speeds fill the GPU's NVLinks at NCCL's per-link
  figure (``ClusterNetwork.intra_bus_bandwidth``); across nodes, one channel a NIC the group's GPUs reach, at
  the fastest inter speed the NIC carries and the GPUs' NVLinks carry that many of (``_inter_channels``);
- **bus bandwidth** per algorithm: ring and tree (with their protocol caps per channel), NVLS inside an
  NVSwitch node (Hopper), NVLS-tree across nodes, PAT for all-gather and reduce-scatter with one GPU a node;
- **latency**: the base latency plus a hop per step, NVLink or network, with this version's constants;
- the pick: the algorithm and protocol of least time for the size, as NCCL's tuner picks it.

All-to-all is grouped send/receive: each rank's bytes to the other nodes leave through the node's NICs on
the destination's rail (PXN, on by default), the rest over NVLink.  A send between pipeline stages is one
channel's worth of its link.

``NCCL_2_8`` holds the 2021 release's constants (v2.8.4-1) for the runs of that year: no NVLS, no PAT, a
tree hop of 28 us, A100 rings capped at 235 GB/s; its channels are taken as 2.30's search builds them (2.8's
speed array also gives a 200 Gb/s NIC 24 GB/s a channel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .network import ClusterNetwork, Placement, search_speeds

SIMPLE, LL128, LL = "Simple", "LL128", "LL"
PROTOCOLS = (LL, LL128, SIMPLE)
_P = {LL: 0, LL128: 1, SIMPLE: 2}


@dataclass(frozen=True)
class NcclVersion:
    """One release's tuning constants (us and GB/s), as ``tuning.cc`` sets them."""
    name: str
    base: dict  # algorithm -> (LL, LL128, Simple) base latency
    nvlink: dict  # algorithm -> hop latency on NVLink
    pci: dict
    net: dict
    ll_max: tuple  # llMaxBws: [cc index or host CPU][N1, N2, N4]
    ring_ll128_per_ch: tuple  # [cc index] per-channel cap
    tree_ll128_per_ch: tuple  # [cc index][N1, N2, N4]
    tree_per_ch: tuple  # [cc index][N1, N2, N4]
    nvls_tree_per_ch: tuple  # [cc index][N1, N2, N4]
    nvls_efficiency: tuple  # [cc index]
    algorithms: tuple  # what this release has
    # where the releases' model differs beyond its tables
    ring_ll_factor: float = 0.5  # a ring's LL bus bandwidth: this share of Simple's (2.8: a quarter)
    ampere_ring_cap: float = math.inf  # GB/s: 2.8 capped every A100 bus bandwidth at 235
    one_a_node_tree_latency: bool = True  # with one rank a node every hop pays the tree's network latency (2.30)
    net_overhead: bool = True  # a ring step inside a node across nodes costs at least the host's post overhead
    ll_multinode_intra_factor: float = 1.0  # 2.8: an LL step inside a node costs 1.8x once the ring leaves it
    plateau_by_ranks: bool = False  # 2.8: the ring's plateau from ranks / 16 x 64 KiB on, at 1.9x

    def ring_plateau(self, nbytes: float, ranks: int, channels: int, compute_capability: int) -> float:
        """The factor on a multi-node Simple ring all-reduce's latency for its plateau (``ncclTopoGetAlgoTime``)."""
        if self.plateau_by_ranks:
            return 1.9 if nbytes >= ranks / 16.0 * 65536 else 1.0
        if nbytes / (channels * ranks) >= 64:
            return 1.4 if compute_capability >= 80 else 1.9
        return 1.0


NCCL_2_30 = NcclVersion(
    "2.30.7",
    base={"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0),
          "pat": (8.0, 8.0, 8.0)},
    nvlink={"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25),
            "pat": (0, 0, 4.0)},
    pci={"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0), "pat": (0, 0, 4.0)},
    net={"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9),
         "pat": (0, 0, 14)},
    # Volta-N1/Intel-N2/Intel-N4, Ampere-N1/AMD-N2/AMD-N4, Hopper-N1/..
    ll_max=((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0)),
    ring_ll128_per_ch=(20.0, 20.0, 36.7),
    tree_ll128_per_ch=((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0)),
    tree_per_ch=((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0)),
    nvls_tree_per_ch=((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5)),
    nvls_efficiency=(0.0, 0.0, 0.85),
    algorithms=("ring", "tree", "nvls", "nvls_tree", "pat"),
)

NCCL_2_8 = NcclVersion(
    "2.8.4",
    base={"tree": (4.4, 4.4, 0), "ring": (3.6, 10.0, 8.4)},
    nvlink={"tree": (0.52, 1.25, 28), "ring": (0.47, 1.9, 3.4)},
    pci={"tree": (1.0, 1.9, 28), "ring": (1.0, 2.5, 5.7)},
    net={"tree": (5.0, 8.5, 28), "ring": (2.7, 4.0, 9.6)},
    ll_max=((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (87.7, 22.5, 19.0)),
    ring_ll128_per_ch=(16.9, 16.9, 16.9),  # 2.8 capped LL128 per collective; all-reduce's figure
    tree_ll128_per_ch=((16.9,) * 3,) * 3,
    tree_per_ch=((26.5, 18.5, 10.0), (24.0, 22.5, 16.0), (24.0, 22.5, 16.0)),
    nvls_tree_per_ch=((0.0,) * 3,) * 3,
    nvls_efficiency=(0.0, 0.0, 0.0),
    algorithms=("ring", "tree"),
    ring_ll_factor=0.25, ampere_ring_cap=235.0, one_a_node_tree_latency=False, net_overhead=False,
    ll_multinode_intra_factor=1.8, plateau_by_ranks=True,
)
VERSIONS = {"2.30": NCCL_2_30, "2.8": NCCL_2_8}

# Trees are not perfectly on the model for medium sizes: NCCL's static correction, powers of two 64 B - 256 MB
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
_GB = 1e9


@dataclass(frozen=True)
class Collective:
    """One collective as NCCL would run it: its algorithm and protocol, latency, bus bandwidth (bytes/s, the
    nccl-tests convention: a ring all-reduce moves 2 (n - 1) / n of the bytes at it) and time."""
    kind: str
    algorithm: str
    protocol: str
    latency_s: float
    bus_bandwidth: float
    time_s: float

    def describe(self) -> str:
        return (f"{self.algorithm}/{self.protocol}, bus {self.bus_bandwidth / _GB:.0f} GB/s, "
                f"latency {self.latency_s * 1e6:.0f} us")


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def _cc_index(net: ClusterNetwork) -> int:
    return 2 if net.compute_capability >= 90 else (1 if net.compute_capability >= 80 else 0)


def _intra_channels(net: ClusterNetwork, ranks: int) -> tuple[int, float]:
    """(channels, GB/s a channel) of a ring inside a node: the fastest intra speed at which at least one channel
    fits the GPU's NCCL bandwidth, as many channels as fit, then doubled at half speed where NCCL duplicates
    channels (``ncclTopoDupChannels``)."""
    total = net.intra_bus_bandwidth() / _GB
    if not net.nccl or net.fabric not in ("nvswitch", "nvlink-pairs"):
        return 1, total
    speeds = search_speeds(net, inter=False)
    speed = next((s for s in speeds if s <= total), speeds[-1])
    channels = max(1, int(total // speed))
    if speed >= 25 and not (net.compute_capability > 80 and speed < 50 and channels > 4):
        channels, speed = 2 * channels, speed / 2
    return channels, speed


def _inter_channels(net: ClusterNetwork, per_node: int) -> tuple[int, float]:
    """(channels, GB/s a channel) across nodes: a channel a NIC the group reaches (``rails``), at the fastest of
    the search's inter speeds that the NIC carries and that the GPUs' NVLinks carry that many channels of (a
    ring enters and leaves each GPU once a channel); the most bus bandwidth of those speeds, as the search keeps
    (on a DGX H100: 8 x 45 GB/s, since 8 x 48 exceeds an H100's 371 GB/s of NVLink; a DGX A100: 8 x 24)."""
    rails = net.rails(per_node)
    speeds = search_speeds(net, inter=True)
    nic = net.nic_bandwidth / _GB if not net.nccl else net.nic_channel_speed() / _GB
    intra = net.intra_bus_bandwidth() / _GB
    best = (1, min(speeds[-1], nic))
    for s in speeds:
        if s > nic:
            continue
        channels = rails if per_node <= 1 else min(rails, int(intra // s))
        if channels >= 1 and channels * s > best[0] * best[1]:
            best = (channels, s)
        if s < 0.49 * best[1]:  # the search stops lowering the speed below half its best
            break
    return best


def collective(kind: str, payload_bytes: float, placement: Placement, net: ClusterNetwork, *,
               version: NcclVersion | None = None, algorithm: str | None = None) -> Collective:
    """``kind`` ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p") of ``payload_bytes`` (the
    whole buffer: an all-gather's output, a reduce-scatter's input) over a group placed so on ``net``, as
    ``version`` of NCCL prices and picks it (None: the network's ``nccl_version``).  A network that is not
    NCCL's (CPU ranks): the ring formulas on its links, no latency.  ``algorithm``: only that one, as
    ``NCCL_ALGO`` forces it (a measurement taken so)."""
    if version is None:  # the network's own release: a pure function of hashable arguments, which a plan asks
        return _collective_cached(kind, payload_bytes, placement, net, algorithm)  # tens of thousands of times
    return _collective(kind, payload_bytes, placement, net, version, algorithm)


@lru_cache(maxsize=1 << 16)
def _collective_cached(kind: str, payload_bytes: float, placement: Placement, net: ClusterNetwork,
                       algorithm: str | None) -> Collective:
    return _collective(kind, payload_bytes, placement, net, VERSIONS[net.nccl_version], algorithm)


def _collective(kind: str, payload_bytes: float, placement: Placement, net: ClusterNetwork, version: NcclVersion,
                algorithm: str | None) -> Collective:
    n = placement.size
    if n <= 1 or payload_bytes <= 0:
        return Collective(kind, "none", "", 0.0, math.inf, 0.0)
    if kind == "p2p":
        return _p2p(payload_bytes, placement, net)
    if kind == "all-to-all":
        return _all_to_all(payload_bytes, placement, net, version)
    if kind not in ("all-reduce", "all-gather", "reduce-scatter"):
        raise ValueError(f"unknown collective {kind!r}")
    if not net.nccl:
        bus = (net.link_bandwidth if placement.nodes == 1
               else min(net.link_bandwidth, net.rails(placement.min_per_node) * net.nic_bandwidth))
        steps = 2.0 if kind == "all-reduce" else 1.0
        return Collective(kind, "ring", "gloo", 0.0, bus, steps * (n - 1) / n * payload_bytes / bus)
    best = None
    for cand in _candidates(kind, payload_bytes, placement, net, version):
        if algorithm is not None and cand.algorithm != algorithm:
            continue
        if best is None or cand.time_s < best.time_s:
            best = cand
    if best is None:
        raise ValueError(f"NCCL {version.name} runs no {algorithm} {kind} over {placement.describe()}")
    return best


def _candidates(kind: str, nbytes: float, pl: Placement, net: ClusterNetwork, v: NcclVersion):
    n, nodes = pl.size, pl.nodes
    cc = _cc_index(net)
    index2 = min(nodes, 3) - 1
    ppn = pl.ranks_per_node
    all_reduce = kind == "all-reduce"
    nsteps = 2 * (n - 1) if all_reduce else n - 1
    intra_hw = v.nvlink if net.fabric in ("nvswitch", "nvlink-pairs") and not (
        net.fabric == "nvlink-pairs" and pl.max_per_node > 2) else v.pci
    ll128_ok = intra_hw is v.nvlink  # LL128 needs NVLink inside the node (typeIntra <= PATH_NVB)
    channels, speed = _intra_channels(net, n) if nodes == 1 else _inter_channels(net, pl.min_per_node)
    if net.fabric == "nvlink-pairs" and pl.max_per_node > 2:  # beyond a pair the ring crosses PCIe Gen5
        channels, speed = 1, min(speed * channels, 64.0) if nodes == 1 else speed
    host_amd = net.host_cpu == "amd"
    ll_max = v.ll_max[cc if nodes == 1 else (1 if host_amd else 0)][index2]
    net_overhead = 2.0 if host_amd else 1.0

    def latency(algorithm: str, p: int) -> float:
        base = v.base[algorithm][p]
        intra = intra_hw[algorithm][p]
        inter = v.net["tree"][p] if ppn == 1 and v.one_a_node_tree_latency else v.net[algorithm][p]
        if algorithm == "ring":
            if nodes > 1 and v.net_overhead:
                intra = max(intra, net_overhead * (3 if p == 2 else 1))
            if nodes > 1 and p == 0:
                intra *= v.ll_multinode_intra_factor
            inter_steps = (2 if all_reduce else 1) * (nodes - 1)
            return base + (nsteps - inter_steps) * intra + inter_steps * inter
        if algorithm == "tree":
            return base + 2 * ((n // nodes - 1) * intra + _log2i(nodes) * inter)
        if algorithm == "nvls":
            return intra + (inter if nodes > 1 else 0.0)
        if algorithm == "nvls_tree":
            return base + intra + 2 * _log2i(nodes) * inter
        return base + _log2i(nodes) * (inter / 3.5) + n * 2.8  # pat

    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    for algorithm in v.algorithms:
        if algorithm == "tree" and not all_reduce:
            continue
        if algorithm == "pat" and (all_reduce or nodes != n or nodes == 1):
            continue
        if algorithm in ("nvls", "nvls_tree") and not (net.nvls and ppn >= 2 and v.nvls_efficiency[cc] > 0):
            continue
        if algorithm == "nvls" and nodes > 1:  # across nodes only with CollNet (SHARP), which is not modelled
            continue
        if algorithm == "nvls_tree" and (nodes == 1 or not all_reduce):
            continue
        for proto in PROTOCOLS:
            p = _P[proto]
            if algorithm in ("nvls", "nvls_tree", "pat") and proto != SIMPLE:
                continue
            if proto == LL128 and not ll128_ok:
                continue
            bw = speed
            nch = channels
            if algorithm in ("nvls", "nvls_tree"):
                nch = max(2, int(pl.min_per_node))
                nvls_speed = speed if nodes > 1 else _nvls_intra_speed(net, nch)
                intra_bw = nvls_speed * v.nvls_efficiency[cc] * (nch - 1) / nch
                intra_bw *= 2.0 if all_reduce else (ppn - 1) / ppn
                inter_bw = nvls_speed * (2 if nodes <= 2 and algorithm == "nvls_tree" else 1)
                bw = min(intra_bw, inter_bw if nodes > 1 else math.inf,
                         v.nvls_tree_per_ch[cc][index2] if algorithm == "nvls_tree" else math.inf)
            bus = nch * bw
            if cc == 1:
                bus = min(bus, v.ampere_ring_cap)
            if algorithm == "ring" and proto == LL:
                bus = min(ll_max, bus * v.ring_ll_factor)
            if algorithm == "ring" and proto == LL128:
                bus = min(bus * 0.92, nch * v.ring_ll128_per_ch[cc])
            if algorithm == "tree":
                bus = min(bus * 0.92, nch * v.tree_per_ch[cc][index2])
                if proto == LL:
                    bus = min(bus / 3.8, ll_max)
                if proto == LL128:
                    bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), nch * v.tree_ll128_per_ch[cc][index2])
            if algorithm == "pat":
                bus *= 0.75
            if bus <= 0:
                continue
            # algorithm bandwidth: what the whole buffer moves at
            if algorithm in ("ring", "nvls", "nvls_tree") and (all_reduce or algorithm == "ring"):
                alg = bus * n / nsteps
            elif algorithm == "tree":
                alg = bus * 0.5
            else:
                alg = bus  # NVLS and PAT all-gather / reduce-scatter: no conversion
            if algorithm == "tree" and 0 <= log_size < 23:
                alg *= _TREE_CORRECTION[p][log_size]
            lat = latency(algorithm, p)
            if algorithm == "ring" and proto == SIMPLE and nodes > 1 and all_reduce:
                lat *= v.ring_plateau(nbytes, n, channels, net.compute_capability)
            seconds = lat * 1e-6 + nbytes / (alg * _GB)
            # report the bus bandwidth in the ring convention, the one every formula here uses
            ring_bus = (2.0 if all_reduce else 1.0) * (n - 1) / n * nbytes / max(seconds - lat * 1e-6, 1e-30)
            yield Collective("all-reduce" if all_reduce else kind, algorithm, proto, lat * 1e-6, ring_bus, seconds)


def _nvls_intra_speed(net: ClusterNetwork, heads: int) -> float:
    """The speed NVLS's search settles on inside a node: every GPU a head (``minChannels = maxChannels``), the
    fastest intra speed that many channels fit in the GPU's NVLink (40 GB/s on an H100 with 8 heads)."""
    total = net.intra_bus_bandwidth() / _GB
    speeds = search_speeds(net, inter=False)
    return next((s for s in speeds if s * heads <= total), speeds[-1])


def _all_to_all(nbytes: float, pl: Placement, net: ClusterNetwork, v: NcclVersion) -> Collective:
    """Grouped send/receive: a rank keeps 1/n of its bytes and sends 1/n to each other rank; the node's bytes to
    other nodes leave through its NICs on the destination's rail (PXN), the rest over NVLink; one send's latency."""
    n, per = pl.size, pl.min_per_node
    intra_bytes = nbytes * (pl.max_per_node - 1) / n
    remote = nbytes * (n - pl.max_per_node) / n
    intra_bw = net.intra_bus_bandwidth()
    seconds = intra_bytes / intra_bw
    latency = (v.base["ring"][2] + v.nvlink["ring"][2]) * 1e-6
    if pl.nodes > 1:
        rails = net.rails(per)
        nic = net.nic_channel_speed()
        seconds = max(seconds, per * remote / (rails * nic) + remote / intra_bw)
        latency = (v.base["ring"][2] + v.net["ring"][2]) * 1e-6
    bus = (n - 1) / n * nbytes / seconds if seconds else math.inf
    return Collective("all-to-all", "p2p", SIMPLE, latency, bus, latency + seconds)


def _p2p(nbytes: float, pl: Placement, net: ClusterNetwork) -> Collective:
    """A send between two ranks: NVLink inside a node; between nodes, the GPU's share of its node's NICs (every
    rank of a stage sends to its peer at once: a NIC a GPU on a DGX, half of one where 4 NICs serve 8 GPUs); no
    start-up cost, as the pipeline's sends are priced."""
    nic = net.nic_channel_speed() if net.nccl else net.nic_bandwidth
    bw = net.intra_bus_bandwidth() if pl.nodes == 1 else nic * min(1.0, net.nics_per_node / net.gpus_per_node)
    return Collective("p2p", "p2p", SIMPLE, 0.0, bw, nbytes / bw)


# NCCL 2.8's ring / Simple latency constants, in seconds
RING_BASE_S, NVLINK_HOP_S, NET_HOP_S = (NCCL_2_8.base["ring"][2] * 1e-6, NCCL_2_8.nvlink["ring"][2] * 1e-6,
                                        NCCL_2_8.net["ring"][2] * 1e-6)


def ring_latency_s(kind: str, ranks: int, ranks_per_node: int) -> float:
    """NCCL 2.8's ring/Simple latency of ``kind`` over ``ranks`` ranks, ``ranks_per_node`` a node (the constants
    the ZeRO-3 rows' prefetch chain was first priced with; ``collective`` now prices every call)."""
    if ranks <= 1:
        return 0.0
    nodes = math.ceil(ranks / max(1, min(ranks_per_node, ranks)))
    passes = 2 if kind == "all-reduce" else 1
    steps, inter = passes * (ranks - 1), passes * (nodes - 1)
    return RING_BASE_S + (steps - inter) * NVLINK_HOP_S + inter * NET_HOP_S

__all__ = ["Collective", "NCCL_2_30", "NCCL_2_8", "NcclVersion", "VERSIONS", "collective", "ring_latency_s",
           "RING_BASE_S", "NVLINK_HOP_S", "NET_HOP_S"]
