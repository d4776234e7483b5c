"""Analytic per-op costs of a decoder-only transformer: FLOPs, bytes moved, saved activations, weights,
TP/SP communication.  Which ops make up a model's layers is its description's to say (``arch``,
through ``costs.layer_ops.layer_ops``); GPT's block is the default.  The pipeline's edge layers (the embedding,
the head with its loss) are ``costs.edge_ops``', built from these ops.

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

from .op_cost import AnalyticError, AttentionShape, OpCost, Shape


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
    return tp_entry_comm(op, shp)


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


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm}  # a description's ``norm`` -> its op


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
    (all s otherwise, as Megatron counts causal attention); a window goes to a GPU's kernel as flex_attention's
    block mask (the blocks outside the window skipped, a few bytes a block) and to a CPU's as an s x s mask in
    the query's dtype, which it keeps and applies to every score: the CPU's flash kernel visits every key block
    under an explicit mask (bench-cpu-gptoss's windowed blocks profile as its full ones).  Two records: selective
    recompute reruns the kernel from the q, k and v it keeps, so only the log-sum-exp goes."""
    kv = _kv_heads(shp, kv_heads)
    windowed = bool(window and window < shp.s)
    keys = window if windowed and not shp.dense_window_mask else shp.s
    flops = 4.0 * shp.b * shp.s * keys * shp.attn_width / shp.t
    q = shp.sbA / shp.t
    kv_elems = 2 * shp.tokens * kv * shp.head_dim / shp.t
    lse = shp.b * shp.a / shp.t * shp.s * 4
    mask = shp.s * shp.s * shp.e if windowed and shp.dense_window_mask else 0.0
    return [OpCost("fused_attention", "attention", fwd_flops=flops, bwd_flops=2.5 * flops,
                   fwd_bytes=(2 * q + kv_elems) * shp.e, bwd_bytes=(3 * q + 2 * kv_elems) * shp.e,
                   activation_bytes=(q + kv_elems) * shp.e + mask,
                   fwd_allocs=(q * shp.e,), bwd_allocs=(q * shp.e, kv_elems * shp.e),
                   attn_shape=AttentionShape(shp.b, shp.a // shp.t, kv // shp.t, shp.s, keys, shp.head_dim,
                                             int(windowed), int(shp.dropout)),
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
    reduce-scatter (SP) of b*s*h.  Saves its input, the attention's output (which the attention kernel keeps
    too: one tensor), or beside it a flattened copy where ``shp.attn_out_copy`` says so."""
    width = shp.attn_width // shp.t
    op = linear("out_proj", shp.tokens, width, shp.h, shp, bias=bias,
                saved_input_elems=shp.tokens * width * (2 if shp.attn_out_copy else 1))
    return tp_exit_comm(op, shp)


def mlp_fc1(shp: Shape, *, bias: bool = True) -> OpCost:
    op = linear("fc1", shp.tokens, shp.h, shp.f // shp.t, shp, bias=bias, saved_input_elems=shp.replicated_sbh)
    return tp_entry_comm(op, shp)


def mlp_gate_up(shp: Shape, *, bias: bool = True) -> OpCost:
    """A gated MLP's gate and up projections as one column-parallel h -> 2f/t (megatron-core's
    gated_linear_unit)."""
    op = linear("fc1_gate_up", shp.tokens, shp.h, 2 * shp.f // shp.t, shp, bias=bias,
                saved_input_elems=shp.replicated_sbh)
    return tp_entry_comm(op, shp)


# eager (``models.llama.SwiGLU``): silu, then the product (2 kernels, 5 e bytes an element of the output);
# backward ten in-place passes (26 e bytes); (kernels, e-byte elements moved an element) forward and backward
SWIGLU_KERNELS, SWIGLU_PASSES = (2, 10), (5, 26)


def swiglu(shp: Shape) -> OpCost:
    """SiLU(gate) * up: saves both halves (2 b s f/t elements); writes b s f/t.  Backward writes both halves'
    gradient (2 b s f/t) beside the sigmoid of the gate (``models.llama.SwiGLU``)."""
    n = shp.tokens * shp.f / shp.t
    return OpCost("swiglu", "vector", fwd_flops=6.0 * n, bwd_flops=12.0 * n, fwd_bytes=3 * n * shp.e,
                  bwd_bytes=5 * n * shp.e, activation_bytes=2 * n * shp.e, bwd_allocs=(2 * n * shp.e, n * shp.e),
                  kernels=SWIGLU_KERNELS, gpu_bytes=tuple(p * n * shp.e for p in SWIGLU_PASSES))


def gelu(shp: Shape) -> OpCost:
    """Saves its input: b*s*f/t elements (8sbh/t at 16-bit with f=4h)."""
    n = shp.tokens * shp.f / shp.t
    return OpCost("gelu", "vector", fwd_flops=8.0 * n, bwd_flops=13.0 * n, fwd_bytes=2 * n * shp.e,
                  bwd_bytes=3 * n * shp.e, activation_bytes=n * shp.e)


def relu2(shp: Shape) -> OpCost:
    """Squared ReLU (Nemotron-H's MLP): ReLU keeps its output, which the square reads back: b*s*f/t elements."""
    n = shp.tokens * shp.f / shp.t
    return OpCost("relu2", "vector", fwd_flops=2.0 * n, bwd_flops=4.0 * n, fwd_bytes=4 * n * shp.e,
                  bwd_bytes=5 * n * shp.e, activation_bytes=n * shp.e, kernels=(2, 3))


def mlp_fc2(shp: Shape, *, bias: bool = True) -> OpCost:
    op = linear("fc2", shp.tokens, shp.f // shp.t, shp.h, shp, bias=bias)
    return tp_exit_comm(op, shp)


def residual_add(name: str, shp: Shape) -> OpCost:
    n = shp.replicated_sbh
    return OpCost(name, "vector", fwd_flops=n, fwd_bytes=3 * n * shp.e, bwd_bytes=2 * n * shp.e, residual=True,
                  kernels=(1, 1))


def tp_entry_comm(op: OpCost, shp: Shape) -> OpCost:
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


def tp_exit_comm(op: OpCost, shp: Shape) -> OpCost:
    """Leaving a TP region: the partial sums are all-reduced (TP) or reduce-scattered (SP) in forward;
    backward all-gathers under SP and needs nothing without it (Megatron's g operator)."""
    if shp.t == 1:
        return op
    payload = shp.sbh * shp.e
    if shp.sp:
        return replace(op, comm_fwd_bytes=payload, comm_bwd_bytes=payload, comm_type="reduce-scatter+all-gather")
    return replace(op, comm_fwd_bytes=payload, comm_type="all-reduce")


def transformer_block(shp: Shape, *, kv_heads: int | None = None, mlp: str = "gelu", norm: str = "layernorm",
                      positions: str = "learned", bias: bool = True, qkv_bias: bool | None = None,
                      kernel: str = "eager", window: int | None = None, head_norm: bool = False) -> list[OpCost]:
    """A pre-norm decoder block, op by op, in execution order (``shp.a`` heads, ``shp.f`` ffn): GPT's with
    the defaults; ``kv_heads`` for grouped-query attention, a gated ``mlp="swiglu"``, ``norm="rmsnorm"``,
    rotary ``positions`` applied to queries and keys, linears without ``bias`` (q/k/v's as ``qkv_bias``
    says), the attention core as one fused ``kernel`` (with a sliding ``window``) or written out,
    ``head_norm``: each query and key head RMS-normalised (Qwen3)."""
    norm_op = NORMS[norm]
    if mlp == "gelu":
        mlp_ops = [mlp_fc1(shp, bias=bias), gelu(shp), mlp_fc2(shp, bias=bias)]
    elif mlp == "relu2":
        mlp_ops = [mlp_fc1(shp, bias=bias), relu2(shp), mlp_fc2(shp, bias=bias)]
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

