"""Analytic per-op costs of a decoder-only transformer: FLOPs, bytes moved, saved activations, weights,
TP/SP communication.  Which ops make up a model's layers is its description's to say (``arch``,
through ``costs.estimate.layer_ops``); GPT's block is the default.

Pure arithmetic, no torch.  Each op function returns an ``OpCost`` for one
micro-batch on one tensor-parallel rank.  Notation (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Sec. 4):
b micro-batch, s sequence, h hidden, a heads, f ffn hidden, V vocabulary,
t tensor-parallel degree, e bytes per element, m bytes per dropout-mask element.

Saved activations follow that paper's accounting: with e=2, m=1, f=4h a block
keeps s*b*h*(34 + 5*a*s/h) bytes without parallelism, 10 + 24/t (+5as/ht) with TP,
34/t (+5as/ht) with TP+SP, and the 5*a*s/h term goes with selective recompute.
Matmul FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters", Sec. 5.1): 2*m*n*k per (m x k)(k x n) product, and
backward = 2 x forward.  TP/SP communication follows Megatron: without SP one
all-reduce of b*s*h per block half in forward and one in backward; with SP an
all-gather + reduce-scatter pair instead (the same bytes on a ring).
"""

from __future__ import annotations

from dataclasses import replace

from .op_cost import AnalyticError, OpCost, Shape


# --------------------------------------------------------------------------- ops


def linear(name: str, tokens: float, k: int, n: int, shp: Shape, *, bias: bool = True,
           saved_input_elems: float | None = None) -> OpCost:
    """(tokens x k) @ (k x n) [+ bias]: 2*tokens*k*n FLOPs forward, twice that backward
    (input and weight gradients).  Saves its input (or ``saved_input_elems`` of it)."""
    saved = tokens * k if saved_input_elems is None else saved_input_elems
    tensors = (k * n, n) if bias else (k * n,)
    w = sum(tensors) * shp.e
    return OpCost(
        name, "matrix",
        fwd_flops=2.0 * tokens * k * n, bwd_flops=4.0 * tokens * k * n,
        fwd_bytes=(tokens * k + tokens * n) * shp.e + w,
        bwd_bytes=(2 * tokens * n + 2 * tokens * k) * shp.e + 2 * w,
        activation_bytes=saved * shp.e, weight_bytes=w, weights=tensors, gemm_dim=float(min(tokens, k, n)),
        gemm_out=int(n), gemm=(tokens, k, n), kernels=(1, 3 if bias else 2),
        fwd_allocs=(tokens * n * shp.e,),
        bwd_allocs=(tokens * k * shp.e, w) + ((tokens * n * shp.e,) if bias and shp.bias_grad_buffer else ()),
    )


def layer_norm(name: str, shp: Shape) -> OpCost:
    """Saves its input (Korthikanti: 2sbh at 16-bit); sharded along s under SP."""
    n = shp.replicated_sbh
    return OpCost(name, "vector", fwd_flops=8.0 * n, bwd_flops=16.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e, weight_bytes=2 * shp.h * shp.e,
                  weights=(shp.h, shp.h), kernels=(1, 2))


def qkv(shp: Shape, kv_heads: int | None = None, *, bias: bool = True) -> OpCost:
    """Column-parallel h -> (h + 2 kv h/a)/t: 3h/t with a key and value head per query head; grouped-query
    attention projects kv_heads key/value heads.  Under SP its input is all-gathered in forward; the
    sharded copy is what is saved (re-gathered in backward), so 2sbh/t."""
    kv = _kv_heads(shp, kv_heads)
    width = (shp.attn_width + 2 * kv * shp.head_dim) // shp.t
    op = linear("qkv", shp.tokens, shp.h, width, shp, bias=bias, saved_input_elems=shp.replicated_sbh)
    return _tp_entry_comm(op, shp)


def _kv_heads(shp: Shape, kv_heads: int | None) -> int:
    """The key/value heads (None: one per query head), each TP rank holding whole ones."""
    kv = shp.a if kv_heads is None else kv_heads
    if kv % shp.t:
        raise AnalyticError(f"tensor parallel degree {shp.t} does not divide the key/value heads ({kv}); "
                            f"pick t dividing them")
    return kv


