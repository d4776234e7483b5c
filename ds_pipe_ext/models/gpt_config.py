"""`GPTConfig`: a validated dataclass loaded from `model_configs/*.toml` (or a path, or a Hugging Face GPT-2
config.json)."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

from ..arch import MLP, Attention, Block, ModelDescription
from .config import (ATTENTION_SETTINGS, CONFIG_DIR, ModelConfigError, available_models, check_loss_chunk,
                     check_positive_ints, config_from_dict, hf_config_path)


@dataclass(frozen=True)
class GPTConfig:
    name: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    ffn_hidden: int = 0  # 0: 4 * hidden, as in GPT-2/3
    dropout: float = 0.0
    tie_embeddings: bool = False
    layernorm_eps: float = 1e-5
    vocab_pad_to: int = 1  # Megatron's make_vocab_size_divisible_by: embedding/head rows padded to a multiple
    # the head + loss in chunks of this many tokens (``models.linear_cross_entropy``: the logits never held
    # whole); 0: the plain head and loss.  At tp 1; under TP Megatron's vocab-parallel loss holds 1/t of them
    loss_chunk_tokens: int = 0
    # one FFN width per block, for models whose blocks differ (width-pruned models such as Minitron
    # keep a different width in each block); empty: ``ffn`` in every block
    block_ffn_hidden: tuple[int, ...] = ()
    # the attention core: "eager" written out (saves the s x s probabilities), "sdpa" torch's fused
    # scaled_dot_product_attention (flash / memory-efficient kernels on a GPU), "auto": sdpa on CUDA, eager
    # on a CPU (whose figures were all measured eager)
    attention: str = "auto"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "hidden", "layers", "heads", "seq_len"),
                            f"model config {self.name!r}")
        if isinstance(self.ffn_hidden, bool) or not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 0:
            raise ModelConfigError(f"model config {self.name!r}: ffn_hidden = {self.ffn_hidden!r}; use 0 (=4*hidden) or a positive integer")
        if self.hidden % self.heads:
            raise ModelConfigError(
                f"model config {self.name!r}: hidden ({self.hidden}) is not divisible by heads ({self.heads}); "
                f"choose heads that divide hidden"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(f"model config {self.name!r}: dropout = {self.dropout!r}; it must be in [0, 1)")
        if not isinstance(self.tie_embeddings, bool):
            raise ModelConfigError(f"model config {self.name!r}: tie_embeddings must be true or false")
        if isinstance(self.vocab_pad_to, bool) or not isinstance(self.vocab_pad_to, int) or self.vocab_pad_to < 1:
            raise ModelConfigError(f"model config {self.name!r}: vocab_pad_to must be a positive integer")
        check_loss_chunk(self)
        widths = self.block_ffn_hidden
        if not isinstance(widths, (list, tuple)) or (widths and (
                len(widths) != self.layers or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths))):
            raise ModelConfigError(f"model config {self.name!r}: block_ffn_hidden = {widths!r}; give one positive "
                                   f"width per block ({self.layers}), or leave it out")
        object.__setattr__(self, "block_ffn_hidden", tuple(widths))
        if not isinstance(self.layernorm_eps, (int, float)) or not self.layernorm_eps > 0:
            raise ModelConfigError(f"model config {self.name!r}: layernorm_eps must be > 0")
        if self.attention not in ATTENTION_SETTINGS:
            raise ModelConfigError(f"model config {self.name!r}: attention = {self.attention!r}; use one of "
                                   f"{', '.join(ATTENTION_SETTINGS)}")

    def attention_kernel(self, device_type: str) -> str:
        """"eager" or "sdpa": what the blocks run on a device of this type ("cuda" or "cpu")."""
        if self.attention != "auto":
            return self.attention
        return "sdpa" if device_type == "cuda" else "eager"

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and LM head: vocab_size rounded up to vocab_pad_to (labels stay < vocab_size)."""
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def block_config(self, index: int) -> "GPTConfig":
        """The configuration block ``index`` is built from (its own FFN width where they differ)."""
        if not self.block_ffn_hidden:
            return self
        return replace(self, ffn_hidden=self.block_ffn_hidden[index], block_ffn_hidden=())

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_pipeline_layers(self) -> int:
        """Layer specs in the pipeline: embedding, the blocks, final norm + LM head."""
        return self.layers + 2

    def describe(self) -> ModelDescription:
        """What the GPT computes, for the analytic costs (``arch``): learned positions, LayerNorm, multi-head
        attention, a GELU MLP (one width per block where they differ), the head tied or not."""
        return _describe(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, name: str = "<dict>") -> "GPTConfig":
        return config_from_dict(cls, data, name=name)


