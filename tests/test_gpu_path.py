"""bench/gpu_path.py's plan of launches, run on CPU ranks with ``tiny-tied`` (``--cpu-dry-run``), so that the GPU check
cannot rot between the sessions that have a GPU: every launch ok, the memory row an ``oom`` that ends at once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipe_ext.forked_launch import FORK_ENV
from ds_pipe_ext.runner import ROOT


def gpu_path(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The bench in its own process, its launches' ranks forked from it (``forked_launch``: what is checked here is
    the plan of launches and what each leaves; DeepSpeed's launcher runs the plan's user-command launches, and
    tests/test_multiprocess.py's)."""
    env = {**os.environ, FORK_ENV: "1"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_path.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


def failed_runs(out: Path) -> str:
    """Each launch that did not end ok, with the end of its output: what a failure in CI needs to be read."""
    runs = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
    return "".join(f"{r['part']} {r['name']}: {r['status']}{r['note']}\n"
                   for r in runs if r["status"] not in ("ok", "oom"))


def test_unknown_parts_and_a_missing_gpu_are_refused_by_name():
    proc = gpu_path("--parts", "train,warp", "--cpu-dry-run")
    assert proc.returncode != 0 and "unknown part(s) ['warp']; choose from train, compare" in proc.stderr
    proc = gpu_path("--parts", "layers")
    assert proc.returncode != 0 and "run it where a GPU is present, or pass --cpu-dry-run" in proc.stderr


@pytest.mark.multiprocess
def test_the_gpu_check_runs_its_whole_plan_on_cpu_ranks(tmp_path):
    proc = gpu_path("--cpu-dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, failed_runs(tmp_path) + proc.stdout[-4000:] + proc.stderr[-3000:]
    result = dict(kv.split("=", 1) for kv in proc.stdout.strip().splitlines()[-1].removeprefix("RESULT ").split())
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [(r["part"], r["name"]) for r in runs] == [
        ("train", "ds.json-1-rank"), ("train", "tiny-tied-bf16-pp1-z0"), ("train", "tiny-tied-bf16-pp1-z1"),
        ("train", "report tiny-tied-bf16-pp1-z1"), ("compare", "zero0"), ("compare", "zero1"), ("compare", "zero2"),
        ("compare", "zero3"), ("hf", "llama-2-layers-pp1"), ("oom", "zero0-mb2"),
        ("speed", "tiny-tied-z1-mb2x2"), ("speed", "llama-tiny-layers4-z1-mb2x2"),
        ("pipe", "tiny-tied-pp1-z0-mb2x2"), ("pipe", "tiny-tied-pp1-z1-mb2x2")]
    assert result["launches_ok"] == f"{len(runs)}/{len(runs)}" and result["device"] == "cpu-dry-run"
    assert result["oom_row"] == "oom" and float(result["oom_exit_s"]) < 60
    assert "every process gone" in proc.stdout and "after the error" in proc.stdout  # timed from the rank's stop
    # a tied model's states (ZeRO-0..3 data parallel; a 1-stage pipeline holding both ends) exact against the rule
    assert result["zero_states_worst_error_pct"] == "0.0" and result["pipeline_states_worst_error_pct"] == "0.0"
    # the heaviest compare row's memory trace, summarized where it ran: what its step held at the peak, by op
    trace = json.loads((tmp_path / "compare-trace.json").read_text())
    assert set(trace) == {"zero0", "zero1", "zero2", "zero3", "heaviest"} and trace[trace["heaviest"]]["by_op"]
    assert float(result["activation_bytes_worst_error_pct"]) < 2  # the layer part ran, on the cpu spec
    # the speed part read the optimizer's profiled step (its share of the median step: on CPU ranks beside other
    # tests' launches the one profiled step can run slower than the median, so no upper bound here)
    assert float(result["optimizer_share_max"]) > 0
    profile = json.loads((tmp_path / "speed-records.json").read_text())["steps"][0]["profile"]
    assert profile["phases"]["optimizer_step"]["calls"] == 2 and profile["top_host_ops"]
    assert float(result["pipeline_vs_dp_min"]) > 0  # the pipe part set its row beside speed's
    # ZeRO-0 (DeepSpeed's BF16_Optimizer in bf16 on a GPU) and ZeRO-1 through the pipeline engine
    assert [r["zero"] for r in json.loads((tmp_path / "pipe-records.json").read_text())["steps"]] == [0, 1]
    # the backends part: each family's attention as the selector says; the chunked loss as the plain one; the
    # fused sinks core as the written-out one
    assert result["attention_backends_agree"] == "4/4" and float(result["chunked_loss_rel_err"]) < 1e-5
    assert float(result["sinks_fused_worst_rel_err"]) < 1e-5
    # the costs part: profiled is the shortest simulated step of the three methods, at every depth
    assert float(result["profiled_vs_uniform_min"]) >= 1.0 and float(result["profiled_vs_parameters_min"]) >= 1.0
    # the today part: every distinct layer of today's families against the analytic model, its routed blocks apart
    assert float(result["today_activation_bytes_worst_error_pct"]) < 3 and "today_moe_layer_worst_error_pct" in result
    today = json.loads((tmp_path / "today-records.json").read_text())["layers"]
    assert {r["model"] for r in today if "pieces_ms" in r} == {"bench-cpu-deepseek", "bench-cpu-gptoss"}
    # each routed layer's profile keeps the busiest expert's load over the mean its input routed with
    assert all(r["profile_imbalance"] >= 1 for r in today if " routed" in r["layer"])
    assert sum(" routed" in r["layer"] for r in today) >= 3  # DeepSeek-V3's block and MTP layer, gpt-oss's
    assert (tmp_path / "train" / "tiny-tied-bf16-pp1-z1" / "run" / "report.png").stat().st_size > 0
    # the report of a stage holding both tied ends: their module's parameters once, as the rank held them
    from ds_pipe_ext.instrument.report import build_report

    (row,) = build_report(tmp_path / "train" / "tiny-tied-bf16-pp1-z1" / "run")["stages"]
    assert row["pred_param_bytes"] == row["meas_param_bytes"]
    assert "throughput: predicted" in proc.stdout and "MFU against the measured cpu spec's GEMM peak" in proc.stdout


def test_a_lent_sessions_call_skips_the_parts_that_would_run_past_its_deadline(tmp_path):
    """launch_scripts/gpu_session.sh: a part expected to end after DEADLINE_S is skipped with a line naming it,
    never started and cut off; the call still ends cleanly, so what ran comes back."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OUT": str(tmp_path), "DEADLINE_S": "0"}
    proc = subprocess.run(["bash", str(ROOT / "launch_scripts" / "gpu_session.sh"), "two"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    skipped = [line.split("skipped ", 1)[1].split(":")[0] for line in proc.stdout.splitlines() if "skipped " in line]
    assert skipped == ["speed", "pipe", "compare"] and "before the 0 s deadline" in proc.stdout
    assert not (tmp_path / "pipe.log").exists()


def test_the_chunked_losss_alignment_check_compares_the_real_rows_with_the_masked_padded_ones():
    """The backends part's check for a GPU with liger-kernel, run here with a stand-in of liger's loss (the mean
    cross-entropy of hidden x weight^T + bias): masking the padded columns with -inf gives the real rows' loss."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("gpu_path", ROOT / "bench" / "gpu_path.py")
    gpu_path_module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_path"] = gpu_path_module  # its dataclasses look their module up
    spec.loader.exec_module(gpu_path_module)

    def fused(weight, hidden, labels, bias=None):
        logits = hidden @ weight.t() + (bias if bias is not None else 0)
        return F.cross_entropy(logits.float(), labels)

    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(16, 8, generator=g), torch.randn(32, 8, generator=g)
    labels = torch.randint(0, 13, (32,), generator=g)
    got = gpu_path_module.liger_alignment(fused, weight, hidden, labels, 13, timer=lambda fn: (fn(), 1e-3)[1])
    assert got["padded, masked loss"] == pytest.approx(got["real rows loss"], rel=1e-6)
    assert got["real rows ms"] == got["padded, masked ms"] == 1.0
