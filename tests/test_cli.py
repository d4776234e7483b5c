import json

import pytest

from ds_pipe_ext.cli import main


def _partition_json(capsys, tmp_path, *extra):
    rc = main(["partition", "--model", "tiny", "--stages", "2", "--micro-batch", "2", "--json",
               "--warmup", "0", "--repeats", "1", "--cache-dir", str(tmp_path), *extra])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_partition_json(tmp_path, capsys):
    out = _partition_json(capsys, tmp_path)
    assert out["parts"][0] == 0 and out["parts"][-1] == 6 and len(out["stages"]) == 2
    assert {"forward_ms", "backward_ms", "memory_bytes", "layer_names"} <= set(out["stages"][0])
    times = [s["time_ms"] for s in out["stages"]]
    # one definition of imbalance: fastest / slowest
    assert out["imbalance"] == pytest.approx(min(times) / max(times))
    # 1F1B without transfers: the slowest stage runs m micro-batches, and no stage waits longer than the
    # p - 1 micro-batches of the fill and drain before its profiled optimizer step
    slowest = max(s["forward_ms"] + s["backward_ms"] for s in out["stages"])
    update = max(s["optimizer_ms"] for s in out["stages"])
    m, p = out["micro_batches"], len(out["stages"])
    assert update > 0
    assert m * slowest * (1 - 1e-9) <= out["predicted_step_ms"] <= ((m + p - 1) * slowest + update) * (1 + 1e-9)
    # the same cached costs split uniformly: profiled minimises the predicted step over every split,
    # so uniform's is never smaller (its bottleneck can be: the step also holds fill and drain)
    uniform = _partition_json(capsys, tmp_path, "--method", "uniform")
    assert uniform["parts"] == [0, 3, 6]
    assert out["predicted_step_ms"] <= uniform["predicted_step_ms"] * (1 + 1e-9)


def test_partition_table_and_errors(tmp_path, capsys):
    args = ["--model", "tiny", "--warmup", "0", "--repeats", "1", "--cache-dir", str(tmp_path)]
    assert main(["partition", "--stages", "3", "--method", "uniform", *args]) == 0
    out = capsys.readouterr().out
    assert "parts=[0, 2, 4, 6]" in out and "imbalance (fastest/slowest, higher is better)" in out
    assert main(["partition", "--stages", "7", *args]) == 2
    assert "at most 6 stages" in capsys.readouterr().err
    assert main(["partition", "--stages", "2", "--method", "bogus", *args]) == 2
    assert "valid methods" in capsys.readouterr().err
    assert main(["partition", "--stages", "2", "--memory-cap-gib", "0.0001", *args]) == 2
    assert "smallest cap that admits a partition" in capsys.readouterr().err


def test_the_text_outputs_of_simulate_and_estimate_compare_render(capsys):
    """The tables people read, not only --json: simulate's per-rank timeline draws compute only (DeepSpeed's
    engine order also times transfers on the rank), and estimate --compare has a header cell per column."""
    assert main(["simulate", "--model", "gpt3-1.3b", "--stages", "4", "--device", "h100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    timeline = [ln for ln in lines if ln.startswith("rank ") and "|" in ln]
    assert len(timeline) == 4 and all(set(ln.split("|")[1]) <= set("FBbwo.") for ln in timeline)
    assert main(["estimate", "--compare", "--model", "gpt3-1.3b", "--world", "64", "--tp", "8", "--sp",
                 "--device", "h100", "--micro-batch", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rule = next((lines[i], lines[i + 1]) for i, ln in enumerate(lines) if ln.startswith("config"))
    rows = [ln for ln in lines if ln.startswith(("pipe-", "zero"))]
    assert header.split()[-2:] == ["GiB", "fits?"] and rows
    assert all(len(r.split()) == len(rule.split()) + 2 for r in rows)  # a cell a column ("1 x 16": 3 words)
