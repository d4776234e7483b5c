"""`HybridConfig`: the hybrid family's validated config (Nemotron-H), from `model_configs/*.toml` or a Hugging
Face ``config.json`` (``model_type`` nemotron_h).

A hybrid model is a pattern of one-kind layers (``hybrid_pattern``): ``M`` a Mamba-2 mixer, ``*`` grouped-query
attention without positions, ``-`` a squared-ReLU MLP; each behind an RMSNorm and a residual; the Llama family's
embedding and head around them; ``E`` a MoE layer (squared-ReLU experts over DeepSpeed's MoE layer, DeepSeek-V3's
sigmoid router, shared experts).  Refused by name: activations other than Nemotron-H's, a latent projection around
the experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..arch import MLP, Block, Experts, Mamba2, ModelDescription
from .config import ModelConfigError, check_positive_ints, check_router_groups, load_family_config
from .hybrid_pattern import block_kinds, to_pattern
from .llama_config import LlamaConfig, attention_of


@dataclass(frozen=True)
class HybridConfig(LlamaConfig):
    pattern: str = ""  # one letter a layer (hybrid_override_pattern): M Mamba-2, * attention, - MLP
    mamba_heads: int = 0
    mamba_head_dim: int = 64
    ssm_state: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk: int = 128
    time_step_min: float = 0.0  # dt's lower clamp after softplus (Nemotron-H: 0.001)
    rotary_positions: bool = False  # Nemotron-H's attention layers take no positions
    # E (MoE) layers (Nemotron-H's newer models): routed squared-ReLU experts over DeepSpeed's MoE layer, picked by
    # DeepSeek-V3's sigmoid router (group-limited, a bias steering the choice, the routed output scaled), beside
    # shared squared-ReLU experts; no balance loss (the router's bias balances, as in Hugging Face's model)
    experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    capacity_factor: float = 0.0  # 0: dropless

    def __post_init__(self) -> None:
        super().__post_init__()
        where = f"model config {self.name!r}"
        kinds = block_kinds(pattern=self.pattern, layers=self.layers, where=where)
        if "moe" in kinds:
            self._check_experts(where)
        check_positive_ints(self, ("mamba_heads", "mamba_head_dim", "ssm_state", "n_groups", "conv_kernel", "chunk"),
                            where)
        if self.mamba_heads % self.n_groups:
            raise ModelConfigError(f"{where}: n_groups ({self.n_groups}) must divide mamba_heads "
                                   f"({self.mamba_heads})")

    def _check_experts(self, where: str) -> None:
        for f in ("experts", "top_k", "expert_ffn_hidden"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"{where}: the pattern has E (MoE) layers: {f} = {v!r}; a positive integer "
                                       f"is required")
        if self.top_k > self.experts:
            raise ModelConfigError(f"{where}: top_k ({self.top_k}) exceeds experts ({self.experts})")
        check_router_groups(self, where, sigmoid=True)

    # what the moe family's routed layer reads of a config (models.moe.RoutedMLP)
    router = "sigmoid"
    router_bias = False
    expert_bias = False
    swiglu_limit = 0.0
    shared_gate = False
    norm_topk_prob = True
    expert_activation = "relu2"

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden

    @property
    def kinds(self) -> tuple[str, ...]:
        return block_kinds(pattern=self.pattern)

    @property
    def mamba(self) -> Mamba2:
        return Mamba2(self.mamba_heads, self.mamba_head_dim, self.ssm_state, self.n_groups, self.conv_kernel,
                      self.chunk)

    def describe(self) -> ModelDescription:
        return _describe(self)


@lru_cache(maxsize=64)
def _describe(cfg: HybridConfig) -> ModelDescription:
    by_kind = {"mamba": Block(None, None, mamba=cfg.mamba), "attention": Block(attention_of(cfg), None),
               "mlp": Block(None, MLP(cfg.ffn, "relu2"))}
    if cfg.experts:
        by_kind["moe"] = Block(None, MLP(cfg.expert_ffn_hidden, "relu2"), Experts(
            cfg.experts, cfg.top_k, shared_ffn=cfg.shared_ffn_hidden, capacity_factor=float(cfg.capacity_factor),
            router="sigmoid", groups=cfg.router_groups, topk_groups=cfg.router_topk_groups))
    return ModelDescription(name=cfg.name, hidden=cfg.hidden, vocab=cfg.padded_vocab, seq_len=cfg.seq_len,
                            blocks=tuple(by_kind[k] for k in cfg.kinds), positions="none", norm="rmsnorm",
                            tied_head=cfg.tie_embeddings, dropout=False, linear_bias=False,
                            loss_chunk_tokens=cfg.loss_chunk_tokens)


def from_hf_nemotron_h(data: dict, *, name: str) -> HybridConfig:
    """A Hugging Face ``config.json`` of ``model_type`` nemotron_h (read as JSON); ``max_position_embeddings``
    becomes ``seq_len``."""
    where = f"model config {name!r} (model_type 'nemotron_h')"
    kinds = block_kinds(pattern=data.get("hybrid_override_pattern"), block_types=data.get("layers_block_type"),
                        where=where)
    act = data.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ModelConfigError(f"{where}: mlp_hidden_act {act!r}: the family's MLP layers are squared ReLU")
    for key in ("attention_bias", "mlp_bias", "use_bias"):
        if data.get(key):
            raise ModelConfigError(f"{where}: {key} = true is not modelled; Nemotron-H's linears carry no biases")
    heads = data["num_attention_heads"]
    head_dim = data.get("head_dim") or data["hidden_size"] // heads
    return HybridConfig.from_dict({
        "vocab_size": data["vocab_size"], "hidden": data["hidden_size"], "layers": len(kinds), "heads": heads,
        "kv_heads": data.get("num_key_value_heads") or heads, "ffn_hidden": data["intermediate_size"],
        "seq_len": data.get("max_position_embeddings", 4096), "rms_norm_eps": data.get("layer_norm_epsilon", 1e-5),
        "tie_embeddings": bool(data.get("tie_word_embeddings", False)),
        "kv_channels": 0 if head_dim * heads == data["hidden_size"] else head_dim, "pattern": to_pattern(kinds),
        "mamba_heads": data["mamba_num_heads"], "mamba_head_dim": data["mamba_head_dim"],
        "ssm_state": data["ssm_state_size"], "n_groups": data["n_groups"], "conv_kernel": data.get("conv_kernel", 4),
        "chunk": data.get("chunk_size", 128), "time_step_min": float(data.get("time_step_min", 0.0)),
        **(_hf_experts(data, where) if "moe" in kinds else {})}, name=name)


def _hf_experts(data: dict, where: str) -> dict:
    """Nemotron-H's MoE fields as the family's; a latent projection around the experts is refused by name."""
    if data.get("moe_latent_size"):
        raise ModelConfigError(f"{where}: moe_latent_size = {data['moe_latent_size']}: a latent projection around "
                               f"the experts is not built; run the checkpoint through hf.pipeline_layers")
    if not data.get("norm_topk_prob", True):
        raise ModelConfigError(f"{where}: norm_topk_prob = false: DeepSpeed's top-k gating renormalises the chosen "
                               f"weights; run the checkpoint through hf.pipeline_layers")
    return {"experts": data.get("n_routed_experts"), "top_k": data.get("num_experts_per_tok"),
            "expert_ffn_hidden": data.get("moe_intermediate_size"),
            "shared_ffn_hidden": data.get("moe_shared_expert_intermediate_size") or 0,
            "router_groups": data.get("n_group") or 1, "router_topk_groups": data.get("topk_group") or 1,
            "routed_scaling_factor": float(data.get("routed_scaling_factor") or 1.0)}


def load_hybrid_config(name_or_path: str | Path, **overrides) -> HybridConfig:
    """A hybrid-family config: a name in model_configs/ (``family = "hybrid"``), a .toml path, a Hugging Face
    config.json or a ``save_pretrained`` directory."""
    return load_family_config(HybridConfig, from_hf_nemotron_h, name_or_path, overrides)

