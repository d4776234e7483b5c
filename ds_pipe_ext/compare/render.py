"""A comparison's rows as an aligned table, JSON for tools, and a PNG (memory by kind, samples/s)."""

from __future__ import annotations

import json
from pathlib import Path

from ..figures import pyplot, save
from ..partition.report import render_table

MIB = 2**20
KIND_LABELS = {"param_bytes": "params", "grad_bytes": "grads", "optimizer_bytes": "optimizer",
               "activation_bytes": "activations"}


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _pair(row: dict, kind: str) -> str:
    meas, pred = row.get("measured_bytes"), row.get("predicted_bytes")
    return f"{_mib(meas and meas[kind])} / {_mib(pred and pred[kind])}"


def layout(row: dict) -> str:
    return f"{row['pp']}x{row['tp']}x{row['dp']}" + (f" ep{row['ep']}" if row.get("ep", 1) > 1 else "")


def render_rows(rows: list[dict]) -> str:
    headers = ["config", "pp x tp x dp", "ZeRO", "mb x acc", "global", "status", "samples/s", "MFU", "step ms",
               "rank", "params MiB meas/pred", "grads", "optimizer", "activations", "at step MiB meas/pred",
               "peak MiB meas/pred", "peak in meas/pred", "RSS MiB", "max mb fit/fail"]
    body = []
    for r in rows:
        mx = r.get("max_micro_batch")
        body.append([
            r["config"], layout(r), str(r["zero"]), f"{r['micro_batch']} x {r['grad_accum']}", str(r["global_batch"]),
            r["status"] + (f" (step {r['oom']['after_step']})" if r.get("oom") else ""),
            "-" if r.get("samples_per_s") is None else f"{r['samples_per_s']:.1f}",
            "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            "-" if r.get("step_ms") is None else f"{r['step_ms']:.0f}",
            "-" if r.get("heaviest_rank") is None else str(r["heaviest_rank"]),
            _pair(r, "param_bytes"), _pair(r, "grad_bytes"), _pair(r, "optimizer_bytes"), _pair(r, "activation_bytes"),
            f"{_mib(r.get('at_step_bytes'))} / {_mib(r.get('predicted_at_step_bytes'))}",
            f"{_mib(r.get('peak_memory_bytes'))} / {_mib(r.get('predicted_peak_memory_bytes'))}",
            f"{r.get('peak_phase') or '-'} / {r.get('predicted_peak_phase') or '-'}",
            _mib(r.get("process_peak_bytes")),
            "-" if not mx else f"{mx['fits'] if mx['fits'] is not None else 'none'} / {mx['fails'] or '-'}",
        ])
    return "\n".join(render_table(headers, body))


def notes(rows: list[dict], *, world: int, cores: int | None, cpu_only: bool,
          compact_malloc: bool = False) -> list[str]:
    out = []
    batches = sorted({r["global_batch"] for r in rows if r["status"] not in ("n/a", "refused")})
    out.append(f"every row trains global batch {batches[0]}" if len(batches) == 1
               else f"global batches differ: {batches}")
    out.append("memory: the heaviest rank (largest peak); params/grads/optimizer are the tensors it holds at the "
               "optimizer step, measured / predicted from DeepSpeed's allocation rules; activations are the saved "
               "tensors' peak, measured / analytic (x the stage's 1F1B in-flight count)")
    out.append("at step MiB: the four kinds' sum (the states at the step + the activations' peak).  peak MiB: the "
               "most bytes alive at once over the last step, measured / predicted (costs.peak: every tensor, "
               "including the gradients held during the backward, ZeRO's reduction buckets and gathered parameters, "
               "the pipeline's buffers, the loss's and Adam's temporaries), with the moment it falls in")
    peaks = sorted({r["mfu_peak"] for r in rows if r.get("mfu_peak")})
    if peaks:
        out.append("MFU: model FLOPs a second (the planner's count: matrix and attention FLOPs of forward and "
                   f"backward, no recompute) per device over {', '.join(peaks)}")
    if cpu_only:
        out.append("peak MiB on CPU: the live tensors' peak from torch.profiler's allocation events (the figure a "
                   "GPU's max_memory_allocated gives); the memory cap applies to the at-step sum after every step "
                   "and a rank above it stops the run cleanly: that is an OOM row.  RSS MiB is the process's "
                   "resident-set peak since the model was built: ~0.5 GiB of Python, torch and DeepSpeed plus "
                   "allocator slack, shown but not capped, because at these sizes it varies more than the layouts "
                   "differ")
        out.append("malloc: compact (glibc returns blocks above 128 KiB at once, so RSS follows the tensors held, "
                   "and every large allocation pays its page faults: samples/s are slower than in training)"
                   if compact_malloc else
                   "malloc: glibc's defaults, as in training (RSS includes what the allocator keeps after a free; "
                   "--compact-malloc makes it follow the tensors, at the price of the step time)")
        if cores is not None and world > cores:
            out.append(f"{world} ranks time-slice {cores} cores: other ranks fill a pipeline's bubbles and ZeRO's "
                       f"collectives wait on descheduled ranks, so read these samples/s as memory runs; compare "
                       f"throughput at --world {cores}")
    for r in rows:
        if r["status"] == "n/a":
            out.append(f"{r['config']}: {r['note']}")
        if r["status"] == "refused":
            out.append(f"{r['config']}: refused before launching: {r['note']}")
        if r["status"] == "failed":
            out.append(f"{r['config']}: the launch failed (see its launches/ directory): "
                       f"{r.get('error', '').strip().splitlines()[-1:] or ''}")
    return out


def rows_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=1)


def write_png(rows: list[dict], path: str | Path, *, title: str = "") -> Path:
    plt = pyplot()

    shown = [r for r in rows if r["status"] not in ("n/a", "refused")]
    names = [r["config"] for r in shown]
    fig, (ax_mem, ax_tput) = plt.subplots(1, 2, figsize=(max(10, 1.1 * len(shown) + 6), 5))
    bottom = [0.0] * len(shown)
    for kind, label in KIND_LABELS.items():
        vals = [((r.get("measured_bytes") or {}).get(kind) or 0) / MIB for r in shown]
        ax_mem.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    peaks = [(r.get("predicted_peak_memory_bytes") or 0) / MIB for r in shown]
    ax_mem.scatter(names, [(r.get("peak_memory_bytes") or 0) / MIB for r in shown], marker="o", s=30,
                   color="tab:red", label="peak measured", zorder=3)
    ax_mem.scatter(names, peaks, marker="_", s=400, color="black", label="peak predicted", zorder=3)
    cap = next((r.get("memory_cap_gib") for r in shown if r.get("memory_cap_gib")), None)
    if cap:
        ax_mem.axhline(cap * 1024, color="red", linestyle="--", label=f"cap {cap} GiB")
    for i, r in enumerate(shown):
        if r["status"] != "ok":
            ax_mem.annotate(r["status"].upper(), (i, max(bottom[i], peaks[i])), ha="center", va="bottom", color="red")
    ax_mem.set_ylabel("MiB, heaviest rank")
    ax_mem.set_title("memory per rank: at the step by kind, and the peak")
    ax_mem.legend(fontsize=8)
    ax_tput.bar(names, [r.get("samples_per_s") or 0 for r in shown], color="tab:green")
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_title("throughput (same global batch)")
    for ax in (ax_mem, ax_tput):
        ax.tick_params(axis="x", labelrotation=60, labelsize=8)
    if title:
        fig.suptitle(title)
    return save(fig, path)
