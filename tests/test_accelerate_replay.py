"""Accelerate: the replay computes the loss the user back-propagated (``SDCHooks.replayable``),
reproduces module state, has no side effect; real ``accelerate launch`` with 3 gloo CPU ranks and
gradient accumulation 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, results, worker_env

SCRIPT = Path(__file__).with_name("accelerate_replay_scenarios.py")
STYLES = ("outside", "z_loss", "by_world", "forward", "hook")
SCENARIOS = [*(f"{s}_{a}" for s in STYLES for a in ("on", "off")), "closure", "outside_fault"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("acc_replay")
    env = worker_env() | {"HF_HOME": str(path / "hf"), "ACCELERATE_USE_CPU": "1"}
    env["ACCELERATE_SDC_CONFIG_FILE"] = "/dev/null"  # the defaults, whatever this machine has
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3",
           str(SCRIPT), "--out", str(path), "--only", ",".join(SCENARIOS)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"accelerate launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return path


def same_error(out: Path, scenario: str, error_type: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == error_type, errors[0]
    return errors[0]


@pytest.mark.parametrize("style", STYLES)
def test_replayed_loss_is_the_back_propagated_one_and_training_is_unchanged(out: Path, style: str) -> None:
    for on, off in zip(results(out, f"{style}_on", 3), results(out, f"{style}_off", 3), strict=True):
        assert on["error"] is None, on["error"]
        replay = on["state"]["checks"]["ring_replay"]
        assert on["step"] == 5 and replay["runs"] == 5 and replay["failures"] == 0
        assert replay["extra"]["tolerance"] == 0.0  # CPU: calibrated to bit equality
        assert on["weights"] == off["weights"]  # weights and buffers bit-identical, every rank
        assert (on["calls"], on["level"], on["memory"]) == (off["calls"], off["level"], off["memory"])
        assert on["calls"] == 10  # 5 steps of 2 micro-batches: the replays left no trace


def test_a_loss_the_replay_cannot_see_is_refused_with_the_fix(out: Path) -> None:
    err = same_error(out, "closure", "ReplayUnavailableError")
    assert "not evidence of a faulty device" in err["message"]
    assert "SDCHooks.replayable(fn)" in err["message"]


def test_a_real_fault_is_still_named_with_replayable(out: Path) -> None:
    err = same_error(out, "outside_fault", "ReplayMismatchError")
    assert (err["rank"], err["step"], err["suspects"]) == (1, 2, [1])
