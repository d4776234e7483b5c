"""The fixed start-up cost of a NCCL collective: NCCL's own latency model, not a fitted number.

NCCL chooses an algorithm and protocol per call from a model of its time, latency + bytes / bandwidth
(``src/graph/tuning.cc``).  For the ring algorithm with the Simple protocol (the one bandwidth-bound
calls use) its latency is a base cost plus one hop's cost per ring step, where a step inside a node
crosses NVLink and a step between nodes the network:

    latency = base + (steps - inter_steps) * nvlink_hop + inter_steps * net_hop
    steps = n - 1 (all-gather, reduce-scatter), 2 (n - 1) (all-reduce); inter_steps likewise over nodes

A collective over a few ranks inside a node costs tens of microseconds; over 1,536 ranks it costs about
seven milliseconds, whatever its size.  That is why ZeRO-3's per-module all-gathers slow down as the
data-parallel group grows even when each one carries less: the bandwidth term shrinks, this one grows.
"""

from __future__ import annotations

import math

# NCCL 2.8's tuning model (src/graph/tuning.cc: baseLat and hwLat, Ring / Simple), in seconds
RING_BASE_S = 8.4e-6
NVLINK_HOP_S = 3.4e-6
NET_HOP_S = 9.6e-6


def ring_latency_s(kind: str, ranks: int, ranks_per_node: int) -> float:
    """NCCL's latency of one ring collective of ``kind`` over ``ranks`` ranks, ``ranks_per_node`` of them on
    each node (a group inside one node never crosses the network)."""
    if ranks <= 1:
        return 0.0
    nodes = math.ceil(ranks / max(1, min(ranks_per_node, ranks)))
    passes = 2 if kind == "all-reduce" else 1  # reduce-scatter then all-gather
    steps, inter = passes * (ranks - 1), passes * (nodes - 1)
    return RING_BASE_S + (steps - inter) * NVLINK_HOP_S + inter * NET_HOP_S


__all__ = ["ring_latency_s", "RING_BASE_S", "NVLINK_HOP_S", "NET_HOP_S"]
