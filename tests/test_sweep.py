"""`ds-pipe-ext sweep`: pipeline depth x micro-batches x checkpointing as real launches, resumable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_pipe_ext.sweep.run import SweepError, cell_name, sweep_cells

ROOT = Path(__file__).resolve().parents[1]


def _sweep(*args, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(Path(sys.executable).with_name("ds-pipe-ext")), "sweep", "--model", "tiny", "--stages", "1,2",
           "--micro-batches", "2", "--checkpointing", "off,on", "--global-batch", "4", "--steps", "2",
           "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def test_cells_and_their_errors():
    cells = sweep_cells([1, 2], [1, 2, 4], [False, True], global_batch=8, num_layers=6)
    assert len(cells) == 12 and cell_name(cells[0]) == "pp1-m1-nockpt" and cell_name(cells[-1]) == "pp2-m4-ckpt"
    assert {c.micro_batch * c.micro_batches for c in cells} == {8}  # the same samples a step in every cell
    with pytest.raises(SweepError, match="do not divide --global-batch 8"):
        sweep_cells([2], [3], [False], global_batch=8, num_layers=6)
    with pytest.raises(SweepError, match="use at most 6 stages"):
        sweep_cells([8], [2], [False], global_batch=8, num_layers=6)


@pytest.mark.multiprocess
@pytest.mark.usefixtures("forked_ranks")  # the cells' ranks forked from the command: checked are the rows and memory
def test_sweep_runs_the_grid_and_resumes_without_rerunning(tmp_path):
    out = tmp_path / "sweep"
    table, _ = _sweep(out=out)
    rows = json.loads((out / "rows.json").read_text())
    assert [r["cell"] for r in rows] == ["pp1-m2-nockpt", "pp1-m2-ckpt", "pp2-m2-nockpt", "pp2-m2-ckpt"]
    by = {r["cell"]: r for r in rows}
    for r in rows:
        assert r["status"] == "ok" and r["samples_per_s"] > 0 and r["predicted_step_ms"] > 0
        assert len(r["stage_rows"]) == r["stages"] and r["micro_batch"] == 2
        for st in r["stage_rows"]:  # model states: what the partitioner predicted is what the stage held
            for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                assert st[f"meas_{kind}"] == st[f"pred_{kind}"] > 0, (r["cell"], st["stage"], kind)
    # checkpointing keeps only the stage inputs: less activation memory on every stage
    for k in (1, 2):
        off, on = by[f"pp{k}-m2-nockpt"]["stage_rows"], by[f"pp{k}-m2-ckpt"]["stage_rows"]
        assert all(b["meas_activation_peak_bytes"] < a["meas_activation_peak_bytes"] for a, b in zip(off, on))
    assert "at step MiB meas/pred" in table and "peak MiB meas/pred" in table and "pp2-m2-ckpt" in table
    assert (out / "sweep.png").stat().st_size > 0

    # interrupted: one cell never finished; a re-run launches only it
    finished = {p.name: p.stat().st_mtime for p in (out / "cells").iterdir()}
    (out / "cells" / "pp2-m2-nockpt.json").unlink()
    _, err = _sweep(out=out)
    assert "3 of 4 cells already finished" in err
    after = {p.name: p.stat().st_mtime for p in (out / "cells").iterdir()}
    assert set(after) == set(finished)
    assert {k: v for k, v in after.items() if k != "pp2-m2-nockpt.json"} == \
        {k: v for k, v in finished.items() if k != "pp2-m2-nockpt.json"}
    assert after["pp2-m2-nockpt.json"] > finished["pp2-m2-nockpt.json"]


def test_the_shipped_cpu_engine_terms_predict_where_they_fit_the_machine(monkeypatch):
    import os

    from ds_pipe_ext.cli.sweep import shipped_cpu_terms

    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the cores the shipped terms' calibration runs shared
    path, terms = shipped_cpu_terms()
    assert str(path) == "launch_scripts/step_model_cpu.json" and terms.cores == 2 and terms.calibrated_on
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert shipped_cpu_terms() is None
