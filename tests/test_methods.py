import pytest

from ds_pipe_ext.costs.types import LayerCost
from ds_pipe_ext.partition import PartitionError, partition_min_max
from ds_pipe_ext.partition.methods import decide_offline, lookup
from ds_pipe_ext.partition.report import build_plan


def gpt_like_costs():
    """bench-cpu's shape: a cheap embedding with many parameters, 12 blocks, a costly head."""
    emb = LayerCost("EmbeddingPipe", 0.001, 0.04, param_bytes=103_450_624)
    blocks = [LayerCost("Block", 0.08, 0.15, param_bytes=12_609_536, activation_bytes=42_024_960, output_bytes=2_097_152)
              for _ in range(12)]
    head = LayerCost("HeadPipe", 0.8, 1.7, param_bytes=102_930_432, activation_bytes=210_063_364)
    return [emb, *blocks, head]


def test_lookup_and_unknown_method():
    assert lookup("profiled")[0].name == "profiled"
    assert lookup("PROFILED")[0].name == "profiled"
    assert lookup("type:Block") == (lookup("type:x")[0], "Block")
    assert lookup("uniform")[0].deepspeed_builtin
    with pytest.raises(PartitionError, match=r"unknown partition_method 'profile'; valid methods: uniform, parameters, type:REGEX, profiled"):
        lookup("profile")


def test_offline_decisions_match_deepspeed_and_beat_it():
    costs = gpt_like_costs()
    assert decide_offline("uniform", costs, 2, micro_batches=4) == [0, 7, 14]
    assert decide_offline("parameters", costs, 2, micro_batches=4) == [0, 7, 14]
    assert decide_offline("type:Block", costs, 2, micro_batches=4) == [0, 7, 14]
    # the slowest stage is smallest at [0, 12, 14]; the step, with stage 0's fill and stage 1's
    # drain, is smallest one block later (13.403 s against 13.491 s simulated)
    assert partition_min_max(costs, 2, micro_batches=4) == [0, 12, 14]
    profiled = decide_offline("profiled", costs, 2, micro_batches=4)
    assert profiled == [0, 13, 14]
    plans = {m: build_plan(m, decide_offline(m, costs, 2, micro_batches=4), costs, micro_batches=4)
             for m in ["uniform", "profiled", "parts:0,12,14"]}
    assert plans["profiled"].predicted_step_ms == pytest.approx(13403, abs=1)
    assert plans["profiled"].predicted_step_ms < plans["parts:0,12,14"].predicted_step_ms < plans["uniform"].predicted_step_ms
    assert decide_offline("parts:0,11,14", costs, 2, micro_batches=4) == [0, 11, 14]


@pytest.mark.parametrize("arg", ["parts:0,14", "parts:0,15,14", "parts:1,7,14", "parts:a,b"])
def test_bad_explicit_parts(arg):
    with pytest.raises(PartitionError, match="parts"):
        decide_offline(arg, gpt_like_costs(), 2, micro_batches=4)


def test_plan_report_renders():
    costs = gpt_like_costs()
    plan = build_plan("profiled", [0, 12, 14], costs, micro_batches=4, link_bandwidth=1e9)
    table = plan.to_table()
    assert "EmbeddingPipe, Block x11" in table and "Block, HeadPipe" in table
    d = plan.to_dict()
    assert [s["layers"] for s in d["stages"]] == [[0, 12], [12, 14]]
    assert d["stages"][0]["inflight"] == 2 and d["stages"][1]["inflight"] == 1
    # p2p: 2 x 2 MiB over 1 GB/s on each side of the single boundary
    assert d["stages"][0]["comm_ms"] == pytest.approx(2 * 2_097_152 / 1e9 * 1e3)
    # stage 1: blocks 12 + head; fastest/slowest over the two stages
    t0 = 1e3 * (0.041 + 11 * 0.23) + d["stages"][0]["comm_ms"]
    t1 = 1e3 * (0.23 + 2.5) + d["stages"][1]["comm_ms"]
    assert d["imbalance"] == pytest.approx(min(t0, t1) / max(t0, t1))
    # aligned columns: every cell of a row sits inside its column's rule
    lines = table.splitlines()
    rule = lines[2]
    spans, start = [], None
    for i, ch in enumerate(rule + " "):
        if ch == "-" and start is None:
            start = i
        elif ch != "-" and start is not None:
            spans.append((start, i))
            start = None
    assert len(spans) == 10
    for row in lines[3:5]:
        for a, b in spans:
            cell = row[a:b]
            assert cell.strip(), (row, a, b)  # something in every column
            assert row[b:b + 1] in ("", " ")  # and nothing spills into the gap
            assert a == 0 or row[a - 1] == " "


def test_analytic_method_partitions_analytic_costs():
    from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
    from ds_pipe_ext.costs.hardware import get_device
    from ds_pipe_ext.models.gpt_config import load_model_config

    cfg = load_model_config("bench-cpu")
    costs = analytic_layer_costs(cfg, EstimateRequest(micro_batch=4, seq=256, dtype="fp32"), get_device("a100"))
    assert [c.name for c in costs] == ["EmbeddingPipe"] + ["Block"] * 12 + ["HeadPipe"]
    parts = decide_offline("analytic", costs, 2, micro_batches=4)
    # the head + loss is worth several blocks: the last stage gets far fewer than uniform's 6 blocks
    assert parts[1] >= 10 and parts == decide_offline("profiled", costs, 2, micro_batches=4)
