"""The simulation of one rank in a world of W (``benchmarks.scale``): what a rank sends and receives
per step, counted exactly, at W = 8, 64 and 4,096. A clean step's collectives and bytes per rank
must not grow with the world once the screen compares neighbourhoods (above 16 ranks; it once
gathered every rank's row on every rank), nor an audited step's beyond the targets of the scale
issue (its exchange once gathered a plan of W x (2W + 1) integers on every rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, worker_env


def _simulate(tmp_path: Path, worlds: tuple[int, ...]) -> list[dict]:
    """``benchmarks.scale`` at each world size, one after another in one process (one start-up)."""
    args = ["--steps", "6", "--audit-every", "3", "--configs", "defaults,fingerprint"]
    runs = [["--world", str(w), *args, "--out", str(tmp_path / f"scale-{w}.json")] for w in worlds]
    code = f"from benchmarks.scale import main\nfor argv in {runs!r}:\n    assert main(argv) == 0"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"scale-{w}.json").read_text()) for w in worlds]


def test_a_clean_step_costs_a_rank_the_same_at_any_world_size_and_an_audited_one_stays_within_target(
    tmp_path: Path,
) -> None:
    small, mid, large = _simulate(tmp_path, (8, 64, 4096))
    clean = [w["total"] for w in (small, mid, large)]
    assert clean[1]["calls_per_step"] == clean[2]["calls_per_step"]  # neighbourhoods: the same collectives
    assert clean[1]["bytes_per_rank_per_step"] == clean[2]["bytes_per_rank_per_step"] > 0  # and bytes
    assert clean[2]["calls_per_step"].get("all_gather", 0) == 0, clean[2]["calls_per_step"]  # no world gather
    assert small["total"]["calls_per_step"].get("all_gather") == 1  # a small world gathers every row
    assert clean[2]["bytes_per_rank_per_step"] - clean[0]["bytes_per_rank_per_step"] <= 64 << 10
    assert clean[2]["memory_bytes"] - clean[0]["memory_bytes"] <= 64 << 20
    audited = large["total"]["audited_step_bytes_per_rank"] - small["total"]["audited_step_bytes_per_rank"]
    assert small["total"]["audited_step_bytes_per_rank"] > 0 and audited <= 1 << 20, audited
    fp_small, fp_large = small["configs"]["fingerprint"], large["configs"]["fingerprint"]
    assert fp_small["bytes_per_rank_per_step"] == fp_large["bytes_per_rank_per_step"] > 0
    assert fp_small["calls_per_step"] == fp_large["calls_per_step"] == {"all_reduce": 1}
