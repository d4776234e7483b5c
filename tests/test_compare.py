"""`ds-pipe-ext compare`: configurations, ZeRO's allocation rules, the micro-batch search, resume,
and one reduced comparison of real launches (2 ranks, 2 steps) with a memory cap."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipe_ext.compare.configs import CompareError, comparison_configs, ds_config
from ds_pipe_ext.layout import ZERO_SETTINGS
from ds_pipe_ext.compare.predict import model_shape
from ds_pipe_ext.compare.run import Comparison, LaunchResult, search_max_micro_batch
from ds_pipe_ext.costs.zero import zero_model_states
from ds_pipe_ext.models.gpt_config import load_model_config
from ds_pipe_ext.runner import ROOT
from ds_pipe_ext.forked_launch import FORK_ENV


def test_configs_share_one_global_batch():
    configs = comparison_configs(4, global_batch=32, micro_batch=4)
    assert [c.name for c in configs] == [
        "pipe-profiled-pp4-dp1-z0", "pipe-uniform-pp4-dp1-z0",
        "pipe-profiled-pp2-dp2-z0", "pipe-uniform-pp2-dp2-z0", "pipe-profiled-pp2-dp2-z1", "pipe-uniform-pp2-dp2-z1",
        "zero1", "zero2", "zero3", "zero3-offload"]
    assert {c.layout.global_batch for c in configs} == {32}
    assert [c.layout.micro_batches for c in configs[:2]] == [8, 8] and configs[-2].layout.micro_batches == 2
    assert [c.name for c in comparison_configs(4, global_batch=32, micro_batch=4, patterns=["pipe-*-z1", "zero3"])] \
        == ["pipe-profiled-pp2-dp2-z1", "pipe-uniform-pp2-dp2-z1", "zero3"]
    with pytest.raises(CompareError, match="multiple of 16"):
        comparison_configs(4, global_batch=24, micro_batch=4)
    with pytest.raises(CompareError, match="match no configuration"):
        comparison_configs(2, global_batch=16, micro_batch=4, patterns=["zero4"])
    ds = ds_config(configs[-2], model="tiny", steps=2, memory_cap_gib=1.0)
    assert ds["zero_optimization"] == {"stage": 3, **ZERO_SETTINGS, "overlap_comm": False} and "pipeline" not in ds
    assert ds["train"]["memory_cap_gib"] == 1.0
    # the last step's live-tensor peak is traced: the pipeline's instrument section, or the top-level one
    assert ds_config(configs[0], model="tiny", steps=3)["pipeline"] == {"stages": 4, "schedule": "1f1b",
                                                                         "partition_method": "profiled",
                                                                         "instrument": {"peak_step": 3}}
    assert ds["instrument"] == {}  # 2 steps: the warm-up and one timed, none to trace


def test_zero_allocation_rules():
    numels = [10, 7, 1]  # 18 elements
    assert zero_model_states(numels, dp=1, stage=0).to_dict() == \
        {"param_bytes": 72, "grad_bytes": 72, "optimizer_bytes": 144}
    # ZeRO-1/2: one flat buffer padded to a multiple of 2 * dp = 8 -> 24 elements, 6 per rank
    z1 = zero_model_states(numels, dp=4, stage=1, rank=1)
    assert z1 == zero_model_states(numels, dp=4, stage=2, rank=1)
    assert z1.to_dict() == {"param_bytes": 96, "grad_bytes": 24, "optimizer_bytes": 72}
    # rank 0's partition [0, 6) lies inside the first parameter (10 elements): in fp32 its gradient is a
    # view of that parameter's whole one; in 16-bit the fp32 conversion copies it.  None: the heaviest rank
    assert zero_model_states(numels, dp=4, stage=1, rank=0).grad_bytes == 40
    assert zero_model_states(numels, dp=4, stage=1).grad_bytes == 40
    assert zero_model_states(numels, dp=4, stage=1, rank=0, element_bytes=2).grad_bytes == 24
    with pytest.raises(ValueError, match="rank 4"):
        zero_model_states(numels, dp=4, stage=1, rank=4)
    # ZeRO-3: each parameter padded to a multiple of dp: 3 + 2 + 1 = 6 elements per rank
    assert zero_model_states(numels, dp=4, stage=3).to_dict() == \
        {"param_bytes": 24, "grad_bytes": 48, "optimizer_bytes": 72}
    # parameters at or below the persistence threshold also stay whole on every rank
    assert zero_model_states(numels, dp=4, stage=3, persistence_threshold=7).param_bytes == 24 + 4 * 8
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        zero_model_states(numels, dp=2, stage=4)


def test_zero_rules_against_deepspeed_estimates():
    """DeepSpeed's estimators (16-bit, no offload) differ from the allocation rules by exactly the terms
    costs.zero names: ZeRO-2 counts a 16-bit gradient partition not held at the step; ZeRO-3 adds the
    largest module in 32 bits and leaves out the 16-bit reduced-gradient buffer."""
    from ds_pipe_ext.compat.zero import deepspeed_estimate_bytes

    shape = model_shape(load_model_config("tiny"))
    numels = [n for layer in shape.layer_numels for n in layer]
    n, dp, largest = shape.params, 4, shape.largest_module_params
    assert n % (2 * dp) == 0 and all(k % dp == 0 for k in numels)  # no padding: the estimators have none
    assert largest == max(numels)  # tiny's largest module is one weight matrix (the embedding)
    ours = {stage: zero_model_states(numels, dp=dp, stage=stage, element_bytes=2).total_bytes for stage in (2, 3)}
    assert deepspeed_estimate_bytes(n, largest, dp=dp, stage=2) - ours[2] == 2 * n // dp
    assert deepspeed_estimate_bytes(n, largest, dp=dp, stage=3) - ours[3] == 4 * largest - 2 * n // dp
    assert deepspeed_estimate_bytes(n, largest, dp=dp, stage=1) is None


def test_model_shape_counts_every_parameter():
    cfg = load_model_config("tiny")
    shape = model_shape(cfg)
    assert len(shape.layer_numels) == cfg.layers + 2 and shape.params == 267648  # measured under ZeRO in a launch


def test_micro_batch_search_doubles_then_bisects():
    tried = []

    def fits_up_to(limit):
        def fits(b):
            tried.append(b)
            return b <= limit
        return fits

    assert search_max_micro_batch(fits_up_to(5), start=1) == (5, 6)
    assert tried == [1, 2, 4, 8, 6, 5]
    tried.clear()
    assert search_max_micro_batch(fits_up_to(2), start=8) == (2, 3)
    assert tried == [8, 4, 2, 3]
    assert search_max_micro_batch(fits_up_to(0), start=2) == (None, 1)
    assert search_max_micro_batch(fits_up_to(100), start=16, limit=64) == (64, None)


def _fake_comparison(out: Path, launched: list, fail: str | None = None) -> Comparison:
    cfg = load_model_config("tiny")

    def launcher(c, ds, work):
        launched.append(c.name)
        if c.name == fail:
            raise KeyboardInterrupt  # the user stops the comparison during this launch
        metrics = {"steps": 2, "samples_per_s": 10.0, "step_s_median": 0.1, "status": "ok",
                   "parts": [0, 3, 6] if c.kind == "pipeline" else None}
        return LaunchResult(0, metrics, {"ranks": []})

    return Comparison(out, model="tiny", model_cfg=cfg, shape=model_shape(cfg), steps=2, memory_cap_gib=None,
                      launcher=launcher, cpu_only=True)


def test_resume_runs_only_unfinished_rows(tmp_path):
    from ds_pipe_ext.compare.run import run_comparison

    configs = comparison_configs(2, global_batch=16, micro_batch=4)
    launched: list = []
    with pytest.raises(KeyboardInterrupt):
        run_comparison(configs, _fake_comparison(tmp_path, launched, fail="zero2"), progress=False)
    assert launched == ["pipe-profiled-pp2-dp1-z0", "pipe-uniform-pp2-dp1-z0", "zero1", "zero2"]
    launched.clear()
    rows = run_comparison(configs, _fake_comparison(tmp_path, launched), progress=False)
    assert launched == ["zero2", "zero3"]  # zero3-offload is not launched on CPU
    assert [r["status"] for r in rows] == ["ok"] * 5 + ["n/a"]


def _compare(*args, out):
    # the rows' ranks forked from the command (forked_launch): the rows, their memory and OOM are what is checked
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           FORK_ENV: "1"}
    cmd = [str(Path(sys.executable).with_name("ds-pipe-ext")), "compare", "--model", "compare-mem", "--world", "2",
           "--micro-batch", "2", "--steps", "3", "--memory-cap-gib", "0.295", "--out", str(out), "--json", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


@pytest.mark.multiprocess
def test_compare_launches(tmp_path):
    """compare-mem: a pipeline stage holds half the model's states (16 B/param); a ZeRO-3 rank at dp 2
    holds 12 B per parameter of the whole model, so 0.295 GiB fits the pipelines and not ZeRO."""
    out = tmp_path / "cmp"
    rows, _ = _compare("--configs", "pipe-*", "zero1", "zero2", "zero3", out=out)
    by = {r["config"]: r for r in rows}
    assert list(by) == ["pipe-profiled-pp2-dp1-z0", "pipe-uniform-pp2-dp1-z0", "zero1", "zero2", "zero3"]
    assert {r["global_batch"] for r in rows} == {8}  # 2 x 4 micro-batches, 2 x 2 x dp 2
    assert by["pipe-uniform-pp2-dp1-z0"]["parts"] == [0, 2, 4]
    for name in ("pipe-profiled-pp2-dp1-z0", "pipe-uniform-pp2-dp1-z0"):
        assert by[name]["status"] == "ok" and by[name]["steps"] == 3 and by[name]["samples_per_s"] > 0
    assert by["zero3"]["status"] == "oom" and by["zero3"]["oom"]["after_step"] == 1
    assert by["zero3"]["oom"]["peak_bytes"] > 0.295 * 2**30 and by["zero3"]["samples_per_s"] is None
    # measured model states equal DeepSpeed's allocation rules exactly, on every rank of every row
    for r in rows:
        assert len(r["ranks"]) == 2
        for rank in r["ranks"]:
            for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                assert rank["measured"][kind] == rank["predicted"][kind], (r["config"], rank["rank"], kind)
    # the pipelines' last step is traced: its peak follows the peak rule (costs.peak), exactly by held kind
    for name in ("pipe-profiled-pp2-dp1-z0", "pipe-uniform-pp2-dp1-z0"):
        for rank in by[name]["ranks"]:
            pred = rank["predicted"]
            for kind in ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "gathered_bytes"):
                assert rank["peak_by_kind"][kind] == pred["peak_by_kind"][kind], (name, rank["rank"], kind)
            assert rank["peak_bytes"] == pytest.approx(pred["peak_bytes"], rel=0.05), (name, rank["rank"])
            assert rank["peak_phase"] == pred["peak_phase"]
    z3 = by["zero3"]["measured_bytes"]
    assert z3["grad_bytes"] == 2 * z3["param_bytes"] and z3["optimizer_bytes"] == 3 * z3["param_bytes"]
    assert (out / "compare.png").stat().st_size > 0

    # interrupted: the zero2 row never finished; a re-run launches only it
    finished = {p.name: p.stat().st_mtime for p in (out / "rows").iterdir()}
    (out / "rows" / "zero2.json").unlink()
    rows2, err = _compare("--configs", "pipe-*", "zero1", "zero2", "zero3", out=out)
    assert "4 of 5 rows already finished" in err
    assert [r["config"] for r in rows2] == list(by)
    assert {p.name: p.stat().st_mtime for p in (out / "rows").iterdir() if p.name != "zero2.json"} == \
        {k: v for k, v in finished.items() if k != "zero2.json"}
    assert sorted(p.name for p in (out / "launches").iterdir()) == sorted(by)

    # the largest micro-batch under the cap, both neighbours verified by launches: 2 fits (the row), 4 and 3 not
    (row,), _ = _compare("--configs", "pipe-uniform-*", "--find-max-micro-batch", out=out)
    assert row["max_micro_batch"] == {"fits": 2, "fails": 3, "tried": {"2": True, "3": False, "4": False}}
    assert sorted(p.name for p in (out / "search" / row["config"]).iterdir()) == ["mb3.json", "mb4.json"]


def test_estimate_compare_is_the_memory_side_without_launches(capsys):
    """`estimate --compare`: per-rank memory of every configuration from the analytic model, with
    DeepSpeed's own estimate beside the ZeRO-2/3 rows, and OOM where the device is too small."""
    from ds_pipe_ext.cli import main

    assert main(["estimate", "--compare", "--model", "gpt3-175b", "--world", "64", "--tp", "8", "--micro-batch", "1",
                 "--device", "a100-80gb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["config"]: r for r in out["rows"]}
    assert out["world"] == 64 and {r["global_batch"] for r in rows.values()} == {16}
    # ZeRO-3 divides the parameters over dp 8 as well: a rank holds an eighth of ZeRO-1's (both tp-sharded), and
    # whole the tensors at or below the GPU plan's persistence threshold (10 h elements: norms and biases, 0.3%)
    z1, z3 = rows["zero1-tp8"]["predicted_bytes"], rows["zero3-tp8"]["predicted_bytes"]
    assert z1["param_bytes"] / 8 < z3["param_bytes"] < 1.005 * z1["param_bytes"] / 8
    assert z3["optimizer_bytes"] == pytest.approx(z1["optimizer_bytes"], rel=1e-3)
    # GPT-3 at micro-batch 1 without recompute: only offloading ZeRO-3's states fits in 80 GiB
    assert [name for name, r in rows.items() if r["status"] == "fits"] == ["zero3-offload-tp8"]
    assert rows["zero2-tp8"]["deepspeed_estimate_model_state_bytes"] is None  # DeepSpeed's estimate has no TP
    assert [r["pp"] for r in rows.values() if r["kind"] == "pipeline"] == [8, 8, 4, 4, 4, 4, 2, 2, 2, 2]
