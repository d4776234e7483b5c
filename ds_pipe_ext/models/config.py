"""`GPTConfig`: a validated dataclass loaded from `model_configs/*.toml` (or a path)."""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"


class ModelConfigError(ValueError):
    """A model config that cannot be used; the message names the field and the fix."""


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

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden", "layers", "heads", "seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelConfigError(f"model config {self.name!r}: {f} = {v!r}; it must be a positive integer")
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
        if not isinstance(self.layernorm_eps, (int, float)) or not self.layernorm_eps > 0:
            raise ModelConfigError(f"model config {self.name!r}: layernorm_eps must be > 0")

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and LM head: vocab_size rounded up to vocab_pad_to (labels stay < vocab_size)."""
        return -(-self.vocab_size // self.vocab_pad_to) * self.vocab_pad_to

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_pipeline_layers(self) -> int:
        """Layer specs in the pipeline: embedding, the blocks, final norm + LM head."""
        return self.layers + 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, name: str = "<dict>") -> "GPTConfig":
        data = dict(data)
        data.setdefault("name", name)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelConfigError(
                f"model config {data['name']!r}: unknown field(s) {unknown}; valid fields are {sorted(known)}"
            )
        missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
        if missing:
            raise ModelConfigError(f"model config {data['name']!r}: missing field(s) {missing}")
        return cls(**data)


def available_models() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def load_model_config(name_or_path: str | Path, **overrides) -> GPTConfig:
    """Load ``tiny`` / ``gpt2-small`` / ... from model_configs/, or a .toml path.

    ``overrides`` replace fields after loading (e.g. ``seq_len=128``).
    """
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ModelConfigError(
            f"unknown model {str(name_or_path)!r}: no file {path}; use one of {available_models()} or a path to a .toml file"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"model config {path}: not valid TOML ({e}); fix the syntax") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    return GPTConfig.from_dict(data, name=path.stem)
