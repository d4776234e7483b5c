"""`ds-pipe-ext simulate`: analytic costs on a datasheet device, so no profiling and no launch."""

import json

import pytest

from ds_pipe_ext.cli import main
from ds_pipe_ext.costs.estimate import EstimateRequest, analytic_layer_costs
from ds_pipe_ext.costs.hardware import get_device
from ds_pipe_ext.costs.stage import stage_costs
from ds_pipe_ext.models.config import load_model_config
from ds_pipe_ext.simulate.events import ChunkCosts, Link, Network, simulate
from ds_pipe_ext.simulate.schedules import build_schedule

ARGS = ["--model", "gpt3-small", "--stages", "3", "--device", "a100", "--dtype", "bf16", "--no-optimizer"]


def _json(capsys, *extra):
    assert main(["simulate", *ARGS, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_is_the_event_simulator_on_the_split_analytic_costs(capsys):
    out = _json(capsys, "--schedule", "gpipe", "--micro-batches", "6", "--latency-ms", "5", "--bandwidth-gbs", "0.25")
    layers = analytic_layer_costs(load_model_config("gpt3-small"), EstimateRequest(1, 2048, dtype="bf16"),
                                  get_device("a100"))
    st = stage_costs(layers, out["parts"], micro_batches=6, schedule="gpipe")
    sim = simulate(build_schedule("gpipe", 3, 6),
                   ChunkCosts([s.forward_s for s in st], [s.backward_s for s in st],
                              output_bytes=[s.boundary_out_bytes for s in st]),
                   network=Network(Link(5e-3, 0.25e9)))
    assert out["step_ms"] == pytest.approx(1e3 * sim.step_s)
    assert out["bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert out["rank_held_peak_micro_batches"] == [6, 6, 6]  # GPipe holds every micro-batch
    # the slow link is on the critical path: a free network is faster
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
    assert "unknown schedule 'pipedream'" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--schedule", "dualpipev", "--micro-batches", "4"]) == 2
    assert "at least 2 x stages micro-batches" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--costs", "no/such/run"]) == 2
    assert "use analytic, profiled or an instrumented run directory" in capsys.readouterr().err
    assert main(["simulate", *ARGS, "--grid", "--networks", "fast"]) == 2
    assert "LATENCY_MS:BANDWIDTH_GBS" in capsys.readouterr().err
