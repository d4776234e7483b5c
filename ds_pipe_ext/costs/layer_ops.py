"""Which ops each pipeline layer of a description runs (``arch``): the embedding, each block as its kind says
(a transformer block, MLA or the sinks in its attention, routed experts in its MLP, a Mamba-2 mixer, an MTP
layer), the head with its loss.  The ops are ``costs.analytic``'s and its companions'; ``costs.estimate``
prices them on a device."""

from __future__ import annotations

from dataclasses import replace

from ..arch import as_description, attention_backend, attention_kernel, runs_on_gpu
from . import analytic as A
from . import attention_ops
from . import edge_ops as E
from .mamba_ops import mamba2_mixer
from .moe_ops import moe_block


def assumed_attention(model, device: str) -> str:
    """What the analytic model assumes the attention core runs as on ``device``: "fused" (one kernel, flash or
    torch's SDPA) or "eager" (written out), for each kind of block; what estimate and plan print."""
    kernels = sorted({attention_kernel(block.attention.kernel, device) for block in as_description(model).blocks
                      if block.attention is not None}) or ["none"]
    return "/".join(kernels)


def layer_ops(model, shp: A.Shape, *, expert_imbalance: float | None = None,
              device: str | None = None) -> list[tuple[str, str, list[A.OpCost]]]:
    """(name, kind, ops) per pipeline layer, as the description says: the embedding, each block (alike
    blocks share one op list), the head.  ``expert_imbalance``: ``EstimateRequest``'s; ``device``: the spec
    costed, which picks an "auto" attention's kernel (``arch.attention_kernel``)."""
    desc = as_description(model)
    embedding = E.embedding(shp, positions=desc.positions == "learned")
    if desc.mtp_layers:  # the shifted ids' lookups for the MTP layers (models/mtp.py)
        embedding = embedding + [attention_ops.mtp_lookups(shp, desc.mtp_layers)]
    layers = [("EmbeddingPipe", "embedding", embedding)]
    built: dict = {}
    for block in desc.blocks:
        if block not in built:
            built[block] = block_ops(desc, block, shp, expert_imbalance=expert_imbalance, device=device)
        layers.append(("Block", "block", built[block]))
    if chunked_head(desc, shp):
        fused = runs_on_gpu(device)  # a GPU runs liger-kernel's fused loss (models.linear_cross_entropy)
        layers.append(("HeadPipe", "head", E.chunked_lm_head(shp, norm=desc.norm, chunk_tokens=desc.loss_chunk_tokens,
                                                             fused=fused)))
    elif desc.mtp_layers:  # the head projects the MTP layers' outputs beside the main ones: 1 + D times the tokens
        wide = replace(shp, b=shp.b * (1 + desc.mtp_layers))
        head = E.lm_head(wide, norm=desc.norm)
        layers.append(("HeadPipe", "head", [E.lm_head(shp, norm=desc.norm)[0], *head[1:]]))
    else:
        layers.append(("HeadPipe", "head", E.lm_head(shp, norm=desc.norm)))
    return layers


