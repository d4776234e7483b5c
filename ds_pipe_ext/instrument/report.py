"""Predicted vs measured, per stage: the partition report (`ds-pipe-ext report RUN_DIR`).

In the terms of a graph partitioner's report: stage times (forward, backward,
with/without recompute), imbalance = fastest/slowest (higher is better) and the
topology-aware imbalance (worst ratio between neighbouring stages), boundary
activation volume and transfer time, ideal forward/backward fill latency per
stage, memory and the bottleneck stage, and the 1F1B step time.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..costs.stage import imbalance, stage_costs
from ..partition.report import render_table
from ..simulate.events import Link, Network
from ..simulate.step_model import StepModel
from .refine import load_run
from .rundir import shared_cores_note

MIB = 2**20


def _imbalance(times: list[float]) -> tuple[float, float]:
    """(imbalance of all stages, worst imbalance of neighbouring stages); both fastest/slowest."""
    pairs = [imbalance([a, b]) for a, b in zip(times, times[1:])]
    return imbalance(times), min(pairs, default=1.0)


def _cumulative(xs: list[float], reverse: bool = False) -> list[float]:
    out, acc = [], 0.0
    for x in (reversed(xs) if reverse else xs):
        acc += x
        out.append(acc)
    return out[::-1] if reverse else out


def measured_expert_imbalance(run_dir: str | Path) -> float:
    """A Mixture-of-Experts run's routing imbalance: each micro-batch's busiest expert against the mean,
    averaged over its steps, routed layers and ranks (``instrument.experts``), at least 1: the factor
    dropless routing pads the experts' work by (``EstimateRequest.expert_imbalance``)."""
    imbalance = _expert_imbalance(load_run(run_dir).summary["stages"])
    if imbalance is None:
        raise ValueError(f"{run_dir}: no routed layers were recorded (not an instrumented run of a "
                         f"Mixture-of-Experts model); give the imbalance as a number >= 1 instead")
    return max(1.0, imbalance)


def _expert_imbalance(stages: list[dict]) -> float | None:
    """The stages' mean busiest-expert-over-mean per micro-batch; None without routed layers."""
    routed = [st["expert_imbalance_mean"] for st in stages if "expert_imbalance_mean" in st]
    return sum(routed) / len(routed) if routed else None


