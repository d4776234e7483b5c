"""Analytic costs of the pipeline's two edge layers, op by op: the embedding (vocabulary lookup, learned
positions, dropout) and the head with its loss (the final norm, the vocabulary projection and the
cross-entropy, whole or in token chunks).  Same notation and conventions as ``costs.analytic``, whose ops
they are built from; pure arithmetic, no torch."""

from __future__ import annotations

from dataclasses import replace

from .analytic import NORMS, dropout, linear, tp_entry_comm
from .op_cost import OpCost, Shape


def embedding(shp: Shape, *, positions: bool = True) -> list[OpCost]:
    """Vocabulary lookup (vocab-parallel: each rank holds V/t rows, then an all-reduce or,
    with SP, a reduce-scatter), plus learned positions.  No FLOPs worth counting; the
    backward scatters gradients into the table.  Saves only the token and position ids (int64)."""
    out = shp.tokens * shp.h
    rows = shp.V // shp.t if shp.V % shp.t == 0 else -(-shp.V // shp.t)
    table = rows * shp.h * shp.e
    # backward: the gradient of the whole (V/t x h) table is zeroed (dense in torch and Megatron: one
    # write-only pass), then the looked-up rows are added, which on small batches costs far less.  Each
    # token's row, read forward and added backward, lies at random in a table beyond the caches
    # a 16-bit backward on a GPU holds 4 x V x h bytes beside the table's gradient at its peak (an H200, bf16:
    # gpt2-medium's and llama3-8b's embeddings measured alike), counted as an fp32 table; its time is priced
    # from CUDA's kernels (``gpu_bytes`` below), which zero the table in its own dtype
    accum = rows * shp.h * shp.table_grad_accum
    ops = [OpCost("word_embedding", "vector", fwd_bytes=2 * out * shp.e, bwd_bytes=2 * out * shp.e + table + 2 * accum,
                  activation_bytes=shp.tokens * 8 + (shp.s * 8 if positions else 0),
                  weight_bytes=rows * shp.h * shp.e, weights=(rows * shp.h,),
                  fwd_allocs=(out * shp.e,), bwd_allocs=(table, accum) if accum else (table,),
                  bwd_fill_bytes=table + accum, row_ops=shp.tokens,
                  # CUDA's kernels (EmbeddingBackwardKernel.cu): the output's gradient read, the table's
                  # gradient zeroed in its own dtype, each token's fp32 partial sum written and read, the
                  # touched rows written
                  gpu_bytes=(2 * out * shp.e, 2 * out * shp.e + table + 8 * out),
                  # forward: the lookup and the (s, b) transpose's copy; backward: CUDA's
                  # embedding_dense_backward (a radix sort of the ids, segment offsets and sums: ~10
                  # kernels), the table's zeroing and, in 16-bit, the fp32 sum's cast
                  kernels=(2, 12 + (2 if accum else 0)), bwd_sync=True)]
    if shp.t > 1:
        # Megatron's vocab-parallel lookup also keeps a bool mask of the tokens outside this rank's rows
        ops[0] = replace(ops[0], comm_fwd_bytes=out * shp.e, activation_bytes=ops[0].activation_bytes + shp.tokens,
                         comm_type="reduce-scatter" if shp.sp else "all-reduce")
    if positions:
        ops.append(OpCost("position_embedding", "vector", fwd_flops=out, fwd_bytes=3 * out * shp.e,
                          bwd_bytes=2 * out * shp.e + 2 * shp.s * shp.h * shp.e, weight_bytes=shp.s * shp.h * shp.e,
                          weights=(shp.s * shp.h,), kernels=(3, 12)))
    ops.append(dropout("embedding_dropout", shp.replicated_sbh, shp))
    return ops


