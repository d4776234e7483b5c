"""What every model family's config shares: the config directory, the error, a dict's and a file's loading
(``config_from_dict``, ``load_family_config``), the checks of settings every family has.  The GPT's own config
is ``gpt_config.GPTConfig``."""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, fields, replace
from pathlib import Path


CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"
ATTENTION_SETTINGS = ("eager", "sdpa", "auto")


class ModelConfigError(ValueError):
    """A model config that cannot be used; the message names the field and the fix."""


def hf_config_path(name_or_path) -> Path | None:
    """The config.json a name points at: the file itself, or a ``save_pretrained`` directory's."""
    path = Path(name_or_path)
    if path.suffix == ".json":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return None


def config_from_dict(cls, data: dict, *, name: str):
    """A family's config dataclass from a dict: unknown fields and missing required ones are named."""
    data = dict(data)
    data.setdefault("name", name)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ModelConfigError(f"model config {data['name']!r}: unknown field(s) {unknown}; valid fields are "
                               f"{sorted(known)}")
    missing = sorted(f.name for f in fields(cls) if f.name not in data and f.default is MISSING)
    if missing:
        raise ModelConfigError(f"model config {data['name']!r}: missing field(s) {missing}")
    return cls(**data)


def load_family_config(config_type: type, from_hf, name_or_path: str | Path, overrides: dict):
    """A family's config (``config_type``, with ``from_dict``): a name in model_configs/, a .toml path, a
    Hugging Face config.json (read by ``from_hf``) or a ``save_pretrained`` directory; ``overrides``
    replace fields (None values ignored)."""
    import json

    path = hf_config_path(name_or_path) or Path(name_or_path)
    if path.suffix not in (".toml", ".json"):
        path = CONFIG_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ModelConfigError(f"unknown model {str(name_or_path)!r}: no file {path}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if path.suffix == ".json":
        try:
            cfg = from_hf(json.loads(path.read_text()), name=path.parent.name or path.stem)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"model config {path}: not valid JSON ({e})") from None
        return replace(cfg, **overrides) if overrides else cfg
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ModelConfigError(f"model config {path}: not valid TOML ({e}); fix the syntax") from None
    data.pop("family", None)
    data.update(overrides)
    return config_type.from_dict(data, name=path.stem)


def check_loss_chunk(cfg) -> None:
    """``loss_chunk_tokens``: 0 (the plain head and loss) or a positive number of tokens a chunk."""
    v = cfg.loss_chunk_tokens
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ModelConfigError(f"model config {cfg.name!r}: loss_chunk_tokens = {v!r}; use 0 (the plain head and "
                               f"loss) or a positive number of tokens a chunk")


def check_positive_ints(cfg, names, where: str) -> None:
    """Each field of ``names`` a positive integer (not a bool), or an error naming the first that is not."""
    for f in names:
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ModelConfigError(f"{where}: {f} = {v!r}; it must be a positive integer")


def check_router_groups(cfg, where: str, *, sigmoid: bool) -> None:
    """The router's groups (``router_groups``, ``router_topk_groups``) against ``experts`` and ``top_k``; the
    sigmoid router (``models.routers``) scores a group by its two best experts and chooses among the experts of its
    ``router_topk_groups`` best groups."""
    check_positive_ints(cfg, ("router_groups", "router_topk_groups"), where)
    if cfg.experts % cfg.router_groups:
        raise ModelConfigError(f"{where}: router_groups (n_group {cfg.router_groups}) must divide experts "
                               f"({cfg.experts}): each group holds experts / n_group of them")
    if cfg.router_topk_groups > cfg.router_groups:
        raise ModelConfigError(f"{where}: router_topk_groups ({cfg.router_topk_groups}) exceeds router_groups "
                               f"({cfg.router_groups})")
    if not sigmoid:
        return
    if cfg.experts // cfg.router_groups < 2:
        raise ModelConfigError(f"{where}: the sigmoid router scores a group by its two best experts; "
                               f"router_groups ({cfg.router_groups}) leaves fewer than 2 experts a group")
    if cfg.top_k > cfg.experts // cfg.router_groups * cfg.router_topk_groups:
        raise ModelConfigError(f"{where}: top_k ({cfg.top_k}) exceeds the experts of the router_topk_groups "
                               f"({cfg.router_topk_groups}) groups it chooses among")


def available_models() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
