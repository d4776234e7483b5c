"""Where a Hugging Face causal LM's config and weights come from: a ``save_pretrained`` directory (each rank
reads only the tensors of the layers it builds, from the safetensors files) or a model in memory.

``ARCHITECTURES`` says, per ``model_type``, where the pipeline's parts live in the model's module tree;
everything else is read from the model's own classes (``AutoModelForCausalLM`` built on the meta device,
no memory), so a layer is built exactly as transformers builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..config_model import ConfigError


class HFPipelineError(ConfigError):
    """A Hugging Face model or batch the pipeline cannot run; the message names the fix."""


@dataclass(frozen=True)
class Architecture:
    """Dotted paths in a ``*ForCausalLM`` of the pipeline's parts."""

    embed: str  # the token embedding
    layers: str  # the decoder layers' ModuleList
    norm: str  # the final norm
    head: str = "lm_head"
    positions: str | None = None  # learned position embedding (GPT-2)
    dropout: str | None = None  # the embedding's dropout (GPT-2)
    rotary: str | None = None  # the model's rotary module: every layer recomputes (cos, sin) from it
    # where the checkpoint's names differ from the module tree's (transformers' conversion_mapping.py says how it
    # loads them): a prefix the checkpoint spells otherwise, and routed experts the checkpoint keeps one
    # per file entry ("...experts.{i}.up_proj.weight") where the module holds them stacked ("...experts.up_proj")
    checkpoint_prefix: tuple[str, str] | None = None
    stacked_experts: bool = False


_DECODER = Architecture(embed="model.embed_tokens", layers="model.layers", norm="model.norm", rotary="model.rotary_emb")
ARCHITECTURES = {
    "llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER,
    "gpt2": Architecture(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                         positions="transformer.wpe", dropout="transformer.drop"),
    # MLA, a group-limited sigmoid router, 1 shared + routed experts; the checkpoint's experts one by one
    "deepseek_v3": Architecture(embed="model.embed_tokens", layers="model.layers", norm="model.norm",
                                rotary="model.rotary_emb", stacked_experts=True),
    # attention sinks, layers alternating a sliding window with full attention, biased attention and experts
    "gpt_oss": _DECODER,
    # hybrid: each layer one mixer (Mamba-2, attention, MLP or MoE) behind its norm and residual; no positions
    "nemotron_h": Architecture(embed="model.embeddings", layers="model.layers", norm="model.norm_f",
                               checkpoint_prefix=("model.", "backbone."), stacked_experts=True),
}


def get_path(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


class HFSource:
    """One Hugging Face causal LM: its config, its architecture, and each part's weights.

    ``directory``: a ``save_pretrained`` directory (config.json and *.safetensors).  ``model``: a
    ``PreTrainedModel`` in memory instead (every rank then holds the whole model).  ``attn_implementation``:
    "sdpa" or "eager" (default: the model's own, else sdpa); given for an instance, it switches the
    instance's own attention (its config is the model's)."""

    def __init__(self, directory: str | Path | None = None, *, model=None, attn_implementation: str | None = None):
        if (directory is None) == (model is None):
            raise HFPipelineError("give a save_pretrained directory or a model instance, not both")
        self.directory = None if directory is None else Path(directory).resolve()
        self.model = model
        if model is not None:
            self.config = model.config
            checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.20's name
            if checkpointing is None:
                checkpointing = getattr(model, "is_gradient_checkpointing", False)
            if checkpointing:
                raise HFPipelineError("the model has Hugging Face gradient checkpointing switched on; switch it "
                                      "off (model.gradient_checkpointing_disable()) and use the pipeline's "
                                      "activation_checkpoint_interval instead")
        else:
            self.config = _load_config(self.directory)
        kind = getattr(self.config, "model_type", None)
        if kind not in ARCHITECTURES:
            raise HFPipelineError(f"model_type {kind!r} is not supported as a pipeline; supported: "
                                  f"{sorted(ARCHITECTURES)} (GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, "
                                  f"Qwen2ForCausalLM, Qwen3ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM, "
                                  f"NemotronHForCausalLM)")
        if getattr(self.config, "gradient_checkpointing", False):
            raise HFPipelineError("config.json has gradient_checkpointing = true; switch it off and use the "
                                  "pipeline's activation_checkpoint_interval instead")
        quantized = getattr(self.config, "quantization_config", None)
        if quantized and self.directory is not None:
            _refuse_quantized(self.directory, quantized)
        sdpa = _supports_sdpa(self.config)
        impl = (attn_implementation or getattr(self.config, "_attn_implementation", None)
                or ("sdpa" if sdpa else "eager"))
        if impl not in ("sdpa", "eager"):
            raise HFPipelineError(f"attn_implementation {impl!r}: the pipeline runs 'sdpa' or 'eager'")
        if impl == "sdpa" and not sdpa:  # gpt-oss: SDPA's fused kernels take no attention sink
            raise HFPipelineError(f"attn_implementation 'sdpa': transformers runs {kind} through its eager attention "
                                  f"only (its attention sinks); use attn_implementation='eager'")
        self.config._attn_implementation = impl
        self.arch = ARCHITECTURES[kind]

    def __repr__(self) -> str:  # stable and shape-specific: LayerSpec reprs feed the profile cache key
        if self.directory is not None:
            where = str(self.directory)
        else:
            import hashlib

            shape = json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode()
            where = f"memory:{self.config.model_type}:{hashlib.sha1(shape).hexdigest()[:12]}"
        return f"HFSource({where}, attn={self.config._attn_implementation})"

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)  # GPT-2 maps it to n_layer

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def family_config(self):
        """The model as one of ds_pipe_ext's families (``models``): its description, for "analytic"."""
        from ..models.registry import from_hf_config

        return from_hf_config(self.config.to_dict(), name=self.config.model_type)

    # -- building parts ---------------------------------------------------------------------------
    def part(self, dotted: str):
        """The module at ``dotted`` with its weights: the instance's own module, or a copy of the meta-built
        one filled with the tensors the safetensors files hold under that name."""
        if self.model is not None:
            return get_path(self.model, dotted)
        import copy

        module = copy.deepcopy(get_path(_meta_model(self), dotted)).to_empty(device="cpu")
        state = self.tensors(self.checkpoint_name(dotted) + ".")
        if self.arch.stacked_experts:
            state = _stack_experts(state, module.state_dict())
        missing = sorted(set(module.state_dict()) - set(state))
        if missing:
            raise HFPipelineError(f"{self.directory}: no weights for {dotted}.{missing[0]} in the safetensors files")
        module.load_state_dict(state, strict=True)
        for name, _ in module.named_buffers():  # one outside the state dict would be uninitialised memory
            if name not in state:
                raise HFPipelineError(f"{dotted}.{name} is a buffer the checkpoint does not hold; such a layer "
                                      f"cannot be built from the meta device")
        return module

    def checkpoint_name(self, dotted: str) -> str:
        """``dotted`` (a path in the module tree) as the checkpoint spells it."""
        if self.arch.checkpoint_prefix and dotted.startswith(self.arch.checkpoint_prefix[0]):
            module_prefix, saved_prefix = self.arch.checkpoint_prefix
            return saved_prefix + dotted.removeprefix(module_prefix)
        return dotted

    def rotary(self):
        """The model's rotary module, built fresh on the CPU (its frequencies are computed, not stored)."""
        if self.arch.rotary is None:
            return None
        cls = type(get_path(self.model if self.model is not None else _meta_model(self), self.arch.rotary))
        return cls(config=self.config)

    def tensors(self, prefix: str) -> dict:
        """The checkpoint's tensors under ``prefix``, with the prefix taken off (only those files opened)."""
        from safetensors import safe_open

        out = {}
        for file, names in _weight_files(self.directory).items():
            wanted = [n for n in names if n.startswith(prefix)]
            if wanted:
                with safe_open(str(self.directory / file), framework="pt") as f:
                    for n in wanted:
                        out[n.removeprefix(prefix)] = f.get_tensor(n)
        return out


