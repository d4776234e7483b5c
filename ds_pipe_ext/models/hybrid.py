"""A hybrid decoder (Nemotron-H) as a list of pipeline layers.  Read top-down:

    tokens ─► LlamaEmbedding ─► one block a letter of the pattern ─► LlamaHead (final RMSNorm + LM head) ─► lm_loss

    M  MambaLayer       x + Mamba2Mixer(RMSNorm(x))
    *  AttentionLayer   x + attention(RMSNorm(x)): grouped-query, causal, no positions (the Llama family's)
    -  MLPLayer         x + down(relu(up(RMSNorm(x)))^2)
    E  MoELayer         x + routed squared-ReLU experts and shared ones(RMSNorm(x)) (DeepSpeed's MoE layer)

Hidden states are sequence-first, (s, b, h), as in the other families; a Mamba-2 layer turns them batch-first
for its scan and back.  Each layer is one kind, so a pipeline split sees each kind's own cost (a Mamba-2
layer, an attention layer and an MLP layer differ several-fold in time and in what they keep).  Tensor
parallelism: attention and the MLP through the ``LayerImpl`` as in the Llama family, the mixer as Megatron-core's
``MambaMixer`` splits it (``mamba2``), an E layer as the moe family's routed blocks (``moe.RoutedMLP``); sequence
parallelism is refused (a scan needs its whole sequence).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..pipe.sequential import SequentialLayers
from .hybrid_config import HybridConfig
from .layers import LOCAL, LayerImpl, lm_loss
from .llama import LlamaAttention, LlamaEmbedding, LlamaHead
from .mamba2 import Mamba2Mixer, Mamba2Shape


def _refuse_sequence_parallel(impl: LayerImpl) -> None:
    if impl.sequence_parallel:
        raise ValueError("hybrid family: sequence parallelism splits the sequence a Mamba-2 scan needs whole; "
                         "turn tensor_parallel.sequence_parallel off")


def _tp_group(impl: LayerImpl):
    _refuse_sequence_parallel(impl)
    if impl.tp_size == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


class MambaLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(Mamba2Shape(
            hidden=cfg.hidden, heads=cfg.mamba_heads, head_dim=cfg.mamba_head_dim, state=cfg.ssm_state,
            groups=cfg.n_groups, conv_kernel=cfg.conv_kernel, chunk=cfg.chunk, eps=cfg.rms_norm_eps,
            time_step_min=cfg.time_step_min), tp_group=_tp_group(impl))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x).transpose(0, 1)).transpose(0, 1)


class AttentionLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, impl: LayerImpl = LOCAL, selective_recompute: bool = False):
        super().__init__()
        _refuse_sequence_parallel(impl)
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.attn = LlamaAttention(cfg, impl, selective_recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class MLPLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, impl: LayerImpl = LOCAL):
        super().__init__()
        _refuse_sequence_parallel(impl)
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        self.up = impl.column_linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = impl.row_linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))).square())


class MoELayer(nn.Module):
    """x + routed(RMSNorm(x)): squared-ReLU experts over DeepSpeed's MoE layer and shared ones (``moe.RoutedMLP``);
    its router's balance loss is not added (Nemotron-H balances with the router's bias)."""

    profile_each = True  # dropless, its busiest expert sets its time (moe.MoEBlock's reason)

    def __init__(self, cfg: HybridConfig, impl: LayerImpl = LOCAL, *, ep: int = 1, reference: bool = False):
        super().__init__()
        from .moe import RoutedMLP

        _refuse_sequence_parallel(impl)
        self.norm = impl.rms_norm(cfg.hidden, cfg.rms_norm_eps)
        # under TP as the moe family's routed blocks: DeepSpeed's layer splits each expert's slots over the TP
        # ranks (the experts whole on each), the shared experts column- and row-parallel
        self.mlp = RoutedMLP(cfg, ep, reference=reference, impl=impl)
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _, counts = self.mlp(self.norm(x))
        self.tokens_per_expert = counts.detach()
        return x + y


LAYERS = {"mamba": MambaLayer, "attention": AttentionLayer, "mlp": MLPLayer}


def hybrid_layer_specs(cfg: HybridConfig, impl: LayerImpl = LOCAL, *, selective_recompute: bool = False,
                       ep: int = 1, reference: bool = False) -> list:
    """[embedding, one layer a letter of the pattern, final norm + head]: layers + 2 pipeline layers."""
    if cfg.tie_embeddings:
        raise ValueError(f"model config {cfg.name!r}: tie_embeddings = true is not built for the hybrid family "
                         f"(Nemotron-H ties none)")
    blocks = [LayerSpec(MoELayer, cfg, impl, ep=ep, reference=reference) if kind == "moe"
              else LayerSpec(AttentionLayer, cfg, impl, True) if kind == "attention" and selective_recompute
              else LayerSpec(LAYERS[kind], cfg, impl) for kind in cfg.kinds]
    return [LayerSpec(LlamaEmbedding, cfg, impl), *blocks, LayerSpec(LlamaHead, cfg, impl)]


class SequentialHybrid(SequentialLayers):
    """The family's layers in one process (data parallelism, parity checks); see ``SequentialLayers``."""

    def __init__(self, specs: list, loss_fn: Callable = lm_loss, *, base_seed: int | None = None,
                 recompute: bool = False):
        super().__init__(specs, loss_fn, base_seed=base_seed, recompute=recompute)


