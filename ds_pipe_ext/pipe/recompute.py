"""One recompute mode per pipeline layer, built into the layers DeepSpeed's ``PipelineModule`` makes.

    none        the layer keeps what autograd saves
    selective   attention's core is replayed in the backward (the layer takes ``selective_recompute``)
    full        the layer keeps its input and replays its forward: DeepSpeed's own activation
                checkpointing at interval 1, answered per layer (``PipelineModule._is_checkpointable``)

Nothing is wrapped: state-dict keys are the same under every choice, so a checkpoint saved under one
loads under another.  Everything here is checked before any layer is built, identically on every rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from deepspeed.pipe import LayerSpec

from ..partition import PartitionError

MODES = ("none", "selective", "full")


def supports_selective(layer) -> bool:
    """A ``LayerSpec`` whose layer takes ``selective_recompute`` (ds_pipe_ext's GPT, Llama and MoE blocks)."""
    if not isinstance(layer, LayerSpec) or type(layer) is not LayerSpec:
        return False
    try:
        return "selective_recompute" in inspect.signature(layer.typename).parameters
    except (TypeError, ValueError):
        return False


def built_recompute(module) -> dict[int, str]:
    """What this stage's built layers recompute, read back from them: {global layer index: "full" (run under
    DeepSpeed's checkpoint) or "selective" (an attention that replays its core)}; layers without, left out."""
    from ..compat import engine as ds_engine

    out = {i: "selective" for i, layer in ds_engine.local_layers(module)
           if any(getattr(m, "selective_recompute", False) for m in layer.modules())}
    out.update({i: "full" for i in ds_engine.checkpointed_layers(module)})
    return dict(sorted(out.items()))


def with_measured_selective(costs: list, specs: list, profile) -> list:
    """``costs`` (profiled as built) with each selective-capable layer's selective mode measured: ``profile``
    runs the same layers built to replay their attention core; what that build keeps, and its extra
    backward, become ``LayerCost.selective_kept_bytes`` / ``selective_replay_s``."""
    from dataclasses import replace

    capable = [supports_selective(s) for s in specs]
    if not any(capable):
        return costs
    rebuilt = with_selective_recompute(specs, ["selective" if c else "none" for c in capable], 0)
    measured = profile(rebuilt)
    return [replace(c, selective_kept_bytes=int(m.activation_bytes),
                    selective_replay_s=max(0.0, m.backward_s - c.backward_s)) if ok else c
            for c, m, ok in zip(costs, measured, capable)]


def check_auto_recompute(needs_costs: bool, memory_cap_gib, interval: int, schedule: str) -> None:
    """What recompute="auto" needs: layer costs (partition_method "profiled" or "analytic"), a memory cap
    to fit, no interval of DeepSpeed's, and a schedule with one chunk a rank."""
    if not needs_costs:
        raise PartitionError('recompute = "auto" is decided with the split from layer costs: use partition_method '
                             '"profiled" or "analytic"')
    if memory_cap_gib is None:
        raise PartitionError('recompute = "auto" recomputes what the memory cap needs: set pipeline.memory_cap_gib '
                             '(or choose the modes yourself)')
    if interval:
        raise PartitionError(f'recompute = "auto" and activation_checkpoint_interval = {interval} both say which '
                             f'layers replay their forward: keep one')
    if schedule == "dualpipev":
        raise PartitionError('recompute = "auto" splits one chunk a rank; DualPipeV pairs two: use 1f1b or gpipe')


def with_selective_recompute(layers: list, recompute: Sequence[str], interval: int) -> list:
    """``layers`` with each "selective" one rebuilt to replay its attention core; the errors name the fix."""
    modes = list(recompute)
    if len(modes) != len(layers):
        raise PartitionError(f"recompute gives {len(modes)} modes for {len(layers)} pipeline layers: give one per "
                             f"layer (embedding, blocks, head)")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise PartitionError(f"recompute mode(s) {unknown}: use {', '.join(MODES)}")
    if interval:
        raise PartitionError(f"a recompute mode per layer and activation_checkpoint_interval = {interval} both say "
                             f"which layers replay their forward: keep one")
    unsupported = [i for i, (mode, layer) in enumerate(zip(modes, layers))
                   if mode == "selective" and not supports_selective(layer)]
    if unsupported:
        raise PartitionError(f"layer(s) {unsupported} have no selective recompute (only ds_pipe_ext's blocks replay "
                             f"their attention core; Hugging Face layers, embeddings and heads do not): give them "
                             f"\"none\" or \"full\"")
    out = list(layers)
    for i, mode in enumerate(modes):
        if mode == "selective":
            spec = layers[i]
            args = list(spec.module_args)
            # a family passes the flag as the layer's third positional argument (cfg, impl, flag) or not at all
            params = list(inspect.signature(spec.typename).parameters)
            at = params.index("selective_recompute")
            if len(args) > at:
                args[at] = True
                out[i] = LayerSpec(spec.typename, *args, **spec.module_kwargs)
            else:
                out[i] = LayerSpec(spec.typename, *args, **{**spec.module_kwargs, "selective_recompute": True})
    return out