def rms_norm(name: str, shp: Shape) -> OpCost:
    """RMSNorm: a scale and no bias; saves its input and each token's fp32 reciprocal RMS (as fused
    kernels do), with fewer passes than LayerNorm (no mean)."""
    n = shp.replicated_sbh
    return OpCost(name, "vector", fwd_flops=4.0 * n, bwd_flops=8.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e + n / shp.h * 4, weight_bytes=shp.h * shp.e,
                  weights=(shp.h,), **_rms_norm_kernels(n, shp.e))


def _rms_norm_kernels(n: float, e: int) -> dict:
    """``models.layers.RMSNorm`` in eager mode, op by op on n elements: forward casts to fp32, squares,
    takes the mean, normalises, casts back and scales (7 kernels, 5e + 32 bytes an element in 16-bit);
    backward recomputes the normalised input and forms dx and the weight's gradient in fp32 (14 kernels,
    ~4(e + 4) + 80 bytes an element).  A cast is free in fp32."""
    cast = e + 4 if e < 4 else 0
    return {"kernels": (7, 14), "gpu_bytes": ((2 * cast + 24 + (4 + e if cast else 0) + 2 * e) * n,
                                              (4 * cast + 80) * n)}


def qk_norm(shp: Shape, kv_heads: int | None = None) -> OpCost:
    """An RMSNorm over each query and key head (Qwen3; Megatron's qk_layernorm): d weights each for
    queries and keys, replicated over TP (their gradients summed over it: 2d elements, not costed);
    saves its input and one fp32 reciprocal RMS per head and token."""
    kv = _kv_heads(shp, kv_heads)
    d = shp.head_dim
    n = shp.tokens * (shp.a + kv) * d / shp.t
    rms = _rms_norm_kernels(n, shp.e)
    return OpCost("qk_norm", "vector", fwd_flops=4.0 * n, bwd_flops=8.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e + n / d * 4, weight_bytes=2 * d * shp.e,
                  weights=(d, d), kernels=(14, 28), gpu_bytes=rms["gpu_bytes"])


def rotary(shp: Shape, kv_heads: int | None = None) -> OpCost:
    """Rotary positions on queries and keys: elementwise (x cos + rotate(x) sin); backward needs only
    the cos and sin tables of the block's s positions (2 s d elements), nothing per token."""
    kv = _kv_heads(shp, kv_heads)
    d = shp.head_dim
    n = shp.tokens * (shp.attn_width + kv * d) / shp.t
    # eager (``models.llama.rotate``): x cos, the negated half, their concatenation, x sin, the sum: five
    # kernels and 10 e bytes an element each way, and the cos / sin tables made each call
    return OpCost("rotary", "vector", fwd_flops=3.0 * n, bwd_flops=3.0 * n, fwd_bytes=3 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=2 * shp.s * d * shp.e, kernels=(12, 10),
                  gpu_bytes=(10 * n * shp.e, 10 * n * shp.e))


def fused_attention(shp: Shape, kv_heads: int | None = None, window: int | None = None) -> list[OpCost]:
    """softmax(QK^T / sqrt(d)) V in one kernel (flash attention; torch's SDPA on a CPU), grouped-query:
    kv_heads key/value heads.  It saves q, k and v and the fp32 log-sum-exp per query row, and
    recomputes the probabilities backward (five products against the forward's two, Dao et al. 2022);
    its output is the projection's saved input, counted there.  Each query sees ``window`` keys at most
    (all s otherwise, as Megatron counts causal attention); a window goes to a CPU's kernel as an s x s mask
    in the query's dtype, which it keeps, and to a GPU's as flex_attention's block mask (the blocks outside
    the window skipped, a few bytes a block).  Two records: selective recompute reruns the kernel from the
    q, k and v it keeps, so only the log-sum-exp goes."""
    kv = _kv_heads(shp, kv_heads)
    keys = min(window, shp.s) if window else shp.s
    flops = 4.0 * shp.b * shp.s * keys * shp.attn_width / shp.t
    q = shp.sbA / shp.t
    kv_elems = 2 * shp.tokens * kv * shp.head_dim / shp.t
    lse = shp.b * shp.a / shp.t * shp.s * 4
    windowed = bool(window and window < shp.s)
    mask = shp.s * shp.s * shp.e if windowed and shp.dense_window_mask else 0.0
    return [OpCost("fused_attention", "attention", fwd_flops=flops, bwd_flops=2.5 * flops,
                   fwd_bytes=(2 * q + kv_elems) * shp.e, bwd_bytes=(3 * q + 2 * kv_elems) * shp.e,
                   activation_bytes=(q + kv_elems) * shp.e + mask,
                   fwd_allocs=(q * shp.e,), bwd_allocs=(q * shp.e, kv_elems * shp.e),
                   attn_shape=(shp.b, shp.a // shp.t, kv // shp.t, shp.s, keys, shp.head_dim, int(windowed),
                               int(shp.dropout)),
                   kernels=(1, 3)),
            OpCost("fused_attention_lse", "attention", activation_bytes=lse, recompute=True)]


