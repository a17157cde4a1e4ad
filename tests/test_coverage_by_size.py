"""docs/coverage.md's table of finite transient faults by the size of their error is what
``benchmarks.coverage_by_size`` computes from the campaigns' rows (the page cannot drift from them)."""

from __future__ import annotations

from benchmarks.coverage_by_size import table
from tests.conftest import ROOT


def test_the_coverage_page_shows_the_table_the_rows_give() -> None:
    rows = [
        str(ROOT / "docs" / "coverage.csv"),
        *map(str, sorted((ROOT / "benchmarks" / "results").glob("coverage-compute-*.csv"))),
        *map(str, sorted((ROOT / "benchmarks" / "results").glob("coverage-sizes-*.csv"))),  # sdc campaign --sizes
    ]
    lines = table(rows)
    assert len(lines) > 3 and any("top exponent bit" in line for line in lines)
    page = (ROOT / "docs" / "coverage.md").read_text()
    assert "\n".join(lines) in page
