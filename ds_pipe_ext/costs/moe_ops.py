"""A Mixture-of-Experts MLP op by op, as DeepSpeed's MoE layer runs it on one rank (``deepspeed.moe``):

    router (fp32 linear h -> E, softmax, top-k) -> dispatch into E x C slots -> experts -> combine

* Slots: DeepSpeed pads every expert to one capacity C.  Dropless (capacity_factor 0) C is the largest
  expert load, all-reduced over the EP group (``sharded_moe.topkgating``: ``torch.max(exp_counts)``, then a MAX
  all-reduce): k x tokens / E x ``imbalance`` (>= 1) where a run's loads are known; else the largest load a
  uniformly random router is expected to give (``busiest_expert_load``), which even a perfectly balanced router's
  chance fluctuations reach (DeepSeek-V3's 256 experts at 4,096 tokens: 1.25x the mean on one rank).  Else
  C = ceil(capacity_factor x k x tokens / E), and tokens beyond it are dropped.
* Work per rank does not depend on EP: a rank holds E / ep experts and EP's all-to-all hands each ep x C
  slots, E x C in all, as at ep 1.  Weights are E / ep experts.  Under EP, dispatch and combine are each
  an all-to-all of the rank's E x C x h slots over the EP group, forward and again backward
  (``device_spec.ring_time``; inside a node while ep GPUs fit one).
* Under TP (``shp.t``) every TP rank holds the same tokens and routes them alike; DeepSpeed drops the
  duplicates (``drop_tokens``: each TP rank keeps 1/t of every expert's slots, C padded to a multiple of t
  dropless), so the all-to-alls and the experts take E x C / t slots a rank, and the experts' output is
  gathered back over the TP group (``gather_tokens``: an all-gather of the E x C slots forward; the drop's
  backward, the same all-gather of their gradients).  Experts stay whole (expert TP 1, Megatron's default
  for its MoE layers); the shared experts split as a dense MLP.
* Saved for backward (what ``saved_tensors_hooks`` count on the layer, tests/test_moe_training.py): the
  router's fp32 input (T h x 4 bytes) and its gates and masks (about 12 bytes per token and expert), the
  dispatched slots (E C h), each expert's gate_up output and SwiGLU output (E C 3 f), the gathered expert
  rows the combine weights (k T h) and the slot indices.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np

from ..arch import Experts
from .analytic import SWIGLU_KERNELS, SWIGLU_PASSES, linear, mlp_fc1, mlp_fc2, mlp_gate_up, relu2, swiglu
from .op_cost import AnalyticError, OpCost, Shape

ROUTER_BYTES_PER_TOKEN_EXPERT = 12  # fp32 gates, the fp32 masks of the renormalisation, the bool/int choice mask
INDEX_BYTES = 8  # int64 slot and expert indices

# The kernels each part launches in eager mode, forward and backward, counted in DeepSpeed 0.19's
# ``moe/sharded_moe.py`` (its sparse-routes path, which MOELayer takes) and ``moe/experts.py``; on a GPU each costs
# at least a launch and its host dispatch (``estimate.layer_floor_s``), on a CPU its dispatch (``host_op_s``).
# Gating: the ops DeepSpeed's gate functions run beyond the router's GEMM, views left out, counted under a torch
# dispatch mode on a block of the moe family (T 256): ``top1gating``, ``top2gating``, ``topkgating`` (the softmax,
# the top k, the choice masks, the counts, the load-balancing loss, the capacity read back by ``int(C)``, the
# locations, the renormalisation, the routes), and what our gates add before it (``models.routers``: the sigmoid
# scores, the group-limited choice and the chosen scores' logs; or the router bias's softmax over the top k).
# Dispatch (``_route_slots``, ``_sparse_encode``): the flat slots (product, add, full, where), the inverse map (full,
# arange, scatter), the padded input (zeros, cat) and the index_select; backward index_select's (zeros, index_add).
# Each local expert: its chunk made contiguous, the first GEMM, the activation, the second GEMM (SwiGLU: two
# kernels forward, ten in-place passes backward, ``llama.SwiGLU``); the outputs' cat.  Combine (``_sparse_decode``):
# zeros, cat, index_select, the fp32 product with the gates, the sum over routes, the cast; backward the same in
# reverse and the gates' gradient.
GATING_KERNELS = {1: (48, 9), 2: (59, 41), "k": (35, 24)}  # by top-k: top1gating, top2gating, topkgating
ROUTER_KERNELS = {"sigmoid": (25, 5), "bias": (11, 1)}  # models.routers' gates, before DeepSpeed's topkgating
DISPATCH_KERNELS = (10, 2)
COMBINE_KERNELS = (6, 7)
EXPERT_COPY_KERNELS = (1, 1)  # a local expert's chunk made contiguous (and its gradient's cat), each way
# An expert's activation as eager code runs it, counted under a torch dispatch mode (views and allocations without a
# kernel left out): (kernels forward, backward) and the traffic of each pass, (e-byte elements, 1-byte mask elements)
# an element of one half.  The SwiGLU (``llama.SwiGLU``, as ``analytic.swiglu``); gpt-oss's (``experts.ClampedSwiGLU``,
# every expert with biases or a limit): the + 1, three products and the sigmoid forward; backward the product and
# the sigmoid again and eleven passes in place or out; with a limit the two clamps both ways, and backward the
# clamps' three masks, their and, and two products by them
EXPERT_ACTIVATIONS = {"swiglu": (SWIGLU_KERNELS, tuple((p, 0) for p in SWIGLU_PASSES)),
                      "gpt-oss": ((5, 13), ((12, 0), (33, 0))),
                      "gpt-oss clamped": ((7, 21), ((16, 0), (44, 8)))}


def expert_activation(experts: Experts) -> str:
    """Which activation the experts run (``models.experts.expert_mlp``'s choice)."""
    if experts.swiglu_limit:
        return "gpt-oss clamped"
    return "gpt-oss" if experts.bias else "swiglu"


@functools.lru_cache(maxsize=1024)
def busiest_expert_load(tokens: int, experts: int, top_k: int, ranks: int = 1) -> float:
    """The expected largest expert load when each of ``tokens`` tokens on each of ``ranks`` ranks goes to ``top_k``
    distinct experts of ``experts``, uniformly at random: DeepSpeed's dropless capacity (the largest count, the MAX
    over the EP group) under a router that favours no expert.  One expert's load on one rank is Binomial(tokens,
    top_k / experts); the max is taken as over independent loads, E[max] = sum over m of 1 - F(m)^(experts x
    ranks).  A rank's loads sum to top_k x tokens, and that negative correlation makes the true max a little larger:
    against a simulated router this reads 0.3% under at 4,096 tokens, 2% at 32, 8% at 2; never under the mean."""
    from scipy.special import bdtr  # the binomial CDF

    below = bdtr(np.arange(tokens + 1), tokens, top_k / experts) ** (experts * ranks)
    return max(float(np.sum(1.0 - below)), math.ceil(top_k * tokens / experts))


def token_ranks(ep: int, tp: int) -> int:
    """The ranks of an EP group that route different tokens: ceil(ep / tp) (its TP peers route the same ones)."""
    return -(-ep // tp)


def slots_per_expert(tokens: int, experts: Experts, imbalance: float | None = None, tp: int = 1,
                     ep: int = 1) -> int:
    """C: the slots DeepSpeed pads each expert to for ``tokens`` routed tokens on each rank of ``ep`` (dropless
    under TP: to a multiple of ``tp``, which DeepSpeed's ``drop_tokens`` splits them over).  Dropless, the mean
    load times ``imbalance``; None: ``busiest_expert_load`` over the EP group's ``token_ranks``."""
    if experts.capacity_factor:
        return max(experts.capacity_slots(tokens), 1)
    if imbalance is None:
        load = busiest_expert_load(tokens, experts.count, experts.top_k, token_ranks(ep, tp))
    else:
        load = imbalance * experts.top_k * tokens / experts.count
    return math.ceil(max(math.ceil(load), 1) / tp) * tp


def encode_bytes(T: int, k: int, slots: int, h: int, e: int, *, backward: bool = False) -> float:
    """Bytes DeepSpeed's ``_sparse_encode`` moves placing T tokens in ``slots`` slots (``slots`` x h, ``e`` bytes an
    element), as its code runs: forward, the slots' source map (a full, an arange, a scatter of the k T routes), the
    input padded with a zero row (``cat``: read and written) and the slots' rows gathered (``index_select``).
    Backward, autograd's ``index_select_backward``: a zeroed (T + 1) x h table, copied by the out-of-place
    ``index_add`` (read, written), then each slot's row read and added into its token's (read, written)."""
    if backward:
        return (T + 1) * h * e * 3 + slots * h * e * 3
    return (slots + 1 + 2 * k * T) * INDEX_BYTES + 2 * T * h * e + 2 * slots * h * e


def decode_bytes(T: int, k: int, slots: int, h: int, e: int, *, backward: bool = False) -> float:
    """Bytes DeepSpeed's ``_sparse_decode`` moves combining the k T routes from ``slots`` slots, as its code runs:
    forward, the experts' output padded with a zero row (``cat``), each route's row gathered (``index_select``),
    multiplied by its fp32 gate (read in ``e`` bytes, written in 4), summed over the k routes (4-byte reads, T x h
    written), cast back where ``e`` is not 4.  Backward: the cast's, the product's two gradients (the routes' rows:
    the output's gradient times the gates, written; the gates': the gradient times the saved rows, summed over h),
    and ``index_select_backward`` (a zeroed (slots + 1) x h table, copied by the out-of-place ``index_add``, each
    route's row added into its slot's)."""
    R = k * T

    def cast(n: int) -> int:  # n elements cast between fp32 and ``e`` bytes: none in fp32
        return n * (4 + e) if e != 4 else 0

    if backward:
        routes = R * h * 4 + cast(R * h) + R * h * (e + 4) + R * h * 4 + 2 * T * h * 4
        return cast(T * h) + routes + (slots + 1) * h * e * 3 + R * h * e * 3
    return 2 * (slots + 1) * h * e + 2 * R * h * e + R * h * (e + 4) + R * h * 4 + T * h * 4 + cast(T * h)


def gating_kernels(experts: Experts) -> tuple[int, int]:
    """The kernels a block's gate launches beyond its router's GEMM, forward and backward: DeepSpeed's ``TopKGate``
    by its top-k, or one of ``models.routers``' gates (which hand DeepSpeed's ``topkgating`` their logits)."""
    ours = "sigmoid" if experts.router == "sigmoid" else "bias" if experts.router_bias else None
    if ours is None:
        return GATING_KERNELS.get(experts.top_k, GATING_KERNELS["k"])
    return tuple(a + b for a, b in zip(GATING_KERNELS["k"], ROUTER_KERNELS[ours]))


def _experts(op: OpCost, local: int) -> OpCost:
    """``op`` with its weights held ``local`` times (one copy per local expert) and its kernels launched ``local``
    times (one GEMM an expert); its work already covers every slot (one tall GEMM's price, as the written-out
    attention's batched products are priced)."""
    return replace(op, weight_bytes=op.weight_bytes * local, weights=op.weights * local,
                   bwd_allocs=op.bwd_allocs[:1] + op.bwd_allocs[1:] * local,
                   kernels=tuple(c * local for c in op.kernels))


def dropless_note(model, tokens: int, imbalance: float | None, ep: int = 1, tp: int = 1) -> str | None:
    """How a dropless model's expert slots are priced, in a line (None without dropless experts): at ``tokens`` a
    rank, over an EP group of ``ep`` at ``tp``."""
    from ..arch import as_description

    experts = next((b.experts for b in as_description(model).blocks
                    if b.experts is not None and not b.experts.capacity_factor), None)
    if experts is None:
        return None
    if imbalance is not None:
        return f"dropless experts: each padded to {imbalance:.2f}x the mean load (--expert-imbalance)"
    mean = experts.top_k * tokens / experts.count
    one = busiest_expert_load(tokens, experts.count, experts.top_k) / mean
    group = busiest_expert_load(tokens, experts.count, experts.top_k, token_ranks(ep, tp)) / mean
    return (f"dropless experts: each padded to the busiest load a uniformly random router gives (DeepSpeed's "
            f"capacity): {one:.2f}x the mean at {tokens} tokens a rank, {group:.2f}x over an EP group of {ep}"
            f"{f' at tp {tp}' if tp > 1 else ''}; --expert-imbalance X|RUN_DIR for a trained router's")

def routed_mlp(shp: Shape, experts: Experts, *, ep: int = 1, imbalance: float | None = None,
               activation: str = "swiglu") -> list[OpCost]:
    """The routed experts of one block (``shp.f`` is one expert's width; SwiGLU experts, or squared-ReLU ones:
    ``activation="relu2"``, up and down alone) on one rank of ``ep``; ``imbalance``: ``slots_per_expert``'s."""
    if experts.count % ep:
        raise AnalyticError(f"ep = {ep} does not divide the {experts.count} experts; choose ep dividing them")
    if imbalance is not None and imbalance < 1:
        raise AnalyticError(f"imbalance = {imbalance}: the largest expert load is at least the mean (>= 1)")
    T, h, f, E, k, e, t = shp.tokens, shp.h, shp.f, experts.count, experts.top_k, shp.e, shp.t
    C = slots_per_expert(T, experts, imbalance, t, ep)
    if C % t:
        raise AnalyticError(f"{C} slots an expert do not split over tp = {t} (DeepSpeed's drop_tokens); choose a "
                            f"capacity_factor whose ceil(capacity_factor x k x tokens / E) tp divides")
    slots, local = E * C, E // ep
    mine = slots // t  # the slots this TP rank's share sends through the all-to-all and its experts
    router = linear("router", T, h, E, shp, bias=experts.router_bias)
    router = replace(router, activation_bytes=T * h * 4)  # DeepSpeed routes an fp32 copy of its input
    gating = OpCost("gating", "vector", fwd_flops=8.0 * T * E, bwd_flops=8.0 * T * E, fwd_bytes=6 * T * E * 4,
                    bwd_bytes=6 * T * E * 4,
                    activation_bytes=ROUTER_BYTES_PER_TOKEN_EXPERT * T * E + k * T * INDEX_BYTES,
                    kernels=gating_kernels(experts))
    if experts.router == "sigmoid":  # models/routers.py: the scores, the chosen ids, the chosen scores' log input
        gating = replace(gating, fwd_flops=gating.fwd_flops + 4.0 * T * E, fwd_bytes=gating.fwd_bytes + 4 * T * E * 4,
                         activation_bytes=gating.activation_bytes + 4 * T * E + k * T * (INDEX_BYTES + 4))
    dispatch = OpCost("dispatch", "vector", fwd_bytes=encode_bytes(T, k, slots, h, e),
                      bwd_bytes=encode_bytes(T, k, slots, h, e, backward=True), bwd_fill_bytes=(T + 1) * h * e,
                      activation_bytes=slots * INDEX_BYTES + k * T * INDEX_BYTES, fwd_allocs=(slots * h * e,),
                      bwd_allocs=(T * h * e,), kernels=DISPATCH_KERNELS)
    width = f if activation == "relu2" else 2 * f  # the first matrix: up alone, or gate and up
    gate_up = _experts(linear("expert_up" if activation == "relu2" else "expert_gate_up", mine, h, width, shp,
                              bias=experts.bias), local)
    gate_up = replace(gate_up, gemm_dim=float(min(ep * C // t, h, width)))
    n = mine * f
    # each local expert launches its own kernels (DeepSpeed's Experts loops over them), its chunk's copy with them
    copies = tuple(c * local for c in EXPERT_COPY_KERNELS)
    if activation == "relu2":  # ReLU keeps its output, the square reads it back (analytic.relu2)
        act = OpCost("expert_relu2", "vector", fwd_flops=2.0 * n, bwd_flops=4.0 * n, fwd_bytes=4 * n * e,
                     bwd_bytes=5 * n * e, activation_bytes=n * e, kernels=(2 * local + copies[0], 3 * local + copies[1]))
    else:
        kernels, (fwd, bwd) = EXPERT_ACTIVATIONS[expert_activation(experts)]
        act = OpCost("expert_swiglu", "vector", fwd_flops=6.0 * n, bwd_flops=12.0 * n, fwd_bytes=3 * n * e,
                     bwd_bytes=5 * n * e, activation_bytes=2 * n * e,
                     kernels=(kernels[0] * local + copies[0], kernels[1] * local + copies[1]),
                     gpu_bytes=((fwd[0] * e + fwd[1]) * n, (bwd[0] * e + bwd[1]) * n))
    down = _experts(linear("expert_down", mine, f, h, shp, bias=experts.bias), local)
    down = replace(down, gemm_dim=float(min(ep * C // t, f, h)))
    combine = OpCost("combine", "vector", fwd_flops=2.0 * k * T * h, bwd_flops=4.0 * k * T * h,
                     fwd_bytes=decode_bytes(T, k, slots, h, e),
                     bwd_bytes=decode_bytes(T, k, slots, h, e, backward=True),
                     bwd_fill_bytes=(slots + 1) * h * e, activation_bytes=k * T * h * e + k * T * 4,
                     fwd_allocs=(T * h * e,), bwd_allocs=(slots * h * e,), kernels=COMBINE_KERNELS)
    # Experts.forward: the local experts' outputs concatenated; backward, their input chunks' gradients
    outputs = OpCost("expert_outputs_cat", "vector", fwd_bytes=2 * mine * h * e, bwd_bytes=2 * mine * h * e,
                     fwd_allocs=(mine * h * e,), bwd_allocs=(mine * h * e,), kernels=(1, 1))
    experts_ops = [gate_up, act, down, outputs]
    if t > 1:  # the experts' output gathered over TP (a copy into the gathered E x C rows); the drop's backward
        gathered = slots * h * e
        experts_ops.append(OpCost("tp_gather_slots", "vector", fwd_bytes=2 * gathered, bwd_bytes=2 * gathered,
                                  comm_fwd_bytes=gathered, comm_bwd_bytes=gathered, comm_type="all-gather",
                                  fwd_allocs=(gathered,), bwd_allocs=(gathered,), kernels=(2, 2)))
    if ep == 1:
        return [router, gating, dispatch, *experts_ops, combine]
    moved = mine * h * e  # each all-to-all moves the rank's slots, forward and (their gradients) backward
    exchange = [OpCost(name, "vector", comm_fwd_bytes=moved, comm_bwd_bytes=moved, comm_type="all-to-all")
                for name in ("dispatch_all_to_all", "combine_all_to_all")]
    return [router, gating, dispatch, exchange[0], *experts_ops[:4], exchange[1], *experts_ops[4:], combine]


def shared_mlp(shp: Shape, experts: Experts, activation: str = "swiglu") -> list[OpCost]:
    """The always-on shared experts (one SwiGLU MLP ``shared_ffn`` wide), scaled by a sigmoid gate where
    ``shared_gate``, and added to the routed output.  They read the same input as the router: in fp32 the
    router's copy is that tensor, saved once."""
    wide = replace(shp, f=experts.shared_ffn)
    mlp = ((mlp_fc1(wide, bias=False), relu2(wide)) if activation == "relu2" else
           (mlp_gate_up(wide, bias=False), swiglu(wide)))
    ops = [replace(op, name=f"shared_{op.name}") for op in (*mlp, mlp_fc2(wide, bias=False))]
    T, h, e = shp.tokens, shp.h, shp.e
    if experts.shared_gate:
        gate = replace(linear("shared_gate", T, h, 1, shp, bias=False), activation_bytes=0)  # input saved above
        scale = OpCost("shared_scale", "vector", fwd_flops=2.0 * T * h, bwd_flops=3.0 * T * h, fwd_bytes=3 * T * h * e,
                       bwd_bytes=4 * T * h * e, activation_bytes=T * h * e + 2 * T * e)
        ops += [gate, scale]
    return ops + [OpCost("shared_add", "vector", fwd_flops=T * h, fwd_bytes=3 * T * h * e, bwd_bytes=2 * T * h * e)]


def moe_block(block_ops: list[OpCost], shp: Shape, experts: Experts, *, ep: int = 1,
              imbalance: float | None = None) -> list[OpCost]:
    """A dense SwiGLU block's ops (``analytic.transformer_block``) with its MLP replaced by routed experts
    (and shared ones)."""
    names = [op.name for op in block_ops]
    first = "fc1_gate_up" if "fc1_gate_up" in names else "fc1"
    i = names.index(first)
    activation = {"swiglu": "swiglu", "relu2": "relu2"}.get(names[i + 1])
    if activation is None or names[i + 2] != "fc2":
        raise AnalyticError(f"a Mixture-of-Experts block needs SwiGLU or squared-ReLU experts; the block's MLP is "
                            f"{names[i:i + 3]}")
    routed = routed_mlp(shp, experts, ep=ep, imbalance=imbalance, activation=activation)
    shared = shared_mlp(shp, experts, activation) if experts.shared_ffn else []
    if shared and shp.e == 4:
        routed[0] = replace(routed[0], activation_bytes=0)  # the shared MLP's saved input is the same tensor
    return block_ops[:i] + routed + shared + block_ops[i + 3:]


def is_expert_op(op: OpCost) -> bool:
    """An op of the routed experts (their GEMMs and activation): what a rank holds E / ep of."""
    return op.name.startswith("expert_")


def expert_weight_bytes(ops: list[OpCost]) -> float:
    """The routed experts' share of a block's weight bytes (what ZeRO partitions over dp / ep)."""
    return sum(op.weight_bytes for op in ops if is_expert_op(op))
