"""The attentions of DeepSeek-V3 and gpt-oss op by op, as ``models.mla`` and ``models.sinks`` run them on one
TP rank (``a`` heads in all, a / t a rank), in ``analytic``'s accounting (one micro-batch, ``Shape``).

Multi-head latent attention (``mla_attention``), its saved tensors (counted on the profiler's saved-tensor
hook, tests/test_mla_sinks.py): the block's normed input (the down projections share it), the query latent
and its norm's output and fp32 reciprocal RMS, the whole key/value down projection's output (its latent's
norm keeps a view of it), that norm's output and RMS, the rotary tables of the rope width, the fused kernel's
q, k, padded v, padded output and log-sum-exp, and the out projection's own copy of the unpadded output.
The down projections are whole on every rank (their weights are not divided by t); each up projection's
backward all-reduces its input's gradient over TP, and the shared rotary key's gradient is all-reduced too.

A multi-token-prediction layer (``mtp_layer``, megatron-core's ``MultiTokenPredictionLayer`` as
``models.mtp`` runs it): the travelling embedding of the shifted ids and the hidden state, each RMS-normed,
concatenated and projected 2h -> h, the block, its final norm.  The lookups are the embedding layer's
(``mtp_lookups``); the output head and the loss run in the head layer over 1 + D times the tokens.

Attention with sinks, fused (``fused_sink_core``, ``models.sinks.FusedSinkAttention``): the fused kernel
(``analytic.fused_attention``), then its output rescaled by sigmoid(L - sink) from its log-sum-exp; it keeps the
rescaled output, which is the out projection's input (counted there), and no window mask; backward the output's gradient
rescaled and each row's product with the output summed for the sink's gradient.  Written out (``sink_softmax``,
``sink_core``: fp32 on a GPU): the written-out core (``analytic.attention_logits``, ``softmax``, ``attend``) whose
softmax runs over s + 1 columns a row, the sink's; a sink weight per head; the passes the written-out code adds
around the products (the repeated heads, the scale, the mask, the sink's column).
"""

from __future__ import annotations

from dataclasses import replace

from ..arch import MLA
from .analytic import fused_attention, linear, rms_norm, rotary, tp_exit_comm
from .op_cost import OpCost, Shape


def _latent_norm(name: str, shp: Shape, width: int, kept: int) -> OpCost:
    """An RMSNorm over ``width`` features a token (a rank's latent), keeping ``kept`` elements a token of its input
    (its input is a view of a wider tensor) and an fp32 reciprocal RMS a token."""
    norm = rms_norm(name, replace(shp, h=width, sp=False, t=1))
    return replace(norm, activation_bytes=shp.tokens * (kept * shp.e + 4))


def mla_attention(shp: Shape, mla: MLA) -> list[OpCost]:
    """The attention half of an MLA block after its input norm, up to and including the out projection."""
    T, t, e, a = shp.tokens, shp.t, shp.e, shp.a
    qk = mla.qk_dim
    heads = a // t
    ops = []
    if mla.q_rank:
        ops += [linear("q_down", T, shp.h, mla.q_rank, shp, bias=False, saved_input_elems=shp.replicated_sbh),
                _latent_norm("q_norm", shp, mla.q_rank, mla.q_rank),
                _gradient_all_reduced(linear("q_up", T, mla.q_rank, heads * qk, shp, bias=False), T * mla.q_rank, shp)]
    else:
        ops.append(_gradient_all_reduced(linear("q_proj", T, shp.h, heads * qk, shp, bias=False,
                                                saved_input_elems=shp.replicated_sbh), T * shp.h, shp))
    kv_down = linear("kv_down", T, shp.h, mla.kv_rank + mla.rope_dim, shp, bias=False, saved_input_elems=0)
    ops += [_gradient_all_reduced(kv_down, T * mla.rope_dim, shp),  # the shared rotary key's gradient
            _latent_norm("kv_norm", shp, mla.kv_rank, mla.kv_rank + mla.rope_dim),
            _gradient_all_reduced(linear("kv_up", T, mla.kv_rank, heads * (mla.nope_dim + mla.v_dim), shp, bias=False),
                                  T * mla.kv_rank, shp)]
    rope = rotary(replace(shp, d=mla.rope_dim), kv_heads=a)
    ops.append(replace(rope, activation_bytes=2 * shp.s * mla.rope_dim * e))
    n = T * heads * qk  # q, k and the padded v: written once each by the concatenations and the pad
    ops.append(OpCost("mla_concat_pad", "vector", fwd_bytes=5 * n * e, bwd_bytes=4 * n * e, kernels=(3, 3)))
    core = fused_attention(replace(shp, d=qk), kv_heads=a)
    # the kernel keeps its own (padded) output beside q, k, v; the out projection keeps a copy of it unpadded
    core[0] = replace(core[0], activation_bytes=core[0].activation_bytes + n * e)
    ops += core
    out = linear("out_proj", T, heads * mla.v_dim, shp.h, shp, bias=False)
    ops.append(tp_exit_comm(out, shp))
    return ops


