import json

import pytest

from ds_pipe_ext.cli import main
from ds_pipe_ext.simulate.schedule import simulate_1f1b


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
    # the step is the event simulator's, on the stages' forward and backward times
    sim = simulate_1f1b([s["forward_ms"] for s in out["stages"]], [s["backward_ms"] for s in out["stages"]],
                        out["micro_batches"])
    assert out["predicted_step_ms"] == pytest.approx(sim.step_s)
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
