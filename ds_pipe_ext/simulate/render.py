"""A simulated step for people: a per-rank text timeline and a PNG Gantt chart."""

from __future__ import annotations

from pathlib import Path

from ..figures import pyplot, save
from .events import StepSimulation

GLYPH = {"F": "F", "B": "B", "I": "b", "W": "w"}  # idle is "."
COLOR = {"F": "#9ecae1", "B": "#fd8d3c", "I": "#fdae6b", "W": "#a1d99b"}


def text_timeline(sim: StepSimulation, width: int = 72) -> list[str]:
    """One line per rank: what occupies each of ``width`` equal slices of the step (the work that
    covers most of the slice; ``.`` idle, ``o`` the optimizer step)."""
    p = len(sim.stage_busy_s)
    dt = sim.step_s / width if sim.step_s > 0 else 1.0
    lines = []
    for r in range(p):
        cover = [dict() for _ in range(width)]
        # compute only: DeepSpeed's engine order also times its transfers (SA, RA, SG, RG) on the rank
        slots = [(s.start_s, s.end_s, GLYPH[s.work.kind]) for s in sim.timeline if s.rank == r and s.work.kind in GLYPH]
        last = max((s.end_s for s in sim.timeline if s.rank == r), default=0.0)
        slots.append((last, sim.stage_finish_s[r], "o"))
        for start, end, g in slots:
            for k in range(int(start / dt), min(width, int(end / dt) + 1)):
                lo, hi = max(start, k * dt), min(end, (k + 1) * dt)
                if hi > lo:
                    cover[k][g] = cover[k].get(g, 0.0) + hi - lo
        line = "".join(max(c, key=c.get) if c and max(c.values()) >= dt / 2 else "." for c in cover)
        lines.append(f"rank {r} |{line}|")
    return lines


def write_gantt(sim: StepSimulation, path: str | Path, title: str) -> Path:
    plt = pyplot()

    p = len(sim.stage_busy_s)
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.6))
    ms = 1e3
    for s in sim.timeline:
        if s.work.kind not in COLOR:  # a transfer of DeepSpeed's engine order
            continue
        ax.broken_barh([(s.start_s * ms, (s.end_s - s.start_s) * ms)], (s.rank - 0.4, 0.8),
                       facecolors=COLOR[s.work.kind], edgecolor="black", linewidth=0.4)
        if (s.end_s - s.start_s) > sim.step_s / 80:
            ax.text((s.start_s + s.end_s) / 2 * ms, s.rank, str(s.work.micro_batch), ha="center", va="center",
                    fontsize=7)
    for r in range(p):
        last = max((s.end_s for s in sim.timeline if s.rank == r), default=0.0)
        if sim.stage_finish_s[r] > last:
            ax.broken_barh([(last * ms, (sim.stage_finish_s[r] - last) * ms)], (r - 0.4, 0.8), facecolors="#bdbdbd",
                           edgecolor="black", linewidth=0.4)
    kinds = sorted({s.work.kind for s in sim.timeline} & set(COLOR), key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLOR[k]) for k in kinds] + [plt.Rectangle((0, 0), 1, 1,
              color="#bdbdbd")], labels=[names[k] for k in kinds] + ["optimizer"], fontsize=8, loc="upper right",
              ncol=5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"{title}: step {sim.step_s * ms:.1f} ms, bubble {100 * sim.bubble_fraction:.1f}%", fontsize=10)
    return save(fig, path)
