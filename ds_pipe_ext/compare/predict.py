"""The analytic side of a comparison: bytes per rank by kind, for any configuration, without launching.

Model states come from DeepSpeed's allocation rules (``costs.zero``) applied to the
parameter sizes of the layers a rank holds; activations from the analytic cost model
(``costs.estimate``) through the stage model (``costs.stage``): a pipeline stage holds
its layers' activations for each of its 1F1B in-flight micro-batches, a data-parallel
rank holds every layer's for one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..costs.estimate import EstimateRequest, analytic_layer_costs, dropout_mask_bytes
from ..costs.hardware import get_device
from ..costs.stage import stage_costs
from ..costs.zero import (bf16_accumulation_bytes, bf16_optimizer_states, expert_parallel_states, runs_bf16_optimizer,
                          zero_model_states)
from ..layout import ZERO_SETTINGS
from .configs import CompareConfig

KINDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")


@dataclass(frozen=True)
class ModelShape:
    """Per layer, the element count of each parameter tensor (what ZeRO's padding depends on)."""

    name: str
    layer_numels: list[list[int]]
    seq_len: int
    largest_module_params: int = 0  # DeepSpeed's "largest layer" (one module's own parameters) for ZeRO-3
    # per layer, the element counts of its routed experts' tensors (all E experts; a Mixture-of-Experts
    # model's, else empty): at EP degree ep a rank holds 1/ep of them, partitioned over dp / ep
    layer_expert_numels: list[list[int]] | None = None
    # and of its other tensors, in order (DeepSpeed's dense parameter group; its padding and partition
    # boundaries depend on the order)
    layer_dense_numels: list[list[int]] | None = None
    # per layer, its ``TiedLayerSpec`` key (None: not tied): a process that builds both ends of a tied pair
    # (a data-parallel model, a pipeline stage holding both) holds one module, DeepSpeed's and ours alike
    layer_tied: list[str | None] | None = None

    @property
    def params(self) -> int:
        """The parameters of the model, a tied module once."""
        return sum(held_numels(self, 0, len(self.layer_numels)))


def held_numels(shape: ModelShape, start: int, stop: int) -> list[int]:
    """The element counts of the tensors a process building layers start..stop holds: a tied module once
    (its second end calls the module the first built, in the same process)."""
    tied = shape.layer_tied or [None] * len(shape.layer_numels)
    seen, out = set(), []
    for numels, key in zip(shape.layer_numels[start:stop], tied[start:stop]):
        if key is not None and key in seen:
            continue
        seen.add(key)
        out += numels
    return out


def model_shape(model_cfg) -> ModelShape:
    """The model's layers (its family's specs) built on the meta device: shapes without memory, for any size."""
    from ..models import family_of

    with torch.device("meta"):
        layers = [spec.build() if hasattr(spec, "build") else spec for spec in family_of(model_cfg).layer_specs(model_cfg)]
    modules = [layer for layer in layers if isinstance(layer, torch.nn.Module)]
    numels = [[p.numel() for p in layer.parameters()] if isinstance(layer, torch.nn.Module) else []
              for layer in layers]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for layer in modules for m in layer.modules()),
                  default=0)
    def tensors(layer, expert: bool) -> list[int]:  # allreduce False: DeepSpeed's mark on experts
        if not isinstance(layer, torch.nn.Module):
            return []
        return [p.numel() for p in layer.parameters() if (getattr(p, "allreduce", True) is False) == expert]

    experts = [tensors(layer, True) for layer in layers]
    moe = any(experts)
    tied = [getattr(spec, "key", None) for spec in family_of(model_cfg).layer_specs(model_cfg)]
    return ModelShape(model_cfg.name, numels, model_cfg.seq_len, largest, experts if moe else None,
                      [tensors(layer, False) for layer in layers] if moe else None,
                      tied if any(key is not None for key in tied) else None)


def layer_activation_bytes(model_cfg, cfg: CompareConfig, *, dtype: str = "fp32", device: str = "cpu") -> list[float]:
    """Activation bytes each layer holds for one micro-batch (the analytic cost model's), on ``device``
    ("cpu" or "cuda": the dropout masks' element, ``dropout_mask_bytes``)."""
    req = EstimateRequest(micro_batch=cfg.layout.micro_batch, seq=model_cfg.seq_len, tp=cfg.layout.tp, dtype=dtype,
                          mask_bytes=dropout_mask_bytes(device, dtype), zero3_linear=cfg.layout.deepspeed_zero3)
    return [c.activation_bytes for c in analytic_layer_costs(model_cfg, req, get_device("a100"), runs_on=device)]


