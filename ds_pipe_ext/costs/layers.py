"""What the profiler needs to know about one pipeline layer, whatever form the user gave it.

DeepSpeed's ``PipelineModule`` accepts four kinds of layer: a ``LayerSpec`` (built
later, on the stage that owns it), a ``TiedLayerSpec`` (the same, sharing a module
by key, optionally called through ``forward_fn(module, x)``), an ``nn.Module``
instance, and any callable (``lambda x: x.view(...)``).  This module gives each a
name (its class or function name), a description that is stable across processes
(for the profile cache key, and to measure identical layers once), and a private
copy to profile, so the user's model is never touched.

Duck-typed on DeepSpeed's spec classes (``typename``, ``build``, ``forward_fn``), so
it needs no DeepSpeed import.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
from collections.abc import Callable, Sequence

import torch
from torch import nn


def is_layer_spec(layer) -> bool:
    """A DeepSpeed ``LayerSpec`` or ``TiedLayerSpec`` (duck-typed: built later, from ``typename``)."""
    return hasattr(layer, "typename") and callable(getattr(layer, "build", None))


def _function_name(fn) -> str:
    if isinstance(fn, functools.partial):
        return _function_name(fn.func)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name


def layer_name(layer) -> str:
    """``Block`` for ``LayerSpec(Block, ...)``, ``EmbeddingPipe.tied_lm_head`` for a tied spec called
    through a function, ``Linear`` for an ``nn.Linear`` instance, ``lambda`` for a lambda."""
    if is_layer_spec(layer):
        base = layer.typename.__name__
        forward_fn = getattr(layer, "forward_fn", None)
        return f"{base}.{_function_name(forward_fn)}" if forward_fn is not None else base
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return _function_name(layer)


def layer_names(layers: Sequence) -> list[str]:
    return [layer_name(layer) for layer in layers]


def _describe_function(fn) -> str:
    if isinstance(fn, functools.partial):
        return f"partial({_describe_function(fn.func)}, {fn.args!r}, {fn.keywords!r})"
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object
        return f"callable {type(fn).__module__}.{type(fn).__qualname__} {fn!r}"
    body = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12]
    return f"function {fn.__module__}.{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno}) {body}"


def describe_layer(layer) -> str:
    """A text that is equal for layers that cost the same and stable across processes."""
    if is_layer_spec(layer):
        forward_fn = getattr(layer, "forward_fn", None)
        return f"spec {layer!r}" + (f" via {_describe_function(forward_fn)}" if forward_fn is not None else "")
    if isinstance(layer, nn.Module):
        trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        return f"module {type(layer).__module__}.{type(layer).__qualname__} {layer!r} trainable={trainable}"
    return _describe_function(layer)


def measured_alone(layer) -> bool:
    """Whether the layer's time follows its own weights, so that identical specs do not cost the same: a class
    that says ``profile_each = True`` (a dropless Mixture-of-Experts block, whose busiest expert sets its time)."""
    cls = layer.typename if is_layer_spec(layer) else type(layer)
    return bool(getattr(cls, "profile_each", False))


def build_for_profiling(layer, device=None) -> tuple[nn.Module, Callable]:
    """(module holding the parameters, call(x)) for a private copy of ``layer``.

    A spec is built afresh, on ``device`` where given (a GPU initialises its weights in place of the host,
    then copying them), an ``nn.Module`` instance is deep-copied (its weights and ``requires_grad`` flags
    included), a callable runs as is on an empty module.
    """
    if is_layer_spec(layer):
        with torch.device(device) if device is not None else contextlib.nullcontext():
            module = layer.build()
        forward_fn = getattr(layer, "forward_fn", None)
        if forward_fn is not None:
            return module, lambda x, m=module, f=forward_fn: f(m, x)
        return module, module
    if isinstance(layer, nn.Module):
        module = copy.deepcopy(layer)
        return module, module
    if not callable(layer):
        raise TypeError(f"pipeline layer {layer!r} is not a LayerSpec, an nn.Module or a callable")
    return nn.Module(), lambda x, f=layer: f(x)


def deepspeed_layer_seeds(base_seed: int, count: int) -> list[int]:
    """The seed each of ``count`` layers is built from under DeepSpeed's ``seed_layers``: layer i from
    ``base_seed + i`` (``PipelineModule._build``), which a profile's ``layer_seeds`` follows."""
    return [base_seed + i for i in range(count)]


def tied_key(spec) -> str:
    """The key of a ``TiedLayerSpec`` ("" for any other layer).  DeepSpeed builds a key's module once a
    process: two layers of one key on one stage share the whole module (every parameter of it), while
    stages apart each build a copy and all-reduce the tied weight's gradient."""
    key = getattr(spec, "key", None)
    return str(key) if is_layer_spec(spec) and key is not None and hasattr(spec, "tied_weight_attr") else ""
