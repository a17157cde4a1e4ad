"""The benchmark entry point runs on the smallest size and emits well-formed results (no speed asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, worker_env


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_benchmark_entry_point_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== kernels" in proc.stdout and "== transformer step" in proc.stdout
    result = json.loads(out.read_text())
    methods = {r["method"] for r in result["kernels"]}
    assert {
        "sum",
        "fingerprint",
        "nonfinite_ddp",
        "nonfinite_tensor",
        "sha1_host",
        "isfinite_loop",
        "copy",
    } <= methods
    for row in result["kernels"]:
        assert row["gb_per_s"] > 0 and math.isfinite(row["vs_sum"]) and row["seconds"]["n"] == 2
    step = result["step"]
    assert set(step["seconds"]) >= {"none", "nonfinite", "fingerprint", "all_three", "detect_anomaly", "replay_audit"}
    assert all(s["median"] > 0 for s in step["seconds"].values())
    assert set(step["work_vs_step"]) == {"nonfinite", "fingerprint", "replay_amortised", "all_three"}


def test_gpu_step_benchmark_quick_on_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's CPU mode: one tiny model through the checks' DDP paths (one gloo rank)."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_step", "--quick", "--device", "cpu", "--sizes", "tiny",
           "--steps", "1", "--rounds", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "tiny" and row["tensors"] > 10 and row["digest_matches_cpu"] is True
    assert row["step_ms"]["none"] > 0 and row["step_ms"]["checks"] > 0
    assert set(row["work_ms"]) == {"nonfinite", "fingerprint"} and all(v > 0 for v in row["work_ms"].values())
    assert all(v > 0 for v in row["fingerprint_gbps"].values())