def chunked_lm_head(shp: Shape, *, norm: str = "layernorm", chunk_tokens: int, fused: bool = False) -> list[OpCost]:
    """The head and its loss in token chunks (``models.linear_cross_entropy``, at tp 1): the same GEMMs, the
    loss's passes a chunk of fp32 logits at a time, and what the forward keeps for the backward is the two
    gradients it made (hidden states' tokens x h, the weight's V x h in fp32), not the logits.  ``fused``: on a
    GPU, liger-kernel's fused linear cross-entropy in its place (the ``[gpu]`` extra), which accumulates the
    weight's gradient in the weight's dtype (its ``accum_dtype`` None; an H200 record's saved bytes showed it).
    The GEMMs are priced as the plain head's, forward and backward, though the chunked head runs its backward
    ones in its forward: the layer's total is right, its split between the two is not."""
    # the head's product is made a chunk at a time inside the loss (no logits-sized output); its backward only
    # scales the two gradients the forward made
    head = replace(linear("lm_head", shp.tokens, shp.h, shp.V, shp, bias=False, saved_input_elems=0),
                   fwd_allocs=(), bwd_allocs=(shp.tokens * shp.h * shp.e, shp.V * shp.h * shp.e))
    chunk = min(chunk_tokens, shp.tokens)
    logits = shp.tokens * shp.V
    chunks = -(-shp.tokens // chunk)
    # a chunk's fp32 logits: the GEMM's output cast (e + 4 + e), log-sum-exp (4), softmax in place (8), the
    # one-hot's subtraction and the scale (8), the cast back for the gradient GEMMs (4 + e); backward only
    # scales the two gradients (read and write each)
    grads = shp.tokens * shp.h * shp.e + shp.V * shp.h * (shp.e if fused else 4)
    xent = OpCost("cross_entropy", "vector", fwd_flops=8.0 * logits, bwd_flops=0.0,
                  fwd_bytes=(3 * shp.e + 28) * logits, bwd_bytes=2 * grads, activation_bytes=grads,
                  # alive at a chunk's peak: its fp32 logits, log-sum-exp's temporary of their size, and the two
                  # gradients being summed (traced on CPU: gpt2-small's head at 2,048 tokens, 956.6 MiB)
                  fwd_allocs=(chunk * shp.V * 4, chunk * shp.V * 4, grads), kernels=(10 * chunks, 2))
    return [NORMS[norm]("ln_f", shp), head, xent]


def lm_head(shp: Shape, *, norm: str = "layernorm") -> list[OpCost]:
    """Final LayerNorm, the column-parallel vocabulary projection (2*b*s*h*V/t FLOPs), and
    the vocab-parallel cross-entropy, which keeps its softmax (b*s*V/t, fp32 in Megatron)."""
    head = linear("lm_head", shp.tokens, shp.h, -(-shp.V // shp.t), shp, bias=False,
                  saved_input_elems=shp.replicated_sbh)
    head = tp_entry_comm(head, shp)
    logits = shp.tokens * -(-shp.V // shp.t)
    # log-softmax over fp32 logits: a max pass, an exp-sum pass, then read and write the result
    # (4 passes); backward reads the saved probabilities and the logits' grad is written (3 passes).
    # It allocates the log-probabilities forward; backward, the loss's dense gradient of them and
    # the logits' gradient
    # As a GPU runs it in eager mode (``models.layers.lm_loss``): the cast to fp32 (read e, write 4), the
    # log-softmax over rows too long for shared memory (max, sum, then read and write: 16 bytes), the
    # gather; backward the loss's dense gradient zeroed (4), the log-softmax's backward (its gradient read
    # twice, its output once, the result written: 16) and the cast back (read 4, write e)
    cast = shp.e + 4 if shp.e < 4 else 0
    xent = OpCost("cross_entropy", "vector", fwd_flops=5.0 * logits, bwd_flops=2.0 * logits,
                  fwd_bytes=4 * logits * 4, bwd_bytes=3 * logits * 4, activation_bytes=logits * 4,
                  fwd_allocs=(logits * 4,), bwd_allocs=(logits * 4, logits * 4),
                  kernels=(3 + bool(cast), 3 + bool(cast)), gpu_bytes=((16 + cast) * logits, (20 + cast) * logits),
                  comm_fwd_bytes=3 * shp.tokens * 4 if shp.t > 1 else 0.0,
                  comm_type="all-reduce" if shp.t > 1 else "")
    return [NORMS[norm]("ln_f", shp), head, xent]