def _states(numels: list[int], cfg: CompareConfig, element_bytes: int, dp_rank: int | None,
            experts: tuple[list[int], list[int]] | None = None) -> dict[str, int]:
    # a TP rank holds 1/tp of each matrix; exact only at tp 1 (vectors are replicated, not split)
    lay = cfg.layout
    if experts is not None and experts[1]:  # DeepSpeed's MoE groups: the rank's 1/ep of the experts, over dp / ep
        dense, local = experts
        return expert_parallel_states(dense, local, dp=lay.dp, ep=lay.ep, stage=lay.zero,
                                      element_bytes=element_bytes, rank=dp_rank).to_dict()
    shard = [max(1, n // lay.tp) if lay.tp > 1 and n > 1 else n for n in numels]
    if runs_bf16_optimizer(pipelined=cfg.kind == "pipeline", zero_stage=lay.zero, bf16=element_bytes == 2):
        # DeepSpeed's BF16_Optimizer accumulates in the training dtype
        # (DeepSpeed 0.19's data_types.grad_accum_dtype default); its flat accumulation buffer is held as a
        # gradient, where the instrumentation counts it
        states = bf16_optimizer_states(shard, dp=lay.dp, accum_bytes=element_bytes).to_dict()
        states["grad_bytes"] += bf16_accumulation_bytes(shard, dp=lay.dp, accum_bytes=element_bytes)
        return states
    return zero_model_states(shard, dp=lay.dp, stage=lay.zero, element_bytes=element_bytes, rank=dp_rank,
                             persistence_threshold=int(ZERO_SETTINGS["stage3_param_persistence_threshold"])).to_dict()


def expert_groups(shape: ModelShape, start: int, stop: int, ep: int) -> tuple[list[int], list[int]] | None:
    """Layers start..stop's tensors in DeepSpeed's two groups: the dense ones, and the 1/ep of each layer's
    experts a rank holds (None: no experts in the model)."""
    if shape.layer_expert_numels is None:
        return None
    experts, dense = shape.layer_expert_numels[start:stop], shape.layer_dense_numels[start:stop]
    return [n for layer in dense for n in layer], [n for layer in experts for n in layer[:len(layer) // ep]]


def data_parallel_rank(cfg: CompareConfig, rank: int) -> int:
    """A global rank's data-parallel index: DeepSpeed's pipe x data (x model) topology, model fastest."""
    return (rank // cfg.layout.tp) % cfg.layout.dp


def predicted_ranks(cfg: CompareConfig, shape: ModelShape, activations: list[float], *,
                    parts: list[int] | None = None, element_bytes: int = 4, dp_rank: int | None = None,
                    model_cfg=None, device: str = "cpu") -> list[dict]:
    """One entry per pipeline stage (a data-parallel run is one stage): bytes by kind at the step and in
    total, for data-parallel rank ``dp_rank`` (None: the heaviest); with ``model_cfg``, the peak over the
    step too (``costs.peak``: ``peak_bytes``, its ``peak_phase`` and ``peak_by_kind``)."""
    if cfg.kind == "pipeline":
        if parts is None:
            raise ValueError(f"{cfg.name}: a pipeline's prediction needs its partition (parts)")
        from ..costs.types import LayerCost

        fake = [LayerCost(name=str(i), forward_s=0.0, backward_s=0.0, activation_bytes=int(a))
                for i, a in enumerate(activations)]
        rows = []
        for st in stage_costs(fake, parts, micro_batches=cfg.layout.micro_batches, schedule=cfg.layout.schedule):
            numels = held_numels(shape, st.start, st.stop)
            rows.append({"stage": st.stage, "layers": [st.start, st.stop], "inflight": st.inflight,
                         **_states(numels, cfg, element_bytes, dp_rank, expert_groups(shape, st.start, st.stop, cfg.layout.ep)),
                         "activation_bytes": int(st.activation_peak_bytes)})
    else:
        numels = held_numels(shape, 0, len(shape.layer_numels))
        rows = [{"stage": 0, "layers": [0, len(shape.layer_numels)], "inflight": 1,
                 **_states(numels, cfg, element_bytes, dp_rank, expert_groups(shape, 0, len(shape.layer_numels), cfg.layout.ep)),
                 "activation_bytes": int(sum(activations))}]
    for r in rows:
        r["total_bytes"] = sum(r[k] for k in KINDS)
    if model_cfg is not None and cfg.layout.tp == 1:  # the peak rule's op lists are per TP rank: tp 1 here
        from ..costs.estimate import rank_steps
        from ..costs.peak import step_peak

        dtype = "fp32" if element_bytes == 4 else "bf16"
        steps = rank_steps(model_cfg, cfg.layout, parts=parts, dtype=dtype, dp_rank=dp_rank, device=device,
                           fused_adam=device != "cpu")  # train.py's AdamW is fused on CUDA (no temporaries)
        for r, step in zip(rows, steps):
            peak = step_peak(step)
            r.update(peak_bytes=peak.total_bytes, peak_phase=peak.phase, peak_by_kind=peak.by_kind)
    return rows
