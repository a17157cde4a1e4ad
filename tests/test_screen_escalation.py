"""The every-step screen at the hook set's defaults, end to end (``screen_escalation_scenarios``):
one torchrun of 3 gloo ranks. A wrong gradient on a step the replay does not audit is named, on
every rank, after a partner's recomputation confirmed it: during the next step at the defaults, in
its own step before its update with ``read="same_step"``; a genuine spike is
flagged, reproduced by the partner and cleared; ``skip_step`` drops the faulty step and training
goes on with equal replicas; under Lightning the callbacks at their defaults give the same verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, results, torchrun

WORLD = 3


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("screen_escalation")
    scenarios = "fault,spike,skip,lightning,logit,fault_same,last,hard,fault_sgd"
    torchrun(ROOT / "tests" / "screen_escalation_scenarios.py", path, scenarios, WORLD)
    return path


def incidents(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / "sdc" / "incidents").glob("*.json"))]


def test_a_wrong_gradient_on_an_unaudited_step_is_named_one_step_later_after_confirmation(out: Path) -> None:
    """At the defaults (``read="auto"``: the host never waits for backward) the fault of step 30 is
    confirmed by the partner on the weights after step 30's update and named during step 31,
    before its update, on every rank alike."""
    runs = results(out, "fault", WORLD)
    errors = [r["error"] for r in runs]
    assert all(e == errors[0] for e in errors)  # the same verdict on every rank
    error = errors[0]
    assert error["type"] == "ReplayMismatchError" and error["step"] == 30 and error["rank"] == 1, error
    assert error["suspects"] == [1] and error["details"]["source"] == "gradient_screen"
    assert "one step later" in error["details"]["read"]
    assert "on the weights after its update" in error["reason"], error["reason"]
    (hit,) = error["details"]["screen"]
    assert hit["rank"] == 1 and hit["recomputed_by"] != 1 and hit["reason"] == "band"
    assert all(r["steps"] == 31 for r in runs)  # step 30's update made, step 31's not
    assert all(r["replay"]["extra"]["screen_confirmed"] == 1 for r in runs)
    assert all(r["replay"]["runs"] == 1 for r in runs)  # the replay audited step 0 only: the screen found it
    (incident,) = incidents(out / "fault")
    assert incident["policy"] == "raise" and incident["error"]["details"]["source"] == "gradient_screen"


def test_under_sgd_the_divergence_a_wrong_gradient_causes_names_its_rank_as_the_suspect(out: Path) -> None:
    """Under SGD the update spreads the 2^128 gradient of step 30 into every replica's weights: the partner's
    recomputation on them witnesses nothing (unconfirmed), and at step 31 every rank's gradients are non-finite. The
    non-finite verdict says so with rank 1, the screen's unconfirmed hit, as its one suspect, not "ordinary
    divergence"; no rank is called faulty."""
    runs = results(out, "fault_sgd", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "NonFiniteGradientError" and error["step"] == 31 and error["rank"] is None, error
    assert error["suspects"] == [1] and error["details"]["pattern"] == "after_screen_hit", error
    assert "after rank 1's group 7 (enc.linear2.weight) 2^1" in error["message"] and "at step 30" in error["message"]
    assert error["message"].endswith("resume from the last checkpoint: a batch that diverges the run does so again, "
                                     "a transient fault not.")
    assert all(r["replay"]["extra"]["screen_unconfirmed"] == 1 for r in runs)


def test_hard_batches_under_sgd_name_nobody(out: Path) -> None:
    """No fault, SGD at lr 0.1 and one rank's batch made hard at random steps: the screen flags some, the partner's
    recomputation on the weights that batch's own update moved does not reproduce them (it fit them back into the
    band, which named the healthy rank at step 15 before 2026-12-07), so they stay unconfirmed; the replay audits
    the step after each, on equal weights, and finds every rank agreeing."""
    runs = results(out, "hard", WORLD)
    assert all(r.get("error") is None for r in runs), runs[0].get("error")
    extra = runs[0]["replay"]["extra"]
    assert extra["screen_unconfirmed"] >= 1 and extra.get("screen_confirmed", 0) == 0, extra
    assert runs[0]["replay"]["runs"] >= 1 + extra["screen_unconfirmed"], runs[0]["replay"]  # step 0 and the audits


def test_read_in_the_same_step_the_fault_is_named_before_its_update(out: Path) -> None:
    """``ScreenConfig(read="same_step")``: the host waits for the screen's rows before the update;
    the fault of step 30 is confirmed and named in step 30, its update never made."""
    runs = results(out, "fault_same", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (30, 1), error
    assert error["details"]["source"] == "gradient_screen" and "read" not in error["details"]
    (hit,) = error["details"]["screen"]
    assert hit["rank"] == 1 and hit["recomputed_by"] != 1 and hit["reason"] == "band"
    assert all(r["steps"] == 30 for r in runs)  # raised before step 30's update
    assert all(r["replay"]["extra"]["screen_confirmed"] == 1 for r in runs)


def test_a_genuine_spike_is_flagged_reproduced_by_the_partner_and_cleared(out: Path) -> None:
    runs = results(out, "spike", WORLD)
    assert all("error" not in r and r["steps"] == 44 for r in runs), runs[0]
    assert all(r["screen"]["extra"]["hits"] == 1 and r["screen"]["failures"] == 0 for r in runs)  # stood out ...
    assert all(r["replay"]["extra"]["screen_cleared"] == 1 and r["replay"]["failures"] == 0 for r in runs)
    assert len({r["digest"] for r in runs}) == 1  # ... and every replica applied it
    assert incidents(out / "spike") == []


def test_skip_step_drops_the_confirmed_faulty_step_and_training_goes_on(out: Path) -> None:
    runs = results(out, "skip", WORLD)
    assert all("error" not in r and r["steps"] == 44 for r in runs), runs[0]
    assert all(r["replay"]["extra"]["skipped_steps"] == 1 for r in runs)
    assert len({r["digest"] for r in runs}) == 1  # the replicas stayed equal (the final comparison passed)
    (incident,) = incidents(out / "skip")
    assert incident["policy"] == "skip_step" and incident["error"]["rank"] == 1


def test_lightning_callbacks_at_their_defaults_name_the_rank_one_step_later(out: Path) -> None:
    runs = results(out, "lightning", WORLD)
    errors = [r["error"] for r in runs]
    assert all(e == errors[0] for e in errors)
    error = errors[0]
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (30, 1), error
    assert error["details"]["source"] == "gradient_screen"
    assert all(r["steps"] == 31 and r["replay"]["runs"] == 1 for r in runs)  # step 30's update made; audited: step 0


def test_a_wrong_logit_is_named_at_the_first_step_it_does_harm(out: Path) -> None:
    """A persistent activation fault in the head: named on rank 1 at the first step it does harm, by the non-finite
    check where its gradients went non-finite (read one step later), else by the replay's audit after the screen's
    unconfirmed hit (a loss that stood out confirms nothing on the weights after the update)."""
    runs = results(out, "logit", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["rank"] == 1 and error["step"] >= 30, error
    if error["type"] == "ReplayMismatchError":  # the audit of a step after an unconfirmed hit, in that step
        assert error["details"].get("source") != "gradient_screen" and runs[0]["replay"]["runs"] > 1, error
        assert all(r["steps"] == error["step"] for r in runs)
    else:
        assert error["type"] == "NonFiniteGradientError", error
        assert all(r["steps"] == error["step"] + 1 for r in runs)  # that step's update happened, the next did not


def test_a_fault_at_the_last_step_is_named_by_the_end_of_training(out: Path) -> None:
    runs = results(out, "last", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (43, 1), error
    assert all(r["steps"] == 44 for r in runs)  # every step trained; the end of training read the verdict


@pytest.mark.slow  # a second 3-rank launch
def test_read_in_the_same_step_a_spike_is_cleared_and_lightning_names_the_fault(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "screen_escalation_scenarios.py", tmp_path, "spike_same,lightning_same", WORLD)
    runs = results(tmp_path, "spike_same", WORLD)
    assert all("error" not in r and r["steps"] == 44 for r in runs), runs[0]
    assert all(r["screen"]["extra"]["hits"] == 1 and r["replay"]["extra"]["screen_cleared"] == 1 for r in runs)
    assert incidents(tmp_path / "spike_same") == []
    runs = results(tmp_path, "lightning_same", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (30, 1), error
    assert all(r["steps"] == 30 for r in runs)  # before step 30's update
