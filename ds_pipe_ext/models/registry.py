"""The model families ds_pipe_ext can train, plan and cost, each a registered unit (torchtitan's ``TrainSpec``).

A family bundles everything the rest of the package asks of a model, so that ``train.py`` and the
commands name a model and never import one:

    load_config(name_or_path, **overrides)   a validated config: ``describe()`` (``arch.ModelDescription``),
                                             ``name``, ``seq_len``, ``vocab_size``, ``to_dict()``
    layer_specs(config, impl, *, selective_recompute[, ep])  the pipeline's layers: embedding, blocks, head
                                             (ep: experts split over ep ranks, expert_parallel families)
    loss_fn(config, impl)                    the pipeline's loss over the last layer's output
    sequential(specs, loss_fn, *, base_seed, recompute)  the same layers as one module (data parallel)
    tensor_parallel(tp, sp)                  the layer implementation for a TP degree (1: local layers)
    cost_model(config, impl)                 a ``costs.model.CostModel`` (``partition_method: "analytic"``)
    profile(config, micro_batch, settings)   every pipeline layer profiled on this machine (cached)
    calibrate(config, request, device, **kw) a device spec fitted to a few layers profiled here

A config file names its family with a top-level ``family = "NAME"`` (GPT without one).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import CONFIG_DIR, ModelConfigError, hf_config_path


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_type: type
    load_config: Callable
    layer_specs: Callable
    loss_fn: Callable
    sequential: Callable
    tensor_parallel: Callable
    cost_model: Callable
    profile: Callable
    calibrate: Callable
    from_hf: Callable | None = None  # a Hugging Face config.json's dict, name= -> the family's config
    expert_parallel: bool = False  # layer_specs takes ep= (DeepSpeed's MoE layers)
    # the tensors a stage boundary carries that need a gradient, at least (the moe family: its hidden states, its
    # routers' summed loss, and MTP's embeddings where it has them): DeepSpeed's pipeline splits only the first over
    # TP (``train.build.build_engine``)
    boundary_grads: int = 1


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.name] = family
    return family


def families() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise ModelConfigError(f"unknown model family {name!r}; registered families: {families()}")
    return _FAMILIES[name]


def family_of(config) -> ModelFamily:
    """The family a loaded config belongs to (its own type's family first: MoEConfig is a LlamaConfig)."""
    for family in sorted(_FAMILIES.values(), key=lambda f: type(config) is not f.config_type):
        if isinstance(config, family.config_type):
            return family
    raise ModelConfigError(f"{type(config).__name__} belongs to no registered model family ({families()})")


# a Hugging Face config.json's model_type -> the family that models it
HF_MODEL_TYPES = {"gpt2": "gpt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                  "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe", "deepseek": "moe", "deepseek_v3": "moe",
                  "gpt_oss": "moe", "nemotron_h": "hybrid"}
# not supported, but close to a family's: that family's loader names what it does not model in them
HF_NEAR_MODEL_TYPES = {"deepseek_v2": "moe"}


def _hf_family_name(kind: str, where) -> str:
    if kind in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[kind]
    if kind in HF_NEAR_MODEL_TYPES:
        return HF_NEAR_MODEL_TYPES[kind]
    raise ModelConfigError(f"model config {where}: model_type {kind!r} is not supported; supported Hugging Face "
                           f"model types: {sorted(HF_MODEL_TYPES)}")


def from_hf_config(data: dict, *, name: str):
    """A Hugging Face config.json's dict as the config of the family that models its ``model_type``."""
    return get_family(_hf_family_name(data.get("model_type", "gpt2"), name)).from_hf(data, name=name)


def _hf_file_family_name(path: Path) -> str:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return "gpt"  # the family's own loader reports the missing or malformed file
    return _hf_family_name(data.get("model_type", "gpt2") if isinstance(data, dict) else "gpt2", path)


def _family_name(name_or_path) -> str:
    hf = hf_config_path(name_or_path)
    if hf is not None:
        return _hf_file_family_name(hf)
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = CONFIG_DIR / f"{name_or_path}.toml"
    try:
        family = tomllib.loads(path.read_text()).get("family", "gpt")
    except (OSError, tomllib.TOMLDecodeError):
        return "gpt"  # the family's own loader reports the missing or malformed file
    if not isinstance(family, str):
        raise ModelConfigError(f"model config {path}: family = {family!r}; name a family, one of {families()}")
    return family


def load_model(name_or_path: str | Path, **overrides):
    """A model's config by name (``model_configs/NAME.toml``), .toml path or Hugging Face config.json,
    loaded by its family."""
    return get_family(_family_name(name_or_path)).load_config(name_or_path, **overrides)
