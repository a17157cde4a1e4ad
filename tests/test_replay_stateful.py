"""The ring replay audit on stateful training steps: real ``torchrun`` (3 gloo CPU ranks),
``Trainer(strategy="ddp")``, one launch for all scenarios of ``replay_scenarios.py``.

For each stateful pattern: no false verdict, and every rank's weights (trained and not) and
buffers bit-identical with the audit on and off; a step that cannot be replayed faithfully gives
``ReplayUnavailableError`` on every rank with the likely cause and fix; real faults are named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun

WORLD = 3
SCRIPT = Path(__file__).with_name("replay_scenarios.py")
PATTERNS = ("tbptt", "ema", "counter", "metric", "random", "hook")
SCENARIOS = [
    "all_on", "all_off",
    "no_hook", "gather", "gather_warn", "gather_off", "reentrant", "rank", "tbptt_fault", "ema_fault",
]  # fmt: skip


def launch(path: Path, scenarios: list[str]) -> Path:
    torchrun(SCRIPT, path, scenarios, WORLD, timeout=600)
    return path


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("replay3"), SCENARIOS)


@pytest.fixture(scope="module")
def each(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("replay3_each"), [f"{p}_{s}" for p in PATTERNS for s in ("on", "off")])


def same_error(out: Path, scenario: str, error_type: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, WORLD)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == error_type, errors[0]
    return errors[0]


def check_no_alarm_no_side_effect(out: Path, pattern: str) -> None:
    on, off = results(out, f"{pattern}_on", WORLD), results(out, f"{pattern}_off", WORLD)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["error"] is None, r_on["error"]
        assert r_on["global_step"] == 6 and r_on["stats"]["runs"] == 6 and r_on["stats"]["failures"] == 0
        # bit-identical training, every rank: trained and frozen weights, buffers
        assert r_on["weights"] == r_off["weights"]
        # the state the step changes saw each real batch once, the replays none
        assert (r_on["calls"], r_on["seen"], r_on["metric_updates"], r_on["memory"]) == (
            r_off["calls"], r_off["seen"], r_off["metric_updates"], r_off["memory"])  # fmt: skip
        assert r_on["leftover"] == []  # muted logging and the step wrapper are gone after fit
    if pattern in ("counter", "all"):
        assert on[0]["calls"] == 6
    if pattern in ("metric", "all"):
        assert on[0]["seen"] == 48 and on[0]["metric_updates"] == 6  # 6 batches of 8, not more
    if pattern in ("hook", "all"):
        assert on[0]["memory"] == 1.5  # 6 real steps of 0.25: the replays left the hook's state alone
    # CPU fp32 replays bit for bit: exact="auto" calibrated to exact comparison
    assert on[0]["stats"]["extra"]["tolerance"] == 0.0


def test_stateful_step_replays_without_false_alarm_or_side_effect(out: Path) -> None:
    """TBPTT hidden state in self, an EMA teacher updated in place, a Python counter, torchmetrics
    metrics, Python and NumPy RNG, and state carried by the explicit hook, all in one step."""
    check_no_alarm_no_side_effect(out, "all")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
def test_each_stateful_pattern_alone(each: Path, pattern: str) -> None:
    check_no_alarm_no_side_effect(each, pattern)


def test_state_the_capture_cannot_see_is_refused_not_blamed_on_a_device(out: Path) -> None:
    err = same_error(out, "no_hook", "ReplayUnavailableError")
    assert "could not reproduce their own result on their own device" in err["message"]
    assert "ranks [0, 1, 2]" in err["message"] and "not evidence of a faulty device" in err["message"]
    assert "sdc_replay_state()" in err["message"]


def test_a_step_that_communicates_is_refused_on_every_rank(out: Path) -> None:
    err = same_error(out, "gather", "ReplayUnavailableError")
    assert "CollectiveInReplay: torch.distributed.all_gather" in err["message"]
    assert "the training step communicates" in err["message"]
    # on_unreplayable="warn": one warning per rank, the audit turns off, training is unchanged
    warn, off = results(out, "gather_warn", WORLD), results(out, "gather_off", WORLD)
    for w, o in zip(warn, off, strict=True):
        assert w["error"] is None and w["disabled"] is True and w["global_step"] == 6
        assert len(w["warnings"]) == 1 and "is now off" in w["warnings"][0]
        assert w["weights"] == o["weights"]


def test_reentrant_checkpoint_suggests_use_reentrant_false(out: Path) -> None:
    err = same_error(out, "reentrant", "ReplayUnavailableError")
    assert "pass use_reentrant=False to torch.utils.checkpoint.checkpoint" in err["message"]
    assert "sdc_replay_step" not in err["message"]


def test_a_rank_dependent_step_is_not_an_sdc_verdict(out: Path) -> None:
    err = same_error(out, "rank", "ReplayUnavailableError")
    assert "every replay pair disagrees" in err["message"] and "self.global_rank" in err["message"]
    assert "3 or more replicas" not in err["message"]


@pytest.mark.parametrize(("scenario", "rank", "step"), [("tbptt_fault", 1, 3), ("ema_fault", 2, 2)])
def test_real_faults_in_stateful_steps_are_named(out: Path, scenario: str, rank: int, step: int) -> None:
    err = same_error(out, scenario, "ReplayMismatchError")
    assert (err["rank"], err["step"], err["suspects"]) == (rank, step, [rank])
    assert err["details"]["classification"] == "persistent"
    assert err["details"]["tolerance"] == 0.0
