"""The compute-fault campaign of the matmul checksum check (``python -m lightning_sdc.campaign matmul``):
its plan, summary and coverage-page section, and (slow) a tiny real campaign on 3 CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdc_core.faults import campaign as c
from sdc_core.faults import campaign_matmul_report as m
from sdc_core.faults import campaign_report as cr
from sdc_core.faults import campaign_run as run


def _row(phase: str, bit_class: str, changed: bool, by: str = "", rank: int = 1, latency: int | None = 0) -> dict:
    return {"id": f"mm-{phase}-{bit_class}", "site": "matmul", "phase": phase, "bit_class": bit_class, "rank": 1,
            "step": 4, "target": "l2", "bit": 3, "changed": changed, "defaults_by": "", "defaults_rank": None,
            "defaults_latency": None, "matmul_by": by, "matmul_rank": rank if by else None,
            "matmul_latency": latency if by else None}  # fmt: skip


def test_plan_covers_every_phase_and_bit_class_at_unaudited_steps() -> None:
    specs = c.plan_matmul(per_class=2, clean=1, seed=3, steps=12)
    faults = [s for s in specs if s["site"] == "matmul"]
    assert len(faults) == 2 * len(c.MATMUL_PHASES) * len(c.BIT_CLASSES) and specs[-1]["site"] == "matmul_clean"
    assert all(1 <= s["step"] <= 10 for s in faults)  # never step 0, the one the default replay audits
    assert all(s["target"] != "l1" for s in faults if s["phase"] == "input_grad")  # l1's input has no gradient
    assert specs == c.plan_matmul(per_class=2, clean=1, seed=3, steps=12)


def test_summary_and_section_of_the_coverage_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(m, "visible_sizes_table", lambda: ["(sizes)"])  # computed at widths up to 4096: slow
    rows = [
        _row("forward", "sign", True, "matmul_checksum"),
        _row("forward", "sign", True, "matmul_checksum", rank=0),
        _row("forward", "mantissa", True),
        {"id": "mm-clean000", "site": "matmul_clean", "outcome": "clean"},
    ]
    summary = c.matmul_summary(rows)
    sign = next(t for t in summary["table"] if t["bit_class"] == "sign")
    assert (sign["matmul_caught"], sign["matmul_same_step"], sign["matmul_right_rank"], sign["defaults_silent"]) == (
        2, 2, 1, 2)  # fmt: skip
    assert summary["false_alarms"] == 0 and summary["clean_runs"] == 1
    doc = tmp_path / "coverage.md"
    doc.write_text("# Detection coverage\n\nthe main campaign's page\n")
    out = tmp_path / "camp"
    out.mkdir()
    (out / "matmul-results.json").write_text(json.dumps({"summary": {**summary, "steps": 12, "world_size": 3,
                                                                     "command": "cmd"}, "runs": rows}))  # fmt: skip
    m.write_matmul_doc(out, doc)
    first = doc.read_text()
    assert first.startswith("# Detection coverage") and cr.SECTION[0] in first and "forward mantissa bit 3" in first
    m.write_matmul_doc(out, doc)  # rewritten in place, not appended twice
    assert doc.read_text() == first
    kept = cr.with_section("# a new main page\n", cr.section(first))  # what write_doc does with the main campaign
    assert kept.startswith("# a new main page") and cr.section(kept) == cr.section(first)


@pytest.mark.slow
def test_a_tiny_matmul_campaign_catches_what_the_defaults_miss(tmp_path: Path) -> None:
    wanted = {("forward", "sign"), ("weight_grad", "exponent")}
    specs = [s for s in c.plan_matmul(per_class=1, clean=1, seed=0, steps=8)
             if s["site"] == "matmul_clean" or (s["phase"], s["bit_class"]) in wanted]  # fmt: skip
    rows = {r["id"]: r for r in run.run_specs(specs, tmp_path, workers=1, steps=8)}
    for spec in specs[:-1]:
        row = rows[spec["id"]]
        assert row["changed"]
        assert (row["matmul_by"], row["matmul_rank"], row["matmul_latency"]) == ("matmul_checksum", spec["rank"], 0)
        assert row["defaults_by"] == ""
    assert rows[specs[-1]["id"]]["outcome"] == "clean"
