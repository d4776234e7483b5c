"""`HybridConfig`: the hybrid family's validated config (Nemotron-H), from `model_configs/*.toml` or a Hugging
Face ``config.json`` (``model_type`` nemotron_h).

A hybrid model is a pattern of one-kind layers (``hybrid_pattern``): ``M`` a Mamba-2 mixer, ``*`` grouped-query
attention without positions, ``-`` a squared-ReLU MLP; each behind an RMSNorm and a residual; the Llama family's
embedding and head around them.  Refused by name: ``E`` (MoE) layers, which Hugging Face's pipeline runs
(``hf.pipeline_layers``) but this family does not build yet, and activations other than Nemotron-H's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..arch import MLP, Block, Mamba2, ModelDescription
from .config import ModelConfigError, load_family_config
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

    def __post_init__(self) -> None:
        super().__post_init__()
        where = f"model config {self.name!r}"
        kinds = block_kinds(pattern=self.pattern, layers=self.layers, where=where)
        if "moe" in kinds:
            raise ModelConfigError(f"{where}: the pattern has E (MoE) layers, which the hybrid family does not "
                                   f"build yet; run the Hugging Face checkpoint through hf.pipeline_layers")
        for f in ("mamba_heads", "mamba_head_dim", "ssm_state", "n_groups", "conv_kernel", "chunk"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"{where}: {f} = {v!r}; it must be a positive integer")
        if self.mamba_heads % self.n_groups:
            raise ModelConfigError(f"{where}: n_groups ({self.n_groups}) must divide mamba_heads "
                                   f"({self.mamba_heads})")

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
        "chunk": data.get("chunk_size", 128), "time_step_min": float(data.get("time_step_min", 0.0))}, name=name)


def load_hybrid_config(name_or_path: str | Path, **overrides) -> HybridConfig:
    """A hybrid-family config: a name in model_configs/ (``family = "hybrid"``), a .toml path, a Hugging Face
    config.json or a ``save_pretrained`` directory."""
    return load_family_config(HybridConfig, from_hf_nemotron_h, name_or_path, overrides)

