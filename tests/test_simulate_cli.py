"""`ds-pipe-ext simulate`: analytic costs on a datasheet device, so no profiling and no launch."""

import json

import pytest

from ds_pipe_ext.cli import main

ARGS = ["--model", "gpt3-small", "--stages", "3", "--device", "a100", "--dtype", "bf16", "--no-optimizer"]


def _json(capsys, *extra):
    assert main(["simulate", *ARGS, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("schedule, step_ms, bubble, held", [
    # worked by hand (conftest.two_stage_run): GPipe's stage 0 idles from 16 s to 22 s, then runs four
    # backwards of 8 s; ranks busy 48 s and 24 s of 2 x 54 s: a third is bubble
    ("gpipe", 54_000.0, 1 / 3, [4, 4]),
    ("1f1b", 50_000.0, 1 - 72 / 100, [2, 1]),
])
def test_simulate_a_runs_measured_stages_under_a_schedule(capsys, two_stage_run, schedule, step_ms, bubble, held):
    run = two_stage_run()
    assert main(["simulate", "--model", "tiny", "--stages", "2", "--costs", str(run), "--schedule", schedule,
                 "--micro-batches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parts"] == [0, 2, 4] and out["step_ms"] == pytest.approx(step_ms)
    assert out["bubble_fraction"] == pytest.approx(bubble)
    assert out["rank_held_peak_micro_batches"] == held


def test_simulate_splits_the_analytic_costs_and_a_slow_link_is_on_the_critical_path(capsys):
    out = _json(capsys, "--schedule", "gpipe", "--micro-batches", "6", "--latency-ms", "5", "--bandwidth-gbs", "0.25")
    assert out["rank_held_peak_micro_batches"] == [6, 6, 6]  # GPipe holds every micro-batch
    assert len(out["parts"]) == 4 and out["parts"][-1] == 14  # gpt3-small: embedding, 12 blocks, head
    free = _json(capsys, "--schedule", "gpipe", "--micro-batches", "6")
    assert free["step_ms"] < out["step_ms"] - 2 * 5.0


def test_simulate_table_grid_and_gantt(capsys, tmp_path):
    png = tmp_path / "gantt.png"
    assert main(["simulate", *ARGS, "--schedule", "zb-h1", "--micro-batches", "6", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "simulated only" in out and "rank 2 |" in out and "bubble" in out
    assert png.stat().st_size > 10_000
    assert main(["simulate", *ARGS, "--grid", "--micro-batch-sizes", "1,2", "--networks", "0.1:1.25,10:0.125"]) == 0
    out = capsys.readouterr().out
    assert out.count("delay 10 ms, 0.125 GB/s") == 2 and "micro-batch 2" in out  # GPipe and 1F1B tables


def test_simulate_errors_name_the_fix(capsys):
    assert main(["simulate", *ARGS, "--schedule", "pipedream"]) == 2
    assert "unknown pipeline schedule 'pipedream'; known: gpipe, 1f1b" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--schedule", "dualpipev", "--micro-batches", "4"]) == 2
    assert "at least 2 x stages micro-batches" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--costs", "no/such/run"]) == 2
    assert "use analytic, profiled or an instrumented run directory" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--grid", "--networks", "fast"]) == 2
    assert "LATENCY_MS:BANDWIDTH_GBS" in capsys.readouterr().err
