"""The GPT's analytic description: a ``costs.model.CostModel`` for ``partition_method: "analytic"``.

The per-op formulas live in ``costs/analytic.py`` and ``costs/estimate.py`` (a
transformer's ops, no model import); this file says which of them make up this
model's pipeline layers, reads (b, s) from a micro-batch of tokens, and knows
whether its layers are sequence-parallel (from the ``LayerImpl`` they were built with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..costs.calibrate import fit_device
from ..costs.estimate import EstimateRequest, analytic_layer_costs, layer_ops, shape_for
from ..costs.hardware import DeviceSpec
from ..costs.types import LayerCost
from .config import GPTConfig
from .gpt import LOCAL, LayerImpl, gpt_layer_specs, lm_loss


@dataclass(frozen=True)
class GPTCostModel:
    """Analytic per-layer costs of a ``GPTConfig`` built with ``gpt_layer_specs``."""

    config: GPTConfig
    sequence_parallel: bool = False

    def request(self, inputs, *, tp: int, dtype: str) -> EstimateRequest:
        tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        b, s = tokens.shape
        return EstimateRequest(micro_batch=int(b), seq=int(s), tp=tp, sp=self.sequence_parallel, dtype=dtype)

    def layer_costs(self, inputs, *, tp: int, device: DeviceSpec, dtype: str) -> list[LayerCost]:
        return analytic_layer_costs(self.config.describe(), self.request(inputs, tp=tp, dtype=dtype), device)

    def calibrate(self, inputs, *, tp: int, device: DeviceSpec, dtype: str, cache_dir: str | None) -> DeviceSpec:
        return profile_and_calibrate(self.config, self.request(inputs, tp=tp, dtype=dtype), device, cache_dir=cache_dir)


def gpt_cost_model(cfg: GPTConfig, impl: LayerImpl = LOCAL) -> GPTCostModel:
    """The cost model of ``gpt_layer_specs(cfg, impl)``."""
    return GPTCostModel(cfg, sequence_parallel=impl.sequence_parallel)


def profile_gpt_layers(cfg: GPTConfig, micro_batch: int, settings, key_fields: dict | None = None):
    """Every pipeline layer of ``cfg`` profiled on this machine with one micro-batch of tokens (cached)."""
    from ..costs.profiler import profile_layers

    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return profile_layers(gpt_layer_specs(cfg), tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss,
                          settings=settings, key_fields={"model": cfg.to_dict(), **(key_fields or {})})


def profile_three_layers(cfg: GPTConfig, micro_batch: int, seq: int, settings, key_fields: dict):
    """The embedding, one block and the head (+ loss) of ``cfg`` (untied, at sequence ``seq``) profiled
    alone on this machine: (the config as profiled, their ``LayerCost``)."""
    from ..costs.profiler import profile_layers

    cfg = GPTConfig.from_dict({**cfg.to_dict(), "seq_len": seq, "tie_embeddings": False}, name=cfg.name)
    specs = gpt_layer_specs(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
    measured = profile_layers([specs[0], specs[1], specs[-1]], tokens[:, :-1], labels=tokens[:, 1:], loss_fn=lm_loss,
                              settings=settings, key_fields={"model": cfg.to_dict(), **key_fields})
    return cfg, measured


def profile_and_calibrate(cfg: GPTConfig, req: EstimateRequest, device: DeviceSpec, *,
                          cache_dir: str | None = ".ds_pipe_ext_cache", warmup: int = 1, repeats: int = 3,
                          also: tuple[EstimateRequest, ...] = ()) -> DeviceSpec:
    """Profile one embedding, one block and the head (+ loss) of ``cfg`` on this machine at ``req``
    (and at each shape in ``also``: more shapes separate the factors), then fit."""
    from ..costs.profiler import ProfileSettings

    settings = ProfileSettings(warmup=warmup, repeats=repeats, cache_dir=cache_dir, progress=False)
    layers = []
    for r in (req, *also):
        shaped, measured = profile_three_layers(cfg, r.micro_batch, r.seq, settings, {"purpose": "calibration"})
        layers += calibration_points(shaped, r, device, [(m.forward_s, m.backward_s) for m in measured])
    return fit_device(device, layers, dtype=req.dtype)


def calibration_points(cfg: GPTConfig, req: EstimateRequest, device: DeviceSpec,
                       measured: list[tuple[float, float]]) -> list[tuple]:
    """(ops, forward s, backward s) of the embedding, a block and the head, measured at ``req``."""
    ops = layer_ops(cfg, shape_for(cfg, req, device))
    return [(ops[i][2], fwd, bwd) for i, (fwd, bwd) in zip((0, 1, -1), measured)]
