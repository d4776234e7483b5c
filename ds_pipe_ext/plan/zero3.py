"""One micro-batch under ZeRO-3 on a GPU: DeepSpeed's parameter prefetch against the compute it hides under.

DeepSpeed's ZeRO-3 (``PartitionedParameterCoordinator.fetch_sub_module``) gathers a module's parameters
before it runs and, once the module's order is traced, prefetches the next modules' parameters while the
current one computes: at least one module ahead (the first parameter is taken whatever
``stage3_prefetch_bucket_size`` says, more while the bucket has room).  A module's parameters are
released after each use unless it is used again within ``stage3_max_reuse_distance`` elements of other
modules' parameters (``__params_to_release``: the trace from the next module on, each visit's parameters
counted, until the distance is reached), so with full activation recompute the backward gathers a module
twice (for the replayed forward and for the backward) unless the modules after it in its layer, replayed
and run back, hold fewer elements than that: the last module of every layer is always kept.  With
``overlap_comm`` the gradients' reduce-scatter runs on its own stream and shares the link with the next
gathers; without it the reduction waits.

So a pass is a chain of (compute, traffic) events: the first event's gather is exposed, then each event
takes the longer of its compute and the traffic the link carries meanwhile (the next event's gather and,
overlapped, the previous event's reduce-scatter).  Pure: plain lists in, seconds out.

DeepSpeed 0.3.12 to 0.4.x (the ZeRO-3 of 2021: ``partition_parameters._allgather_param``, read at v0.3.13 and
v0.4.0) gathered each parameter with a NCCL call of its own and called ``torch.cuda.synchronize()`` before
each, which waits for every stream, the reduction stream too: a module's reduce-scatter (one call a
parameter, ``_reduce_scatter_gradient``) finished before the next prefetch was issued, whatever
``overlap_comm`` said.  ``exposed_s`` takes each module's tensors, so its callers price a call a tensor or one
a module.

Both releases prefetch only while the parameters gathered are under ``stage3_max_live_parameters``
(``prefetch_next_sub_modules`` at v0.3.13: ``total_available_parameter_numel < max_available_parameters_in_numel``,
counted after the current module's fetch; 0.19's ``fetch_sub_module`` bounds what it prefetches by what is left
under the same limit): after a module of more elements than that (DeepSpeed's default 1e9: Megatron-530B's QKV
and MLP matrices), the next module's gather waits, exposed.
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
    elements: float = 0.0  # its parameters' elements (what DeepSpeed's reuse distance counts)
    host_gather_s: float = 0.0  # host time a gather blocks the queue for (nothing else is issued meanwhile)
    host_reduce_s: float = 0.0  # likewise, its reduce-scatter


def chain_s(events: Sequence[tuple], *, overlap_reduce: bool) -> float:
    """Seconds of a sequence of (compute, gather, reduce[, prefetched]) events, the next gather prefetched during
    the current compute (unless the next event says ``prefetched`` False: then it waits, exposed, after the
    compute) and, where ``overlap_reduce``, the previous reduction beside it on the link."""
    if not events:
        return 0.0
    total = events[0][1]
    for k, (compute, _gather, reduce, *_rest) in enumerate(events):
        nxt = events[k + 1] if k + 1 < len(events) else None
        prefetched = nxt is not None and (len(nxt) < 4 or nxt[3])
        link = nxt[1] if prefetched else 0.0
        if nxt is not None and not prefetched:
            total += nxt[1]
        if overlap_reduce:
            link += events[k - 1][2] if k else 0.0
            total += max(compute, link)
        else:
            total += max(compute, link) + reduce
    if overlap_reduce:
        total += events[-1][2]  # the last reduction has nothing after it to hide under
    return total


def _visits(layers: Sequence[Sequence[ModuleTraffic]], recompute: bool) -> list[tuple[tuple, ModuleTraffic, str]]:
    """DeepSpeed's trace of one micro-batch: every module's forward, then per layer from the last its replayed
    forward (full recompute) and its backward in reverse module order, as ((layer, module), module, "F" | "R"
    | "B")."""
    visits = [((i, j), m, "F") for i, layer in enumerate(layers) for j, m in enumerate(layer)]
    for i in reversed(range(len(layers))):
        if recompute:
            visits += [((i, j), m, "R") for j, m in enumerate(layers[i])]
        visits += [((i, j), m, "B") for j, m in reversed(list(enumerate(layers[i])))]
    return visits


def microbatch_s(layers: Sequence[Sequence[ModuleTraffic]], *, recompute: bool, overlap_reduce: bool,
                 max_reuse: float = 0.0, max_live: float = float("inf")) -> float:
    """One micro-batch's forward and backward through ``layers`` (each a list of modules in forward order)
    with ZeRO-3's traffic: the forward pass, then per layer from the last the replayed forward (under
    full recompute) and the backward in reverse module order.  A visit gathers its module unless the
    module stayed gathered since its previous visit: fewer than ``max_reuse`` elements visited in between
    (0: every visit gathers).  A visit's gather is prefetched under the previous visit's compute only if the
    previous module holds fewer than ``max_live`` elements (``stage3_max_live_parameters``)."""
    visits = _visits(layers, recompute)
    before = [0.0]  # elements visited before each visit
    for _, m, _ in visits:
        before.append(before[-1] + m.elements)
    last: dict[tuple, int] = {}
    events = []
    for k, (key, m, kind) in enumerate(visits):
        prev = last.get(key)
        kept = prev is not None and before[k] - before[prev + 1] < max_reuse
        last[key] = k
        host = (0.0 if kept else m.host_gather_s) + (m.host_reduce_s if kind == "B" else 0.0)
        live = visits[k - 1][1].elements if k else 0.0  # the module gathered when this one would be prefetched
        events.append(((m.backward_s if kind == "B" else m.forward_s) + host, 0.0 if kept else m.gather_s,
                       m.reduce_s if kind == "B" else 0.0, live < max_live))
    forward = sum(len(layer) for layer in layers)
    return chain_s(events[:forward], overlap_reduce=False) + chain_s(events[forward:], overlap_reduce=overlap_reduce)


def exposed_s(costs: Sequence, layer_op_lists: Sequence[Sequence], *, gather: Callable[[list], float],
              reduce: Callable[[list], float], persistent: float, recompute: bool, overlap_reduce: bool,
              max_reuse: float = 0.0, host_gather: Callable[[list], float] | None = None,
              host_reduce: Callable[[list], float] | None = None, max_live: float = float("inf")) -> float:
    """The traffic one micro-batch leaves exposed beside its compute: ``microbatch_s`` minus the compute.
    ``costs``: each layer's ``LayerCost``; ``layer_op_lists``: each layer's ops (``costs.layer_ops.layer_ops``),
    an op with weights being one module, its share of the layer's time its share of the forward FLOPs
    (equal shares where they have none; a layer without weights is one module with no traffic);
    ``gather`` / ``reduce``: seconds of the all-gather / reduce-scatter of a module's tensors (their element
    counts, a list); tensors of at most ``persistent`` elements stay whole on every rank and are never
    gathered; ``max_reuse``: ``stage3_max_reuse_distance``; ``host_gather`` / ``host_reduce``: host time a
    module's gather / reduce-scatter holds the queue for, serial with the compute (None: none)."""
    layers = []
    for cost, ops in zip(costs, layer_op_lists):
        owners = [op for op in ops if op.weights]
        flops = sum(op.fwd_flops for op in owners)
        # every second of the layer lands on some module, so the chain's compute is the layers' own
        shares = [op.fwd_flops / flops for op in owners] if flops else [1 / len(owners)] * len(owners)
        layers.append([ModuleTraffic(cost.forward_s * share, cost.backward_s * share,
                                     gather([w for w in op.weights if w > persistent]), reduce(list(op.weights)),
                                     float(sum(op.weights)),
                                     host_gather([w for w in op.weights if w > persistent]) if host_gather else 0.0,
                                     host_reduce(list(op.weights)) if host_reduce else 0.0)
                       for op, share in zip(owners, shares)] or [ModuleTraffic(cost.forward_s, cost.backward_s, 0, 0)])
    compute = sum(c.time_s(recompute=recompute) for c in costs)
    return max(0.0, microbatch_s(layers, recompute=recompute, overlap_reduce=overlap_reduce, max_reuse=max_reuse,
                                 max_live=max_live) - compute)


__all__ = ["ModuleTraffic", "chain_s", "exposed_s", "microbatch_s"]