def attention_logits(shp: Shape) -> OpCost:
    """Q K^T per head: 2*b*s*s*h/t FLOPs; saves Q and K (4sbh/t at 16-bit)."""
    flops = 2.0 * shp.b * shp.s * shp.s * shp.attn_width / shp.t
    scores = shp.a * shp.s * shp.s * shp.b / shp.t * shp.e
    q = shp.sbA / shp.t * shp.e
    # backward makes dQ and dK, then the q, k, v output's gradient of the three (the next op's input); the
    # attention's held dV and V go with it
    heads = shp.b * shp.a // shp.t
    return OpCost("logits", "attention", fwd_flops=flops, bwd_flops=2 * flops,
                  fwd_bytes=2 * shp.sbA / shp.t * shp.e + scores,
                  activation_bytes=2 * q, fwd_allocs=(scores,), bwd_allocs=(3 * q, 2 * q), bwd_release=True,
                  gemm=(heads * shp.s, shp.head_dim, shp.s), kernels=(3, 3))


def softmax(shp: Shape) -> OpCost:
    """Saves its output: a*s*s*b/t elements (2as^2b/t at 16-bit); recomputed under selective recompute."""
    n = shp.a * shp.s * shp.s * shp.b / shp.t
    return OpCost("softmax", "vector", fwd_flops=5.0 * n, bwd_flops=4.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e, recompute=True,
                  fwd_allocs=(n * shp.e,), bwd_allocs=(n * shp.e,))


def dropout(name: str, elems: float, shp: Shape, *, recompute: bool = False) -> OpCost:
    """Saves its mask (m bytes per element); nothing when the model has no dropout."""
    if not shp.dropout:
        return OpCost(name, "vector")
    return OpCost(name, "vector", fwd_flops=elems, bwd_flops=elems, fwd_bytes=2 * elems * shp.e + elems * shp.m,
                  bwd_bytes=2 * elems * shp.e + elems * shp.m, activation_bytes=elems * shp.m, recompute=recompute,
                  random_elems=elems)


