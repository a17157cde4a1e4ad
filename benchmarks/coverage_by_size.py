"""The share of finite transient compute faults named within one step at the defaults, by the size
of the element's error and by step, from ``sdc campaign`` result rows (the table of docs/coverage.md):

    python -m benchmarks.coverage_by_size docs/coverage.csv benchmarks/results/coverage-compute-*.csv \
        benchmarks/results/coverage-sizes-*.csv

Two kinds of rows. A bit flip's relative error is worked out from its flipped bit (sign: 2, top
exponent bit: 2^128, mantissa bit b: 2^(b - 23.5)); other exponent bits get a row of their own, the
direction of their change not being recorded. A row of ``sdc campaign --sizes`` (its element
multiplied by 1 + e) carries its relative error e in ``rel_error``, exactly. Errors are binned per
decade, each bin centred on a power of ten (1e-4 holds 10^-4.5 .. 10^-3.5), so every scaled fault
sits in the middle of its bin. Prints a markdown table; its last two columns count the scaled
faults alone (they are also in the others).
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

COMPUTE = {"activation", "gradient", "matmul_output"}
EXPONENT = "exponent bit (about 1, or 2^(2^k) - 1)"
BELOW, ABOVE = "< 3e-5", "> 3e4 (top exponent bit: 2^128)"
DECADES = range(-4, 5)  # the bins 1e-4 .. 1e4, each 10^(k - 0.5) .. 10^(k + 0.5)
STEP_RANGES = ("steps 0-19", "steps 20+")


def decade_label(k: int) -> str:
    """The label of the bin centred on 10^k."""
    return {0: "1 (sign flips: 2)", 1: "10"}.get(k, f"1e{k}")


LABELS = [BELOW, *(decade_label(k) for k in DECADES), ABOVE, EXPONENT]


def relative_error(bit_class: str, bit: int) -> float | None:
    """The element's relative error after a flip of ``bit`` (None: an exponent bit, either way)."""
    if bit_class == "sign":
        return 2.0
    if bit_class == "exponent_top":
        return 2.0**128
    if bit_class == "mantissa":
        return 2.0 ** (bit - 23.5)
    return None


def size_bin(size: float) -> str:
    """The label of the bin of a relative error ``size`` (> 0)."""
    k = math.floor(math.log10(size) + 0.5)  # the nearest power of ten on a log scale
    if k < DECADES[0]:
        return BELOW
    return ABOVE if k > DECADES[-1] else decade_label(k)


def row_size(row: dict[str, str]) -> float | None:
    """A row's relative error: its ``rel_error`` (a scaled fault), else its flipped bit's."""
    if row.get("rel_error") not in (None, "", "None"):
        return float(row["rel_error"])
    return relative_error(row["bit_class"], int(row["bit"]))


def named_within_one_step(row: dict[str, str]) -> bool:
    """The defaults named the injected rank at the fault's step or the next."""
    latency, rank = row["defaults_latency"], row["defaults_rank"]
    if row["defaults_by"] in ("", "-") or latency in ("", "None") or rank in ("", "None"):
        return False
    return 0 <= float(latency) <= 1 and float(rank) == float(row["rank"])


def counts(paths: list[str]) -> dict[tuple[str, str, bool], list[int]]:
    """Per (bin label, step range, scaled or not): [finite faults, named within one step], over
    the finite transient compute faults of the rows of ``paths``."""
    out: dict[tuple[str, str, bool], list[int]] = defaultdict(lambda: [0, 0])
    for path in paths:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                finite = row["nonfinite"] != "True" and row["defaults_by"] != "nonfinite_gradient"
                if row["site"] not in COMPUTE or not finite:
                    continue
                size = row_size(row)
                label = EXPONENT if size is None else size_bin(size)
                when = STEP_RANGES[0] if int(row["step"]) < 20 else STEP_RANGES[1]
                cell = out[(label, when, row.get("rel_error") not in (None, "", "None"))]
                cell[0] += 1
                cell[1] += named_within_one_step(row)
    return out


def table(paths: list[str]) -> list[str]:
    """The markdown table's lines for the rows of ``paths``."""
    cells = counts(paths)

    def total(label: str, when: tuple[str, ...] = STEP_RANGES, scaled: tuple[bool, ...] = (False, True)) -> list[int]:
        picked = [cells.get((label, w, s), [0, 0]) for w in when for s in scaled]
        return [sum(c[0] for c in picked), sum(c[1] for c in picked)]

    def share(c: list[int]) -> str:
        return f"{c[1]}/{c[0]}" if c[0] else "-"

    lines = ["| relative error of the element | faults | named within one step | share | steps 0-19 | steps 20+ "
             "| scaled, steps 0-19 | scaled, steps 20+ |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label in LABELS:
        n, k = total(label)
        if n:
            by_step = [share(total(label, (w,))) for w in STEP_RANGES]
            scaled = [share(total(label, (w,), (True,))) for w in STEP_RANGES]
            lines.append(f"| {label} | {n} | {k} | {k / n:.0%} | {' | '.join(by_step)} | {' | '.join(scaled)} |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m benchmarks.coverage_by_size RESULTS.csv [MORE.csv ...]")
    print("\n".join(table(sys.argv[1:])))
