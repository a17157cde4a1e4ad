"""No accusation on noisy kernels, faults still named (issue 33): real ``torchrun``, 3 gloo CPU ranks.

``tests/nondeterminism_scenarios.py`` trains a small model through ``SDCHooks`` (every check on)
whose pooling is a scatter-add with a drawn summation order: nondeterministic on every call, on
one call in four, only on some batches, with or without a deterministic path, under or outside
the user's ``torch.use_deterministic_algorithms``. Clean runs at the defaults and with the
replay on every step must raise nothing; a weight flip, an activation fault and a backward
fault far above the noise must be named, with the right rank, on every rank alike.

The default run holds 12 clean runs of the kernel that caught the old replay out (noisy on some
calls, replay every step: a lucky exact first audit made it trust exactness; 9 of 12 runs met a
disagreement the re-runs explained), 4 of three more, and the faults; ``-m slow`` runs 30 of
every kernel at both settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun

WORLD = 3
SCRIPT = Path(__file__).with_name("nondeterminism_scenarios.py")
KERNELS = ["every", "some", "batches", "capable", "incapable", "user_capable", "user_incapable", "exact"]
FAULTS = {"flip": 1, "activation": 2, "backward": 0}  # the faulty rank of each fault


def launch(out: Path, scenarios: list[str], runs: int, timeout: float) -> None:
    torchrun(SCRIPT, out, scenarios, WORLD, "--runs", str(runs), timeout=timeout)


def runs(out: Path, scenario: str) -> list[list[dict[str, Any]]]:
    """Per run, every rank's result."""
    rows = results(out, scenario, WORLD)
    return [list(per_rank) for per_rank in zip(*(r["runs"] for r in rows), strict=True)]


def assert_clean(out: Path, scenario: str, expected: int) -> dict[str, float]:
    """No run raised on any rank; returns counters summed over the runs (rank 0's)."""
    found = runs(out, scenario)
    assert len(found) == expected
    errors = [(i, r, run[r]["error"]["message"]) for i, run in enumerate(found) for r in range(WORLD)
              if run[r]["error"] is not None]  # fmt: skip
    assert not errors, f"{scenario}: {len(errors)} false verdicts, first: {errors[:3]}"
    totals: dict[str, float] = {}
    for run in found:
        for k, v in (run[0]["replay"]["extra"] or {}).items():
            totals[k] = totals.get(k, 0.0) + v
        totals["noisy_calls"] = totals.get("noisy_calls", 0) + sum(r["noisy_calls"] for r in run)
    return totals


def assert_named(out: Path, kernel: str, fault: str) -> dict[str, Any]:
    (run,) = runs(out, f"{kernel}:every:{fault}")
    errors = [r["error"] for r in run]
    assert all(e is not None for e in errors), f"{fault}: not every rank raised: {errors}"
    assert all(e == errors[0] for e in errors), errors  # the same verdict on every rank
    err = errors[0]
    assert err["rank"] == FAULTS[fault] and err["suspects"] == [FAULTS[fault]], err["message"]
    assert err["step"] in (2, 3), err["message"]  # the step of the fault, or the next for a flip after it
    assert any(r["fired"] for r in run)
    return err


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nondeterminism")
    faults = [f"{k}:every:{f}" for k in ("some", "every") for f in FAULTS]
    more = [f"{s}@4" for s in ("batches:every", "incapable:defaults", "every:every")]
    series = ["exact:every:transient", "exact:every:ratchet"]  # issue 52: one look widens no tolerance
    launch(out, ["some:every", *more, *faults, *series], 12, 600)  # one launch: one start-up of the ranks
    return out


def test_clean_runs_on_a_kernel_noisy_on_some_calls_accuse_no_one(quick: Path) -> None:
    totals = assert_clean(quick, "some:every", 12)
    assert totals["noisy_calls"] > 0  # the kernel really was noisy
    # the case of the issue happened and was told from a fault: disagreements that re-runs explained
    assert totals.get("disagreements_explained_by_noise", 0) > 0
    assert totals.get("confirmations", 0) >= totals.get("disagreements_explained_by_noise", 0)


def test_noisy_batches_defaults_and_every_call_accuse_no_one(quick: Path) -> None:
    for scenario in ("batches:every", "incapable:defaults", "every:every"):
        totals = assert_clean(quick, f"{scenario}@4", 4)
        assert totals["noisy_calls"] > 0, scenario


@pytest.mark.parametrize("kernel", ["some", "every"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_faults_far_above_the_noise_are_named(quick: Path, kernel: str, fault: str) -> None:
    err = assert_named(quick, kernel, fault)
    if fault != "flip":  # compute faults: the replay names them at their step
        assert err["check"] == "ring_replay" and err["step"] == 2, err["message"]


def test_a_transient_sub_rtol_fault_is_recorded_and_widens_no_tolerance(quick: Path) -> None:
    (run,) = runs(quick, "exact:every:transient")
    assert all(r["error"] is None for r in run), [r["error"] for r in run]  # one look accuses no one
    extra = run[0]["replay"]["extra"]
    assert all(r["replay"]["extra"] == extra for r in run)  # every rank recorded the same
    assert extra["unexplained_differences"] == 1 and extra["last_unexplained_rank"] == 1, extra
    assert extra["last_unexplained_step"] == 3 and 0 < extra["last_unexplained_diff"] < 1e-3, extra
    assert extra.get("tolerance", 0.0) == 0.0, extra  # the CPU model is bit-exact: still compared bit for bit


def test_a_transient_fault_does_not_hide_a_later_fault_of_its_size(quick: Path) -> None:
    (run,) = runs(quick, "exact:every:ratchet")
    errors = [r["error"] for r in run]
    assert all(e is not None and e == errors[0] for e in errors), errors  # the same verdict on every rank
    err = errors[0]
    assert err["check"] == "ring_replay" and err["suspects"] == [2] and err["step"] == 8, err["message"]


@pytest.mark.slow  # about 4 minutes: 30 clean runs of every kernel at the defaults and with the replay every step
def test_thirty_clean_runs_of_every_kernel_at_both_settings(tmp_path: Path) -> None:
    scenarios = [f"{k}:{s}" for k in KERNELS for s in ("defaults", "every")]
    launch(tmp_path, scenarios, 30, 900)
    for scenario in scenarios:
        totals = assert_clean(tmp_path, scenario, 30)
        if scenario.startswith(("capable", "user_capable", "exact")) and scenario.endswith("every"):
            assert totals["noisy_calls"] == 0 and totals.get("tolerance", 0.0) == 0.0, scenario  # bit for bit
