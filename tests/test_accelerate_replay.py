"""Accelerate: the replay computes the loss the user back-propagated (``SDCHooks.replayable``),
reproduces module state, has no side effect; real ``accelerate launch`` with 3 gloo CPU ranks and
gradient accumulation 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, must_run, results, worker_env

SCRIPT = Path(__file__).with_name("accelerate_replay_scenarios.py")
# hook: labels outside the model, an extra loss term and state through the explicit hook;
# by_world: a loss scaled by the number of processes (the HF Trainer's default); forward: the
# forward hooks record, the model keeps a counter and a tensor it changes in place; bare: a loss computed from the
# outputs in the loop, scaled by the number of processes, with no loss_fn or replayable
STYLES = ("hook", "by_world", "forward", "bare")
MORE = ("outside", "z_loss")  # the same, one thing at a time (slow)
SCENARIOS = [*(f"{s}_{a}" for s in STYLES for a in ("on", "off")), "closure", "outside_fault"]


def launch(path: Path, scenarios: list[str]) -> Path:
    env = worker_env() | {"HF_HOME": str(path / "hf"), "ACCELERATE_USE_CPU": "1"}
    env["ACCELERATE_SDC_CONFIG_FILE"] = "/dev/null"  # the defaults, whatever this machine has
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3",
           str(SCRIPT), "--out", str(path), "--only", ",".join(scenarios)]  # fmt: skip
    must_run(cmd, env, 600, ROOT)
    return path


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("acc_replay"), SCENARIOS)


@pytest.fixture(scope="module")
def more(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("acc_replay_more"), [f"{s}_{a}" for s in MORE for a in ("on", "off")])


def same_error(out: Path, scenario: str, error_type: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == error_type, errors[0]
    return errors[0]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_replayed_loss_is_the_back_propagated_one_and_training_is_unchanged(out: Path, style: str) -> None:
    check_no_alarm_no_side_effect(out, style)


@pytest.mark.slow
@pytest.mark.parametrize("style", MORE)
def test_loss_outside_the_model_and_extra_terms_alone(more: Path, style: str) -> None:
    check_no_alarm_no_side_effect(more, style)


def check_no_alarm_no_side_effect(out: Path, style: str) -> None:
    for on, off in zip(results(out, f"{style}_on", 3), results(out, f"{style}_off", 3), strict=True):
        assert on["error"] is None, on["error"]
        replay = on["state"]["checks"]["ring_replay"]
        assert on["step"] == 5 and replay["runs"] == 5 and replay["failures"] == 0
        assert replay["extra"]["tolerance"] == 0.0  # CPU: calibrated to bit equality
        assert on["weights"] == off["weights"]  # weights and buffers bit-identical, every rank
        assert (on["calls"], on["level"], on["memory"]) == (off["calls"], off["level"], off["memory"])
        assert on["calls"] == 10  # 5 steps of 2 micro-batches: the replays left no trace
        if style == "hook":
            assert on["memory"] == 1.25  # 10 real forwards of 0.125


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_loss_the_replay_cannot_see_is_refused_with_the_fix(out: Path) -> None:
    err = same_error(out, "closure", "ReplayUnavailableError")
    assert "not evidence of a faulty device" in err["message"]
    assert "SDCHooks.replayable(fn)" in err["message"]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_real_fault_is_still_named_with_replayable(out: Path) -> None:
    err = same_error(out, "outside_fault", "ReplayMismatchError")
    assert (err["rank"], err["step"], err["suspects"]) == (1, 2, [1])
