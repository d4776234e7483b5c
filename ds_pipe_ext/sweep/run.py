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
from pathlib import Path

from ..compare.configs import CompareConfig, ds_config
from ..compare.run import Launcher, LaunchResult, launch_status
from ..layout import Layout, LayoutError


class SweepError(ValueError):
    """A sweep that cannot be set up; the message names the argument to change."""


def cell_name(cell: Layout) -> str:
    return f"pp{cell.pp}-m{cell.micro_batches}-{'ckpt' if cell.recompute == 'full' else 'nockpt'}"


def sweep_cells(stages: list[int], micro_batches: list[int], checkpointing: list[bool], *, global_batch: int,
                num_layers: int, schedule: str = "1f1b") -> list[Layout]:
    """K stages on K ranks x M micro-batches of global_batch / M x checkpointing every layer or none."""
    if any(k < 1 for k in stages) or any(m < 1 for m in micro_batches):
        raise SweepError(f"--stages {stages} and --micro-batches {micro_batches} must be positive")
    deep = [k for k in stages if k > num_layers]
    if deep:
        raise SweepError(f"--stages {deep}: the model has {num_layers} pipeline layers; use at most {num_layers} stages")
    bad = [m for m in micro_batches if global_batch % m]
    if bad:
        raise SweepError(f"--micro-batches {bad} do not divide --global-batch {global_batch}: every cell trains the "
                         f"same {global_batch} samples a step, in M micro-batches of {global_batch} / M")
    try:
        return [Layout(pp=k, micro_batch=global_batch // m, micro_batches=m, recompute="full" if c else "none",
                       schedule=schedule) for k in stages for c in checkpointing for m in micro_batches]
    except LayoutError as e:
        raise SweepError(f"--schedule {schedule}: {e}") from None


def cell_ds_config(cell: Layout, *, model: str, steps: int, method: str, step_model: str | None,
                   seed: int = 1234) -> dict:
    ds = ds_config(CompareConfig(cell_name(cell), cell, method), model=model, steps=steps, seed=seed)
    if step_model:
        ds["pipeline"]["step_model"] = step_model
    return ds


def cell_row(cell: Layout, result: LaunchResult, run_dir: Path, step_model, model_cfg=None) -> dict:
    """What one launch measured beside what was predicted for it."""
    from ..instrument.report import build_report

    status = launch_status(result)
    m = result.metrics or {}
    row = {"cell": cell_name(cell), "stages": cell.pp, "micro_batches": cell.micro_batches,
           "micro_batch": cell.micro_batch, "checkpointing": cell.recompute == "full", "status": status,
           "parts": m.get("parts"), "samples_per_s": m.get("samples_per_s") if status == "ok" else None,
           "mfu": m.get("mfu") if status == "ok" else None, "mfu_peak": m.get("mfu_peak"),
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

        row["predicted_step_ms"] = 1e3 * predict_run(step_model, run_stages(RunDir(run_dir).read(), cell_name(cell)))
    row["predicted_samples_per_s"] = cell.global_batch / (row["predicted_step_ms"] / 1e3)
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "memory_bytes", "forward_ms",
            "backward_ms")
    for st in rep["stages"]:
        pred_bwd = st["pred_backward_recompute_ms"]
        row["stage_rows"].append({
            "stage": st["stage"], "layers": st["layers"],
            **{f"meas_{k}": st[f"meas_{k}"] for k in keys},
            **{f"pred_{k}": st[f"pred_{k}"] for k in keys if k != "backward_ms"}, "pred_backward_ms": pred_bwd})
    # memory: the peak over the traced last step (measured) and the peak rule's (predicted), heaviest
    # rank; the at-step sums (states at the step + activations' peak) beside
    row["at_step_bytes"] = max(s["meas_memory_bytes"] for s in row["stage_rows"])
    row["predicted_at_step_bytes"] = max(s["pred_memory_bytes"] for s in row["stage_rows"])
    traced = [r["step_peak"]["peak_bytes"] for r in json.loads((run_dir / "summary.json").read_text())["ranks"]
              if r.get("step_peak")]
    row["peak_memory_bytes"] = max(traced) if traced else row["at_step_bytes"]
    row["predicted_peak_memory_bytes"] = row["predicted_at_step_bytes"]
    if model_cfg is not None and row["parts"]:
        from ..costs.estimate import rank_steps
        from ..device import rank_device
        from ..costs.peak import step_peak

        steps = rank_steps(model_cfg, cell, parts=row["parts"], dtype="fp32", device=rank_device().type)
        row["predicted_peak_memory_bytes"] = max(step_peak(s).total_bytes for s in steps)
    return row


class Sweep:
    """One sweep's state on disk: OUT/cells/NAME.json per finished cell, OUT/launches/NAME/ per launch."""

    def __init__(self, out: Path, *, model: str, steps: int, method: str, launcher: Launcher,
                 step_model: str | None = None, predict_with=None):
        """``step_model``: a file the launches partition by (``pipeline.step_model``) and the rows are
        predicted with; ``predict_with``: a ``StepModel`` that only predicts (the launches unchanged)."""
        self.out, self.model, self.steps, self.method = Path(out), model, steps, method
        self.launcher, self.step_model_path = launcher, step_model
        if step_model and predict_with is None:
            from ..simulate.step_model import StepModel

            predict_with = StepModel.load(step_model)
        self.predict_with = predict_with
        self.launched: list[str] = []

    def cell_path(self, cell: Layout) -> Path:
        return self.out / "cells" / f"{cell_name(cell)}.json"

    def row(self, cell: Layout) -> dict:
        path = self.cell_path(cell)
        if path.is_file():
            return json.loads(path.read_text())
        name = cell_name(cell)
        ds = cell_ds_config(cell, model=self.model, steps=self.steps, method=self.method,
                            step_model=self.step_model_path)
        self.launched.append(name)
        work = self.out / "launches" / name
        result = self.launcher(CompareConfig(name, cell, self.method), ds, work)
        from ..models.registry import load_model

        row = cell_row(cell, result, work / "run", self.predict_with, load_model(self.model))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1))  # written last: a cell on disk is a finished cell
        return row


def run_sweep(cells: list[Layout], sweep: Sweep, *, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    rows = []
    bar = tqdm(cells, desc="sweep", unit="launch", disable=not progress)
    for cell in bar:
        bar.set_postfix_str(cell_name(cell))
        rows.append(sweep.row(cell))
    return rows
