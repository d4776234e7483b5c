"""Instrumented training on 2 and 4 CPU ranks, and the report in all three formats."""

import json

import pytest

from ds_pipe_ext.cli import main as cli
from ds_pipe_ext.instrument.report import build_report
from ds_pipe_ext.runner import ROOT, launch, write_config


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")
def test_every_stage_records_and_the_report_renders(tmp_path, capsys):
    # 4 stages, gathered every 2 steps and at the end, forwarded to DeepSpeed's CSV monitor, every layer
    # timed (per_layer) (2 stages under TP are instrumented in test_trainer.py)
    ranks = stages = 4
    extra = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}}
    cfg = write_config(tmp_path / "ds.json", pipeline={"stages": stages, "instrument": {"every": 2, "per_layer": True}},
                       **extra)
    run = tmp_path / "run"
    proc, _ = launch(ranks, cfg, "--steps", "3", "--instrument", str(run), out_dir=tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(ranks):
        records = [json.loads(line) for line in (run / f"rank{r}.jsonl").read_text().splitlines()]
        assert [rec["step"] for rec in records] == [1, 2, 3]
        assert all(len(rec["forward_ms"]) == len(rec["backward_ms"]) == 4 for rec in records)
    summary = json.loads((run / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == list(range(stages))
    written = " ".join(str(p) for p in (tmp_path / "csv").rglob("*.csv"))
    assert "ds_pipe_ext" in written and "forward_ms_mean" in written, written

    rep = build_report(run)
    for st in rep["stages"]:
        # model states: measured bytes are exactly what the profile predicted
        for kind in ("param", "grad", "optimizer"):
            assert st[f"meas_{kind}_bytes"] == st[f"pred_{kind}_bytes"], (kind, st)
        # 1F1B in-flight activations: within 5% of the prediction
        assert st["meas_activation_peak_bytes"] == pytest.approx(st["pred_activation_peak_bytes"], rel=0.05)
    # per_layer: every layer the stages built as a module, each once per micro-batch, inside its stage's
    # instruction time
    layers = rep["layers"]
    assert sorted(x["layer"] for x in layers) == list(range(rep["summary"]["parts"][-1]))
    for st in rep["stages"]:
        mine = [x for x in layers if x["stage"] == st["stage"]]
        assert [x["layer"] for x in mine] == list(range(*st["layers"]))
        assert 0 < sum(x["meas_forward_ms"] for x in mine) < st["meas_forward_ms"]
        assert st["meas_outside_layers_forward_ms"] > 0
    assert layers[0]["meas_backward_ms"] is None  # the embedding of token ids: its backward is not timed
    assert all(x["meas_backward_ms"] > 0 for x in layers[1:])
    assert cli(["report", str(run)]) == 0
    table = capsys.readouterr().out
    assert "imbalance fastest/slowest" in table and "topology-aware" in table and "step (1F1B" in table
    assert "per layer (instrument.per_layer)" in table
    assert cli(["report", str(run), "--json", "--png", str(tmp_path / "r.png")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == stages and "step_error_pct" in data["summary"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the run's measured stages through the simulator: the report's stage times, GPipe's order
    assert cli(["simulate", "--model", "tiny", "--stages", str(stages), "--costs", str(run), "--schedule", "gpipe",
                "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["parts"] == data["summary"]["parts"] and sim["micro_batches"] == data["summary"]["micro_batches"]
    busiest = max((r["meas_forward_ms"] + r["meas_backward_ms"]) * sim["micro_batches"] for r in data["stages"])
    assert sim["step_ms"] >= busiest


def test_report_on_missing_run_dir_is_a_clear_error(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2
    assert "predicted.json is missing" in capsys.readouterr().err


def test_instrumentation_is_off_by_default():
    from ds_pipe_ext.pipe.config import PipelineSettings

    cfg = json.loads((ROOT / "ds.json").read_text())
    assert PipelineSettings.from_ds_config(cfg).instrument.enabled is False


def test_refine_scales_each_stage_to_its_measured_time(tmp_path):
    from ds_pipe_ext.costs.types import LayerCost
    from ds_pipe_ext.instrument.refine import RunDirError, refine_costs
    from ds_pipe_ext.instrument.rundir import Predicted, RunDir

    costs = [LayerCost("a", 1.0, 2.0), LayerCost("b", 1.0, 2.0), LayerCost("c", 3.0, 6.0)]
    run = RunDir(tmp_path)
    run.write_predicted(Predicted(method="parts:0,2,3", parts=[0, 2, 3], micro_batches=2, layer_costs=costs))
    assert run.read_predicted() == Predicted("parts:0,2,3", [0, 2, 3], 2, costs)  # typed, round trip
    run.write_summary({"stages": [
        {"stage": 0, "forward_ms_mean": 4000.0, "backward_ms_mean": 4000.0},   # 2x fwd, 1x bwd
        {"stage": 1, "forward_ms_mean": 1500.0, "backward_ms_mean": 12000.0},  # 0.5x fwd, 2x bwd
    ]})
    refined = refine_costs(costs, tmp_path)
    assert [(c.forward_s, c.backward_s) for c in refined] == [(2.0, 2.0), (2.0, 2.0), (1.5, 12.0)]
    with pytest.raises(RunDirError, match="different model"):
        refine_costs(costs[:2], tmp_path)


@pytest.mark.parametrize("schedule, step_s, held", [
    # worked by hand: GPipe runs every forward first, so stage 0's first backward waits for stage 1's
    # four forwards and first backward (t = 22 s), then runs four backwards of 8 s; 1F1B interleaves them
    ("gpipe", 54.0, [4, 4]),
    ("1f1b", 50.0, [2, 1]),
])
def test_report_and_step_fit_use_the_schedule_the_run_ran(two_stage_run, schedule, step_s, held):
    from ds_pipe_ext.instrument.report import build_report
    from ds_pipe_ext.instrument.rundir import RunDir
    from ds_pipe_ext.instrument.step_fit import predict_run, run_stages
    from ds_pipe_ext.simulate.step_model import StepModel

    run_dir = two_stage_run(schedule)
    rep = build_report(run_dir)
    assert rep["summary"]["schedule"] == schedule
    assert rep["summary"]["predicted_step_ms"] == pytest.approx(1e3 * step_s)
    assert [r["pred_activation_peak_bytes"] for r in rep["stages"]] == [200 * k for k in held]
    stages = run_stages(RunDir(run_dir).read(), "fake")
    assert stages.schedule == schedule and [st.inflight for st in stages.stages] == held
    assert predict_run(StepModel(), stages) == pytest.approx(step_s)
    assert RunDir(run_dir).read_predicted().schedule == schedule
