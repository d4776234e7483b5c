"""A Mixture-of-Experts decoder on the Llama family's blocks, as a list of pipeline layers.  Read top-down:

    tokens ─► MoEEmbedding ─► (hidden, aux) ─► MoEBlock × L ─► (hidden, aux) ─► MoEHead ─► (logits, aux) ─► MoELoss

* A routed block's MLP is DeepSpeed's ``deepspeed.moe.layer.MoE`` over SwiGLU experts (``LlamaMLP``), beside
  optional always-on shared experts (one fused MLP; Qwen-MoE scales theirs by a sigmoid gate).  The first
  ``dense_layers`` blocks keep a dense MLP.  Attention is the Llama block's.
* Every layer passes (hidden, aux) on: aux is the running sum of the routers' load-balancing losses, so it
  crosses stage boundaries with the hidden states, and the last stage's loss is lm + aux_loss_coef x aux
  (Megatron-DeepSpeed's sum over layers).  DeepSpeed runs backward on every floating output of a stage, so
  the embedding's aux is a leaf that requires grad, not a constant.
* DeepSpeed's ``Experts`` deep-copies one expert into every local slot, so all experts would start equal
  and a routing error could not change the loss.  Each expert is re-initialised from a seed drawn once
  per layer (the same on every rank) plus its global id: the same weights under any EP degree.
* Under TP (no SP) every TP rank holds the same tokens and routes them alike.  DeepSpeed's MoE layer drops
  the duplicates (each TP rank sends 1/tp of every expert's slots through the all-to-all and its experts) and
  gathers the experts' output back over TP; its expert groups are ep consecutive ranks of a stage, TP ranks
  first (``parallel.topology.rank_groups``), so an expert's gradient sums over the TP ranks that computed its
  slots and averages over data parallelism.  Experts stay whole (Megatron's expert TP 1); the shared experts,
  attention and dense MLPs split as the Llama family's.
* Routing is configured so a one-process reference can reproduce it exactly: no noisy gate, no random
  token selection, no sampled second expert.  ``capacity_factor`` 0 is dropless (DeepSpeed pads every
  expert to the largest expert load, all-reduced over the EP group); > 0 drops tokens beyond
  capacity_factor x k x tokens / E.

``reference=True`` builds the same parameters but routes in plain torch (``reference_routing``): the
parity tests' one-process model, independent of DeepSpeed's dispatch, all-to-all and combine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..arch import capacity_slots
from ..compat.engine import tell_deepspeed_megatrons_tp
from ..pipe.sequential import SequentialLayers
from .config import ModelConfigError
from .layers import INIT_STD, LOCAL, LayerImpl, lm_loss
from .llama import LlamaAttention, LlamaEmbedding, LlamaHead, LlamaMLP
from .experts import expert_mlp, shared_mlp
from .mla import MLAttention
from .sinks import SinkAttention
from .moe_config import MoEConfig
from .mtp import MTPLayer, shifted_ids
from .routers import make_biased_gate, make_sigmoid_gate


def expert_parallel_rank(ep: int) -> int:
    """This rank's place in its expert-parallel group, as DeepSpeed builds the groups: consecutive ranks of a
    stage's data-parallel group (DeepSpeed's pipeline topology numbers data-parallel ranks fastest, so it is
    the global rank mod ep).  ``check_expert_groups`` compares it with DeepSpeed's groups once they exist."""
    return dist.get_rank() % ep if ep > 1 and dist.is_initialized() else 0


def check_expert_groups(model: nn.Module) -> None:
    """Every MoE layer's experts were seeded for the EP rank DeepSpeed's groups give this rank (raises, the
    same on every rank, if DeepSpeed ever lays its groups out otherwise)."""
    from deepspeed.moe.layer import MoE

    for name, module in model.named_modules():
        if isinstance(module, MoE) and module.ep_size > 1:
            actual = dist.get_rank(group=module.deepspeed_moe.ep_group)
            if actual != expert_parallel_rank(module.ep_size):
                raise RuntimeError(f"{name}: DeepSpeed placed rank {dist.get_rank()} at expert-parallel rank "
                                   f"{actual}, not {expert_parallel_rank(module.ep_size)} as its experts were seeded")


