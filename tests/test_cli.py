import json

from ds_pipe_ext.cli import main


def test_partition_json(tmp_path, capsys):
    rc = main(["partition", "--model", "tiny", "--stages", "2", "--micro-batch", "2", "--json",
               "--warmup", "0", "--repeats", "1", "--cache-dir", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parts"][0] == 0 and out["parts"][-1] == 6 and len(out["stages"]) == 2
    assert out["imbalance_slowest_over_fastest"] >= 1.0
    assert {"forward_ms", "backward_ms", "memory_bytes", "layer_names"} <= set(out["stages"][0])


def test_partition_table_and_errors(tmp_path, capsys):
    args = ["--model", "tiny", "--warmup", "0", "--repeats", "1", "--cache-dir", str(tmp_path)]
    assert main(["partition", "--stages", "3", "--method", "uniform", *args]) == 0
    out = capsys.readouterr().out
    assert "parts=[0, 2, 4, 6]" in out and "imbalance (slowest/fastest)" in out
    assert main(["partition", "--stages", "7", *args]) == 2
    assert "at most 6 stages" in capsys.readouterr().err
    assert main(["partition", "--stages", "2", "--method", "bogus", *args]) == 2
    assert "valid methods" in capsys.readouterr().err
    assert main(["partition", "--stages", "2", "--memory-cap-gib", "0.0001", *args]) == 2
    assert "smallest cap that admits a partition" in capsys.readouterr().err
