"""The launch helpers' resume rule: a stored launch is re-read only for the run that made it."""

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
