"""The every-step screen names no healthy rank on a clean run whose own update fits a batch that stood out: real
``accelerate launch``, 3 gloo CPU ranks (``screen_stress_scenario.py``). Under the rule of 2026-12-07 (any value 2^24
above its recomputation on the weights after the update confirmed) this run named rank 0 at step 29."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, must_run, worker_env


@pytest.mark.slow  # an accelerate launch of 31 steps
def test_a_loss_2_28_above_the_others_that_its_update_fits_names_nobody(tmp_path: Path) -> None:
    env = worker_env() | {"HF_HOME": str(tmp_path / "hf"), "ACCELERATE_USE_CPU": "1",
                          "ACCELERATE_SDC_CONFIG_FILE": "/dev/null"}  # fmt: skip
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3",
           str(ROOT / "tests" / "screen_stress_scenario.py"), "31"]  # fmt: skip
    proc = must_run(cmd, env, 600, tmp_path)
    (line,) = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    assert line["error"] is None and line["steps"] == 31, line
    assert line["screen"]["hits"] >= 1 and line["replay"]["screen_unconfirmed"] >= 1, line  # it stood out, unnamed
    assert line["replay"].get("screen_confirmed", 0) == 0, line
