"""The every-step screen on FSDP2 at the hook set's defaults, end to end (``screen_fsdp2_scenarios``):
one torchrun of 3 gloo ranks with real ``fully_shard``. A wrong gradient on a step the replay does
not audit is named (one step later at the defaults, in its step with ``read="same_step"``), on every
rank, after the partner's lockstep recomputation through the sharded model confirmed it; a clean run
raises nothing and confirms nothing; a genuine spike is flagged and nobody is named; under
Lightning's ``ModelParallelStrategy`` the callbacks at their defaults give the same verdict."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, results, torchrun

WORLD = 3
pytestmark = pytest.mark.slow  # one torchrun of ten FSDP2 runs: about 40 s on 2 cores


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("screen_fsdp2")
    scenarios = ("fault,clean,spike,lightning,lightning_clean,fault_same,spike_same,fault_accumulate,clean_accumulate,"
                 "fault_outside,spike_outside")
    torchrun(ROOT / "tests" / "screen_fsdp2_scenarios.py", path, scenarios, WORLD)
    return path


def test_the_screen_compares_runs_of_fsdp_parameter_groups(out: Path) -> None:
    runs = results(out, "clean", WORLD)
    expected = ["group 0 (l0.weight (+1))", "group 1 (l1.weight (+1))", "group 2 (head.weight (+1))", "loss", "level"]
    assert all(r["groups"] == expected for r in runs)


def test_a_wrong_gradient_on_an_unaudited_step_is_named_one_step_later_after_confirmation(out: Path) -> None:
    """At the defaults every rank re-runs its partner's kept micro-batches of step 12 through the
    sharded model during step 13, on the weights after step 12's update."""
    runs = results(out, "fault", WORLD)
    errors = [r["error"] for r in runs]
    assert all(e == errors[0] for e in errors)  # the same verdict on every rank
    error = errors[0]
    assert error["type"] == "ReplayMismatchError" and error["step"] == 12 and error["rank"] == 1, error
    assert error["suspects"] == [1] and error["details"]["source"] == "gradient_screen"
    (hit,) = error["details"]["screen"]
    assert hit["rank"] == 1 and hit["recomputed_by"] == 2 and hit["reason"] == "band"
    assert hit["value"].startswith(("group 0", "group 1")) and hit["excess"] > 20  # the faulty backward's groups
    assert all(r["steps"] == 13 for r in runs)  # step 12's update made, step 13's not
    assert all(r["replay"]["extra"]["screen_confirmed"] == 1 for r in runs)
    assert all(r["replay"]["runs"] == 1 for r in runs)  # the replay audited step 0 only: the screen found it
    assert all(r["nonfinite"]["failures"] == 0 for r in runs)  # a finite fault: not the non-finite check's


def test_read_in_the_same_step_the_collective_confirmation_names_the_rank_before_its_update(out: Path) -> None:
    """``ScreenConfig(read="same_step")``: the lockstep re-run during step 12, on the same weights."""
    runs = results(out, "fault_same", WORLD)
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (12, 1), error
    assert all(r["steps"] == 12 and r["replay"]["extra"]["screen_confirmed"] == 1 for r in runs)


def test_a_clean_run_raises_nothing_and_confirms_nothing(out: Path) -> None:
    runs = results(out, "clean", WORLD)
    assert all("error" not in r and r["steps"] == 16 for r in runs), runs[0]
    assert all(r["screen"]["runs"] == 16 for r in runs)  # screened on every step
    assert all(r["replay"]["extra"].get("screen_confirmed", 0) == 0 and r["replay"]["failures"] == 0 for r in runs)


def test_a_genuine_spike_is_flagged_and_nobody_is_named(out: Path) -> None:
    """At the defaults the partner re-runs the spiky batch on the weights after its own update: with a
    10^4 spike under AdamW that update moves the head enough that the recomputation neither reproduces
    the owner's peaks within 2x nor falls back in band (unconfirmed); read in the same step, on the
    same weights, the partner reproduces them (cleared); with the loss computed outside the model the partner's
    outputs give the owner's projection of them (cleared). Either way nobody is named."""
    for name, outcome in (("spike", "screen_unconfirmed"), ("spike_same", "screen_cleared"),
                          ("spike_outside", "screen_cleared")):  # the loss outside: the outputs' projection agrees
        runs = results(out, name, WORLD)
        assert all("error" not in r and r["steps"] == 16 for r in runs), runs[0]
        assert all(r["screen"]["extra"]["hits"] == 1 for r in runs)  # the spike stood out ...
        extra = [r["replay"]["extra"] for r in runs]
        assert all(e[outcome] == 1 and e.get("screen_confirmed", 0) == 0 for e in extra), (name, extra)
        assert all(r["replay"]["failures"] == 0 for r in runs)


def test_lightning_model_parallel_callbacks_at_their_defaults_name_the_rank_one_step_later(out: Path) -> None:
    runs = results(out, "lightning", WORLD)
    errors = [r["error"] for r in runs]
    assert all(e == errors[0] for e in errors)
    error = errors[0]
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (12, 1), error
    assert error["details"]["source"] == "gradient_screen" and error["details"]["screen"][0]["recomputed_by"] == 2
    assert all(r["steps"] == 13 and r["replay"]["runs"] == 1 for r in runs)  # step 12's update made; audited: step 0
    clean = results(out, "lightning_clean", WORLD)
    assert all("error" not in r and r["steps"] == 16 and r["screen"]["runs"] == 16 for r in clean), clean[0]
    assert all(r["replay"]["extra"].get("screen_confirmed", 0) == 0 for r in clean)


def test_with_gradient_sync_off_on_accumulation_micro_batches_the_same_verdict(out: Path) -> None:
    """Accelerate's accumulation on FSDP2: the first micro-batch of each step with gradient sync off, the fault in it.
    The audit at step 0 and the partner's recomputation mirror the owner's sync: rank 1 named at step 12; clean: no
    verdict, every step screened."""
    runs = results(out, "fault_accumulate", WORLD)
    for r in results(out, "fault_outside", WORLD):  # the loss computed in the loop: rank 1 named the same way
        e = r["error"]
        assert (e["type"], e["step"], e["suspects"], e["details"]["source"]) == ("ReplayMismatchError", 12, [1],
                                                                                "gradient_screen"), e  # fmt: skip
    error = runs[0]["error"]
    assert all(r["error"] == error for r in runs)
    assert error["type"] == "ReplayMismatchError" and (error["step"], error["rank"]) == (12, 1), error
    assert all(r["steps"] == 13 and r["replay"]["runs"] == 1 for r in runs)
    clean = results(out, "clean_accumulate", WORLD)
    assert all("error" not in r and r["steps"] == 16 and r["screen"]["runs"] == 16 for r in clean), clean[0]