def build_report(run_dir: str | Path) -> dict:
    run = load_run(run_dir)
    pred, stages = run.predicted, run.summary["stages"]
    costs, parts, m = pred.layer_costs, pred.parts, pred.micro_batches
    recompute, bandwidth = pred.recompute, pred.link_bandwidth
    p = len(parts) - 1
    if len(stages) != p:
        raise ValueError(f"{run_dir}: summary has {len(stages)} stages, the partition has {p}")
    schedule = pred.schedule  # its order and in-flight counts
    predicted = stage_costs(costs, parts, micro_batches=m, recompute=recompute, schedule=schedule)
    rows = []
    for st, pc in zip(stages, predicted):
        layer = costs[pc.start:pc.stop]
        out_bytes = pc.boundary_out_bytes
        rows.append({
            "stage": pc.stage, "layers": [pc.start, pc.stop],
            "pred_forward_ms": 1e3 * pc.forward_s,
            "pred_backward_ms": 1e3 * sum(c.backward_s for c in layer),
            "pred_recompute_ms": 1e3 * sum(c.recompute_s for c in layer),
            "pred_backward_recompute_ms": 1e3 * pc.backward_s,
            "meas_forward_ms": st["forward_ms_mean"], "meas_forward_p90_ms": st["forward_ms_p90"],
            "meas_backward_ms": st["backward_ms_mean"], "meas_backward_p90_ms": st["backward_ms_p90"],
            "boundary_out_bytes": out_bytes,
            "pred_transfer_ms": 1e3 * out_bytes / bandwidth if bandwidth and out_bytes else 0.0,
            "meas_send_ms": st["send_activation_ms_mean"] / m,
            "pred_param_bytes": pc.param_bytes,
            "pred_grad_bytes": pc.grad_bytes,
            "pred_optimizer_bytes": pc.optimizer_bytes,
            "pred_activation_peak_bytes": int(pc.activation_peak_bytes),
            "meas_param_bytes": st["param_bytes"], "meas_grad_bytes": st["grad_bytes"],
            "meas_optimizer_bytes": st["optimizer_bytes"], "meas_activation_peak_bytes": st["activation_peak_bytes"],
            "meas_optimizer_ms": st["optimizer_step_ms_mean"] + st["reduce_grads_ms_mean"] + st["reduce_tied_grads_ms_mean"],
            "meas_process_peak_bytes": st.get("max_allocated_bytes", st.get("peak_rss_bytes", 0)),
        })
    for r in rows:
        r["pred_time_ms"] = r["pred_forward_ms"] + r["pred_backward_recompute_ms"]
        r["meas_time_ms"] = r["meas_forward_ms"] + r["meas_backward_ms"]
        r["time_error_pct"] = 100.0 * (r["pred_time_ms"] - r["meas_time_ms"]) / r["meas_time_ms"] if r["meas_time_ms"] else 0.0
        r["pred_memory_bytes"] = r["pred_param_bytes"] + r["pred_grad_bytes"] + r["pred_optimizer_bytes"] + r["pred_activation_peak_bytes"]
        r["meas_memory_bytes"] = r["meas_param_bytes"] + r["meas_grad_bytes"] + r["meas_optimizer_bytes"] + r["meas_activation_peak_bytes"]
    pf, pb = [r["pred_forward_ms"] for r in rows], [r["pred_backward_recompute_ms"] for r in rows]
    mf, mb = [r["meas_forward_ms"] for r in rows], [r["meas_backward_ms"] for r in rows]
    for r, a, b, c, d in zip(rows, _cumulative(pf), _cumulative(pb, reverse=True), _cumulative(mf), _cumulative(mb, reverse=True)):
        r.update(pred_fill_forward_ms=a, pred_fill_backward_ms=b, meas_fill_forward_ms=c, meas_fill_backward_ms=d)

    # Step prediction: the stages' layer times through the step model in DeepSpeed's order (the run ran
    # on its engine), plus what a refined run learned about the rest (sends occupy the sender, loading,
    # the update, the loss broadcast); without it, the boundary transfers at the configured bandwidth.
    over = pred.overheads or {}
    zero = [0.0] * p
    fwd_s = [f / 1e3 + a + b for f, a, b in zip(pf, over.get("send_forward_s", zero), over.get("load_s", zero))]
    bwd_s = [x / 1e3 + a for x, a in zip(pb, over.get("send_backward_s", zero))]
    timed = [replace(pc, forward_s=f, backward_s=b) for pc, f, b in zip(predicted, fwd_s, bwd_s)]
    link = Link() if over or not bandwidth else Link(0.0, bandwidth)
    step = StepModel(step_fixed_s=over.get("tail_s", 0.0)).predict(
        timed, m, schedule=schedule, network=Network(link), update_s=over.get("optimizer_s"))
    predicted_step = 1e3 * step.step_s
    measured_step = max(st["step_ms_median"] for st in stages)
    summary = {
        "run_dir": str(run_dir), "method": pred.method, "parts": parts, "micro_batches": m, "schedule": schedule,
        "recompute": recompute, "refined_from": pred.refined_from,
        "imbalance_predicted": dict(zip(("forward", "backward"), zip(_imbalance(pf), _imbalance(pb)))),
        "imbalance_measured": dict(zip(("forward", "backward"), zip(_imbalance(mf), _imbalance(mb)))),
        "predicted_step_ms": predicted_step, "measured_step_ms": measured_step,
        "step_error_pct": 100.0 * (predicted_step - measured_step) / measured_step,
        "worst_stage_error_pct": max(abs(r["time_error_pct"]) for r in rows),
        "bottleneck_stage_time": max(range(p), key=lambda s: rows[s]["meas_time_ms"]),
        "bottleneck_stage_memory": max(range(p), key=lambda s: rows[s]["meas_memory_bytes"]),
        "predicted_bubble_fraction": step.simulation.bubble_fraction,
        "host": pred.host, "shared_cores_note": shared_cores_note(pred.host),
    }
    if pred.throughput:  # samples/s and MFU of both steps, by the planner's FLOP count (``mfu``)
        from ..mfu import Throughput

        rate = Throughput(**pred.throughput)
        for kind, ms in (("predicted", predicted_step), ("measured", measured_step)):
            summary[f"{kind}_samples_per_s"] = rate.samples_per_s(ms / 1e3)
            summary[f"{kind}_mfu"] = rate.mfu(ms / 1e3)
        summary["mfu_peak"] = rate.peak
    if pred.layer_recompute is not None:  # what each stage recomputes, and its measured peak against the cap
        for r, st in zip(rows, stages):
            i, j = r["layers"]
            r["recompute"] = {k: pred.layer_recompute[k] for k in range(i, j) if pred.layer_recompute[k] != "none"}
            traced = (st.get("step_peak") or {}).get("peak_bytes")
            r["meas_peak_bytes"], r["meas_peak_source"] = ((traced, "traced") if traced
                                                           else (r["meas_memory_bytes"], "states + activations"))
    summary["memory_cap_gib"] = pred.memory_cap_gib
    summary["expert_imbalance"] = _expert_imbalance(stages)
    for r, st in zip(rows, stages):  # instrument.per_layer: what the instructions took beyond their timed layers
        times = st.get("layer_times")
        if times:
            r["meas_outside_layers_forward_ms"] = r["meas_forward_ms"] - sum(t["forward_ms"] for t in times.values())
            r["meas_outside_layers_backward_ms"] = r["meas_backward_ms"] - sum(t.get("backward_ms", 0.0)
                                                                               for t in times.values())
    return {"summary": summary, "stages": rows, "routers": router_rows(stages), "layers": layer_rows(costs, stages)}


