"""Every bench runs: each ``bench/*.py`` has a ``--smoke`` mode (its whole code path at the smallest size, its
launches included) and make test runs them all (tests/bench_smoke.py: one process that imports torch and DeepSpeed
once, the benches and their ranks forked from it), so that a refactor that breaks a bench fails here, not when the
next person reruns a RESULTS row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smoke import BENCH, NOT_RUN, smoke_benches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_driver(*benches: Path, jobs: int = 1, timeout: int = 900) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """tests/bench_smoke.py in its own process (the pytest worker is never forked).  One bench at a time: beside
    make test's other workers a second would only oversubscribe the cores (alone here, every bench's smoke took
    142 s and 198 CPU-s one at a time, 137 s and 262 CPU-s two at a time: ranks waiting on each other's
    collectives while the other bench runs)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "bench_smoke.py"), "--jobs", str(jobs),
                           *map(str, benches)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_bench_is_smoked_or_says_why_not():
    names = {p.name for p in BENCH.glob("*.py")}
    smoked = {p.name for p in smoke_benches()}
    assert smoked | set(NOT_RUN) == names and not smoked & set(NOT_RUN)
    assert len(smoked) >= 20
    for name in smoked:  # each takes the flag (argparse or its own argv check), not ignores it
        assert "--smoke" in (BENCH / name).read_text(), f"bench/{name} has no --smoke mode"
    # gpu_path's smoke is the CPU dry run that its own test runs whole
    assert "--cpu-dry-run" in (ROOT / "tests" / "test_gpu_path.py").read_text()
    assert "smoke" in (BENCH / "gpu_path.py").read_text()


@pytest.mark.multiprocess
def test_every_bench_runs_its_smoke_mode():
    proc, results = run_driver()
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n\n".join(f"{r['bench']}: exit {r['returncode']}{', timed out' if r['timed_out'] else ''}"
                                   f", RESULT line {r['result']!r}\n{r['log_tail']}" for r in failed)
    assert proc.returncode == 0
    assert sorted(r["bench"] for r in results) == sorted(f"bench/{p.name}" for p in smoke_benches())


def _broken_copy(tmp_path: Path, name: str, original: str, replacement: str, as_name: str) -> Path:
    text = (BENCH / name).read_text()
    assert text.count(original) == 1, original
    path = tmp_path / as_name
    path.write_text(text.replace(original, replacement))
    return path


@pytest.mark.multiprocess
def test_the_smoke_run_fails_a_broken_bench(tmp_path):
    """The test of the test: a bench whose import breaks, one whose code breaks after its launch, and one that
    stops printing its RESULT line each fail, with their cause in the log; the healthy bench beside them passes."""
    bad_import = _broken_copy(tmp_path, "solver_speed.py", "from ds_pipe_ext.partition import partition_min_max  #",
                              "from ds_pipe_ext.partition import partition_min_max_gone  #", "bad_import.py")
    after_launch = _broken_copy(tmp_path, "instrument_overhead.py", "med = {k: 1e3 * statistics.median(v)",
                                "med = {k: 1e3 * statistics.median_of_them(v)", "bad_after_launch.py")
    no_result = _broken_copy(tmp_path, "solver_speed.py", 'print(f"RESULT solve_', 'print(f"RESULTS solve_',
                             "no_result.py")
    proc, results = run_driver(bad_import, after_launch, no_result, BENCH / "solver_speed.py")
    by_name = {Path(r["bench"]).name: r for r in results}
    assert proc.returncode == 1
    assert by_name["solver_speed.py"]["ok"]
    assert not by_name["bad_import.py"]["ok"] and "partition_min_max_gone" in by_name["bad_import.py"]["log_tail"]
    # its launch ran (the ranks timed their blocks), then the bench's own code failed
    bad = by_name["bad_after_launch.py"]
    assert not bad["ok"] and bad["returncode"] == 1 and "median_of_them" in bad["log_tail"]
    assert not by_name["no_result.py"]["ok"] and by_name["no_result.py"]["returncode"] == 0
    assert by_name["no_result.py"]["result"] is None
