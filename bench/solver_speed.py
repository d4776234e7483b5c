"""Partitioner speed: our exact solver on 10,000 layers x 128 stages, and against
DeepSpeed's `partition_balanced` on 400 layers x 16 stages.

    python bench/solver_speed.py [--smoke]

Last line: RESULT solve_10000x128_s=X speedup_vs_deepspeed_400x16=Y   (target X < 1)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_pipe_ext.partition import partition_min_max  # noqa: E402
from ds_pipe_ext.runner import SMOKE_HELP  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bottleneck(weights, parts) -> float:
    return max(sum(weights[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    (layers, stages), (ds_layers, ds_stages) = ((1000, 16), (100, 8)) if args.smoke else ((10_000, 128), (400, 16))
    rng = random.Random(0)
    big = [rng.uniform(0.5, 1.5) for _ in range(layers)]
    t_big, parts = timed(lambda: partition_min_max(big, stages), repeats=5)
    print(f"ours, {layers} layers x {stages} stages: {t_big * 1e3:.1f} ms (median of 5), bottleneck "
          f"{bottleneck(big, parts):.4f}")

    from deepspeed.runtime.utils import partition_balanced

    # integer weights: DeepSpeed's DP is exact on them too, so the bottlenecks compare fairly
    small = [rng.randint(1, 1000) for _ in range(ds_layers)]
    t_ours, ours = timed(lambda: partition_min_max([float(w) for w in small], ds_stages), repeats=5)
    t_ds, theirs = timed(lambda: partition_balanced(small, ds_stages), repeats=1)
    print(f"{ds_layers} layers x {ds_stages} stages: ours {t_ours * 1e3:.2f} ms, "
          f"DeepSpeed partition_balanced {t_ds * 1e3:.0f} ms")
    print(f"  bottleneck: ours {bottleneck(small, ours):.0f}, DeepSpeed {bottleneck(small, [int(b) for b in theirs]):.0f}"
          "  (DeepSpeed minimises slowest - fastest, not the slowest stage)")
    print(f"RESULT solve_10000x128_s={t_big:.4f} speedup_vs_deepspeed_400x16={t_ds / t_ours:.0f}")


if __name__ == "__main__":
    main()
