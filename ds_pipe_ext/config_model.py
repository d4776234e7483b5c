"""`ConfigModel`: the base of every config section of ours, validated the way DeepSpeed validates its own.

DeepSpeed's config sections are pydantic models (``deepspeed.runtime.config_utils.
DeepSpeedConfigModel``: unknown keys forbidden).  Ours are too, stricter still: a
string where a boolean or a number belongs is an error (``"false"`` never becomes
True), and sections are frozen once built.  ``parse_section`` turns pydantic's
errors into one ``ConfigError`` that names every bad key by its full path
(``tensor_parallel.sequence_parallel``), what was given, and for an unknown key the
valid ones.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A malformed config; the message names the key and the fix."""


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


M = TypeVar("M", bound=ConfigModel)


def _lookup(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The section model at ``path`` (to list its valid keys)."""
    for key in path:
        field = model.model_fields.get(key) if isinstance(key, str) else None
        inner = getattr(field, "annotation", None) if field else None
        candidates = [inner, *getattr(inner, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def describe_errors(model: type[BaseModel], section: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith(("function-", "literal["))))
        key = ".".join([section, *map(str, loc)]) if section else ".".join(map(str, loc))
        if e["type"] == "extra_forbidden":
            parent = _lookup(model, loc[:-1])
            valid = sorted(parent.model_fields) if parent else []
            lines.append(f"unknown key {key!r}; valid keys here are {valid}")
        elif e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{key} must be an object (a JSON dict), got {e.get('input')!r}")
        else:
            lines.append(f"{key} = {e.get('input')!r}: {e['msg']}")
    return "; ".join(lines)


def parse_section(model: type[M], data, section: str) -> M:
    """``model`` validated from ``data`` (a dict), or a ``ConfigError`` naming each bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f'"{section}" must be an object (a JSON dict), got {data!r}')
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_errors(model, section, e)) from None
