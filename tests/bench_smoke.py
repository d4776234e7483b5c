"""Every bench's ``--smoke`` in one process that has imported torch and DeepSpeed once: each bench forked from it,
its launches' ranks forked from the bench (``DS_PIPE_EXT_FORK_RANKS=1``, ``ds_pipe_ext.forked_launch``), at most
``--jobs`` benches at a time.  tests/test_bench_smoke.py runs it; by hand:

    python tests/bench_smoke.py [--jobs 2] [BENCH.py ...]      (default: every bench; the last line is JSON)

A bench passes when it exits 0 and prints a ``RESULT`` line; its figures are not looked at.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

# bench/ files that get no smoke run of their own, and why
NOT_RUN = {
    "splits_in_one_launch.py": "the ranks of runner.measure_in_one_launch (frozen_layers, host_allocator and "
                               "partition_speedup launch it in their smoke runs)",
    "generalization_worker.py": "the ranks of profiled_generalization (launched by its smoke run)",
    "generalization_shapes.py": "profiled_generalization's table of shapes (imported by it)",
    "gpu_path.py": "its --smoke is --cpu-dry-run, which tests/test_gpu_path.py runs whole: its launches run once",
}
# the longest first, so that the last to finish is a short one (seconds alone on this machine, forked)
LONGEST_FIRST = ["recompute_split.py", "partition_speedup.py", "compare_zero.py", "analytic_vs_profiled.py",
                 "planner_vs_measured.py", "peak_memory.py", "host_allocator.py", "prediction_transfer.py"]


def smoke_benches() -> list[Path]:
    """The benches the smoke run covers: every bench/*.py but NOT_RUN, the longest first."""
    names = sorted(p.name for p in BENCH.glob("*.py") if p.name not in NOT_RUN)
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return [BENCH / n for n in sorted(names, key=lambda n: order.get(n, len(order)))]


def _preimport() -> None:
    """What most benches and their ranks import, once, before anything is forked (no threads start here)."""
    import matplotlib

    matplotlib.use("Agg")
    import deepspeed  # noqa: F401
    import deepspeed.pipe  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import scipy.optimize  # noqa: F401
    import torch  # noqa: F401

    sys.path.insert(0, str(ROOT))
    import ds_pipe_ext.cli  # noqa: F401
    import ds_pipe_ext.pipe.schedules  # noqa: F401
    import ds_pipe_ext.train.build  # noqa: F401
    import ds_pipe_ext.train.trainer  # noqa: F401
    import train  # noqa: F401


def result_line(log: str) -> str | None:
    lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
    return lines[-1] if lines else None


def run_smoke(benches: list[Path], *, jobs: int = 2, timeout_s: float = 300.0, work: Path | None = None) -> list[dict]:
    """Each bench's ``--smoke`` forked from this process, ``jobs`` at a time, each in its own directory under
    ``work`` (its relative outputs land there); per bench: name, ok, returncode, seconds, CPU seconds (its own and
    its ranks', which it reaps), its RESULT line, and the end of its log where it failed."""
    from ds_pipe_ext.forked_launch import FORK_ENV, fork_script

    _preimport()
    work = Path(work or tempfile.mkdtemp(prefix="ds_pipe_ext_smoke_"))
    # the machine's measurements (its cpu spec, its ranks' gloo collectives: ~20 s of both cores) and the layer
    # profiles are cached per directory, keyed by what they measured: each bench's directory shares the checkout's,
    # which the tests beside it fill, as a user's runs from the checkout share it
    shared = ROOT / ".ds_pipe_ext_cache"
    shared.mkdir(exist_ok=True)
    env = {**os.environ, FORK_ENV: "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    queue, running, results = list(benches), {}, []
    while queue or running:
        while queue and len(running) < jobs:
            bench = queue.pop(0)
            cwd = work / bench.stem
            cwd.mkdir(parents=True, exist_ok=True)
            if not (cwd / shared.name).exists():
                (cwd / shared.name).symlink_to(shared, target_is_directory=True)
            log = cwd / "log.txt"
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            # the bench and the ranks it forks: one group, ended together if it overruns
            pid = fork_script(bench, ["--smoke"], env=env, cwd=cwd, stdout=fd, stderr=fd, new_group=True)
            os.close(fd)
            running[pid] = (bench, log, time.monotonic())
        time.sleep(0.05)
        for pid, (bench, log, t0) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            late = not done and time.monotonic() - t0 > timeout_s
            if late:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status, usage = os.wait4(pid, 0)
            elif not done:
                continue
            del running[pid]
            text = log.read_text(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            line = result_line(text)
            ok = code == 0 and line is not None and not late
            results.append({"bench": f"bench/{bench.name}", "ok": ok, "returncode": code, "timed_out": late,
                            "seconds": round(time.monotonic() - t0, 1),
                            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "result": line,
                            "log_tail": None if ok else text[-4000:]})
            print(f"{'ok  ' if ok else 'FAIL'} {bench.name:<28} {results[-1]['seconds']:6.1f} s "
                  f"{results[-1]['cpu_s']:6.1f} CPU-s  "
                  f"{(line or 'no RESULT line')[:90]}", file=sys.stderr, flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("benches", nargs="*", type=Path, help="default: every bench but NOT_RUN")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a bench")
    args = ap.parse_args()
    t0 = time.monotonic()
    results = run_smoke([b.resolve() for b in args.benches] or smoke_benches(), jobs=args.jobs, timeout_s=args.timeout)
    print(f"{sum(r['ok'] for r in results)}/{len(results)} benches ran in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    print(json.dumps(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