def attend(shp: Shape) -> list[OpCost]:
    """softmax(QK^T) V: 2*b*s*s*h/t FLOPs; saves V and the (dropped-out) probabilities.

    Two records because only the probabilities are recomputed under selective recompute.
    Without dropout the probabilities are the softmax output, already counted there.
    """
    flops = 2.0 * shp.b * shp.s * shp.s * shp.attn_width / shp.t
    probs = shp.a * shp.s * shp.s * shp.b / shp.t
    v = shp.sbA / shp.t * shp.e
    # backward makes dP (the probabilities' gradient, the next op's input) and dV, which waits for dQ and dK
    # (the three are one tensor's); V is a view of the q, k, v output, freed with q and k
    return [OpCost("attend", "attention", fwd_flops=flops, bwd_flops=2 * flops,
                   fwd_bytes=(probs + 2 * shp.sbA / shp.t) * shp.e, activation_bytes=v,
                   bwd_allocs=(probs * shp.e, v), bwd_hold=2 * v,
                   gemm=(shp.b * shp.a // shp.t * shp.s, shp.s, shp.head_dim), kernels=(1, 2)),
            OpCost("attend_saved_probs", "attention", activation_bytes=probs * shp.e if shp.dropout else 0.0,
                   recompute=True)]


def out_proj(shp: Shape, *, bias: bool = True) -> OpCost:
    """Row-parallel a d/t -> h (a d = h unless the heads are wider), then an all-reduce (TP) or
    reduce-scatter (SP) of b*s*h."""
    op = linear("out_proj", shp.tokens, shp.attn_width // shp.t, shp.h, shp, bias=bias)
    return _tp_exit_comm(op, shp)


def mlp_fc1(shp: Shape, *, bias: bool = True) -> OpCost:
    op = linear("fc1", shp.tokens, shp.h, shp.f // shp.t, shp, bias=bias, saved_input_elems=shp.replicated_sbh)
    return _tp_entry_comm(op, shp)


def mlp_gate_up(shp: Shape, *, bias: bool = True) -> OpCost:
    """A gated MLP's gate and up projections as one column-parallel h -> 2f/t (megatron-core's
    gated_linear_unit)."""
    op = linear("fc1_gate_up", shp.tokens, shp.h, 2 * shp.f // shp.t, shp, bias=bias,
                saved_input_elems=shp.replicated_sbh)
    return _tp_entry_comm(op, shp)


def swiglu(shp: Shape) -> OpCost:
    """SiLU(gate) * up: saves both halves (2 b s f/t elements); writes b s f/t.  Backward writes both halves'
    gradient (2 b s f/t) beside the sigmoid of the gate (``models.llama.SwiGLU``)."""
    n = shp.tokens * shp.f / shp.t
    # eager (``models.llama.SwiGLU``): silu, then the product (2 kernels, 5 e bytes an element of the
    # output); backward ten in-place passes (26 e bytes)
    return OpCost("swiglu", "vector", fwd_flops=6.0 * n, bwd_flops=12.0 * n, fwd_bytes=3 * n * shp.e,
                  bwd_bytes=5 * n * shp.e, activation_bytes=2 * n * shp.e, bwd_allocs=(2 * n * shp.e, n * shp.e),
                  kernels=(2, 10), gpu_bytes=(5 * n * shp.e, 26 * n * shp.e))


def gelu(shp: Shape) -> OpCost:
    """Saves its input: b*s*f/t elements (8sbh/t at 16-bit with f=4h)."""
    n = shp.tokens * shp.f / shp.t
    return OpCost("gelu", "vector", fwd_flops=8.0 * n, bwd_flops=13.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e)


def mlp_fc2(shp: Shape, *, bias: bool = True) -> OpCost:
    op = linear("fc2", shp.tokens, shp.f // shp.t, shp.h, shp, bias=bias)
    return _tp_exit_comm(op, shp)


def residual_add(name: str, shp: Shape) -> OpCost:
    n = shp.replicated_sbh
    return OpCost(name, "vector", fwd_flops=n, fwd_bytes=3 * n * shp.e, bwd_bytes=2 * n * shp.e, residual=True,
                  kernels=(1, 1))


def _tp_entry_comm(op: OpCost, shp: Shape) -> OpCost:
    """Entering a TP region: SP all-gathers the input (fwd); backward gathers it again for the weight
    gradient (megatron-core's ColumnParallelLinear keeps only its shard) and reduce-scatters the input
    gradient.  Plain TP all-reduces the input gradient in backward (Megatron's f operator)."""
    if shp.t == 1:
        return op
    payload = shp.sbh * shp.e
    if shp.sp:
        return replace(op, comm_fwd_bytes=payload, comm_bwd_bytes=2 * payload,
                       comm_type="all-gather+all-gather,reduce-scatter")
    return replace(op, comm_bwd_bytes=payload, comm_type="all-reduce")


def _tp_exit_comm(op: OpCost, shp: Shape) -> OpCost:
    """Leaving a TP region: the partial sums are all-reduced (TP) or reduce-scattered (SP) in forward;
    backward all-gathers under SP and needs nothing without it (Megatron's g operator)."""
    if shp.t == 1:
        return op
    payload = shp.sbh * shp.e
    if shp.sp:
        return replace(op, comm_fwd_bytes=payload, comm_bwd_bytes=payload, comm_type="reduce-scatter+all-gather")
    return replace(op, comm_fwd_bytes=payload, comm_type="all-reduce")


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


def transformer_block(shp: Shape, *, kv_heads: int | None = None, mlp: str = "gelu", norm: str = "layernorm",
                      positions: str = "learned", bias: bool = True, qkv_bias: bool | None = None,
                      kernel: str = "eager", window: int | None = None, head_norm: bool = False) -> list[OpCost]:
    """A pre-norm decoder block, op by op, in execution order (``shp.a`` heads, ``shp.f`` ffn): GPT's with
    the defaults; ``kv_heads`` for grouped-query attention, a gated ``mlp="swiglu"``, ``norm="rmsnorm"``,
    rotary ``positions`` applied to queries and keys, linears without ``bias`` (q/k/v's as ``qkv_bias``
    says), the attention core as one fused ``kernel`` (with a sliding ``window``) or written out,
    ``head_norm``: each query and key head RMS-normalised (Qwen3)."""
    norm_op = {"layernorm": layer_norm, "rmsnorm": rms_norm}[norm]
    if mlp == "gelu":
        mlp_ops = [mlp_fc1(shp, bias=bias), gelu(shp), mlp_fc2(shp, bias=bias)]
    else:
        mlp_ops = [mlp_gate_up(shp, bias=bias), swiglu(shp), mlp_fc2(shp, bias=bias)]
    if kernel == "fused":
        core = fused_attention(shp, kv_heads, window)
    else:
        core = [attention_logits(shp), softmax(shp),
                dropout("attn_prob_dropout", shp.a * shp.s * shp.s * shp.b / shp.t, shp, recompute=True),
                *attend(shp)]
    return [
        norm_op("ln_1", shp),
        qkv(shp, kv_heads, bias=bias if qkv_bias is None else qkv_bias),
        *([qk_norm(shp, kv_heads)] if head_norm else []),
        *([rotary(shp, kv_heads)] if positions == "rotary" else []),
        *core,
        out_proj(shp, bias=bias),
        dropout("attn_dropout", shp.replicated_sbh, shp),
        residual_add("residual_1", shp),
        norm_op("ln_2", shp),
        *mlp_ops,
        dropout("mlp_dropout", shp.replicated_sbh, shp),
        residual_add("residual_2", shp),
    ]


def chunked_lm_head(shp: Shape, *, norm: str = "layernorm", chunk_tokens: int) -> list[OpCost]:
    """The head and its loss in token chunks (``models.linear_cross_entropy``, at tp 1): the same GEMMs, the
    loss's passes a chunk of fp32 logits at a time, and what the forward keeps for the backward is the two
    gradients it made (hidden states' tokens x h, the weight's V x h in fp32), not the logits.  The GEMMs are
    priced as the plain head's, forward and backward, though the chunked head runs its backward ones in its
    forward: the layer's total is right, its split between the two is not."""
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
    grads = shp.tokens * shp.h * shp.e + shp.V * shp.h * 4
    xent = OpCost("cross_entropy", "vector", fwd_flops=8.0 * logits, bwd_flops=0.0,
                  fwd_bytes=(3 * shp.e + 28) * logits, bwd_bytes=2 * grads, activation_bytes=grads,
                  # alive at a chunk's peak: its fp32 logits, log-sum-exp's temporary of their size, and the two
                  # gradients being summed (traced on CPU: gpt2-small's head at 2,048 tokens, 956.6 MiB)
                  fwd_allocs=(chunk * shp.V * 4, chunk * shp.V * 4, grads), kernels=(10 * chunks, 2))
    return [{"layernorm": layer_norm, "rmsnorm": rms_norm}[norm]("ln_f", shp), head, xent]


def lm_head(shp: Shape, *, norm: str = "layernorm") -> list[OpCost]:
    """Final LayerNorm, the column-parallel vocabulary projection (2*b*s*h*V/t FLOPs), and
    the vocab-parallel cross-entropy, which keeps its softmax (b*s*V/t, fp32 in Megatron)."""
    head = linear("lm_head", shp.tokens, shp.h, -(-shp.V // shp.t), shp, bias=False,
                  saved_input_elems=shp.replicated_sbh)
    head = _tp_entry_comm(head, shp)
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
    return [{"layernorm": layer_norm, "rmsnorm": rms_norm}[norm]("ln_f", shp), head, xent]


def total(ops: list[OpCost], *, selective_recompute: bool = False) -> OpCost:
    """Sum of ops; with selective recompute the ops marked ``recompute`` keep no activations."""
    acc = OpCost("total", "mixed")
    for op in ops:
        if selective_recompute and op.recompute:
            op = replace(op, activation_bytes=0.0)
        acc = acc + op
    return acc


def matmul_flops_per_iteration(*, B: int, s: int, L: int, h: int, V: int) -> float:
    """Narayanan et al. 2021: 72*B*s*L*h^2 * (1 + s/(6h) + V/(12hL)) (fwd + bwd, no recompute)."""
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))

