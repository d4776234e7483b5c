"""Analytic costs of a whole model from its description (``arch``): each layer's ops (``costs.layer_ops``) priced
on a device, per-op rows, per-layer totals, ``LayerCost`` records, and each pipeline rank's step for the peak rule."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..arch import as_description, attention_backend, runs_on_gpu
from . import analytic as A
from .gpu_pricing import MEGATRON
from .hardware import DeviceSpec
from .layer_ops import chunked_head, efficient_sdpa, layer_ops, tied_projection
from .moe_ops import expert_weight_bytes
from .op_cost import DTYPE_BYTES
from .peak import RankStep, ZeroSettings, layer_peak_bytes, walks_schedule
from .types import LayerCost


def dropout_mask_bytes(device: str, dtype: str) -> int:
    """Bytes per element of the mask a dropout keeps for its backward.  CUDA's kernel keeps a bool (1 byte:
    on an H200 the profiler's saved bytes of a GPT block equal the analytic count with 1-byte masks, 1,681
    against 1,680 MiB); the CPU's keeps a mask of the input's dtype.  ``device``: a spec name ("cpu" is
    the CPU; every other spec, "cuda" and the datasheets', a GPU) or a torch device type."""
    if dtype not in DTYPE_BYTES:
        raise A.AnalyticError(f"dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype] if device == "cpu" else 1


def table_grad_accum_bytes(device: str, dtype: str) -> int:
    """Bytes per element of the buffer an embedding's backward sums its table's gradient in before the cast
    (``Shape.table_grad_accum``): fp32 on a GPU in 16-bit (measured on an H200: the embedding's allocator
    peak 4 x V x h above its 16-bit gradient, gpt2-medium and llama3-8b alike); none on a CPU or in fp32.
    ``device``: as ``dropout_mask_bytes``'s."""
    if dtype not in DTYPE_BYTES:
        raise A.AnalyticError(f"dtype {dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    return 4 if device != "cpu" and DTYPE_BYTES[dtype] < 4 else 0


@dataclass(frozen=True)
class EstimateRequest:
    micro_batch: int
    seq: int
    tp: int = 1
    sp: bool = False
    dtype: str = "bf16"
    selective_recompute: bool = False
    optimizer_bytes_per_param: int | None = None  # None: 8 in fp32 (Adam m, v), 12 in 16-bit (+ fp32 master)
    mask_bytes: int | None = None  # dropout mask element; None: ``dropout_mask_bytes`` of the device and dtype
    # dropless Mixture-of-Experts: the largest expert load over the mean (DeepSpeed pads every expert to it),
    # measured from a run's loads; None: what a uniformly random router gives (``moe_ops.busiest_expert_load``)
    expert_imbalance: float | None = None
    ep: int = 1  # expert-parallel degree: E / ep experts a rank, two all-to-alls each way per MoE block
    # how the layers run on a GPU (``costs.gpu_pricing``): "eager" (train.py), "compiled" (train.compile) or
    # "megatron" (Megatron-LM's fused kernels; "megatron-2021": before its fused gradient accumulation); a CPU
    # spec prices every one alike
    execution: str = "eager"
    # DeepSpeed's ZeRO-3 runs every linear through its own autograd function (``memory_efficient_linear``, on
    # by default), which keeps the input it is handed as it is
    zero3_linear: bool = False


def shape_for(model, req: EstimateRequest, device: DeviceSpec | None = None, *, runs_on: str | None = None) -> A.Shape:
    """One micro-batch of ``model`` (a description, or a config that describes itself) on one TP rank;
    ``a`` and ``f`` are the first block's (``layer_ops`` gives each block its own).  ``runs_on``: the device the layers run on where it is
    not the spec's (its dropout masks and embedding backward)."""
    desc = as_description(model)
    if req.dtype not in DTYPE_BYTES:
        raise A.AnalyticError(f"dtype {req.dtype!r}: use one of {sorted(DTYPE_BYTES)}")
    if req.seq > desc.seq_len:
        raise A.AnalyticError(f"seq {req.seq} exceeds the model's seq_len {desc.seq_len}")
    e = DTYPE_BYTES[req.dtype]
    runs_on = runs_on or (device.name if device else "cuda")
    m = req.mask_bytes if req.mask_bytes is not None else dropout_mask_bytes(runs_on, req.dtype)
    return A.Shape(b=req.micro_batch, s=req.seq, h=desc.hidden, a=desc.heads, f=desc.ffn, V=desc.vocab,
                   e=e, m=m, t=req.tp, sp=req.sp, dropout=desc.dropout, ep=req.ep,
                   d=next((b.attention.head_dim or 0 for b in desc.blocks if b.attention is not None), 0),
                   table_grad_accum=table_grad_accum_bytes(runs_on, req.dtype), bias_grad_buffer=runs_on_gpu(runs_on),
                   dense_window_mask=not runs_on_gpu(runs_on),
                   # (under selective recompute the kernel keeps nothing: its output is the linear's only copy)
                   autograd_linear=(runs_on_gpu(runs_on) and req.execution == "eager" and req.tp == 1
                                    and not req.zero3_linear and not req.selective_recompute))


def runs_efficient_sdpa(model, req: EstimateRequest, device: str | None) -> bool:
    """Whether any block of ``model`` runs torch's memory-efficient SDPA kernel on ``device`` (the spec's name)
    under ``req``: the only case ``req.zero3_linear`` changes a layer's costs (``Shape.attn_out_copy``)."""
    shp = shape_for(model, req, runs_on=device)
    return any(efficient_sdpa(replace(shp, a=b.attention.heads, d=b.attention.head_dim or 0), b.attention, device)
               for b in as_description(model).blocks if b.attention is not None)


def op_backend(op: A.OpCost, req: EstimateRequest, device: str | None) -> str | None:
    """The SDPA backend a fused attention op runs on ``device`` (``arch.attention_backend``), None for others."""
    if not op.attn_shape:
        return None
    shape = op.attn_shape
    if req.execution in MEGATRON and runs_on_gpu(device):
        return "cudnn"  # Megatron-core's fused attention: Transformer Engine's, on cuDNN's kernels
    return attention_backend("fused", device, dtype=req.dtype, head_dim=shape.head_dim,
                             gqa=shape.kv_heads != shape.heads, masked=bool(shape.masked), sinks=shape.sinks)


# ops train.py runs outside the layers torch.compile compiles: the loss (DeepSpeed's loss_fn)
UNCOMPILED_OPS = frozenset({"cross_entropy"})


def op_rows(ops: list[A.OpCost], device: DeviceSpec, req: EstimateRequest) -> list[dict]:
    rows = []
    for op in ops:
        execution = "eager" if req.execution == "compiled" and op.name in UNCOMPILED_OPS else req.execution
        kw = dict(dtype=req.dtype, tp=req.tp, ep=req.ep, execution=execution,
                  attention_backend=op_backend(op, req, device.name))
        f = device.op_time(op, **kw)
        b = device.op_time(op, backward=True, **kw)
        saved = 0.0 if (req.selective_recompute and op.recompute) else op.activation_bytes
        rows.append({"op": op.name, "kind": op.kind, "fwd_flops": op.fwd_flops, "bwd_flops": op.bwd_flops,
                     "activation_bytes": saved, "weight_bytes": op.weight_bytes,
                     "comm_fwd_bytes": op.comm_fwd_bytes, "comm_bwd_bytes": op.comm_bwd_bytes, "comm_type": op.comm_type,
                     "compute_fwd_s": f["compute_s"], "memory_fwd_s": f["memory_s"], "comm_fwd_s": f["comm_s"],
                     "comm_bwd_s": b["comm_s"],
                     "fwd_s": f["time_s"], "bwd_s": b["time_s"], "accumulate_bwd_s": b["accumulate_s"],
                     "intensity": f["intensity"]})
    return rows


def time_by_class(ops: list[A.OpCost], rows: list[dict], layer_s: float) -> dict[str, float]:
    """A layer's forward + backward seconds by what spends them: GEMMs, attention cores, memory-bound ops, the
    TP/EP collectives inside the layer and the host (what its dispatch adds beyond the kernels)."""
    out = {"gemm": 0.0, "attention": 0.0, "memory": 0.0, "communication": 0.0}
    for op, r in zip(ops, rows):
        comm = r["comm_fwd_s"] + r["comm_bwd_s"]
        kind = {"matrix": "gemm", "attention": "attention"}.get(op.kind, "memory")
        out[kind] += r["fwd_s"] + r["bwd_s"] - comm
        out["communication"] += comm
    out["host"] = max(0.0, layer_s - sum(out.values()))
    return out


def layer_floor_s(ops: list[A.OpCost], device: DeviceSpec, req: EstimateRequest) -> tuple:
    """What an eager layer's host costs on a GPU spec: (the layer's module call s, each op's forward
    dispatch s, each op's backward dispatch s).  An op's kernels start no sooner than the host issues them,
    so an op takes at least its dispatch.  Zeros on a CPU, compiled, or under Megatron's fused kernels."""
    if device.gpu is None or req.execution != "eager":
        return 0.0, [0.0] * len(ops), [0.0] * len(ops)
    kern = device.gpu
    return (kern.layer_call_s, [kern.host_kernel_s * op.kernels[0] for op in ops],
            [kern.host_kernel_bwd_s * op.kernels[1] for op in ops])


def estimate_layers(model, req: EstimateRequest, device: DeviceSpec, *, runs_on: str | None = None) -> list[dict]:
    """Per layer, its ops costed on ``device``; ``runs_on``: the device the layers run on, where it is not the
    spec's (an "auto" attention's kernel, ``arch.attention_kernel``)."""
    shp = shape_for(model, req, device, runs_on=runs_on)
    out = []
    done: dict = {}  # alike blocks share one op list: cost it once
    # a tied head runs as the embedding's forward_fn, which compiling the layers' modules leaves eager
    tied = as_description(model).tied_head
    desc_mtp = as_description(model).mtp_layers
    for name, kind, ops in layer_ops(model, shp, expert_imbalance=req.expert_imbalance,
                                     device=runs_on or device.name):
        if (id(ops), kind) in done:
            out.append({**done[id(ops), kind], "name": name})
            continue
        index = len(out)
        layer_req = replace(req, execution="eager") if kind == "head" and tied and req.execution == "compiled" else req
        rows = op_rows(ops, device, layer_req)
        params = sum(op.weight_bytes for op in ops) / shp.e
        recompute_fwd = sum(r["fwd_s"] for r, op in zip(rows, ops) if op.recompute) if req.selective_recompute else 0.0
        call, host_fwd, host_bwd = layer_floor_s(ops, device, layer_req)
        fwd_s = call + sum(max(r["fwd_s"], h) for r, h in zip(rows, host_fwd))
        if any(op.bwd_sync for op in ops):  # the host waits on the GPU: dispatch and kernels in series
            bwd_s = call + sum(r["bwd_s"] + h for r, h in zip(rows, host_bwd)) + recompute_fwd
        else:
            bwd_s = call + sum(max(r["bwd_s"], h) for r, h in zip(rows, host_bwd)) + recompute_fwd
        out.append({
            "name": name, "kind": kind, "alike_of": index,  # the first layer of these ops (alike blocks)
            "fwd_flops": sum(r["fwd_flops"] for r in rows), "bwd_flops": sum(r["bwd_flops"] for r in rows),
            "activation_bytes": sum(r["activation_bytes"] for r in rows),
            "param_bytes": params * shp.e, "params": params, "expert_params": expert_weight_bytes(ops) / shp.e,
            "tensors": [int(n) for op in ops for n in op.weights],
            # multi-token prediction: the D shifted embeddings (then the MTP outputs) travel beside the hidden states
            "output_bytes": 0 if kind == "head" else shp.replicated_sbh * shp.e * (1 + desc_mtp),
            "loss_input_bytes": (0 if kind != "head" else shp.tokens * shp.h * shp.e if chunked_head(model, shp)
                                 else shp.tokens * (1 + desc_mtp) * -(-shp.V // shp.t) * shp.e),
            "peak_bytes": layer_peak_bytes(ops, shp.e, selective=req.selective_recompute,
                                           output_bytes=0 if kind == "head" else shp.replicated_sbh * shp.e * (1 + desc_mtp)),
            # selective recompute as a choice per layer: what it keeps, the forward it replays (None: no
            # attention core to replay)
            "selective_kept_bytes": (sum(op.activation_bytes for op in ops if not op.recompute)
                                     if any(op.recompute and op.activation_bytes for op in ops) else None),
            "selective_replay_s": sum(r["fwd_s"] for r, op in zip(rows, ops) if op.recompute),
            "comm_bytes": sum(r["comm_fwd_bytes"] + r["comm_bwd_bytes"] for r in rows),
            "fwd_s": fwd_s, "bwd_s": bwd_s,
            "host_fwd_s": call + sum(host_fwd), "host_bwd_s": call + sum(host_bwd),
            "class_s": time_by_class(ops, rows, fwd_s + bwd_s),
            # W: an embedding's backward is all weight gradient (token ids take none); a GEMM with a
            # weight spends half its backward on dW (the other half is dX); adding a weight's gradient into the
            # last micro-batch's (a roofline spec's accumulate_s) is all weight gradient; the rest is input gradient
            "wgrad_s": (sum(r["bwd_s"] for r in rows) if kind == "embedding" else
                        sum((0.5 * (r["bwd_s"] - r["accumulate_bwd_s"]) if op.kind == "matrix" and op.weight_bytes
                             else 0.0) + r["accumulate_bwd_s"] for r, op in zip(rows, ops))),
        })
        done[id(ops), kind] = out[-1]
    return out


def analytic_layer_costs(model, req: EstimateRequest, device: DeviceSpec, *,
                         runs_on: str | None = None) -> list[LayerCost]:
    """The same records the profiler produces, from arithmetic (for partition_method "analytic");
    ``runs_on``: as ``estimate_layers``."""
    shp = shape_for(model, req, device, runs_on=runs_on)
    costs = []
    for row in estimate_layers(model, req, device, runs_on=runs_on):
        if row["alike_of"] < len(costs):  # an alike block: the first one's record under its own name
            costs.append(costs[row["alike_of"]].renamed(row["name"]))
            continue
        params = int(row["params"])
        per_param = req.optimizer_bytes_per_param or (8 if req.dtype == "fp32" else 12)
        costs.append(LayerCost(
            name=row["name"], forward_s=row["fwd_s"], backward_s=row["bwd_s"], recompute_s=row["fwd_s"],
            param_bytes=params * shp.e, grad_bytes=params * shp.e,
            optimizer_bytes=params * per_param,
            activation_bytes=int(row["activation_bytes"]), output_bytes=int(row["output_bytes"]),
            weight_grad_s=row["wgrad_s"], param_numels=tuple(row["tensors"]),
            peak_bytes=int(row["peak_bytes"]), loss_input_bytes=int(row["loss_input_bytes"]),
            expert_param_bytes=int(row["expert_params"]) * shp.e,
            selective_kept_bytes=None if row["selective_kept_bytes"] is None else int(row["selective_kept_bytes"]),
            selective_replay_s=row["selective_replay_s"],
        ))
    if as_description(model).tied_head and len(costs) > 1 and costs[0].param_numels:
        # the head projects onto the embedding's word table: one weight, held once where a stage has both
        table = costs[0].param_numels[0] * shp.e
        costs[0] = replace(costs[0], tied_key="word_embeddings", tied_param_bytes=table)
        costs[-1] = replace(costs[-1], tied_key="word_embeddings", tied_param_bytes=min(table, costs[-1].param_bytes))
    return costs


def rank_steps(model, lay, *, parts: list[int] | None = None, seq: int | None = None, dtype: str = "fp32",
               dp_rank: int | None = None, mask_bytes: int | None = None, fused_adam: bool = False,
               zero: ZeroSettings | None = None, modes: list[str] | None = None,
               device: str | None = None, expert_imbalance: float | None = None) -> list[RankStep]:
    """Every pipeline rank's ``RankStep`` for ``model`` under ``lay`` (a ``Layout``; one rank without a
    pipeline), its layers' ops from the analytic model and its ZeRO settings from the ds.json the layout
    writes.  ``parts``: the pipeline's split (required with pp > 1); ``fused_adam``: the optimizer makes no
    temporaries (GPUs' FusedAdam; train.py's torch AdamW on CPU does); ``zero``: the run's ZeRO settings where
    its ds.json has its own (``ZeroSettings.from_ds_config``; its ``bf16_accum_bytes`` where DeepSpeed runs
    the pipeline with its ``BF16_Optimizer``), else those the layout writes.  ``modes``: a recompute mode per
    pipeline layer (in place of the layout's one setting).  ``device``: the spec (or device type) the rank runs
    on: the dropout masks' element where ``mask_bytes`` is None, and an "auto" attention's kernel (None: 1-byte
    masks and the attention written out, as before either was known).  ``expert_imbalance``: ``EstimateRequest``'s."""
    desc = as_description(model)
    if mask_bytes is None and device is not None:
        mask_bytes = dropout_mask_bytes(device, dtype)
    req = EstimateRequest(micro_batch=lay.micro_batch, seq=seq or desc.seq_len, tp=lay.tp, sp=lay.sp, dtype=dtype,
                          mask_bytes=mask_bytes, selective_recompute=lay.recompute == "selective", ep=lay.ep,
                          zero3_linear=lay.deepspeed_zero3)
    shp = shape_for(desc, req, runs_on=device)
    layers = layer_ops(desc, shp, expert_imbalance=expert_imbalance, device=device)
    modes = list(modes) if modes is not None else [lay.recompute] * len(layers)
    # selective: the attention core's activations are not kept
    ops = [[replace(op, activation_bytes=0.0) if mode == "selective" and op.recompute else op for op in layer]
           for (_, _, layer), mode in zip(layers, modes)]
    if desc.tied_head and (not lay.pipelined or lay.pp == 1):
        ops[-1] = tied_projection(ops[-1])

    def checkpoint(start: int, stop: int) -> tuple | None:
        # full recompute keeps each layer's input: the hidden states (the embedding's token ids: ~nothing)
        if "full" not in modes[start:stop]:
            return None
        return tuple((0.0 if i == 0 else float(shp.replicated_sbh * e)) if modes[i] == "full" else None
                     for i in range(start, stop))

    zero = zero or ZeroSettings.of_layout(lay)
    e = DTYPE_BYTES[dtype]
    if not lay.pipelined:
        order = tuple((kind, mb) for mb in range(lay.micro_batches) for kind in ("F", "B"))
        return [RankStep(ops, order, e, zero, dp=lay.dp, dp_rank=dp_rank, checkpoint_bytes=checkpoint(0, len(ops)),
                         offload=lay.offload, fused_adam=fused_adam, ep=lay.ep, tp=lay.tp)]
    spec = lay.schedule_spec
    if not walks_schedule(spec):
        raise NotImplementedError(f"the peak rule walks one model chunk a rank with whole backwards; "
                                  f"{spec.name} runs {spec.chunks_per_rank} chunks or splits them")
    if parts is None or len(parts) != lay.pp + 1:
        raise ValueError(f"a pipeline of {lay.pp} stages needs its split: parts of {lay.pp + 1} boundaries")
    schedule = spec.for_ranks(lay.pp, lay.micro_batches)
    boundary = float(shp.tokens * shp.h * e)  # a block's output, sent between stages
    logits = float(shp.tokens * -(-shp.V // shp.t) * e)  # the last stage's output, kept for the loss
    steps = []
    for s in range(lay.pp):
        order = tuple((w.kind, w.micro_batch) for w in schedule.orders[s] if w.kind in ("F", "B"))
        last = s == lay.pp - 1
        steps.append(RankStep(ops[parts[s]:parts[s + 1]], order, e, zero, dp=lay.dp, dp_rank=dp_rank,
                              pipe_buffers=max(2, min(lay.pp - s, lay.micro_batches)),
                              output_bytes=logits if last else boundary, input_bytes=boundary if s else 0.0,
                              flat_grad_bytes=zero.bf16_accum_bytes or (e if e < 4 and lay.zero == 0 else 0),
                              checkpoint_bytes=checkpoint(parts[s], parts[s + 1]), offload=lay.offload,
                              fused_adam=fused_adam, ep=lay.ep, tp=lay.tp))
    return steps
