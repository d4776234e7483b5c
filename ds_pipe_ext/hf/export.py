"""A pipeline checkpoint (DeepSpeed's per-layer files, ``engine.save_checkpoint``) back to a Hugging Face
``save_pretrained`` directory, through the one name map ``layers.hf_key_map``."""

from __future__ import annotations

from pathlib import Path

import torch

from .layers import hf_key_map
from .pipeline import as_source, pipeline_layers
from .source import HFPipelineError, HFSource


def checkpoint_state(checkpoint_dir: str | Path, source: HFSource, num_layers: int, *, tag: str | None = None) -> dict:
    """The Hugging Face state dict a pipeline checkpoint holds (a tied head's weight is the embedding's)."""
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise HFPipelineError(f"{root}: no 'latest' file; pass tag= (the checkpoint's subdirectory)")
        tag = latest.read_text().strip()
    state = {}
    for index in range(num_layers):
        names = hf_key_map(source, index, num_layers)
        if not names:
            continue  # the tied head: its weight is the embedding's, already read from layer 0
        files = sorted((root / tag).glob(f"layer_{index:02d}-*model_states.pt"))
        if not files:
            raise HFPipelineError(f"{root / tag}: no file for pipeline layer {index} (layer_{index:02d}-*model_states.pt)")
        for key, tensor in torch.load(files[0], map_location="cpu", weights_only=True).items():
            prefix = next((p for p in names if key.startswith(p)), None)
            if prefix is not None:
                state[names[prefix] + key.removeprefix(prefix)] = tensor
    return state


def save_pretrained(checkpoint_dir: str | Path, model, out_dir: str | Path, *, tag: str | None = None) -> Path:
    """Write ``out_dir`` as ``save_pretrained`` would, from the checkpoint of ``pipeline_layers(model)``.

    ``model``: the directory or instance the pipeline was built from (its config and architecture)."""
    from transformers import AutoModelForCausalLM

    source = as_source(model)
    state = checkpoint_state(checkpoint_dir, source, len(pipeline_layers(source)), tag=tag)
    hf = AutoModelForCausalLM.from_config(source.config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (source.tied and k == source.arch.head + ".weight")]
    if missing or unexpected:
        raise HFPipelineError(f"the checkpoint does not fill the model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}")
    hf.save_pretrained(str(out_dir))
    return Path(out_dir)
