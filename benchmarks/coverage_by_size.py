"""The share of finite transient compute faults named within one step at the defaults, by the size
of the element's error and by step, from ``sdc campaign`` result rows (the table of docs/coverage.md):

    python -m benchmarks.coverage_by_size docs/coverage.csv benchmarks/results/coverage-compute-*.csv

A fault's relative error is worked out from its flipped bit (sign: 2, top exponent bit: 2^128,
mantissa bit b: 2^(b - 23.5)); other exponent bits get a row of their own, the direction of their
change not being recorded. Prints a markdown table.
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

COMPUTE = {"activation", "gradient", "matmul_output"}
EXPONENT = "exponent bit (about 1, or 2^(2^k) - 1)"
BINS = [(0.0, 1e-4, "< 1e-4"), (1e-4, 1e-3, "1e-4 .. 1e-3"), (1e-3, 1e-2, "1e-3 .. 1e-2"),
        (1e-2, 1e-1, "1e-2 .. 1e-1"), (1e-1, 1.0, "1e-1 .. 1"), (1.0, 1e4, "1 .. 1e4 (sign flips: 2)"),
        (1e4, math.inf, "> 1e4 (top exponent bit: 2^128)")]  # fmt: skip


def relative_error(bit_class: str, bit: int) -> float | None:
    """The element's relative error after a flip of ``bit`` (None: an exponent bit, either way)."""
    if bit_class == "sign":
        return 2.0
    if bit_class == "exponent_top":
        return 2.0**128
    if bit_class == "mantissa":
        return 2.0 ** (bit - 23.5)
    return None


def named_within_one_step(row: dict[str, str]) -> bool:
    """The defaults named the injected rank at the fault's step or the next."""
    latency, rank = row["defaults_latency"], row["defaults_rank"]
    if row["defaults_by"] in ("", "-") or latency in ("", "None") or rank in ("", "None"):
        return False
    return 0 <= float(latency) <= 1 and float(rank) == float(row["rank"])


def table(paths: list[str]) -> list[str]:
    """The markdown table's lines for the rows of ``paths``."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_step: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for path in paths:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                finite = row["nonfinite"] != "True" and row["defaults_by"] != "nonfinite_gradient"
                if row["site"] not in COMPUTE or not finite:
                    continue
                size = relative_error(row["bit_class"], int(row["bit"]))
                label = EXPONENT if size is None else next(name for lo, hi, name in BINS if lo <= size < hi)
                named = named_within_one_step(row)
                when = "steps 0-19" if int(row["step"]) < 20 else "steps 20+"
                for counts in (totals[label], by_step[(label, when)]):
                    counts[0] += 1
                    counts[1] += named

    def share(counts: list[int]) -> str:
        return f"{counts[1]}/{counts[0]}" if counts[0] else "-"

    lines = ["| relative error of the element | faults | named within one step | share | steps 0-19 | steps 20+ |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label in [name for *_, name in BINS] + [EXPONENT]:
        n, k = totals[label]
        if n:
            early, late = by_step[(label, "steps 0-19")], by_step[(label, "steps 20+")]
            lines.append(f"| {label} | {n} | {k} | {k / n:.0%} | {share(early)} | {share(late)} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m benchmarks.coverage_by_size RESULTS.csv [MORE.csv ...]")
    print("\n".join(table(sys.argv[1:])))
