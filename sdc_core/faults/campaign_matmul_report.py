"""The matmul campaign's section of the coverage page (between the markers ``SECTION``): its
table, the fault sizes the check always catches, the long clean runs. Numbers are computed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from sdc_core.checks.matmul_bound import visible_error_sizes
from sdc_core.faults.campaign_report import SECTION, md_table, with_section
from sdc_core.io.safe_files import atomic_write_text


def write_matmul_doc(out: Path, doc: Path, clean_runs: Path | None = None) -> None:
    """Write (or replace) the matmul section of ``doc`` from the campaign folder ``out`` and the
    long clean runs' JSON ``clean_runs`` (``python -m benchmarks.matmul``), atomically."""
    results = json.loads((Path(out) / "matmul-results.json").read_text())
    long_runs = json.loads(Path(clean_runs).read_text()) if clean_runs is not None else None
    text = matmul_markdown(results["summary"], results["runs"], results["summary"].get("command", ""), long_runs)
    atomic_write_text(doc, with_section(doc.read_text() if doc.is_file() else "", text))


def matmul_markdown(summary: dict[str, Any], rows: list[dict[str, Any]], command: str,
                    long_runs: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The coverage page's section on compute faults inside matrix products."""
    head = ["phase", "bit_class", "injections", "changed", "defaults: caught", "defaults: same step",
            "defaults: silent", "with matmul: caught", "with matmul: same step", "with matmul: right rank",
            "with matmul: silent", "with matmul: by"]  # fmt: skip
    changed = [r for r in rows if r["site"] == "matmul" and r["changed"]]
    tot = {name: sum(bool(r[f"{name}_by"]) and r[f"{name}_latency"] == 0 and r[f"{name}_rank"] == r["rank"]
                     for r in changed) for name in ("defaults", "matmul")}  # fmt: skip
    missed = [r for r in changed if not r["matmul_by"]]
    return "\n".join([
        SECTION[0],
        "## Compute faults inside matrix products (`MatmulChecksumCheck`)",
        "",
        f"A bit flipped in one element of a matrix product computed by one rank, inside the layer (the forward "
        f"output, or in the backward the input or the weight gradient as the product's autograd node returns "
        f"them), at a step the replay does not audit at its default cadence (every 100 steps: only step 0 "
        f"here). Each injection trains {summary['steps']} steps on {summary['world_size']} CPU ranks three times: "
        "without checks (did it change the result?), with the default checks (non-finite gradients, replay every "
        "100 steps, fingerprint every step), and with the defaults plus `MatmulChecksumCheck()`.",
        "",
        f"```bash\n{command}\n```",
        "",
        *md_table(head, ([t["phase"], t["bit_class"], t["injections"], t["changed"], t["defaults_caught"],
                          t["defaults_same_step"], t["defaults_silent"], t["matmul_caught"], t["matmul_same_step"],
                          t["matmul_right_rank"], t["matmul_silent"],
                          ", ".join(f"{k} {v}" for k, v in t["matmul_by"].items()) or "-"]
                         for t in summary["table"])),
        "",
        "Columns: `changed` = the fault moved the final weights (more than 1e-6 relative) or crashed the run; "
        "`caught` = a check raised; `same step` = the error named the step of the fault (it is raised before the "
        "update of the next step); `right rank` = it named the injected rank; `silent` = changed but not caught; "
        "`by` = which check raised first. `caught` can exceed `changed`: the check sees a wrong product whether or "
        "not it moved the final weights measurably.",
        "",
        f"Of {len(changed)} injections that changed the result, the default checks caught {tot['defaults']} in "
        f"their step with the right rank, the defaults plus the matmul check {tot['matmul']}. Clean runs with the "
        f"check: {summary['false_alarms']} false alarms in {summary['clean_runs']}.",
        "",
        "What the check sees: a wrong element whose error exceeds the rounding bound of its block "
        "(`sdc_core.checks.matmul`). "
        "Sign flips, exponent flips and flips of the upper mantissa bits of elements of typical size are far "
        "above it in fp32; flips of the low mantissa bits change an element by less than 2^-10 of its value and "
        "stay under it" + (f" ({len(missed)} changed the result here without being caught: "
                           + ", ".join(sorted({f"{r['phase']} {r['bit_class']} bit {r['bit']}" for r in missed}))
                           + ")" if missed else "") + ".",
        "",
        *visible_sizes_table(),
        *_long_runs_table(long_runs),
        SECTION[1],
    ])


def _long_runs_table(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    runs = data["clean_runs"]
    return [
        "",
        f"Long clean runs (`python -m benchmarks.matmul --clean-steps {runs[0]['steps']}`: a transformer of width "
        f"{runs[0]['width']} trained on {data['device']} with the check on every step, each verdict read before the "
        "update): alarms, and the largest residual seen relative to its bound (1 would alarm).",
        "",
        *md_table(["precision", "steps", "alarms", "largest ratio: output", "input gradient", "weight gradient"],
                  ([r["precision"], r["steps"], r["alarms"],
                    *(f"{r['largest_ratio'][k]:.2g}" for k in ("output", "input_gradient", "weight_gradient"))]
                   for r in runs)),
    ]


def visible_sizes_table(widths: tuple[int, ...] = (64, 256, 1024, 4096)) -> list[str]:
    """Markdown: the error of one element always caught per width and precision, with the default
    blocks of 32 and with whole rows (computed here: slow at the larger widths)."""
    rows = []
    for width in widths:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            b = visible_error_sizes(width, dtype, rows=256)
            r = visible_error_sizes(width, dtype, rows=256, block=0)
            cells = [s[f"{k}_vs_max"] for s in (b, r) for k in ("output", "input_gradient", "weight_gradient")]
            rows.append([width, name, *(f"{v:.3g}x" if math.isfinite(v) else "none guaranteed" for v in cells)])
    return [
        "Fault sizes always caught (the stated threshold: a wrong element at least this far from the right value "
        "raises), relative to the largest element of its row (weight gradient: of the whole gradient), for a "
        "`Linear(width, width)` at its default initialisation fed unit-variance rows and output gradients, "
        "median over rows; `rows` = `block=0`:",
        "",
        *md_table(["width", "precision", "output (blocks of 32)", "input gradient", "weight gradient", "output (rows)",
                   "input gradient (rows)", "weight gradient (rows)"], rows),
        "",
        "The bound is a worst case (rounding errors all of one sign), so it grows with the reduction length K as "
        "K^1.5 relative to a typical element and, per checksum, with the block: smaller blocks see smaller errors "
        "and cost thin extra products (docs/performance.md). In bf16 and fp16 the rounding of the output itself "
        "dominates. Errors below these sizes may still be caught (the clean residuals sit far below the bound: "
        "the campaign's clean runs and the long clean runs below), but only these are guaranteed.",
    ]

