"""The step-interleaved DDP benchmark runs on 2 gloo ranks with a tiny model and emits well-formed
results (no speed asserted): every configuration timed on every step, the checks' work counted
only where checks run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, torchrun, worker_env


@pytest.mark.slow
def test_step_interleaved_ddp_benchmark_tiny(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    torchrun("benchmarks.ddp_steps", out, None, 2, "--steps", "4", "--skip", "1", "--block", "2", "--width", "32",
             timeout=300, env=worker_env() | {"OMP_NUM_THREADS": "1"}, cwd=ROOT, module=True)  # fmt: skip
    result = json.loads(out.read_text())
    configs = {"none", "nonfinite", "fingerprint", "defaults", "defaults_no_screen"}
    assert result["world_size"] == 2 and set(result["step_seconds"]) == configs
    assert all(row["n"] == 4 and row["median"] > 0 for row in result["step_seconds"].values())
    assert result["overhead"]["none"] == 0 and len(result["overhead_by_block"]["defaults"]) == 2
    assert result["work_share"]["none"] == 0
    assert all(result["work_share"][c] > 0 for c in configs - {"none"})
