"""A sweep's rows as one aligned table (a line per stage), JSON for tools, and a PNG (seed 001's chart)."""

from __future__ import annotations

import json
from pathlib import Path

from ..figures import pyplot, save
from ..partition.report import render_table

MIB = 2**20


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_rows(rows: list[dict]) -> str:
    """A line per stage of every cell: memory by kind at the step (measured), its total measured / predicted,
    forward and backward per micro-batch measured / predicted; the cell's samples/s and its heaviest rank's
    peak over the step (measured / the peak rule's) on its first line."""
    headers = ["cell", "K", "M", "mb", "ckpt", "status", "samples/s meas/pred", "MFU", "step ms meas/pred",
               "peak MiB meas/pred", "stage", "layers", "params MiB", "grads", "optimizer", "act peak",
               "at step MiB meas/pred", "fwd ms meas/pred", "bwd ms meas/pred"]
    body = []
    for r in rows:
        head = [r["cell"], str(r["stages"]), str(r["micro_batches"]), str(r["micro_batch"]),
                "on" if r["checkpointing"] else "off", r["status"],
                f"{_num(r.get('samples_per_s'), '.2f')} / {_num(r.get('predicted_samples_per_s'), '.2f')}",
                "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
                f"{_num(r.get('step_ms'), '.0f')} / {_num(r.get('predicted_step_ms'), '.0f')}",
                f"{_mib(r.get('peak_memory_bytes'))} / {_mib(r.get('predicted_peak_memory_bytes'))}"]
        stages = r.get("stage_rows") or [None]
        for i, st in enumerate(stages):
            lead = head if i == 0 else [""] * len(head)
            if st is None:
                body.append(lead + ["-"] * 9)
                continue
            body.append(lead + [
                str(st["stage"]), f"{st['layers'][0]}-{st['layers'][1] - 1}",
                _mib(st["meas_param_bytes"]), _mib(st["meas_grad_bytes"]), _mib(st["meas_optimizer_bytes"]),
                _mib(st["meas_activation_peak_bytes"]),
                f"{_mib(st['meas_memory_bytes'])} / {_mib(st['pred_memory_bytes'])}",
                f"{st['meas_forward_ms']:.1f} / {st['pred_forward_ms']:.1f}",
                f"{st['meas_backward_ms']:.1f} / {st['pred_backward_ms']:.1f}"])
    return "\n".join(render_table(headers, body))


def rows_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=1)


def write_png(rows: list[dict], path: str | Path, *, title: str = "") -> Path:
    """Left: the heaviest stage's memory against M, a line per K, solid without checkpointing and
    dashed with it, predicted as dots.  Right: samples/s against M, the same lines."""
    plt = pyplot()
    fig, (ax_mem, ax_tput) = plt.subplots(1, 2, figsize=(12, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, k in enumerate(sorted({r["stages"] for r in rows})):
        for ckpt in (False, True):
            line = sorted((r for r in rows if r["stages"] == k and r["checkpointing"] == ckpt),
                          key=lambda r: r["micro_batches"])
            if not line:
                continue
            style = dict(color=colours[i % len(colours)], linestyle="--" if ckpt else "-", marker="o")
            label = f"K={k}" + (", checkpointing" if ckpt else "")
            ms = [r["micro_batches"] for r in line]
            ax_mem.plot(ms, [(r.get("peak_memory_bytes") or float("nan")) / MIB for r in line], label=label, **style)
            ax_mem.scatter(ms, [(r.get("predicted_peak_memory_bytes") or float("nan")) / MIB for r in line],
                           color=style["color"], marker="x", zorder=3)
            ax_tput.plot(ms, [r.get("samples_per_s") or float("nan") for r in line], label=label, **style)
            for r in line:
                if r["status"] != "ok":
                    ax_tput.annotate(r["status"].upper(), (r["micro_batches"], 0), color="red", ha="center")
    for ax in (ax_mem, ax_tput):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per step (M)")
        ax.legend(fontsize=8)
    ax_mem.set_ylabel("MiB, heaviest stage (x: predicted)")
    ax_mem.set_title("peak memory per device")
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_title("throughput (same global batch)")
    if title:
        fig.suptitle(title)
    return save(fig, path)
