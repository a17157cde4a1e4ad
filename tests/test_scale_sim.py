"""The simulation of one rank in a world of W (``benchmarks.scale``): what a rank sends and receives
per step, counted exactly, at W = 8 and W = 4,096. An audited step's traffic per rank and the
clean step's count of collectives must not grow with the world (the audited step's exchange once
gathered a plan of W x (2W + 1) integers on every rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, worker_env


def _simulate(tmp_path: Path, world: int) -> dict:
    out = tmp_path / f"scale-{world}.json"
    cmd = [sys.executable, "-m", "benchmarks.scale", "--world", str(world), "--steps", "6", "--audit-every", "3",
           "--configs", "defaults,fingerprint", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_an_audited_step_and_the_weight_comparison_cost_a_rank_the_same_at_any_world_size(tmp_path: Path) -> None:
    small, large = _simulate(tmp_path, 8), _simulate(tmp_path, 4096)
    assert small["total"]["collectives_per_step"] == large["total"]["collectives_per_step"] > 0
    audited = large["total"]["audited_step_bytes_per_rank"] - small["total"]["audited_step_bytes_per_rank"]
    assert small["total"]["audited_step_bytes_per_rank"] > 0 and audited <= 1 << 20, audited
    fp_small, fp_large = small["configs"]["fingerprint"], large["configs"]["fingerprint"]
    assert fp_small["bytes_per_rank_per_step"] == fp_large["bytes_per_rank_per_step"] > 0
    assert fp_small["calls_per_step"] == fp_large["calls_per_step"] == {"all_reduce": 1}