ANALYTIC_KERNEL = {"eager": "eager", "sdpa": "fused", "auto": "auto"}  # the setting as ``arch`` names kernels


@lru_cache(maxsize=64)
def _describe(cfg: GPTConfig) -> ModelDescription:
    widths = cfg.block_ffn_hidden or (cfg.ffn,) * cfg.layers
    return ModelDescription(name=cfg.name, hidden=cfg.hidden, vocab=cfg.padded_vocab, seq_len=cfg.seq_len,
                            blocks=tuple(Block(Attention(cfg.heads, kernel=ANALYTIC_KERNEL[cfg.attention]),
                                               MLP(w, "gelu")) for w in widths),
                            positions="learned", norm="layernorm", tied_head=cfg.tie_embeddings,
                            dropout=cfg.dropout > 0, loss_chunk_tokens=cfg.loss_chunk_tokens)


# Hugging Face GPT-2 config.json key -> GPTConfig field
HF_GPT2_KEYS = {"n_embd": "hidden", "n_layer": "layers", "n_head": "heads", "vocab_size": "vocab_size",
                "n_positions": "seq_len", "n_inner": "ffn_hidden", "layer_norm_epsilon": "layernorm_eps",
                "tie_word_embeddings": "tie_embeddings", "resid_pdrop": "dropout"}


def from_hf_gpt2(data: dict, *, name: str) -> GPTConfig:
    """A Hugging Face GPT-2 ``config.json`` (read as JSON): n_embd, n_layer, n_head, vocab_size, n_positions.

    GPT-2 ties its LM head to the embedding (``tie_word_embeddings``, default true) and uses
    one dropout rate (``resid_pdrop``; the attention and embedding rates are taken equal).
    """
    if not isinstance(data, dict):
        raise ModelConfigError(f"model config {name!r}: a Hugging Face config.json must be a JSON object")
    missing = [k for k in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions") if k not in data]
    if missing:
        raise ModelConfigError(f"model config {name!r}: not a GPT-2 config.json, it lacks {missing}")
    fields_ = {field: data[key] for key, field in HF_GPT2_KEYS.items() if data.get(key) is not None}
    fields_.setdefault("tie_embeddings", True)
    return GPTConfig.from_dict(fields_, name=name)


def load_model_config(name_or_path: str | Path, **overrides) -> GPTConfig:
    """Load ``tiny`` / ``gpt2-small`` / ... from model_configs/, a .toml path, or a Hugging Face GPT-2 config.json.

    ``overrides`` replace fields after loading (e.g. ``seq_len=128``).
    """
    path = hf_config_path(name_or_path) or Path(name_or_path)
    if path.suffix not in (".toml", ".json"):
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ModelConfigError(
            f"unknown model {str(name_or_path)!r}: no file {path}; use one of {available_models()}, "
            f"a path to a .toml file, a Hugging Face config.json or a save_pretrained directory"
        )
    if path.suffix == ".json":
        import json

        try:
            cfg = from_hf_gpt2(json.loads(path.read_text()), name=path.parent.name or path.stem)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"model config {path}: not valid JSON ({e})") from None
        return GPTConfig.from_dict({**cfg.to_dict(), **{k: v for k, v in overrides.items() if v is not None}},
                                   name=cfg.name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"model config {path}: not valid TOML ({e}); fix the syntax") from None
    family = data.pop("family", "gpt")
    if family != "gpt":
        raise ModelConfigError(f"model config {path}: family = {family!r} is not the GPT's; load it with "
                               f"ds_pipe_ext.models.load_model, which picks the family")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig.from_dict(data, name=path.stem)
