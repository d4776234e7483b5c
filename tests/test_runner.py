"""The launch helpers: the command a launch runs, and the resume rule (a stored launch is re-read only for the run
that made it)."""

import json
import re

import pytest

from ds_pipe_ext.runner import measure_in_one_launch, write_config

TRAIN = {"model": "bench-cpu", "steps": 4, "seed": 1234}


def _stored_launch(out, methods):
    out.mkdir()
    write_config(out / "ds.json", train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4, train=TRAIN)
    records = [{"method": m, "parts": [0, 7, 14], "samples_per_s": 1.0} for m in methods]
    (out / "metrics.json").write_text(json.dumps({"measured": records, "rank": 0}))
    return records


def _measure(out, methods, **overrides):
    kwargs = {"train": TRAIN, "micro_batch": 1, "micro_batches": 4, "step_model": "unused.json", **overrides}
    return measure_in_one_launch(out, methods, **kwargs)


def test_the_same_run_reads_its_stored_launch_back(tmp_path):
    records = _stored_launch(tmp_path / "a", ["profiled", "uniform"])
    assert _measure(tmp_path / "a", ["profiled", "uniform"]) == records


@pytest.mark.parametrize("methods, overrides, named", [
    (["uniform", "profiled"], {}, "methods"),
    (["profiled", "uniform"], {"micro_batches": 8}, "gradient_accumulation_steps 4 (asked 8)"),
    (["profiled", "uniform"], {"train": {**TRAIN, "model": "bench-cpu-pruned"}}, "train"),
])
def test_a_stored_launch_of_another_run_is_refused(tmp_path, methods, overrides, named):
    _stored_launch(tmp_path / "a", ["profiled", "uniform"])
    with pytest.raises(SystemExit, match=re.escape(named)) as err:
        _measure(tmp_path / "a", methods, **overrides)
    assert "remove the directory or choose another --out" in str(err.value)


def test_a_launch_runs_what_the_deepspeed_command_runs_on_one_node(monkeypatch):
    """``launch`` skips the ``deepspeed`` runner's interpreter, not what it does: on one node without a hostfile
    the runner hands deepspeed.launcher.launch exactly this command, for any device count it accepts."""
    from types import SimpleNamespace

    import deepspeed.launcher.runner as ds_runner

    from ds_pipe_ext.runner import single_node_launch

    started = []

    class Started:
        returncode = 0

        def __init__(self, cmd, env=None):
            started.append(cmd)

        def wait(self):
            return 0

    accelerator = SimpleNamespace(device_count=lambda: 8, visible_devices_envs=lambda: ["CUDA_VISIBLE_DEVICES"])
    monkeypatch.setattr(ds_runner, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(ds_runner, "fetch_hostfile", lambda path: None)  # one node
    monkeypatch.setattr(ds_runner, "subprocess", SimpleNamespace(Popen=Started))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for ranks in (1, 2, 4):
        ds_runner.main(["--num_gpus", str(ranks), "--master_port", "29611", "train.py", "--steps", "2"])
        assert started[-1] == [*single_node_launch(ranks, 29611), "train.py", "--steps", "2"]