def block_ops(desc, block, shp: A.Shape, *, expert_imbalance: float | None = None,
              device: str | None = None) -> list:
    """One block's ops, as its kind says (``arch.Block.kind``): a transformer block; or, a hybrid's layers,
    its norm, then attention, an MLP (routed experts: MoE) or a Mamba-2 mixer alone, then its residual."""
    if block.mtp:  # the transformer block it holds, between its input projection and its final norm
        inner = block_ops(desc, replace(block, mtp=False), shp, expert_imbalance=expert_imbalance, device=device)
        return attention_ops.mtp_layer(shp, inner, norm=A.NORMS[desc.norm])
    if block.mamba is not None:
        m = block.mamba
        return [A.NORMS[desc.norm]("norm", shp),
                *mamba2_mixer(shp, heads=m.heads, head_dim=m.head_dim, state=m.state, groups=m.groups,
                              conv_kernel=m.conv_kernel, chunk=m.chunk, bias=desc.linear_bias,
                              torch_code=device == "cpu"),
                A.residual_add("residual", shp)]
    att, mlp = block.attention, block.mlp
    shaped = replace(shp, a=att.heads if att else shp.a, f=mlp.ffn if mlp else shp.f,
                     d=(att.head_dim or 0) if att else shp.d)
    kernel = core_kernel(shaped, att, device) if att else "eager"
    if att is not None:
        shaped = replace(shaped, attn_out_copy=shp.autograd_linear and efficient_sdpa(shaped, att, device))
    ops = A.transformer_block(shaped, kv_heads=att.kv_heads if att else None, mlp=mlp.kind if mlp else "gelu",
                              norm=desc.norm, positions=desc.positions, bias=desc.linear_bias,
                              qkv_bias=att.qkv_bias if att else None,
                              kernel=kernel,
                              window=att.window if att else None, head_norm=att.qk_norm if att else False)
    if att is not None and (att.mla is not None or att.sinks or att.out_bias):
        ops = _attention_variant(ops, shaped, att, kernel, device)
    half = next(i for i, op in enumerate(ops) if op.name == "residual_1") + 1
    if att is None:  # the MLP's half alone
        ops = ops[half:]
    elif mlp is None:  # the attention's half alone
        ops = ops[:half]
    if block.experts is not None:  # routed experts in place of the MLP (costs/moe_ops.py)
        ops = moe_block(ops, shaped, block.experts, ep=shp.ep, imbalance=expert_imbalance)
    return ops


def _attention_variant(ops: list, shp: A.Shape, att, kernel: str, device: str | None) -> list:
    """A block's ops with DeepSeek-V3's or gpt-oss's attention in place (``costs.attention_ops``): MLA between the
    input norm and the first residual; the sinks' wider softmax; the out projection's bias."""
    names = [op.name for op in ops]
    if att.mla is not None:
        start, end = names.index("ln_1") + 1, names.index("out_proj") + 1
        ops = ops[:start] + attention_ops.mla_attention(shp, att.mla) + ops[end:]
    if att.sinks and kernel == "fused":
        ops = attention_ops.fused_sink_core(ops, shp, att.kv_heads, flash=runs_on_gpu(device))
    elif att.sinks:
        ops = [attention_ops.sink_softmax(op, shp) if op.name == "softmax" else op for op in ops]
        ops = attention_ops.sink_core(ops, shp, att.kv_heads)
    if att.out_bias:
        ops = [A.out_proj(shp, bias=True) if op.name == "out_proj" else op for op in ops]
    return ops


def core_backend(shp: A.Shape, att, device: str | None) -> str:
    """The kernel a block's attention core runs on ``device`` (``arch.attention_backend``)."""
    return attention_backend(att.kernel, device, dtype="fp32" if shp.e == 4 else "bf16", head_dim=shp.head_dim,
                             gqa=att.kv_heads not in (None, shp.a), masked=bool(att.window and att.window < shp.s),
                             sinks=att.sinks)


def core_kernel(shp: A.Shape, att, device: str | None) -> str:
    """"fused" or "eager": as the description says, but for sinks the backend has none (fp32 on a GPU)."""
    kind = attention_kernel(att.kernel, device)
    return "eager" if kind == "fused" and core_backend(shp, att, device) == "eager" else kind


def efficient_sdpa(shp: A.Shape, att, device: str | None) -> bool:
    """Whether a block's attention core runs torch's memory-efficient SDPA kernel on ``device``."""
    return core_backend(shp, att, device) == "efficient"


def chunked_head(model, shp: A.Shape) -> bool:
    """Whether the head hands the loss hidden states, not logits (``loss_chunk_tokens``, at tp 1)."""
    return bool(as_description(model).loss_chunk_tokens) and shp.t == 1


def tied_projection(head: list) -> list:
    """A head whose vocabulary projection is the embedding's matrix, on the rank that holds the embedding:
    one tensor, counted there (its gradient is still computed here, then added into the embedding's)."""
    return [replace(op, weights=()) if op.name == "lm_head" else op for op in head]
