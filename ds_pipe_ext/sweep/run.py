"""The sweep: pipeline depth K x micro-batches M x activation checkpointing, one real launch a cell.

The table a user reads to choose a pipeline depth and a micro-batch count (GPipe's memory
experiment): the global batch stays fixed, so M micro-batches of G / M samples each; K stages
on K ranks; checkpointing off (0) or every layer (1).  Each cell is a ``deepspeed`` launch of
``train.py`` with instrumentation on, through the comparison's launcher, and its row holds what
each stage measured (memory by kind, forward/backward time) beside what the partitioner
predicted (``instrument.report.build_report``), and the step measured beside the step predicted.

A finished cell is written to ``OUT/cells/NAME.json`` last, so a sweep that was interrupted
resumes where it stopped; a launch that runs out of memory is a row with status ``oom``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..compare.configs import CompareConfig, ds_config
from ..compare.run import Launcher, LaunchResult, launch_status


class SweepError(ValueError):
    """A sweep that cannot be set up; the message names the argument to change."""


@dataclass(frozen=True)
class SweepCell:
    stages: int  # K: pipeline stages, one rank each
    micro_batches: int  # M: micro-batches per step (gradient accumulation)
    checkpointing: bool  # activation checkpointing of every layer
    global_batch: int

    @property
    def name(self) -> str:
        return f"pp{self.stages}-m{self.micro_batches}-{'ckpt' if self.checkpointing else 'nockpt'}"

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.micro_batches


def sweep_cells(stages: list[int], micro_batches: list[int], checkpointing: list[bool], *, global_batch: int,
                num_layers: int) -> list[SweepCell]:
    if any(k < 1 for k in stages) or any(m < 1 for m in micro_batches):
        raise SweepError(f"--stages {stages} and --micro-batches {micro_batches} must be positive")
    deep = [k for k in stages if k > num_layers]
    if deep:
        raise SweepError(f"--stages {deep}: the model has {num_layers} pipeline layers; use at most {num_layers} stages")
    bad = [m for m in micro_batches if global_batch % m]
    if bad:
        raise SweepError(f"--micro-batches {bad} do not divide --global-batch {global_batch}: every cell trains the "
                         f"same {global_batch} samples a step, in M micro-batches of {global_batch} / M")
    return [SweepCell(k, m, c, global_batch) for k in stages for c in checkpointing for m in micro_batches]


def cell_ds_config(cell: SweepCell, *, model: str, steps: int, method: str, schedule: str,
                   step_model: str | None, seed: int = 1234) -> dict:
    cfg = CompareConfig(cell.name, "pipeline", cell.stages, 1, 1, 0, cell.micro_batch, cell.micro_batches, method=method)
    ds = ds_config(cfg, model=model, steps=steps, seed=seed)
    ds["pipeline"].update(activation_checkpoint_interval=1 if cell.checkpointing else 0, schedule=schedule,
                          **({"step_model": step_model} if step_model else {}))
    return ds


def cell_row(cell: SweepCell, result: LaunchResult, run_dir: Path, step_model, schedule: str = "1f1b") -> dict:
    """What one launch measured beside what was predicted for it."""
    from ..instrument.report import build_report

    status = launch_status(result)
    m = result.metrics or {}
    row = {"cell": cell.name, "stages": cell.stages, "micro_batches": cell.micro_batches,
           "micro_batch": cell.micro_batch, "checkpointing": cell.checkpointing, "status": status,
           "parts": m.get("parts"), "samples_per_s": m.get("samples_per_s") if status == "ok" else None,
           "step_ms": 1e3 * m["step_s_median"] if status == "ok" and "step_s_median" in m else None,
           "predicted_step_ms": None, "stage_rows": []}
    if status == "failed":
        row["error"] = result.log_tail[-1500:]
    if status != "ok" or not (run_dir / "summary.json").is_file():
        return row
    rep = build_report(run_dir)
    row["predicted_step_ms"] = rep["summary"]["predicted_step_ms"]
    if step_model is not None:  # the fitted step model's prediction (engine costs, optimizer, shared cores)
        from ..instrument.rundir import RunDir
        from ..instrument.step_fit import predict_run, run_stages

        row["predicted_step_ms"] = 1e3 * predict_run(step_model, run_stages(RunDir(run_dir).read(), cell.name),
                                                       schedule=schedule)
    row["predicted_samples_per_s"] = cell.global_batch / (row["predicted_step_ms"] / 1e3)
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "memory_bytes", "forward_ms",
            "backward_ms")
    for st in rep["stages"]:
        pred_bwd = st["pred_backward_recompute_ms"]
        row["stage_rows"].append({
            "stage": st["stage"], "layers": st["layers"],
            **{f"meas_{k}": st[f"meas_{k}"] for k in keys},
            **{f"pred_{k}": st[f"pred_{k}"] for k in keys if k != "backward_ms"}, "pred_backward_ms": pred_bwd})
    heaviest = max(row["stage_rows"], key=lambda s: s["meas_memory_bytes"])
    row["peak_memory_bytes"] = heaviest["meas_memory_bytes"]
    row["predicted_peak_memory_bytes"] = max(s["pred_memory_bytes"] for s in row["stage_rows"])
    return row


class Sweep:
    """One sweep's state on disk: OUT/cells/NAME.json per finished cell, OUT/launches/NAME/ per launch."""

    def __init__(self, out: Path, *, model: str, steps: int, method: str, schedule: str, launcher: Launcher,
                 step_model: str | None = None):
        self.out, self.model, self.steps, self.method, self.schedule = Path(out), model, steps, method, schedule
        self.launcher, self.step_model_path = launcher, step_model
        self.launched: list[str] = []

    def cell_path(self, cell: SweepCell) -> Path:
        return self.out / "cells" / f"{cell.name}.json"

    def row(self, cell: SweepCell) -> dict:
        path = self.cell_path(cell)
        if path.is_file():
            return json.loads(path.read_text())
        ds = cell_ds_config(cell, model=self.model, steps=self.steps, method=self.method, schedule=self.schedule,
                            step_model=self.step_model_path)
        self.launched.append(cell.name)
        work = self.out / "launches" / cell.name
        launch_cfg = CompareConfig(cell.name, "pipeline", cell.stages, 1, 1, 0, cell.micro_batch, cell.micro_batches,
                                   method=self.method)
        result = self.launcher(launch_cfg, ds, work)
        step_model = None
        if self.step_model_path:
            from ..simulate.step_model import StepModel

            step_model = StepModel.load(self.step_model_path)
        row = cell_row(cell, result, work / "run", step_model, self.schedule)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1))  # written last: a cell on disk is a finished cell
        return row


def run_sweep(cells: list[SweepCell], sweep: Sweep, *, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    rows = []
    bar = tqdm(cells, desc="sweep", unit="launch", disable=not progress)
    for cell in bar:
        bar.set_postfix_str(cell.name)
        rows.append(sweep.row(cell))
    return rows
