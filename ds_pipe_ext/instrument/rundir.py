"""`RunDir`: the one reader and writer of an instrumented run's directory.

    RUN_DIR/predicted.json   ``Predicted``: what the partition predicted (rank 0, before training)
    RUN_DIR/rank{R}.jsonl    one step record per line from rank R
    RUN_DIR/summary.json     per-stage summary gathered on rank 0 (every N steps and at the end)

Every file of the format is named here once; a missing or malformed file is a
``RunDirError`` that names it and says how to produce it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..costs.types import LayerCost
from ..layout import Layout


class RunDirError(ValueError):
    """A run directory that cannot be used; the message names the missing or bad file."""


@dataclass(frozen=True)
class Predicted:
    method: str
    parts: list[int]
    micro_batches: int
    layer_costs: list[LayerCost]
    recompute: bool = False
    link_bandwidth: float | None = None  # bytes/s
    refined_from: str | None = None
    overheads: dict | None = None  # measured per-stage extras (instrument.refine.measured_overheads)
    layout: dict | None = None  # the ``layout.Layout`` the run ran (its to_dict); None in older run directories
    layer_recompute: list[str] | None = None  # a recompute mode per layer (given, or "auto"'s choice); None: none
    memory_cap_gib: float | None = None  # the cap the split (and "auto"'s modes) fit each stage's peak under
    # what turns a step into samples/s and MFU: samples_per_step, world_size, model_flops_per_sample,
    # peak_flops (None: unknown) and what that peak is (``mfu``); None in older run directories
    throughput: dict | None = None
    # where the ranks ran: device type, ranks on this host, CPU cores they could use (``host_record``); the
    # layer costs were profiled by one process alone, so ranks sharing cores run slower than their profile
    host: dict | None = None

    @property
    def schedule(self) -> str:
        """The pipeline schedule the run ran: its order and in-flight counts (1F1B where the run
        directory predates the layout record: DeepSpeed's own schedule)."""
        return Layout.from_dict(self.layout).schedule_spec.name if self.layout else "1f1b"

    def to_dict(self) -> dict:
        return {**asdict(self), "layer_costs": [c.to_dict() for c in self.layer_costs]}

    @classmethod
    def from_dict(cls, d: dict) -> "Predicted":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{**{k: v for k, v in d.items() if k in known},
                      "layer_costs": [LayerCost.from_dict(c) for c in d["layer_costs"]]})


def host_record(device_type: str) -> dict:
    """This host as the run saw it: the device type, the ranks the launcher started on it (DeepSpeed's
    ``LOCAL_SIZE``, torch's ``LOCAL_WORLD_SIZE``) and the CPU cores the process may run on."""
    import os

    ranks = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return {"device_type": device_type, "ranks_on_host": int(ranks), "cores": int(cores)}


def shared_cores_note(host: dict | None) -> str:
    """One line where the step's prediction cannot hold because CPU ranks shared cores; "" otherwise."""
    if not host or host.get("device_type") != "cpu" or host["ranks_on_host"] <= host["cores"]:
        return ""
    return (f"the prediction cannot hold here: {host['ranks_on_host']} CPU ranks shared {host['cores']} cores, while "
            f"the layers were profiled by one process alone (run one rank a core, or plan --device cpu, which "
            f"measures ranks sharing the cores)")


@dataclass(frozen=True)
class Run:
    predicted: Predicted
    summary: dict = field(default_factory=dict)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def predicted_path(self) -> Path:
        return self.path / "predicted.json"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    def rank_path(self, rank: int) -> Path:
        return self.path / f"rank{rank}.jsonl"

    def write_predicted(self, predicted: Predicted) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.predicted_path.write_text(json.dumps(predicted.to_dict(), indent=1))

    def write_summary(self, summary: dict) -> None:
        self.summary_path.write_text(json.dumps(summary, indent=1))

    def open_rank_log(self, rank: int):
        self.path.mkdir(parents=True, exist_ok=True)
        return open(self.rank_path(rank), "w")

    def _read_json(self, path: Path) -> dict:
        if not path.is_file():
            raise RunDirError(f"{path} is missing: run train.py with instrumentation on "
                              f'("pipeline": {{"instrument": {{"enabled": true, "run_dir": "{self.path}"}}}}) first')
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RunDirError(f"{path} is not valid JSON ({e})") from None

    def read_predicted(self) -> Predicted:
        raw = self._read_json(self.predicted_path)
        try:
            return Predicted.from_dict(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise RunDirError(f"{self.predicted_path} is malformed ({e}); it must be written by train.py") from None

    def read(self) -> Run:
        """The prediction and the measured summary (both must exist)."""
        return Run(self.read_predicted(), self._read_json(self.summary_path))
