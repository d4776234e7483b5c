"""What CPU ranks of this machine get: gloo's collectives (latency and bus bandwidth per kind), and
their share of the cores.

The ``cpu`` spec's link figure is a memory copy (23 GB/s here), but ranks talk through gloo over
loopback TCP: an all-reduce reaches ~1.5 GB/s of bus bandwidth and gloo's all-gather and
reduce-scatter only ~0.5 GB/s, and a call between a step's kernels costs 1-3 ms before any byte
moves.  The planner charges data-parallel reductions, ZeRO's gathers, TP's per-layer collectives and
pipeline p2p with these.

Ranks that compute at once also share the memory bandwidth and caches: a GEMM or a copy runs slower
in each of two ranks than in one alone.  The ratio of the two speeds scales the cpu spec's peaks.

Measured once per rank count (the ranks started on this machine, one thread each, as the
launches run) and cached next to the cpu spec.  Each kind at two sizes, as a training step meets
it: between two GEMMs (a block's, at bench scale), its cost the median loop of GEMM + call less the
loop of GEMMs alone.  A rank that reaches the call first sleeps in it and is woken when its partner
arrives; on this machine a small all-reduce costs 0.2-0.4 ms back to back after a barrier (the
fastest of 20 calls) and 2.7-3.6 ms between GEMMs, which is what a step pays.  Latency and
bandwidth solve the two-point line ``t = latency + ring_factor * bytes / busbw``
(``device_spec.ring_time``'s factor, so the figures drop straight into its formulas).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cache import measured_once

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "p2p")
SMALL, LARGE = 64 * 2**10, 64 * 2**20  # bytes: latency-bound and bandwidth-bound


def _ring_factor(kind: str, n: int) -> float:
    return {"all-reduce": 2.0 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "p2p": 1.0}[kind]


def _worker(rank: int, world: int, init_file: str, out_path: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    times: dict[str, dict[int, float]] = {k: {} for k in KINDS}
    left, right = torch.randn(256, 512), torch.randn(512, 1536)  # bench-cpu's QKV GEMM at micro-batch 1

    def gemm():
        return left @ right

    for size in (SMALL, LARGE):
        n = size // 4
        full, shard = torch.randn(n), torch.randn(n // world)
        calls = {
            "all-reduce": lambda: dist.all_reduce(full),
            "all-gather": lambda: dist.all_gather_into_tensor(full, shard),
            "reduce-scatter": lambda: dist.reduce_scatter_tensor(shard, full),
            # a neighbour's send and receive, as a pipeline boundary moves one activation
            "p2p": lambda: dist.send(full, 1) if rank == 0 else (dist.recv(full, 0) if rank == 1 else None),
        }
        loops, repeats = (2, 3) if size == LARGE else (40, 5)
        alone = _per_loop(dist, gemm, loops, repeats)
        for kind, call in calls.items():  # _per_loop's first GEMM + call warms the collective up
            times[kind][size] = max(_per_loop(dist, lambda: (gemm(), call()), loops, repeats) - alone, 0.0)
    shared = {}  # per-rank speed with every rank busy, over its speed alone (same kernel, same timing)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x, y = torch.empty(16 * 2**20), torch.empty(16 * 2**20)  # 64 MiB: beyond the caches
    for kind, call, reps in (("matrix", lambda: a @ b, 40), ("memory", lambda: y.copy_(x), 40)):
        call()
        took = {}
        for together in (False, True):
            best = float("inf")
            for _ in range(3):
                dist.barrier()
                if together or rank == 0:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        call()
                    best = min(best, time.perf_counter() - t0)
            took[together] = best
        shared[kind] = min(took[False] / took[True], 1.0)
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "shared": shared}))
    dist.barrier()
    dist.destroy_process_group()


def _per_loop(dist, body, loops: int, repeats: int) -> float:
    """Seconds per call of ``body``: the median over ``repeats`` of the mean over ``loops`` calls, the
    ranks set off together by a barrier (after one call to warm up)."""
    body()
    took = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(loops):
            body()
        took.append((time.perf_counter() - t0) / loops)
    return statistics.median(took)


def fit(times: dict[str, dict], world: int) -> dict[str, list[float]]:
    """{kind: [latency_s, bus_bandwidth]} from {kind: {bytes: seconds}} at two sizes."""
    out = {}
    for kind, by_size in times.items():
        (s1, t1), (s2, t2) = sorted((int(s), t) for s, t in by_size.items())
        f = _ring_factor(kind, world)
        bw = f * (s2 - s1) / max(t2 - t1, 1e-12)
        out[kind] = [max(t1 - f * s1 / bw, 0.0), bw]
    return out


def measure_cpu_ranks(world: int = 2, cache_dir: str | None = ".ds_pipe_ext_cache") -> dict:
    """What ``world`` one-thread ranks of this machine get: {"collectives": {kind: [latency_s, bus
    bandwidth bytes/s]} over gloo, "shared": {"matrix": f, "memory": f}}, where f is a rank's GEMM
    (memory-copy) speed while every rank runs one, over its speed alone: ranks share the cores'
    memory bandwidth and caches, and the single-process micro-benchmarks see neither."""
    path = Path(cache_dir) / f"cpu-ranks-v3-{world}ranks.json" if cache_dir else None
    # several commands or test workers at once: one measures, the others read
    return measured_once(path, lambda: _measure_now(world), parse=_complete, dump=lambda got: got)


def _complete(got: dict) -> dict:
    """A cached measurement with every collective and both shared figures, else ValueError (measured again)."""
    if set(got["collectives"]) != set(KINDS) or set(got["shared"]) != {"matrix", "memory"}:
        raise ValueError("an incomplete measurement")
    return got


def _measure_now(world: int) -> dict:
    """``measure_cpu_ranks``' measurement, run here and now."""
    with tempfile.TemporaryDirectory() as d:
        # a child interpreter spawns the ranks: spawning from here would re-import the caller's
        # __main__, which a script without a main guard cannot survive
        out = Path(d) / "out.json"
        proc = subprocess.run([sys.executable, "-m", __name__, str(world), str(out)], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"measuring gloo collectives between {world} CPU ranks failed "
                               f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        raw = json.loads(out.read_text())
    return {"collectives": fit(raw["times"], world), "shared": raw["shared"]}


if __name__ == "__main__":  # python -m ds_pipe_ext.costs.cpu_comm WORLD OUT.json (measure_cpu_ranks' child)
    import torch.multiprocessing as mp

    world, out_path = int(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as d:
        # forked from this fresh interpreter (it holds no threads or process group): the ranks start without
        # importing torch again
        mp.start_processes(_worker, args=(world, str(Path(d) / "init"), out_path), nprocs=world, join=True,
                           start_method="fork")