def global_expert_names(model: nn.Module) -> dict[str, str]:
    """{this rank's name of a local expert's tensor: its name in a one-process model}: local expert i of EP
    rank r is global expert r x local experts + i."""
    from deepspeed.moe.layer import MoE

    names = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE) and module.ep_size > 1:
            first = expert_parallel_rank(module.ep_size) * module.num_local_experts
            prefix = f"{name}.deepspeed_moe.experts.deepspeed_experts."
            for key in module.deepspeed_moe.experts.deepspeed_experts.state_dict():
                i, rest = key.split(".", 1)
                names[f"{prefix}{key}"] = f"{prefix}{first + int(i)}.{rest}"
    return names


def check_moe_config(cfg: MoEConfig) -> None:
    """What DeepSpeed's MoE layer cannot run, named before any layer is built."""
    # DeepSpeed's top-2 and top-k gates divide by the chosen gates' sum, top-1 not; our gates call its top-k
    renormalises = cfg.top_k > 1 or cfg.router == "sigmoid" or cfg.router_bias
    if cfg.norm_topk_prob != renormalises:
        raise ModelConfigError(
            f"model config {cfg.name!r}: norm_topk_prob = {str(cfg.norm_topk_prob).lower()} with top_k = {cfg.top_k}, "
            f"but DeepSpeed's MoE layer {'renormalises' if renormalises else 'does not renormalise'} the top-k gate "
            f"weights; set norm_topk_prob = {str(renormalises).lower()} to train this shape with it")
    if cfg.tie_embeddings:
        raise ModelConfigError(f"model config {cfg.name!r}: tied embeddings are not built for the moe family; "
                               f"set tie_embeddings = false")


