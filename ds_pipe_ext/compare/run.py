"""Running a comparison: one real ``deepspeed`` launch per configuration, a row per launch.

Read top-down: ``run_comparison`` walks the configurations, skipping those whose row is
already in ``OUT/rows/`` (a half-done comparison resumes), launches the rest through a
``Launcher`` (``DeepSpeedLauncher`` for real; tests may pass their own), turns what each
launch measured and what the analytic side predicts into a row, and optionally searches
each configuration's largest micro-batch under the memory cap.

A launch that stops at the cap (``train.memory_cap_gib``: every rank checks its peak after
each step and all stop together) or runs out of memory is a row with status ``oom`` and
what it measured before it stopped; it never stops the comparison.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .configs import CompareConfig, ds_config
from .predict import KINDS, ModelShape, data_parallel_rank, layer_activation_bytes, predicted_ranks

OOM_EXIT = 3  # train.py's exit status when it stopped at train.memory_cap_gib
# glibc keeps freed memory in its heaps, so a process's resident set says more about the
# allocator's history than about the tensors alive; with every block above 128 KiB mmap-ed and
# returned at once, the resident-set peak follows what the rank really held.  The price is a page
# fault per page of every large allocation, every step (bench-cpu, micro-batch 1: 0.317 against
# 0.356 samples/s), so this is for memory runs only (``--compact-malloc``; train.py's
# ``steady_host_allocator`` keeps thresholds the environment set); throughput runs keep train.py's
# fixed thresholds.
COMPACT_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"}
OOM_TEXT = ("out of memory", "outofmemoryerror", "cannot allocate memory")


@dataclass
class LaunchResult:
    returncode: int
    metrics: dict | None  # rank 0's summary (train.py --metrics-out)
    run_summary: dict | None  # the run directory's summary.json (per-rank memory and phase times)
    log_tail: str = ""


Launcher = Callable[[CompareConfig, dict, Path], LaunchResult]


class DeepSpeedLauncher:
    """``deepspeed --num_gpus WORLD train.py --deepspeed_config DS --instrument RUN_DIR``."""

    def __init__(self, *, timeout: int = 900, compact_malloc: bool = False):
        self.timeout, self.env = timeout, (COMPACT_MALLOC_ENV if compact_malloc else None)

    def __call__(self, cfg: CompareConfig, ds: dict, work: Path) -> LaunchResult:
        import subprocess

        from ..runner import launch

        if work.exists():  # an interrupted earlier attempt: nothing of it may be read as this launch's
            shutil.rmtree(work)
        work.mkdir(parents=True)
        config = work / "ds.json"
        config.write_text(json.dumps(ds, indent=1))
        run_dir = work / "run"
        try:
            proc, _ = launch(cfg.layout.world_size, config, "--instrument", str(run_dir), out_dir=work,
                             timeout=self.timeout, env=self.env)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, f"timed out after {self.timeout} s"
        metrics = work / "metrics.json"
        summary = run_dir / "summary.json"
        return LaunchResult(rc, json.loads(metrics.read_text()) if metrics.is_file() else None,
                            json.loads(summary.read_text()) if summary.is_file() else None, tail)


def launch_status(result: LaunchResult) -> str:
    if result.returncode == 0 and result.metrics is not None:
        return "ok"
    if result.metrics is not None and result.metrics.get("status") == "oom":
        return "oom"
    if result.returncode in (OOM_EXIT, -9, 137) or any(t in result.log_tail.lower() for t in OOM_TEXT):
        return "oom"
    return "failed"


def _peak(rank: dict, traced: int | None) -> int | None:
    """The measured peak over the step: the allocator's on GPU, the traced live tensors' on CPU (None:
    not traced)."""
    peak = rank.get("max_allocated_bytes", traced)
    return None if peak is None else int(peak)


def build_row(cfg: CompareConfig, result: LaunchResult, shape: ModelShape, model_cfg, *,
              memory_cap_gib: float | None, cpu_only: bool) -> dict:
    """What one launch measured beside what the analytic side predicts, heaviest rank first."""
    status = launch_status(result)
    m = result.metrics or {}
    row = {"config": cfg.name, **cfg.to_dict(), "status": status, "steps": m.get("steps", 0),
           "samples_per_s": m.get("samples_per_s") if status == "ok" else None,
           "mfu": m.get("mfu") if status == "ok" else None, "mfu_peak": m.get("mfu_peak"),
           "step_ms": 1e3 * m["step_s_median"] if status == "ok" and "step_s_median" in m else None,
           "parts": m.get("parts"), "oom": m.get("oom"), "memory_cap_gib": memory_cap_gib,
           "peak_measure": "allocator peak" if not cpu_only else "tensors held (model states + activations)",
           "predicted_samples_per_s": None}  # the schedule simulator's, once it models ZeRO
    if status == "failed":
        row["error"] = result.log_tail[-1500:]
    ranks = (result.run_summary or {}).get("ranks") or []
    device = "cpu" if cpu_only else "cuda"
    acts = layer_activation_bytes(model_cfg, cfg, device=device)
    try:
        predicted = predicted_ranks(cfg, shape, acts, parts=row["parts"], model_cfg=model_cfg, device=device)
    except ValueError:
        predicted = []  # a pipeline that stopped before it was partitioned: nothing to predict against
    # ZeRO-1/2 can differ between data-parallel ranks (costs.zero, costs.peak): predict each one's own
    by_rank = {(d, p["stage"]): p for d in range(cfg.layout.dp) if predicted
               for p in predicted_ranks(cfg, shape, acts, parts=row["parts"], dp_rank=d, model_cfg=model_cfg,
                                        device=device)}
    row["ranks"] = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        measured = {k: int(r[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
        measured["activation_bytes"] = int(r["activation_peak_bytes"])
        counted = sum(measured.values())
        traced = r.get("step_peak") or {}  # none where the run stopped first, or ran under 3 steps
        row["ranks"].append({"rank": r["rank"], "stage": r["stage"], "measured": measured, "at_step_bytes": counted,
                             "peak_bytes": _peak(r, traced.get("peak_bytes")),
                             "peak_phase": traced.get("phase"), "peak_by_kind": traced.get("by_kind"),
                             "peak_by_op": traced.get("by_op"),
                             "process_peak_bytes": r.get("peak_rss_bytes"),
                             "predicted": by_rank.get((data_parallel_rank(cfg, r["rank"]), r["stage"]))})
    if row["ranks"]:
        heaviest = max(row["ranks"], key=lambda r: r["peak_bytes"] or r["at_step_bytes"])
        row["heaviest_rank"] = heaviest["rank"]
        row["peak_memory_bytes"] = heaviest["peak_bytes"]
        row["peak_phase"] = heaviest["peak_phase"]
        row["peak_by_op"] = heaviest["peak_by_op"]  # what the step made and held at the peak, by the op that made it
        row["at_step_bytes"] = heaviest["at_step_bytes"]
        row["measured_bytes"] = heaviest["measured"]
        row["process_peak_bytes"] = heaviest["process_peak_bytes"]
        pred = heaviest["predicted"] or {}
    else:
        row.update(heaviest_rank=None, peak_memory_bytes=None, measured_bytes=None, process_peak_bytes=None,
                   peak_phase=None, peak_by_op=None, at_step_bytes=None)
        pred = max(predicted, key=lambda p: p.get("peak_bytes", p["total_bytes"])) if predicted else {}
    row["predicted_bytes"] = {k: pred[k] for k in KINDS} if pred else None
    row["predicted_at_step_bytes"] = pred.get("total_bytes")
    row["predicted_peak_memory_bytes"] = pred.get("peak_bytes", pred.get("total_bytes"))
    row["predicted_peak_phase"] = pred.get("peak_phase")
    row["predicted_ranks"] = predicted
    return row


def refusal(cfg: CompareConfig, model_cfg) -> str | None:
    """Why DeepSpeed (or train.py) would refuse this layout for this model, before any launch; None if not."""
    from ..layout import LayoutError

    try:
        cfg.layout.check(model_cfg)
    except LayoutError as e:
        return str(e)
    return None


def not_applicable_row(cfg: CompareConfig, why: str) -> dict:
    return {"config": cfg.name, **cfg.to_dict(), "status": "n/a", "note": why, "samples_per_s": None,
            "step_ms": None, "peak_memory_bytes": None, "predicted_peak_memory_bytes": None,
            "measured_bytes": None, "predicted_bytes": None, "ranks": [], "predicted_samples_per_s": None}


def search_max_micro_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 4096) -> tuple[int | None, int | None]:
    """(largest micro-batch that fits, the next one up, which does not): doubling from ``start``
    until the first failure, then bisection between the last fit and the first failure.
    (None, b): not even b = 1 fits; (b, None): ``limit`` fits."""
    lo: int | None = None
    hi: int | None = None
    if fits(start):
        lo, b = start, 2 * start
        while b <= limit:
            if not fits(b):
                hi = b
                break
            lo, b = b, 2 * b
        if hi is None:
            return lo, None
    else:
        hi, b = start, start // 2
        while b >= 1:
            if fits(b):
                lo = b
                break
            hi, b = b, b // 2
        if lo is None:
            return None, hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


class Comparison:
    """One comparison's state on disk: OUT/rows/NAME.json per finished row, OUT/launches/... per launch."""

    def __init__(self, out: Path, *, model: str, model_cfg, shape: ModelShape, steps: int,
                 memory_cap_gib: float | None, launcher: Launcher, cpu_only: bool, seed: int = 1234):
        self.out, self.model, self.model_cfg, self.shape = Path(out), model, model_cfg, shape
        self.steps, self.cap, self.launcher, self.cpu_only, self.seed = steps, memory_cap_gib, launcher, cpu_only, seed
        self.launched: list[str] = []  # what this invocation launched (resume is tested on it)

    def row_path(self, cfg: CompareConfig) -> Path:
        return self.out / "rows" / f"{cfg.name}.json"

    def _launch(self, cfg: CompareConfig, *, steps: int, tag: str) -> LaunchResult:
        ds = ds_config(cfg, model=self.model, steps=steps, seed=self.seed, memory_cap_gib=self.cap)
        self.launched.append(tag)
        return self.launcher(cfg, ds, self.out / "launches" / tag)

    def row(self, cfg: CompareConfig) -> dict:
        path = self.row_path(cfg)
        if path.is_file():
            return json.loads(path.read_text())
        refused = refusal(cfg, self.model_cfg)
        if refused is not None:  # a row the runtime refuses is shown with its reason, not launched
            row = {**not_applicable_row(cfg, refused), "status": "refused"}
        elif cfg.layout.offload and self.cpu_only:
            row = not_applicable_row(cfg, "offload moves ZeRO-3's states from GPU to CPU memory; on a CPU-only "
                                          "machine they are in CPU memory already")
        else:
            result = self._launch(cfg, steps=self.steps, tag=cfg.name)
            row = build_row(cfg, result, self.shape, self.model_cfg, memory_cap_gib=self.cap, cpu_only=self.cpu_only)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(row, indent=1))  # written last: a row on disk is a finished row
        return row

    def fits(self, cfg: CompareConfig, micro_batch: int, known: dict) -> bool:
        """Does ``cfg`` at this micro-batch train a step under the cap?  Launched once, remembered on disk."""
        if micro_batch in known:
            return known[micro_batch]
        probe = cfg.with_micro_batch(micro_batch)
        path = self.out / "search" / cfg.name / f"mb{micro_batch}.json"
        if path.is_file():
            status = json.loads(path.read_text())["status"]
        else:
            status = launch_status(self._launch(probe, steps=1, tag=f"{cfg.name}-mb{micro_batch}"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"micro_batch": micro_batch, "status": status}))
        known[micro_batch] = status == "ok"
        return known[micro_batch]

    def find_max_micro_batch(self, cfg: CompareConfig, row: dict) -> dict:
        known = {cfg.layout.micro_batch: row["status"] == "ok"} if row["status"] in ("ok", "oom") else {}
        fit, fail = search_max_micro_batch(lambda b: self.fits(cfg, b, known), start=cfg.layout.micro_batch)
        return {"fits": fit, "fails": fail, "tried": {str(k): v for k, v in sorted(known.items())}}


def run_comparison(configs: list[CompareConfig], comparison: Comparison, *, find_max: bool = False,
                   progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    rows = []
    bar = tqdm(configs, desc="comparison", unit="config", disable=not progress)
    for cfg in bar:
        bar.set_postfix_str(cfg.name)
        row = comparison.row(cfg)
        if find_max and row["status"] in ("ok", "oom") and "max_micro_batch" not in row:
            row["max_micro_batch"] = comparison.find_max_micro_batch(cfg, row)
            comparison.row_path(cfg).write_text(json.dumps(row, indent=1))
        rows.append(row)
    return rows


def model_state_error_pct(rows: list[dict]) -> float:
    """Largest |predicted - measured| / measured over every rank and kind of model state (0: exact)."""
    errors = [0.0]
    for row in rows:
        for r in row.get("ranks", []):
            if r["predicted"] is None:
                continue
            for k in ("param_bytes", "grad_bytes", "optimizer_bytes"):
                if r["measured"][k]:
                    errors.append(100 * abs(r["predicted"][k] - r["measured"][k]) / r["measured"][k])
    return max(errors)
