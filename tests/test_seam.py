"""The seam holds: a model family that lives only in the tests (``gated_family.py`` gated SwiGLU blocks with grouped-query
attention, RMSNorm, an untied head) goes through estimate, plan, simulate and the PipelineModule (offline
and in a 2-rank launch) with no edit outside models/: it registers itself, and the core reads its
description."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_pipe_ext.cli import main
from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.costs.model import CostModel
from ds_pipe_ext.layout import Layout, LayoutError
from ds_pipe_ext.models import registry
from ds_pipe_ext.partition.methods import decide_offline
from ds_pipe_ext.runner import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gated_family import FAMILY, GatedConfig, _specs  # noqa: E402


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


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_the_pipeline_module_splits_the_family_as_the_offline_decision_does(tmp_path):
    """2 ranks, partition_method "analytic" on the family's cost model: every rank builds the split that
    the decision function chooses offline from the same costs, and trains."""
    proc, ranks = launch(2, None, "--steps", "2", out_dir=tmp_path, cwd=tmp_path, script="tests/gated_pipeline.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = GatedConfig()
    costs = FAMILY.cost_model(cfg).layer_costs(torch.zeros(4, cfg.seq_len, dtype=torch.long), tp=1,
                                               device=get_device("a100"), dtype="fp32")
    offline = decide_offline("analytic", costs, 2, micro_batches=4)
    assert [r["parts"] for r in ranks.values()] == [offline, offline]
    assert all(len(r["losses"]) == 2 and all(x == x for x in r["losses"]) for r in ranks.values())
