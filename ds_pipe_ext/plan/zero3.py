"""One micro-batch under ZeRO-3 on a GPU: DeepSpeed's parameter prefetch against the compute it hides under.

DeepSpeed's ZeRO-3 (``PartitionedParameterCoordinator.fetch_sub_module``) gathers a module's parameters
before it runs and, once the module's order is traced, prefetches the next modules' parameters while the
current one computes: at least one module ahead (the first parameter is taken whatever
``stage3_prefetch_bucket_size`` says, more while the bucket has room).  A module's parameters are
released after its forward, so with full activation recompute the backward gathers them twice: once for
the replayed forward and once for the backward.  With ``overlap_comm`` the gradients' reduce-scatter runs
on its own stream and shares the link with the next gathers; without it the reduction waits.

So a pass is a chain of (compute, traffic) events: the first event's gather is exposed, then each event
takes the longer of its compute and the traffic the link carries meanwhile (the next event's gather and,
overlapped, the previous event's reduce-scatter).  Pure: plain lists in, seconds out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class ModuleTraffic:
    """One module (the parameters one op owns) of a layer: its compute and its ZeRO-3 traffic."""
    forward_s: float
    backward_s: float  # the backward proper (without a replayed forward)
    gather_s: float  # all-gather of its parameters
    reduce_s: float  # reduce-scatter of its gradients


def chain_s(events: Sequence[tuple[float, float, float]], *, overlap_reduce: bool) -> float:
    """Seconds of a sequence of (compute, gather, reduce) events, the next gather prefetched during the
    current compute and, where ``overlap_reduce``, the previous reduction beside it on the link."""
    if not events:
        return 0.0
    total = events[0][1]
    for k, (compute, _gather, reduce) in enumerate(events):
        link = events[k + 1][1] if k + 1 < len(events) else 0.0
        if overlap_reduce:
            link += events[k - 1][2] if k else 0.0
            total += max(compute, link)
        else:
            total += max(compute, link) + reduce
    if overlap_reduce:
        total += events[-1][2]  # the last reduction has nothing after it to hide under
    return total


def microbatch_s(layers: Sequence[Sequence[ModuleTraffic]], *, recompute: bool, overlap_reduce: bool) -> float:
    """One micro-batch's forward and backward through ``layers`` (each a list of modules in forward order)
    with ZeRO-3's traffic: the forward pass, then per layer from the last the replayed forward (under
    full recompute, gathering again) and the backward in reverse module order."""
    forward = [(m.forward_s, m.gather_s, 0.0) for layer in layers for m in layer]
    backward = []
    for layer in reversed(layers):
        if recompute:
            backward += [(m.forward_s, m.gather_s, 0.0) for m in layer]
        backward += [(m.backward_s, m.gather_s, m.reduce_s) for m in reversed(layer)]
    return chain_s(forward, overlap_reduce=False) + chain_s(backward, overlap_reduce=overlap_reduce)


def exposed_s(costs: Sequence, layer_op_lists: Sequence[Sequence], *, gather: Callable[[float], float],
              reduce: Callable[[float], float], persistent: float, recompute: bool, overlap_reduce: bool) -> float:
    """The traffic one micro-batch leaves exposed beside its compute: ``microbatch_s`` minus the compute.
    ``costs``: each layer's ``LayerCost``; ``layer_op_lists``: each layer's ops (``costs.estimate.layer_ops``),
    an op with weights being one module, its share of the layer's time its share of the forward FLOPs
    (equal shares where they have none; a layer without weights is one module with no traffic);
    ``gather`` / ``reduce``: seconds of an all-gather / reduce-scatter of that many elements; tensors of
    at most ``persistent`` elements stay whole on every rank and are never gathered."""
    layers = []
    for cost, ops in zip(costs, layer_op_lists):
        owners = [op for op in ops if op.weights]
        flops = sum(op.fwd_flops for op in owners)
        # every second of the layer lands on some module, so the chain's compute is the layers' own
        shares = [op.fwd_flops / flops for op in owners] if flops else [1 / len(owners)] * len(owners)
        layers.append([ModuleTraffic(cost.forward_s * share, cost.backward_s * share,
                                     gather(sum(w for w in op.weights if w > persistent)), reduce(sum(op.weights)))
                       for op, share in zip(owners, shares)] or [ModuleTraffic(cost.forward_s, cost.backward_s, 0, 0)])
    compute = sum(c.time_s(recompute=recompute) for c in costs)
    return max(0.0, microbatch_s(layers, recompute=recompute, overlap_reduce=overlap_reduce) - compute)


__all__ = ["ModuleTraffic", "chain_s", "exposed_s", "microbatch_s"]
