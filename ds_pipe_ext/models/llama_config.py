"""`LlamaConfig`: the Llama family's validated config (Llama 2/3, Mistral, Qwen2, Qwen3), from
`model_configs/*.toml` or a Hugging Face ``config.json`` (``model_type`` llama, mistral, qwen2 or qwen3).

What the family models, and what it refuses by name rather than cost wrongly:

    RMSNorm, a SwiGLU MLP (gate, up, down; no biases), grouped-query attention (kv_heads key/value heads
    shared by heads / kv_heads queries), rotary positions (``rope_theta``; Llama 3.1's ``llama3`` frequency
    scaling), optional q/k/v biases (Qwen2), heads wider than hidden / heads and an RMSNorm over each
    query and key head (Qwen3), an optional sliding window on every layer (Mistral 7B v0.1), a head tied
    to the embedding or not, the vocabulary padded to a multiple (Megatron's make_vocab_size_divisible_by).
    The yarn rope scaling (DeepSeek-V3's and gpt-oss's) too.
    Refused: other rope scalings (linear, dynamic, longrope), biases on o_proj or the MLP, attention
    dropout, per-layer window patterns.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from ..arch import MLP, Attention, Block, ModelDescription
from .config import ModelConfigError, check_loss_chunk, check_positive_ints, config_from_dict, load_family_config

ROPE_SCALINGS = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary frequency scaling.  "llama3" (Llama 3.1's): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, shorter than ``... /
    high_freq_factor`` kept, and those between interpolated (transformers' ``_compute_llama3_parameters``).
    "yarn" (Peng et al. 2023; DeepSeek-V3's and gpt-oss's context extension): frequencies interpolated by
    ``factor`` below the ``beta_slow`` rotation bound, kept above ``beta_fast``'s, ramped between (rounded outward
    where ``truncate``); cos and sin scaled by the attention factor (0.1 ln(factor) + 1, or DeepSeek's ratio of
    mscale terms); DeepSeek-V3's softmax scale times mscale(factor, mscale_all_dim)^2 (``attention_scale``).
    transformers' ``_compute_yarn_parameters`` and ``yarn_apply_mscale`` are the references."""

    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALINGS[1:]:
            raise ModelConfigError(f"rope scaling {self.rope_type!r} is not modelled; supported: {list(ROPE_SCALINGS)}")
        if not (self.factor > 0 and self.original_max_position_embeddings > 0):
            raise ModelConfigError(f"rope scaling {self.rope_type}: factor and original_max_position_embeddings must "
                                   f"be positive (got {self})")
        if self.rope_type == "llama3" and not (self.high_freq_factor is not None and self.low_freq_factor is not None
                                               and self.high_freq_factor > self.low_freq_factor > 0):
            raise ModelConfigError(f"rope scaling llama3: 0 < low_freq_factor < high_freq_factor is required "
                                   f"(got {self})")


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    seq_len: int  # the training sequence (the model's own limit may be longer)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry biases
    sliding_window: int = 0  # 0: none; else every layer attends to at most this many past positions
    vocab_pad_to: int = 1
    loss_chunk_tokens: int = 0  # as GPTConfig's: the head + loss in token chunks; 0: the plain ones
    # one head's width (Megatron's --kv-channels, HF's head_dim); 0: hidden / heads.  Qwen3's heads are
    # wider: 32 heads of 128 on hidden 2,048 (Qwen3-30B-A3B)
    kv_channels: int = 0
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3; --qk-layernorm)

    def __post_init__(self) -> None:
        where = f"model config {self.name!r}"
        check_positive_ints(self, ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq_len",
                                   "vocab_pad_to"), where)
        check_loss_chunk(self)
        kc = self.kv_channels
        if isinstance(kc, bool) or not isinstance(kc, int) or kc < 0:
            raise ModelConfigError(f"{where}: kv_channels = {kc!r}; 0 (hidden / heads) or a head's width")
        if not kc and self.hidden % self.heads:
            raise ModelConfigError(f"{where}: heads ({self.heads}) do not divide hidden ({self.hidden}); "
                                   f"choose heads dividing it, or give each head's width as kv_channels")
        if self.heads % self.kv_heads:
            raise ModelConfigError(f"{where}: kv_heads ({self.kv_heads}) must divide heads ({self.heads}): each "
                                   f"key/value head serves heads / kv_heads query heads")
        if self.head_dim % 2:
            raise ModelConfigError(f"{where}: rotary positions need an even head width (got {self.head_dim})")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or self.rope_theta <= 0:
            raise ModelConfigError(f"{where}: rope_theta = {self.rope_theta!r}; a positive number is required")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", rope_scaling_from(self.rope_scaling, where))
        if not isinstance(self.rms_norm_eps, (int, float)) or not self.rms_norm_eps > 0:
            raise ModelConfigError(f"{where}: rms_norm_eps must be > 0")
        for f in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ModelConfigError(f"{where}: {f} must be true or false")
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ModelConfigError(f"{where}: sliding_window = {w!r}; 0 (none) or a positive window")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to

    @property
    def window(self) -> int | None:
        """The attention window where it is shorter than the sequence (else attention is plainly causal)."""
        return self.sliding_window if 0 < self.sliding_window < self.seq_len else None

    @property
    def num_pipeline_layers(self) -> int:
        """Embedding, the blocks, final norm + LM head (as the description counts them)."""
        return self.layers + 2

    def describe(self) -> ModelDescription:
        """What the model computes: rotary positions, RMSNorm, grouped-query attention through a fused
        kernel, a SwiGLU MLP, no biases but Qwen2's q/k/v ones."""
        return _describe(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, name: str = "<dict>") -> "LlamaConfig":
        return config_from_dict(cls, data, name=name)