def layer_rows(costs: list, stages: list[dict]) -> list[dict]:
    """Per layer of a run with ``instrument.per_layer``: its profile against its calls in training (ms a
    micro-batch; backward None where the hooks cannot time it)."""
    rows = []
    for st in stages:
        for layer, t in (st.get("layer_times") or {}).items():
            c = costs[int(layer)]
            rows.append({"stage": st["stage"], "layer": int(layer), "name": c.name,
                         "pred_forward_ms": 1e3 * c.forward_s, "meas_forward_ms": t["forward_ms"],
                         "pred_backward_ms": 1e3 * c.backward_s, "meas_backward_ms": t.get("backward_ms")})
    return rows


def router_rows(stages: list[dict]) -> list[dict]:
    """Per routed layer of a Mixture-of-Experts run: its tokens routed over the summarised steps (all
    data-parallel ranks), the busiest expert's share against the mean (1: balanced), the stage's dropped
    fraction and the loss terms; [] for a dense model."""
    rows = []
    for st in stages:
        for layer, load in sorted(st.get("expert_load", {}).items(), key=lambda kv: int(kv[0])):
            total = sum(load)
            rows.append({"stage": st["stage"], "layer": int(layer), "routed": total,
                         "max_over_mean": max(load) * len(load) / total if total else 0.0,
                         "dropped_fraction": st.get("dropped_token_fraction_mean", 0.0),
                         "loss_terms": st.get("loss_terms", {})})
    return rows


def _layer_list(modes: dict, mode: str) -> str:
    chosen = [str(k) for k, m in modes.items() if m == mode]
    return ",".join(chosen) if chosen else "-"


