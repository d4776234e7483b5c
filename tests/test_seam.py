"""The seam holds: a model family that lives only in this file (gated SwiGLU blocks with grouped-query
attention, RMSNorm, an untied head) goes through estimate, plan, simulate and the PipelineModule's
partition decision with no edit outside models/: it registers itself, and the core reads its description."""

import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from ds_pipe_ext.arch import MLP, Attention, Block, ModelDescription
from ds_pipe_ext.cli import main
from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.costs.model import CostModel
from ds_pipe_ext.layout import Layout, LayoutError
from ds_pipe_ext.models import registry
from ds_pipe_ext.partition.methods import decide_offline


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


@pytest.fixture
def gated_toml(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._FAMILIES, FAMILY.name, FAMILY)
    path = tmp_path / "gated-toy.toml"
    path.write_text('family = "test-gated"\nvocab_size = 1000\nhidden = 64\nlayers = 6\nseq_len = 32\n')
    return path


def test_the_description_counts_what_the_family_builds():
    cfg = GatedConfig()
    built = [spec.build() for spec in _specs(cfg)]
    costs = analytic_layer_costs(cfg.describe(), EstimateRequest(2, 32, dtype="fp32"), get_device("a100"))
    # worked by hand: qkv 64 x (64 + 2 x 2 x 16) + 128 = 8,320; out 4,160; gate/up 64 x 192 + 192 = 12,480;
    # down 96 x 64 + 64 = 6,208; two RMSNorm scales 128: a block holds 31,296.  The untied head: 64 + 64,000
    assert [c.param_bytes // 4 for c in costs] == [64_000] + [31_296] * 6 + [64_064]
    assert [sum(p.numel() for p in m.parameters()) for m in built] == [c.param_bytes // 4 for c in costs]
    with pytest.raises(LayoutError, match=r"does not divide the key/value heads \(2\)"):
        Layout(tp=4).check(cfg.describe())


def test_estimate_plan_and_simulate_take_a_family_from_the_registry(gated_toml, capfd):
    assert main(["estimate", "--model", str(gated_toml), "--device", "a100", "--micro-batch", "2", "--json"]) == 0
    est = json.loads(capfd.readouterr().out)
    assert est["model"] == "gated-toy" and [r["params"] for r in est["layers"]][1] == 31_296
    assert {r["op"] for r in est["block_ops"]} >= {"fc1_gate_up", "swiglu", "ln_1"}
    assert main(["plan", "--model", str(gated_toml), "--gpus", "2", "--device", "a100", "--only", "pp=2", "--json"]) == 0
    (row,) = json.loads(capfd.readouterr().out)
    assert row["pp"] == 2 and row["parts"][0] == 0 and row["parts"][-1] == 8 and row["step_s"] > 0
    assert main(["simulate", "--model", str(gated_toml), "--stages", "2", "--device", "a100", "--json"]) == 0
    sim = json.loads(capfd.readouterr().out)
    assert sim["parts"][-1] == 8 and sim["step_ms"] > 0


def test_the_pipeline_modules_decision_takes_the_familys_cost_model(gated_toml):
    cfg = registry.load_model(gated_toml)
    assert isinstance(cfg, GatedConfig) and registry.family_of(cfg) is FAMILY
    cost_model = FAMILY.cost_model(cfg)
    assert isinstance(cost_model, CostModel)  # what PipelineModule accepts for "analytic"
    costs = cost_model.layer_costs(torch.zeros(4, 32, dtype=torch.long), tp=1, device=get_device("a100"),
                                   dtype="fp32")
    parts = decide_offline("analytic", costs, 2, micro_batches=4)
    assert parts[0] == 0 and parts[-1] == 8 and 1 < parts[1] < 8
    assert decide_offline("uniform", costs, 2, micro_batches=4) == [0, 4, 8]