def _supports_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(cls, "_supports_sdpa", True))


# transformers' config that dequantizes each quantization method a released checkpoint uses, on load
DEQUANTIZE = {"fp8": "FineGrainedFP8Config", "mxfp4": "Mxfp4Config"}


def _refuse_quantized(directory: Path, quantized) -> None:
    """A stage reads its tensors from the safetensors files as they are: quantized ones (DeepSeek-V3's FP8
    blocks and their scales, gpt-oss's MXFP4 experts) would train as the wrong numbers.  The fix is
    transformers' own dequantization, once."""
    method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
    method = getattr(method, "value", method)
    cls = DEQUANTIZE.get(str(method), "the quantization config with dequantize=True")
    raise HFPipelineError(
        f"{directory}: its weights are quantized ({method}); the pipeline trains weights in the training dtype. "
        f"Dequantize them once with transformers and train from that directory: "
        f"AutoModelForCausalLM.from_pretrained({str(directory)!r}, quantization_config={cls}(dequantize=True), "
        f"dtype=torch.bfloat16).save_pretrained(OUT)")


def _stack_experts(state: dict, wanted: dict) -> dict:
    """A module's stacked expert tensors ("mixer.experts.up_proj", (E, out, in)) from the checkpoint's
    per-expert ones ("mixer.experts.{i}.up_proj.weight"), as transformers' MergeModulelist(dim=0) loads them
    (conversion_mapping.py: nemotron_h's, and qwen2_moe's that deepseek_v3 shares)."""
    out = dict(state)
    for name, tensor in wanted.items():
        if name in state or ".experts." not in f".{name}":
            continue
        stem, leaf = name.rsplit(".", 1)
        # a fused gate_up_proj is each expert's gate_proj and up_proj concatenated (Concatenate(dim=1))
        leaves = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else (leaf,)
        keys = [[f"{stem}.{i}.{part}.weight" for part in leaves] for i in range(tensor.shape[0])]
        if all(k in state for row in keys for k in row):
            out[name] = torch.stack([torch.cat([state[k] for k in row]) for row in keys])
            for row in keys:
                for k in row:
                    del out[k]
    return out


def _load_config(directory: Path):
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise HFPipelineError(f"{directory}: no config.json; pass a save_pretrained directory")
    try:
        kind = json.loads((directory / "config.json").read_text()).get("model_type")
    except json.JSONDecodeError as e:
        raise HFPipelineError(f"{directory}/config.json: not valid JSON ({e})") from None
    if kind not in ARCHITECTURES:
        raise HFPipelineError(f"model_type {kind!r} is not supported as a pipeline; supported: {sorted(ARCHITECTURES)}")
    return AutoConfig.from_pretrained(str(directory), local_files_only=True)


@lru_cache(maxsize=8)
def _weight_files(directory: Path) -> dict[str, list[str]]:
    """safetensors file -> the tensor names it holds (from the index of a sharded checkpoint)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    single = directory / "model.safetensors"
    if not single.is_file():
        raise HFPipelineError(f"{directory}: no model.safetensors (or its index); save the model with "
                              f"save_pretrained(safe_serialization=True)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {"model.safetensors": list(f.keys())}


_META: dict[str, object] = {}


def _meta_model(source: HFSource):
    """The whole model built on the meta device (no memory, no initialisation), once per process."""
    key = repr(source)
    if key not in _META:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            _META[key] = AutoModelForCausalLM.from_config(source.config,
                                                          attn_implementation=source.config._attn_implementation)
    return _META[key]