def render_report_table(rep: dict) -> str:
    s, rows = rep["summary"], rep["stages"]
    lines = [f"run {s['run_dir']}: method={s['method']} parts={s['parts']} micro_batches={s['micro_batches']}"
             + (f" (costs refined from {s['refined_from']})" if s["refined_from"] else "")]
    lines += ["", "time per micro-batch (ms): predicted vs measured (mean / p90)"]
    lines += render_table(
        ["stage", "layers", "fwd pred", "fwd meas", "fwd p90", "bwd pred", "bwd meas", "bwd p90", "err %",
         "fill fwd pred/meas", "fill bwd pred/meas"],
        [[str(r["stage"]), f"{r['layers'][0]}-{r['layers'][1] - 1}", f"{r['pred_forward_ms']:.2f}",
          f"{r['meas_forward_ms']:.2f}", f"{r['meas_forward_p90_ms']:.2f}", f"{r['pred_backward_recompute_ms']:.2f}",
          f"{r['meas_backward_ms']:.2f}", f"{r['meas_backward_p90_ms']:.2f}", f"{r['time_error_pct']:+.1f}",
          f"{r['pred_fill_forward_ms']:.1f}/{r['meas_fill_forward_ms']:.1f}",
          f"{r['pred_fill_backward_ms']:.1f}/{r['meas_fill_backward_ms']:.1f}"] for r in rows])
    lines += ["", "boundaries and memory (MiB): predicted / measured"]
    lines += render_table(
        ["stage", "out MiB", "xfer pred ms", "send meas ms", "params", "grads", "optimizer", "act peak", "optim step ms"],
        [[str(r["stage"]), f"{r['boundary_out_bytes'] / MIB:.2f}", f"{r['pred_transfer_ms']:.2f}", f"{r['meas_send_ms']:.2f}",
          f"{r['pred_param_bytes'] / MIB:.1f}/{r['meas_param_bytes'] / MIB:.1f}",
          f"{r['pred_grad_bytes'] / MIB:.1f}/{r['meas_grad_bytes'] / MIB:.1f}",
          f"{r['pred_optimizer_bytes'] / MIB:.1f}/{r['meas_optimizer_bytes'] / MIB:.1f}",
          f"{r['pred_activation_peak_bytes'] / MIB:.1f}/{r['meas_activation_peak_bytes'] / MIB:.1f}",
          f"{r['meas_optimizer_ms']:.1f}"] for r in rows])
    ip, im = s["imbalance_predicted"], s["imbalance_measured"]
    lines += [
        "",
        f"imbalance fastest/slowest (higher is better): predicted fwd {ip['forward'][0]:.3f} bwd {ip['backward'][0]:.3f}; "
        f"measured fwd {im['forward'][0]:.3f} bwd {im['backward'][0]:.3f}",
        f"topology-aware (worst neighbouring pair): predicted fwd {ip['forward'][1]:.3f} bwd {ip['backward'][1]:.3f}; "
        f"measured fwd {im['forward'][1]:.3f} bwd {im['backward'][1]:.3f}",
        f"bottleneck stage: time {s['bottleneck_stage_time']}, memory {s['bottleneck_stage_memory']}",
        f"step (1F1B, bubble {100 * s['predicted_bubble_fraction']:.0f}%): predicted {s['predicted_step_ms']:.1f} ms, "
        f"measured {s['measured_step_ms']:.1f} ms, error {s['step_error_pct']:+.1f}%",
    ]
    if s.get("shared_cores_note"):
        lines.append("  " + s["shared_cores_note"])
    if "measured_samples_per_s" in s:
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        lines.append(f"throughput: predicted {s['predicted_samples_per_s']:.2f} samples/s (MFU "
                     f"{pct(s['predicted_mfu'])}), measured {s['measured_samples_per_s']:.2f} samples/s (MFU "
                     f"{pct(s['measured_mfu'])}); MFU against {s['mfu_peak']}")
    if any("recompute" in r for r in rows):
        cap = s.get("memory_cap_gib")
        lines += ["", "recompute per stage (a mode per layer" + (f"; the split's memory cap {cap:.4g} GiB = {cap * 1024:.1f} MiB" if cap else "")
                  + "): layers replaying their forward (full) or attention core (selective), and the measured peak"]
        lines += render_table(
            ["stage", "full", "selective", "peak MiB", "measured as"] + (["of cap"] if cap else []),
            [[str(r["stage"]), _layer_list(r["recompute"], "full"), _layer_list(r["recompute"], "selective"),
              f"{r['meas_peak_bytes'] / MIB:.1f}", r["meas_peak_source"]]
             + ([f"{100 * r['meas_peak_bytes'] / (cap * 2**30):.0f}%"] if cap else []) for r in rows])
    layers = rep.get("layers") or []
    if layers:
        lines += ["", "per layer (instrument.per_layer), ms a micro-batch: its profile / its calls in training; a "
                      "stage's instructions beyond its timed layers (the engine around them, the loss, untimed "
                      "backwards) as 'outside'"]
        ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines += render_table(["stage", "layer", "name", "fwd pred", "fwd meas", "bwd pred", "bwd meas"],
                              [[str(x["stage"]), str(x["layer"]), x["name"], ms(x["pred_forward_ms"]),
                                ms(x["meas_forward_ms"]), ms(x["pred_backward_ms"]), ms(x["meas_backward_ms"])]
                               for x in layers]
                              + [[str(r["stage"]), "outside", "", "", ms(r["meas_outside_layers_forward_ms"]), "",
                                  ms(r["meas_outside_layers_backward_ms"])]
                                 for r in rows if "meas_outside_layers_forward_ms" in r])
    routers = rep.get("routers") or []
    if routers:
        terms = routers[-1]["loss_terms"]
        lines += ["", "routers (Mixture-of-Experts): tokens routed per layer over the summarised steps, the busiest "
                      "expert against the mean, tokens dropped beyond capacity"
                  + ("; loss terms: " + ", ".join(f"{k} {v:.4f}" for k, v in terms.items()) if terms else "")]
        lines += render_table(["stage", "layer", "routed", "busiest / mean", "dropped"],
                              [[str(r["stage"]), str(r["layer"]), str(r["routed"]), f"{r['max_over_mean']:.2f}",
                                f"{100 * r['dropped_fraction']:.1f}%"] for r in routers])
        if s.get("expert_imbalance"):
            lines.append(f"per micro-batch, the busiest expert carries {s['expert_imbalance']:.2f} x the mean "
                         f"(dropless routing pads every expert to it): `plan` / `estimate` --expert-imbalance "
                         f"{s['run_dir']}")
    return "\n".join(lines)


def report_json(rep: dict) -> str:
    return json.dumps(rep, indent=1)
