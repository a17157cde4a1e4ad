"""benchmarks/matmul.py on tiny sizes: the step comparison, the cost breakdown, the device stress and
the docs section run and report what they should (speeds themselves are not tested)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import matmul as bench


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_step_breakdown_stress_and_section(tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    run = bench.run_one(32, "fp32", rounds=1, device=cpu, batch=2, seq=8)
    assert set(run["overhead"]) == set(bench.CONFIGS[1:]) and run["false_alarms"] == 0
    assert all(0 < share < 1 for share in run["work_share"].values())
    parts = bench.breakdown(cpu, [(16, 64, 64)], repeats=1)
    assert parts[0]["block32"]["forward_ms"] > 0 and parts[0]["block0"]["weight_grad_ms"] > 0
    found = bench.stress(cpu, [(4, 40, 8), (3, 5, 7)])
    assert found["alarms"] == 0 and all(v is not None for v in found["faults_caught"].values())
    runs = [{"meta": {"device": "cpu", "torch": torch.__version__, "threads": 1}, "results": [run]}]
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n")
    once = bench._with_section(page.read_text(), bench.section(runs, parts))
    assert once.startswith("# Performance") and bench.SECTION[0] in once and "| 32 | fp32 |" in once
    assert bench._with_section(once, bench.section(runs, parts)) == once  # replaced in place
