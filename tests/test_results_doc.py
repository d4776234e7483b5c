"""docs/RESULTS.md keeps the current figure of every claim a bench makes: each bench that prints a ``RESULT``
line has a row naming it, every row's history link points at a file that exists, and the page stays short."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "RESULTS.md"


def _benches_with_a_result_line() -> list[str]:
    return sorted(f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py")
                  if re.search(r"""print\(\s*f?["']\\?n?RESULT """, p.read_text()))


def test_every_bench_that_prints_a_result_has_a_row():
    text = RESULTS.read_text()
    benches = _benches_with_a_result_line()
    assert "bench/partition_speedup.py" in benches and len(benches) >= 15  # the scan finds them
    missing = [b for b in benches if b not in text]
    assert not missing, f"benches with a RESULT line but no row in docs/RESULTS.md: {missing}"


def test_rows_link_to_dated_files_that_exist_and_the_page_stays_short():
    text = RESULTS.read_text()
    links = set(re.findall(r"\]\((results/[^)#]+)\)", text))
    assert links and all((RESULTS.parent / link).is_file() for link in links), sorted(links)
    assert all(re.fullmatch(r"results/\d{4}-\d\d-\d\d-[\w.-]+\.md", link) for link in links if link != "results/")
    assert len(text.splitlines()) <= 300


def test_every_bench_command_names_a_bench_and_flags_it_takes():
    """A RESULTS command that cannot run is a figure nobody can reproduce: each ``python bench/X.py ...`` names a
    bench that exists, and every ``--flag`` it passes is one the bench reads (its source names it)."""
    commands = re.findall(r"`(?:OMP_NUM_THREADS=1 )?python (bench/[\w.]+\.py)([^`]*)`", RESULTS.read_text())
    assert len(commands) >= 25
    wrong = []
    for bench, args in commands:
        path = ROOT / bench
        if not path.is_file():
            wrong.append(f"{bench}: no such bench")
            continue
        source = path.read_text()
        wrong += [f"{bench} {flag}: the bench takes no such flag" for flag in re.findall(r"--[\w-]+", args)
                  if f'"{flag}"' not in source]
    assert not wrong, wrong