def rope_scaling_from(data: dict | None, where: str) -> RopeScaling | None:
    """A ``rope_scaling`` table (or transformers 5's ``rope_parameters``) as a ``RopeScaling``; None for none."""
    if not data:
        return None
    kind = data.get("rope_type", data.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ModelConfigError(f"{where}: rope scaling {kind!r} is not modelled; supported: {list(ROPE_SCALINGS)} "
                               f"(drop the scaling, or train at the original context)")
    keys = ("factor", "original_max_position_embeddings")
    keys += ("low_freq_factor", "high_freq_factor") if kind == "llama3" else ()
    missing = [k for k in keys if data.get(k) is None]
    if missing:
        raise ModelConfigError(f"{where}: rope scaling {kind} lacks {missing}")
    optional = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate") \
        if kind == "yarn" else ()
    return RopeScaling(**{k: data[k] for k in keys}, **{k: data[k] for k in optional if data.get(k) is not None},
                       rope_type=kind)


@lru_cache(maxsize=64)
def _describe(cfg: LlamaConfig) -> ModelDescription:
    block = Block(attention_of(cfg), MLP(cfg.ffn, "swiglu"))
    return ModelDescription(name=cfg.name, hidden=cfg.hidden, vocab=cfg.padded_vocab, seq_len=cfg.seq_len,
                            blocks=(block,) * cfg.layers, positions="rotary", norm="rmsnorm",
                            tied_head=cfg.tie_embeddings, dropout=False, linear_bias=False,
                            loss_chunk_tokens=cfg.loss_chunk_tokens)


def attention_of(cfg: LlamaConfig) -> Attention:
    """The family's attention as the description says it: grouped-query through a fused kernel."""
    wide = cfg.head_dim * cfg.heads != cfg.hidden
    return Attention(cfg.heads, cfg.kv_heads, qkv_bias=cfg.qkv_bias, window=cfg.window, kernel="fused",
                     head_dim=cfg.head_dim if wide else None, qk_norm=cfg.qk_norm)


def _yarn_inv_freq(r: RopeScaling, dim: int, base: float) -> list[float]:
    """yarn's frequencies of a ``dim``-wide rotary part (transformers' ``_compute_yarn_parameters``)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    out = []
    for j, i in enumerate(range(0, dim, 2)):
        extrapolated = 1.0 / base ** (i / dim)
        keep = 1 - min(max((j - low) / (high - low), 0.0), 1.0)  # 1: the frequency kept, 0: interpolated
        out.append(extrapolated / r.factor * (1 - keep) + extrapolated * keep)
    return out


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_attention_factor(cfg) -> float:
    """What cos and sin are scaled by: yarn's attention factor, 1 otherwise."""
    r = cfg.rope_scaling
    if r is None or r.rope_type != "yarn":
        return 1.0
    if r.attention_factor is not None:
        return float(r.attention_factor)
    if r.mscale and r.mscale_all_dim:
        return _yarn_mscale(r.factor, r.mscale) / _yarn_mscale(r.factor, r.mscale_all_dim)
    return _yarn_mscale(r.factor)


def attention_scale(cfg, head_width: int) -> float:
    """The softmax's scale: 1 / sqrt(width), times DeepSeek's yarn mscale(factor, mscale_all_dim)^2 where set."""
    scale = head_width ** -0.5
    r = cfg.rope_scaling
    if r is not None and r.rope_type == "yarn" and r.mscale_all_dim:
        scale *= _yarn_mscale(r.factor, r.mscale_all_dim) ** 2
    return scale


def rotary_inv_freq(cfg: LlamaConfig) -> list[float]:
    """The rotary frequencies of one head (head_dim / 2 of them), scaled as ``cfg.rope_scaling`` says."""
    d = cfg.head_dim
    inv = [1.0 / cfg.rope_theta ** (i / d) for i in range(0, d, 2)]
    r = cfg.rope_scaling
    if r is None:
        return inv
    if r.rope_type == "yarn":
        return _yarn_inv_freq(r, d, cfg.rope_theta)
    low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / r.factor)
        else:
            smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (
                r.high_freq_factor - r.low_freq_factor)
            out.append((1 - smooth) * f / r.factor + smooth * f)
    return out


