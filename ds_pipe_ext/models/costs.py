"""A family's analytic cost model, profile and calibration, from its description and layer specs.

Every family's ``CostModel`` (``partition_method: "analytic"``) is its config's description costed by the
op library (``costs/analytic.py``, ``costs/estimate.py``): this file reads (b, s) from a micro-batch of
tokens and knows whether the layers are sequence-parallel (from the ``LayerImpl`` they were built with).
Profiling builds the family's own layers (``specs_fn``) and runs them on this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..costs.calibrate import fit_device
from ..costs.estimate import EstimateRequest, analytic_layer_costs, shape_for
from ..costs.layer_ops import layer_ops
from ..costs.hardware import DeviceSpec
from ..costs.types import LayerCost
from .layers import LayerImpl, lm_loss


@dataclass(frozen=True)
class DescribedCostModel:
    """Analytic per-layer costs of a config that describes itself, built by ``specs_fn``."""

    config: object
    specs_fn: Callable  # the family's layer_specs (what calibration profiles)
    sequence_parallel: bool = False
    loss_fn: Callable = lm_loss  # the family's loss over the head's output (calibration profiles it)
    expert_parallel: int = 1  # Mixture-of-Experts layers: E / ep experts a rank and their all-to-all

    def request(self, inputs, *, tp: int, dtype: str) -> EstimateRequest:
        tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        b, s = tokens.shape
        return EstimateRequest(micro_batch=int(b), seq=int(s), tp=tp, sp=self.sequence_parallel, dtype=dtype,
                               ep=self.expert_parallel)

    def layer_costs(self, inputs, *, tp: int, device: DeviceSpec, dtype: str) -> list[LayerCost]:
        return analytic_layer_costs(self.config.describe(), self.request(inputs, tp=tp, dtype=dtype), device)

    def calibrate(self, inputs, *, tp: int, device: DeviceSpec, dtype: str, cache_dir: str | None) -> DeviceSpec:
        return profile_and_calibrate(self.config, self.request(inputs, tp=tp, dtype=dtype), device,
                                     cache_dir=cache_dir, specs_fn=self.specs_fn, loss_fn=self.loss_fn)


def described_cost_model(cfg, impl: LayerImpl, specs_fn: Callable, loss_fn: Callable = lm_loss) -> DescribedCostModel:
    """The cost model of ``specs_fn(cfg, impl)``."""
    return DescribedCostModel(cfg, specs_fn, sequence_parallel=impl.sequence_parallel, loss_fn=loss_fn)


def _tokens(cfg, micro_batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))


def profile_family_layers(cfg, micro_batch: int, settings, key_fields: dict | None = None, *, specs_fn: Callable,
                          loss_fn: Callable = lm_loss):
    """Every pipeline layer of ``cfg`` profiled on this machine with one micro-batch of tokens (cached)."""
    from ..costs.profiler import profile_layers

    tokens = _tokens(cfg, micro_batch, cfg.seq_len)
    return profile_layers(specs_fn(cfg), tokens[:, :-1], labels=tokens[:, 1:], loss_fn=loss_fn,
                          settings=settings, key_fields={"model": cfg.to_dict(), **(key_fields or {})})


def profile_three_layers(cfg, micro_batch: int, seq: int, settings, key_fields: dict, *, specs_fn: Callable,
                         loss_fn: Callable = lm_loss):
    """The embedding, one block and the head (+ loss) of ``cfg`` (untied, at sequence ``seq``) profiled
    alone on this machine: (the config as profiled, their ``LayerCost``)."""
    from ..costs.profiler import profile_layers

    cfg = replace(cfg, seq_len=seq, tie_embeddings=False)
    specs = specs_fn(cfg)
    tokens = _tokens(cfg, micro_batch, seq)
    measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:], loss_fn=loss_fn,
                              settings=settings, key_fields={"model": cfg.to_dict(), **key_fields})
    return cfg, measured


def profile_and_calibrate(cfg, req: EstimateRequest, device: DeviceSpec, *,
                          cache_dir: str | None = ".ds_pipe_ext_cache", warmup: int = 1, repeats: int = 3,
                          also: tuple[EstimateRequest, ...] = (), specs_fn: Callable,
                          loss_fn: Callable = lm_loss) -> DeviceSpec:
    """Profile one embedding, one block and the head (+ loss) of ``cfg`` on this machine at ``req``
    (and at each shape in ``also``: more shapes separate the factors), then fit."""
    from ..costs.profiler import ProfileSettings

    settings = ProfileSettings(warmup=warmup, repeats=repeats, cache_dir=cache_dir, progress=False)
    layers = []
    for r in (req, *also):
        shaped, measured = profile_three_layers(cfg, r.micro_batch, r.seq, settings, {"purpose": "calibration"},
                                                specs_fn=specs_fn, loss_fn=loss_fn)
        layers += calibration_points(shaped, r, device, [(m.forward_s, m.backward_s) for m in measured])
    return fit_device(device, layers, dtype=req.dtype)


def calibration_points(cfg, req: EstimateRequest, device: DeviceSpec,
                       measured: list[tuple[float, float]]) -> list[tuple]:
    """(ops, forward s, backward s) of the embedding, a block and the head, measured at ``req``."""
    ops = layer_ops(cfg, shape_for(cfg, req, device), device=device.name)
    return [(ops[i][2], fwd, bwd) for i, (fwd, bwd) in zip((0, 1, -1), measured)]
