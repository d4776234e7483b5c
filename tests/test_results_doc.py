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
