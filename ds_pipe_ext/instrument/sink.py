"""Where the records go: JSONL per rank, a per-stage summary gathered on rank 0, DeepSpeed's monitor.

The files are ``RunDir``'s (``instrument/rundir.py``).
"""

from __future__ import annotations

import json
import statistics

import torch.distributed as dist
from pathlib import Path

from .layer_timing import summarize_layer_times
from .rundir import RunDir


def p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def summarize(records: list[dict], *, skip_warmup: bool = True) -> dict:
    """One rank's steady-state figures: step 1 (allocations, caches) is left out when there are more."""
    steady = records[1:] if skip_warmup and len(records) > 1 else records
    fwd = [t for r in steady for t in r["forward_ms"]]
    bwd = [t for r in steady for t in r["backward_ms"]]
    mean = lambda key: statistics.fmean(r[key] for r in steady)  # noqa: E731
    last = records[-1]
    out = {
        "rank": last["rank"], "stage": last["stage"], "num_stages": last["num_stages"],
        "micro_batches": last["micro_batches"], "steps": len(records), "steps_summarized": len(steady),
        "forward_ms_mean": statistics.fmean(fwd) if fwd else 0.0, "forward_ms_p90": p90(fwd),
        "backward_ms_mean": statistics.fmean(bwd) if bwd else 0.0, "backward_ms_p90": p90(bwd),
        "step_ms_mean": mean("step_ms"), "step_ms_median": statistics.median(r["step_ms"] for r in steady),
    }
    for key in ("send_activation_ms", "recv_activation_ms", "send_grad_ms", "recv_grad_ms", "reduce_grads_ms",
                "reduce_tied_grads_ms", "optimizer_step_ms", "load_micro_batch_ms", "aggregate_loss_ms",
                "all_gather_ms"):
        out[f"{key}_mean"] = mean(key) if key in last else 0.0
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        out[key] = last[key]
    out["activation_peak_bytes"] = max(r["activation_peak_bytes"] for r in steady)
    traced = [r["peak"] for r in records if r.get("peak")]
    if traced:  # the live-tensor peak of the traced step (instrument.peak_step), by kind
        out["step_peak"] = traced[-1]
    for key in ("peak_rss_bytes", "max_allocated_bytes", "max_reserved_bytes"):
        if key in last:
            out[key] = max(r[key] for r in records)
    if "expert_load" in last:  # a Mixture-of-Experts stage: its routers' loads over the summarised steps
        out["expert_load"] = {layer: [sum(r["expert_load"][layer][e] for r in steady) for e in range(len(load))]
                              for layer, load in last["expert_load"].items()}
        out["dropped_token_fraction_mean"] = mean("dropped_token_fraction")
        out["expert_imbalance_mean"] = mean("expert_imbalance") if "expert_imbalance" in last else 1.0
    if "layer_forward_ms" in last:  # instrument.per_layer
        out["layer_times"] = summarize_layer_times(steady)
    if "loss_terms" in last:
        out["loss_terms"] = {name: statistics.fmean(r["loss_terms"][name] for r in steady) for name in last["loss_terms"]}
    return out


class RunSink:
    def __init__(self, run_dir: str | Path, rank: int, *, every: int = 0, monitor=None, group=None):
        self.run_dir = RunDir(run_dir)
        self.rank = rank
        self.every = every
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.group = group
        self.records: list[dict] = []
        self._file = self.run_dir.open_rank_log(rank)

    def emit(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.every and record["step"] % self.every == 0:
            self.gather()

    def gather(self) -> list[dict] | None:
        """Collective: every rank calls it at the same step; rank 0 writes summary.json."""
        mine = summarize(self.records)
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        if self.rank != 0:
            return None
        by_stage: dict[int, list[dict]] = {}
        for s in everyone:
            by_stage.setdefault(s["stage"], []).append(s)
        summary = {"steps": mine["steps"], "ranks": everyone,
                   "stages": [_merge_stage(by_stage[k]) for k in sorted(by_stage)]}
        self.run_dir.write_summary(summary)
        if self.monitor is not None:
            step = mine["steps"]
            events = []
            for st in summary["stages"]:
                for key in ("forward_ms_mean", "backward_ms_mean", "step_ms_mean", "activation_peak_bytes"):
                    events.append((f"ds_pipe_ext/stage{st['stage']}/{key}", float(st[key]), step))
            self.monitor.write_events(events)
        return summary["stages"]

    def close(self) -> None:
        self._file.close()


def _merge_stage(rank_summaries: list[dict]) -> dict:
    """Data-parallel replicas of a stage: mean of their times, max of their memory."""
    merged = dict(rank_summaries[0])
    merged["ranks"] = [s["rank"] for s in rank_summaries]
    for key, value in rank_summaries[0].items():
        if key.endswith("_bytes"):
            merged[key] = max(s[key] for s in rank_summaries)
        elif key.endswith(("_mean", "_p90", "_median")):
            merged[key] = statistics.fmean(s[key] for s in rank_summaries)
    if "expert_load" in merged:  # the stage's data-parallel ranks route their own tokens: their loads add up
        merged["expert_load"] = {layer: [sum(s["expert_load"][layer][e] for s in rank_summaries)
                                         for e in range(len(load))] for layer, load in merged["expert_load"].items()}
    if "layer_times" in merged:  # data-parallel replicas run the same layers: their mean
        merged["layer_times"] = {layer: {k: statistics.fmean(s["layer_times"][layer][k] for s in rank_summaries)
                                         for k in times} for layer, times in merged["layer_times"].items()}
    merged.pop("rank", None)
    return merged
