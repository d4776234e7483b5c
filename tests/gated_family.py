"""A model family that lives only in the tests (gated SwiGLU blocks with grouped-query attention,
RMSNorm, an untied head): what another team's family would be, registered without an edit outside
models/.  Imported by tests/test_seam.py and by the launch script tests/gated_pipeline.py."""

import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from deepspeed.pipe import LayerSpec
from torch import nn

from ds_pipe_ext.arch import MLP, Attention, Block, ModelDescription
from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.models import registry


@dataclass(frozen=True)
class GatedConfig:
    name: str = "gated-toy"
    vocab_size: int = 1000
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    layers: int = 6
    seq_len: int = 32

    def describe(self) -> ModelDescription:
        block = Block(Attention(self.heads, self.kv_heads), MLP(self.ffn, "swiglu"))
        return ModelDescription(self.name, self.hidden, self.vocab_size, self.seq_len, (block,) * self.layers,
                                positions="none", norm="rmsnorm", tied_head=False)

    def to_dict(self) -> dict:
        return asdict(self)


class Embed(nn.Module):
    def __init__(self, cfg: GatedConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)

    def forward(self, tokens):
        return self.wte(tokens)


class GatedBlock(nn.Module):
    def __init__(self, cfg: GatedConfig):
        super().__init__()
        self.cfg, hd = cfg, cfg.hidden // cfg.heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden), nn.RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, cfg.hidden + 2 * cfg.kv_heads * hd)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x):
        c, (b, s, h) = self.cfg, x.shape
        hd = h // c.heads
        q, k, v = self.qkv(self.norm1(x)).split([h, c.kv_heads * hd, c.kv_heads * hd], dim=-1)
        q = q.view(b, s, c.heads, hd).transpose(1, 2)
        k, v = (t.view(b, s, c.kv_heads, hd).transpose(1, 2).repeat_interleave(c.heads // c.kv_heads, 1)
                for t in (k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Head(nn.Module):
    def __init__(self, cfg: GatedConfig):
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def _loss(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _specs(cfg, impl=None, *, selective_recompute=False):
    return [LayerSpec(Embed, cfg), *[LayerSpec(GatedBlock, cfg) for _ in range(cfg.layers)], LayerSpec(Head, cfg)]


@dataclass(frozen=True)
class GatedCostModel:
    config: GatedConfig

    def layer_costs(self, inputs, *, tp, device, dtype):
        b, s = inputs.shape
        return analytic_layer_costs(self.config.describe(), EstimateRequest(int(b), int(s), tp=tp, dtype=dtype), device)

    def calibrate(self, inputs, *, tp, device, dtype, cache_dir):
        return device


def _load(path, **overrides):
    data = tomllib.loads(Path(path).read_text())
    data.pop("family")
    return GatedConfig(**{**data, **{k: v for k, v in overrides.items() if v is not None}}, name=Path(path).stem)


FAMILY = registry.ModelFamily(
    name="test-gated", config_type=GatedConfig, load_config=_load, layer_specs=_specs,
    loss_fn=lambda impl=None: _loss, sequential=None, tensor_parallel=lambda tp, sp=False: None,
    cost_model=lambda cfg, impl=None: GatedCostModel(cfg), profile=None, calibrate=None)


def register() -> registry.ModelFamily:
    return registry.register_family(FAMILY)