def from_hf_state_dict(hf: dict, cfg: HybridConfig) -> dict:
    """A Hugging Face ``NemotronHForCausalLM`` state dict (``model.``/``backbone.`` prefixed, experts none) as
    ``SequentialHybrid``'s ("layers.<pipeline layer>.<name>"): q, k and v stacked as ``qkv``."""
    hf = {k.replace("backbone.", "model.", 1): v for k, v in hf.items()}
    out = {"layers.0.embed_tokens.weight": hf["model.embeddings.weight"]}
    for i, kind in enumerate(cfg.kinds):
        src, dst = f"model.layers.{i}.", f"layers.{i + 1}."
        out[dst + "norm.weight"] = hf[src + "norm.weight"]
        mixer = {k.removeprefix(src + "mixer."): v for k, v in hf.items() if k.startswith(src + "mixer.")}
        if kind == "mamba":
            out.update({dst + "mixer." + k: v for k, v in mixer.items()})
        elif kind == "attention":
            out[dst + "attn.qkv.weight"] = torch.cat([mixer["q_proj.weight"], mixer["k_proj.weight"],
                                                      mixer["v_proj.weight"]])
            out[dst + "attn.o_proj.weight"] = mixer["o_proj.weight"]
        elif kind == "moe":  # transformers' stacked experts, one by one in DeepSpeed's layer
            moe = dst + "mlp.moe.deepspeed_moe."
            out[moe + "gate.wg.weight"] = mixer["gate.weight"]
            out[moe + "gate.e_score_correction_bias"] = mixer["gate.e_score_correction_bias"]
            for j in range(cfg.experts):
                out[f"{moe}experts.deepspeed_experts.{j}.up.weight"] = mixer["experts.up_proj"][j]
                out[f"{moe}experts.deepspeed_experts.{j}.down.weight"] = mixer["experts.down_proj"][j]
            if cfg.shared_ffn_hidden:
                out[dst + "mlp.shared.up.weight"] = mixer["shared_experts.up_proj.weight"]
                out[dst + "mlp.shared.down.weight"] = mixer["shared_experts.down_proj.weight"]
        else:
            out[dst + "up.weight"], out[dst + "down.weight"] = mixer["up_proj.weight"], mixer["down_proj.weight"]
    last = len(cfg.kinds) + 1
    out[f"layers.{last}.norm.weight"] = hf["model.norm_f.weight"]
    out[f"layers.{last}.lm_head.weight"] = hf["lm_head.weight"]
    return out