def reference_routing(logits: torch.Tensor, k: int, *, topk_gating: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert ids (T, k), their gate weights (T, k), the load-balancing loss) of fp32 router logits (T, E),
    as DeepSpeed's top-1 / top-2 / top-k gates compute them when nothing is dropped:
    top-1 keeps the softmax probability; top-2 and top-k renormalise the chosen ones; the loss is
    mean(importance x load) x E^2 with the load of the first choice only for k <= 2, and of all k divided
    by k beyond (``topk_gating``: at any k, as DeepSpeed's ``topkgating``, which the sigmoid router calls)."""
    gates = F.softmax(logits, dim=1)
    experts = gates.shape[1]
    importance = gates.mean(0)
    if k <= 2 and not topk_gating:
        first = gates.argmax(1)
        chosen = first[:, None]
        if k == 2:
            second = logits.masked_fill(F.one_hot(first, experts).bool(), float("-inf")).argmax(1)
            chosen = torch.stack((first, second), dim=1)
        load = F.one_hot(first, experts).float().mean(0)
        aux = (importance * load).mean() * experts * experts
    else:
        chosen = gates.topk(k, dim=1).indices
        load = torch.zeros_like(gates).scatter(1, chosen, 1.0).mean(0)
        aux = (importance * load).mean() * experts * experts / k
    weights = gates.gather(1, chosen)
    if k > 1:
        weights = weights / weights.sum(1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    return chosen, weights, aux


class RoutedMLP(nn.Module):
    """Routed experts (DeepSpeed's MoE layer) plus optional shared experts: x -> (y, aux loss, tokens per expert)."""

    def __init__(self, cfg: MoEConfig, ep: int = 1, *, reference: bool = False, impl: LayerImpl = LOCAL):
        super().__init__()
        from deepspeed.moe.layer import MoE

        # drawn before anything else (on the CPU's generator even when built on the meta device): the same for any ep
        expert_seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
        dropless = cfg.capacity_factor == 0
        self.top_k, self.reference = cfg.top_k, reference
        self.moe = MoE(cfg.hidden, expert_mlp(cfg, cfg.expert_ffn), num_experts=cfg.experts, ep_size=ep,
                       k=cfg.top_k, capacity_factor=cfg.capacity_factor or 1.0,
                       eval_capacity_factor=cfg.capacity_factor or 1.0, min_capacity=0, noisy_gate_policy=None,
                       drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False)
        if cfg.router == "sigmoid" or cfg.router_bias:  # a gate of ours in DeepSpeed's place (models/routers.py)
            kw = dict(capacity_factor=cfg.capacity_factor or 1.0, eval_capacity_factor=cfg.capacity_factor or 1.0,
                      min_capacity=0, noisy_gate_policy=None, drop_tokens=not dropless, use_rts=False)
            gate = (make_sigmoid_gate(cfg.hidden, cfg.experts, k=cfg.top_k, groups=cfg.router_groups,
                                      topk_groups=cfg.router_topk_groups, **kw) if cfg.router == "sigmoid"
                    else make_biased_gate(cfg.hidden, cfg.experts, k=cfg.top_k, **kw))
            with torch.no_grad():
                gate.wg.weight.copy_(self.moe.deepspeed_moe.gate.wg.weight)
                if gate.wg.bias is not None:
                    gate.wg.bias.zero_()
            self.moe.deepspeed_moe.gate = gate
        self.routed_scale = float(cfg.routed_scaling_factor)
        first = expert_parallel_rank(ep) * self.moe.num_local_experts
        for i, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(expert_seed + first + i)
            for p in expert.parameters():
                if not p.is_meta:  # a shape-only build (meta device) has no values to set
                    with torch.no_grad():
                        p.copy_(torch.randn(p.shape, generator=g, device="cpu") * INIT_STD)
        self.tp = impl.tp_size
        self.shared = shared_mlp(cfg, cfg.shared_ffn_hidden, impl) if cfg.shared_ffn_hidden else None
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if cfg.shared_gate else None
        if reference and not dropless:
            raise ModelConfigError("the reference routing is dropless; set capacity_factor = 0 to compare with it")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.tp > 1:
            self._check_tp_capacity(x)
            tell_deepspeed_megatrons_tp()  # profiled before the engine: no model-parallel unit yet
        if self.reference:
            y, aux, counts = self._reference(x)
        elif self.moe.ep_size > 1 and self.moe.deepspeed_moe.ep_group is None:
            y, aux, counts = self._alone(x)  # profiled alone: no engine, no EP group
        else:
            y, aux, counts = self.moe(x)
        if self.routed_scale != 1.0:
            y = y * self.routed_scale
        if self.shared is not None:
            shared = self.shared(x)
            y = y + (shared * torch.sigmoid(self.shared_gate(x)) if self.shared_gate is not None else shared)
        return y, aux, counts

    def _check_tp_capacity(self, x: torch.Tensor) -> None:
        """DeepSpeed splits every expert's C slots over the TP ranks; dropless it pads C to a multiple of tp, with a
        capacity factor it asserts deep in the all-to-all.  Named here instead."""
        gate = self.moe.deepspeed_moe.gate
        if not gate.drop_tokens:
            return
        tokens, experts = x.numel() // x.shape[-1], self.moe.num_experts
        slots = max(capacity_slots(tokens, experts, self.top_k, gate.capacity_factor), gate.min_capacity)
        if slots % self.tp:
            raise ModelConfigError(
                f"capacity_factor {gate.capacity_factor} gives ceil({tokens} tokens / {experts} experts x "
                f"{gate.capacity_factor} x top_k {self.top_k}) = {slots} slots an expert, which tp = {self.tp} does not "
                f"divide (DeepSpeed splits them over the TP ranks); choose a capacity_factor giving a multiple of "
                f"{self.tp}, or capacity_factor = 0 (dropless)")

    def _alone(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer built for EP run on one rank with no collective, as the profiler runs it: DeepSpeed's own
        dispatch and combine at ep_size 1 hand its E / ep local experts ep experts' slots each (local expert
        i takes global experts i x ep .. i x ep + ep - 1), the work EP's all-to-all brings a rank.  The loads
        follow the router, which at initialisation is near-uniform."""
        layer = self.moe.deepspeed_moe
        layer.ep_size = 1  # MOELayer reads it for the all-to-all and the expert reshape only
        try:
            return self.moe(x)
        finally:
            layer.ep_size = self.moe.ep_size

    def _reference(self, x: torch.Tensor, *, fold: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output by ``reference_routing``; ``fold``: as ``_alone`` assigns experts."""
        layer = self.moe.deepspeed_moe
        tokens = x.reshape(-1, x.shape[-1])
        route = getattr(layer.gate, "route", None)  # our gates: the logits they hand DeepSpeed's top-k gating
        logits = route(tokens)[1] if route else F.linear(tokens.float(), layer.gate.wg.weight.float())
        chosen, weights, aux = reference_routing(logits, self.top_k, topk_gating=route is not None)
        if fold:
            chosen = chosen // self.moe.ep_size
        out = torch.zeros_like(tokens)
        experts = layer.experts.deepspeed_experts
        for e, expert in enumerate(experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None].to(x.dtype))
        counts = torch.bincount(chosen.reshape(-1), minlength=len(experts))
        return out.view_as(x), aux, counts


class MoEEmbedding(LlamaEmbedding):
    """tokens -> (hidden states, aux = 0), the aux a leaf that requires grad (see the module's docstring)."""

    def __init__(self, cfg: MoEConfig, impl: LayerImpl = LOCAL):
        super().__init__(cfg, impl)
        self.mtp_layers = cfg.mtp_layers

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(hidden, aux), and with multi-token prediction the embeddings of the ids shifted by 1 .. D, which
        travel to the MTP layers (``models.mtp``)."""
        hidden = super().forward(tokens)
        aux = torch.zeros(1, device=hidden.device, requires_grad=torch.is_grad_enabled())
        shifted = [super(MoEEmbedding, self).forward(shifted_ids(tokens, k)) for k in range(1, self.mtp_layers + 1)]
        return (hidden, aux, *shifted)


class MoEBlock(nn.Module):
    """Pre-RMSNorm decoder block whose MLP is routed (or dense, for the first ``dense_layers``):
    (x, aux) -> (x + attn + mlp, aux + this router's loss)."""

    # dropless, an expert computes as many slots as the busiest expert's load, which its router sets: at
    # initialisation 1.4-3.9x the mean load, different block to block (the profiler measures each block)
    profile_each = True

    def __init__(self, cfg: MoEConfig, impl: LayerImpl = LOCAL, selective_recompute: bool = False, *,
                 routed: bool = True, ep: int = 1, reference: bool = False, index: int = 0):
        super().__init__()
        self.input_norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        if cfg.mla:
            self.attn = MLAttention(cfg, impl, selective_recompute)
        elif cfg.attention_sinks:
            self.attn = SinkAttention(cfg, impl, selective_recompute, window=cfg.layer_window(index))
        else:
            self.attn = LlamaAttention(cfg, impl, selective_recompute)
        self.post_attention_norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.mlp = RoutedMLP(cfg, ep, reference=reference, impl=impl) if routed else LlamaMLP(cfg, impl)
        self.routed = routed
        self.capacity_factor, self.top_k, self.experts = cfg.capacity_factor, cfg.top_k, cfg.experts
        # the last forward's, for the instrumentation (instrument/experts.py)
        self.tokens_per_expert: torch.Tensor | None = None  # routed (before any drop)
        self.dropped_tokens = 0  # routed beyond an expert's capacity (capacity_factor > 0)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, aux, *travelling = inputs  # multi-token prediction's embeddings pass through (models.mtp)
        x = x + self.attn(self.input_norm(x))
        if not self.routed:
            return x + self.mlp(self.post_attention_norm(x)), aux, *travelling
        y, layer_aux, counts = self.mlp(self.post_attention_norm(x))
        self.tokens_per_expert = counts.detach()
        if self.capacity_factor:  # DeepSpeed's capacity: ceil(tokens / E x capacity_factor x k); the rest dropped
            capacity = capacity_slots(x.shape[0] * x.shape[1], self.experts, self.top_k, self.capacity_factor)
            self.dropped_tokens = int((self.tokens_per_expert - capacity).clamp(min=0).sum())
        return x + y, aux + layer_aux.to(aux.dtype), *travelling


class MoEHead(LlamaHead):
    """Final RMSNorm + LM head: (hidden, aux[, the MTP layers' normed outputs]) -> (logits, aux); the MTP outputs go
    through the same head in the same product, their logits after the main ones along the sequence."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux, *mtp = inputs
        x = self.norm(x)
        if mtp:
            x = torch.cat((x, *mtp), dim=0)
        return self.head_output(x, self.lm_head.weight, self.lm_head), aux


class MoEMTPLayer(MTPLayer):
    """Multi-token-prediction layer ``k`` of a moe-family model: its block is the family's block at index
    layers + k - 1 (DeepSeek-V3's layer 61, a routed block)."""

    profile_each = True  # its block routes as its own router says (MoEBlock's reason)

    def __init__(self, cfg: MoEConfig, impl: LayerImpl = LOCAL, selective_recompute: bool = False, *, k: int,
                 ep: int = 1, reference: bool = False):
        index = cfg.layers + k - 1
        block = MoEBlock(cfg, impl, selective_recompute, routed=cfg.is_moe_block(index), ep=ep, reference=reference,
                         index=index)
        super().__init__(cfg, impl, block, k=k, depth=cfg.mtp_layers)


class MoELoss:
    """lm loss + aux_loss_coef x the routers' summed loss; remembers both terms of the last call, which
    ``PipelineModule.get_additional_losses`` reports (DeepSpeed averages them over the step's micro-batches).
    Stages without the loss report zeros under the same names: DeepSpeed sizes the loss broadcast from
    every stage's own answer."""

    NAMES = ("lm_loss", "moe_aux_loss")

    def __init__(self, aux_loss_coef: float, lm: Callable = lm_loss):
        self.aux_loss_coef, self.lm = aux_loss_coef, lm
        self.last: dict[str, torch.Tensor] = {name: torch.zeros(()) for name in self.NAMES}

    def __call__(self, outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        logits, aux = outputs
        lm = self.lm(logits, labels)
        self.last = {"lm_loss": lm.detach(), "moe_aux_loss": aux.detach().reshape(())}
        return lm + self.aux_loss_coef * aux.reshape(())

    def additional_losses(self) -> dict[str, torch.Tensor]:
        return self.last

    def __repr__(self) -> str:  # stable: the profile cache key reads it
        return f"MoELoss(aux_loss_coef={self.aux_loss_coef})"


def moe_layer_specs(cfg: MoEConfig, impl: LayerImpl = LOCAL, *, selective_recompute: bool = False, ep: int = 1,
                    reference: bool = False) -> list:
    """[embedding, L blocks (the first ``dense_layers`` dense), D multi-token-prediction layers, final norm + head]
    (L + D + 2 layers)."""
    check_moe_config(cfg)
    if impl.sequence_parallel:
        raise ModelConfigError("sequence parallelism of a Mixture-of-Experts model is not supported: DeepSpeed's MoE "
                               "layer takes the TP ranks to hold the same tokens; turn sp off (TP splits it without)")
    blocks = [LayerSpec(MoEBlock, cfg, impl, selective_recompute, routed=cfg.is_moe_block(i), ep=ep,
                        reference=reference, index=i) for i in range(cfg.layers)]
    mtp = [LayerSpec(MoEMTPLayer, cfg, impl, selective_recompute, k=k, ep=ep, reference=reference)
           for k in range(1, cfg.mtp_layers + 1)]
    return [LayerSpec(MoEEmbedding, cfg, impl), *blocks, *mtp, LayerSpec(MoEHead, cfg, impl)]


class SequentialMoE(SequentialLayers):
    """The family's layers in one process (data parallelism, parity checks); see ``SequentialLayers``."""

    def __init__(self, specs: list, loss_fn: Callable, *, base_seed: int | None = None, recompute: bool = False):
        super().__init__(specs, loss_fn, base_seed=base_seed, recompute=recompute)
