"""PNG of a report: per-stage time bars (predicted vs measured) and memory stacked by kind."""

from __future__ import annotations

from pathlib import Path

from ..figures import pyplot, save

MIB = 2**20


def write_png(rep: dict, path: str | Path) -> Path:
    plt = pyplot()

    rows, s = rep["stages"], rep["summary"]
    x = list(range(len(rows)))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    w = 0.38
    for off, who, color in ((-w / 2, "pred", "#9ecae1"), (w / 2, "meas", "#3182bd")):
        fwd = [r[f"{who}_forward_ms"] for r in rows]
        bwd = [r["pred_backward_recompute_ms" if who == "pred" else "meas_backward_ms"] for r in rows]
        label = "predicted" if who == "pred" else "measured"
        ax_t.bar([i + off for i in x], fwd, w, color=color, edgecolor="black", hatch="//", label=f"{label} fwd")
        ax_t.bar([i + off for i in x], bwd, w, bottom=fwd, color=color, edgecolor="black", label=f"{label} bwd")
    ax_t.set_xticks(x, [f"stage {r['stage']}\n{r['layers'][0]}-{r['layers'][1] - 1}" for r in rows])
    ax_t.set_ylabel("ms per micro-batch")
    ax_t.set_title(f"time: step predicted {s['predicted_step_ms']:.0f} ms, measured {s['measured_step_ms']:.0f} ms")
    ax_t.set_ylim(0, 1.35 * max(ax_t.get_ylim()[1], 1e-9))  # headroom for the legend
    ax_t.legend(fontsize=8, loc="upper left", ncol=2)

    kinds = [("param", "#fdae6b"), ("grad", "#e6550d"), ("optimizer", "#a63603"), ("activation_peak", "#31a354")]
    for off, who in ((-w / 2, "pred"), (w / 2, "meas")):
        bottom = [0.0] * len(rows)
        for kind, color in kinds:
            vals = [r[f"{who}_{kind}_bytes"] / MIB for r in rows]
            ax_m.bar([i + off for i in x], vals, w, bottom=bottom, color=color, edgecolor="black",
                     alpha=0.55 if who == "pred" else 1.0, label=kind if who == "meas" else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax_m.set_xticks(x, [f"stage {r['stage']}\npred | meas" for r in rows])
    ax_m.set_ylabel("MiB")
    ax_m.set_title(f"memory by kind (bottleneck: stage {s['bottleneck_stage_memory']})")
    ax_m.set_ylim(0, 1.25 * max(ax_m.get_ylim()[1], 1e-9))
    ax_m.legend(fontsize=8, loc="upper left", ncol=2)
    ip, im = s["imbalance_predicted"], s["imbalance_measured"]
    fig.suptitle(f"{s['method']} parts={s['parts']}  m={s['micro_batches']}   imbalance (fastest/slowest, higher is "
                 f"better): predicted fwd {ip['forward'][0]:.2f} bwd {ip['backward'][0]:.2f}, "
                 f"measured fwd {im['forward'][0]:.2f} bwd {im['backward'][0]:.2f}", fontsize=9)
    return save(fig, path)