# ---------------------------------------------------------------------------- Hugging Face config.json

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def from_hf_llama(data: dict, *, name: str) -> LlamaConfig:
    """A Hugging Face ``config.json`` of ``model_type`` llama, mistral, qwen2 or qwen3 (read as JSON).

    ``max_position_embeddings`` becomes ``seq_len`` (override it with the sequence you train at);
    transformers 5 keeps rope_theta and the scaling in ``rope_parameters``, 4.x at the top level.
    """
    kind = data.get("model_type")
    where = f"model config {name!r} (model_type {kind!r})"
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings")
    missing = [k for k in required if data.get(k) is None]
    if missing:
        raise ModelConfigError(f"{where}: config.json lacks {missing}")
    hidden, heads = data["hidden_size"], data["num_attention_heads"]
    head_dim = data.get("head_dim")
    if isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int) and head_dim * heads == hidden:
        head_dim = None  # the default width, said explicitly (Llama 3's configs do)
    for key in ("attention_bias", "mlp_bias"):
        if kind in ("llama", "qwen3") and data.get(key):
            raise ModelConfigError(f"{where}: {key} = true (biases on o_proj or the MLP) is not modelled; the "
                                   f"Llama family models q/k/v biases only (Qwen2's)")
    if data.get("attention_dropout"):
        raise ModelConfigError(f"{where}: attention_dropout = {data['attention_dropout']} is not modelled; use 0")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{where}: hidden_act {act!r}: the family's MLP is SwiGLU (silu)")
    rope = data.get("rope_parameters") or {}
    theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else data.get("rope_scaling")
    window = 0
    if kind == "mistral":
        window = data.get("sliding_window") or 0
    elif kind in ("qwen2", "qwen3") and data.get("use_sliding_window"):
        raise ModelConfigError(f"{where}: use_sliding_window = true (a window on layers from max_window_layers "
                               f"on) is not modelled; Qwen2, 2.5 and 3 releases train with it off")
    layer_types = data.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        raise ModelConfigError(f"{where}: layer_types mixes {sorted(set(layer_types))}; a per-layer attention "
                               f"pattern is not modelled")
    return LlamaConfig.from_dict({
        "vocab_size": data["vocab_size"], "hidden": hidden, "layers": data["num_hidden_layers"], "heads": heads,
        "kv_heads": data.get("num_key_value_heads") or heads, "ffn_hidden": data["intermediate_size"],
        "seq_len": data["max_position_embeddings"], "rope_theta": float(theta),
        "rope_scaling": rope_scaling_from(scaling, where), "rms_norm_eps": data.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(data.get("tie_word_embeddings", False)), "qkv_bias": kind == "qwen2",
        "sliding_window": int(window), "kv_channels": head_dim or 0, "qk_norm": kind == "qwen3"}, name=name)


def load_llama_config(name_or_path: str | Path, **overrides) -> LlamaConfig:
    """A Llama-family config: a name in model_configs/ (``family = "llama"``), a .toml path, a Hugging Face
    config.json or a ``save_pretrained`` directory.  ``overrides`` replace fields (e.g. ``seq_len=4096``)."""
    return load_family_config(LlamaConfig, from_hf_llama, name_or_path, overrides)