def _gradient_all_reduced(op: OpCost, elems: float, shp: Shape) -> OpCost:
    """``op`` with its input's gradient (``elems`` of it) all-reduced over TP in backward (Megatron's f)."""
    if shp.t == 1:
        return op
    return replace(op, comm_bwd_bytes=op.comm_bwd_bytes + elems * shp.e, comm_type="all-reduce")


def sink_softmax(op: OpCost, shp: Shape) -> OpCost:
    """The written-out softmax over each query's keys and its head's sink: s + 1 columns a row."""
    grow = (shp.s + 1) / shp.s
    return replace(op, fwd_flops=op.fwd_flops * grow, bwd_flops=op.bwd_flops * grow, fwd_bytes=op.fwd_bytes * grow,
                   bwd_bytes=op.bwd_bytes * grow, activation_bytes=op.activation_bytes * grow,
                   fwd_allocs=tuple(x * grow for x in op.fwd_allocs), bwd_allocs=tuple(x * grow for x in op.bwd_allocs),
                   weight_bytes=shp.a / shp.t * shp.e, weights=(shp.a // shp.t,))


def fused_sink_core(ops: list[OpCost], shp: Shape, kv_heads: int | None, *, flash: bool) -> list[OpCost]:
    """``ops`` with the fused core of attention with sinks in place of the fused kernel alone: the kernel as
    "sink_attention" (the backend ``arch.attention_backend(..., sinks=True)`` says; the window's mask, made once
    a shape, is not saved), then the rescale as ``models.sinks.FusedSinkAttention`` runs it: forward the weights
    from the log-sum-exp and the output times them (2 passes of q's size, e bytes an element; 5 kernels);
    backward the gradient times them and its product with the saved output summed a row (6 passes; 12 kernels).
    ``flash``: the kernel is a GPU's FlashAttention-2 (a CPU's flash kernel otherwise), which takes the batch as one
    sequence after another: v is copied into that order, and at b > 1 q and k forward, the rescaled gradient and
    the output backward (b 1's are views).  The output it saves
    is the out projection's input (``models.sinks`` lays it out so), counted there."""
    heads = shp.sbA / shp.t  # a rank's q-shaped elements
    kv = heads * (kv_heads or shp.a) / shp.a
    rows = shp.b * shp.s * shp.a / shp.t
    fwd_copies = (2 * kv + (2 * (heads + kv) if shp.b > 1 else 0)) * shp.e if flash else 0.0
    bwd_copies = 4 * heads * shp.e if flash and shp.b > 1 else 0.0
    rescale = OpCost("sink_rescale", "vector", fwd_flops=heads + 4 * rows, bwd_flops=3 * heads + 6 * rows,
                     fwd_bytes=2 * heads * shp.e + 16 * rows + fwd_copies,
                     bwd_bytes=6 * heads * shp.e + 32 * rows + bwd_copies,
                     kernels=(5 + 3 * flash, 12 + 2 * flash),
                     weight_bytes=shp.a / shp.t * shp.e, weights=(shp.a // shp.t,))
    out = []
    for op in ops:
        if op.name == "fused_attention":
            windowed = bool(op.attn_shape.masked)
            mask = shp.s * shp.s * shp.e if windowed and shp.dense_window_mask else 0.0
            out += [replace(op, name="sink_attention", activation_bytes=op.activation_bytes - mask,
                            attn_shape=op.attn_shape._replace(sinks=True)), rescale]
        else:
            out.append(op)
    return out


def sink_core(ops: list[OpCost], shp: Shape, kv_heads: int) -> list[OpCost]:
    """``ops`` with the written-out core's passes that ``models.sinks.SinkAttention._core`` adds to the eager
    product, softmax and product (n scores, e bytes each): the key and value heads repeated for every query head
    (their gradients summed back); the scores scaled, the mask cast and added, the sink's column concatenated
    (6 n e bytes forward); backward the scale's product and the probabilities' slice, whose gradient is a zeroed
    s x (s + 1) tensor the slice is copied into (5 n e).  The logits op keeps its GEMMs alone.  Saved tensors
    and allocations stay the core's ops' own."""
    n = shp.a * shp.s * shp.s * shp.b / shp.t
    e, heads = shp.e, shp.sbA / shp.t  # a rank's q-shaped elements
    kv = heads * (kv_heads or shp.a) / shp.a
    repeat = OpCost("sink_repeat_kv", "vector", fwd_bytes=2 * (kv + heads) * e, bwd_bytes=2 * (heads + kv) * e,
                    kernels=(2, 2))
    mask = shp.s * shp.s * (4 + 2 * e)  # the fp32 mask read and cast, then read by the add
    passes = OpCost("sink_scale_mask_concat", "vector", fwd_flops=2 * n, bwd_flops=n,
                    fwd_bytes=6 * n * e + mask, bwd_bytes=5 * n * e, kernels=(4, 3))
    out = []
    for op in ops:
        if op.name == "logits":
            out += [repeat, replace(op, kernels=(1, 2)), passes]
        else:
            out.append(op)
    return out


def mtp_layer(shp: Shape, block_ops: list[OpCost], *, norm) -> list[OpCost]:
    """One MTP layer's ops (``models.mtp``): the travelling embedding and the hidden state normed, concatenated and
    projected 2h -> h, ``block_ops`` (its block's), its final norm.  The shifted ids' lookups are the embedding
    layer's, the output head and loss the head layer's (``mtp_lookups``, ``layer_ops.layer_ops``)."""
    T, h, e = shp.tokens, shp.h, shp.e
    concat = OpCost("mtp_concat", "vector", fwd_bytes=4 * T * h * e, bwd_bytes=4 * T * h * e, kernels=(1, 2))
    proj = linear("mtp_eh_proj", T, 2 * h, h, shp, bias=False)
    return [norm("mtp_enorm", shp), norm("mtp_hnorm", shp), concat, proj, *block_ops, norm("mtp_final_norm", shp)]


def mtp_lookups(shp: Shape, depth: int) -> OpCost:
    """The embedding layer's lookups of the ids shifted by 1 .. ``depth`` (the table is the layer's own; each
    keeps its ids for the backward).  Each lookup's backward is a dense gradient of the whole table, as the main
    lookup's (``edge_ops.embedding``): zeroed, its rows added, then summed into the others' in place (autograd's
    input buffer: an ``add_``, read two, write one; ``bwd_inplace_bytes``: a CPU prices them at its measured add_
    rate, ``DeviceSpec.in_place_bandwidth``)."""
    T, h, e = shp.tokens, shp.h, shp.e
    table = (-(-shp.V // shp.t)) * h * e
    return OpCost("mtp_lookups", "vector", fwd_bytes=2 * depth * T * h * e,
                  bwd_bytes=depth * (2 * T * h * e + table + 3 * table), bwd_fill_bytes=depth * table,
                  bwd_inplace_bytes=depth * 3 * table, row_ops=depth * T, activation_bytes=depth * T * 8,
                  bwd_allocs=(table,) * depth, kernels=(2 * depth, 13 * depth), bwd_sync=True)
