"""Real multi-process runs: ``torchrun`` with 3 gloo CPU ranks and ``Trainer(strategy="ddp")``.

All scenarios of one world size run in one torchrun launch (start-up is paid once; shared with
test_causal_order, ``conftest.lightning_ddp``); each test then checks what every rank reported.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import results

WORLD = 3


@pytest.fixture(scope="module")
def out(lightning_ddp: Path) -> Path:
    """The shared launch of the scenarios (``conftest.LIGHTNING_DDP_DEFAULT``)."""
    return lightning_ddp


def error_on_every_rank(out: Path, scenario: str, error_type: str) -> dict[str, Any]:
    """The error every rank raised; asserts it is the same on all ranks, in the same step."""
    per_rank = results(out, scenario, WORLD)
    errors = [r["error"] for r in per_rank]
    assert all(e is not None for e in errors), f"some rank did not raise: {errors}"
    assert all(e == errors[0] for e in errors), f"ranks disagree: {errors}"
    assert errors[0]["type"] == error_type
    return errors[0]


def metrics_rows(out: Path, scenario: str) -> list[dict[str, str]]:
    with open(out / "logs" / scenario / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def last_value(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key)]
    assert values, f"{key} never logged"
    return values[-1]


@pytest.mark.parametrize("scenario", ["clean", "clean_exact", "clean_bf16", "clean_fp16", "clean_validation",
                                      "clean_adam_buffers"])
def test_clean_runs_raise_nothing(out: Path, scenario: str) -> None:
    per_rank = results(out, scenario, WORLD)
    for r in per_rank:
        assert r["error"] is None, r["error"]
        assert r["global_step"] == 8
        for state in r["states"].values():
            assert state["runs"] > 0 and state["failures"] == 0
    assert len({r["weights"] for r in per_rank}) == 1  # replicas stayed identical


def test_clean_run_logs_sdc_metrics(out: Path) -> None:
    rows = metrics_rows(out, "clean")
    for check in ("nonfinite_gradient", "ring_replay", "weight_fingerprint"):
        assert last_value(rows, f"sdc/{check}/runs") > 0
        assert last_value(rows, f"sdc/{check}/failures") == 0
        assert last_value(rows, f"sdc/{check}/time_ms_total") > 0
    assert last_value(rows, "sdc/ring_replay/max_diff") == 0.0  # CPU fp32 replay is bit-exact
    assert last_value(rows, "sdc/weight_fingerprint/last_verified_step") == 7


def test_audit_and_tap_leave_training_bit_identical(out: Path) -> None:
    off, tap, on = (results(out, s, WORLD)[0] for s in ("audit_off", "tap_only", "audit_on"))
    assert on["states"]["RingReplayAudit"]["runs"] == 6  # every step was audited
    assert off["weights"] == tap["weights"] == on["weights"]
    # the replay never logs: as many train_loss rows with the audit as without
    count = [sum(1 for r in metrics_rows(out, s) if r.get("train_loss")) for s in ("audit_off", "audit_on")]
    assert count[0] == count[1] > 0


def test_nonfinite_gradient_names_rank_and_parameter(out: Path) -> None:
    err = error_on_every_rank(out, "nonfinite", "NonFiniteGradientError")
    assert (err["check"], err["step"], err["rank"], err["suspects"]) == ("nonfinite_gradient", 3, 1, [1])
    assert err["details"]["pattern"] == "one_rank"
    assert err["details"]["parameters"] == {"1": ["body.weight"]}
    assert set(err["hosts"]) == {"1"} and "rank 1" in err["message"]
    assert last_value(metrics_rows(out, "nonfinite"), "sdc/nonfinite_gradient/failures") == 1


def test_nonfinite_on_all_ranks_is_reported_as_divergence(out: Path) -> None:
    err = error_on_every_rank(out, "nonfinite_all", "NonFiniteGradientError")
    assert err["rank"] is None and err["suspects"] == [0, 1, 2]
    assert err["details"]["pattern"] == "all_ranks"


def test_skip_step_keeps_weights_clean(out: Path) -> None:
    per_rank = results(out, "nonfinite_skip", WORLD)
    for r in per_rank:
        assert r["error"] is None and r["finite"]
        assert r["states"]["NonFiniteGradientCheck"]["extra"]["skipped_steps"] == 1
        assert r["states"]["WeightFingerprintCheck"]["failures"] == 0
    assert len({r["weights"] for r in per_rank}) == 1
    assert last_value(metrics_rows(out, "nonfinite_skip"), "sdc/nonfinite_gradient/skipped_steps") == 1


def test_weight_bit_flip_is_attributed_by_majority(out: Path) -> None:
    err = error_on_every_rank(out, "fingerprint", "FingerprintMismatchError")
    assert (err["step"], err["rank"], err["suspects"]) == (3, 2, [2])
    assert err["details"]["differing_tensors"] == {"2": ["param:body.weight"]}
    assert err["details"]["groups"] == [[0, 1], [2]]


def test_optimizer_state_flip_is_caught(out: Path) -> None:
    err = error_on_every_rank(out, "optimizer_state", "FingerprintMismatchError")
    assert (err["rank"], err["step"]) == (0, 4)  # seen right after the step that corrupted it
    assert err["details"]["differing_tensors"]["0"] == ["optimizer0:head.weight:exp_avg_sq"]


def test_persistent_compute_fault_is_attributed_by_two_pairs(out: Path) -> None:
    # with a validation loop between the steps (Lightning's val_check_interval=2) as without
    validated = error_on_every_rank(out, "replay_persistent_validated", "ReplayMismatchError")
    assert (validated["step"], validated["rank"], validated["suspects"]) == (4, 1, [1])
    assert last_value(metrics_rows(out, "clean_validation"), "val_loss") > 0  # the clean run validated too
    err = error_on_every_rank(out, "replay_persistent", "ReplayMismatchError")
    assert (err["step"], err["rank"], err["suspects"]) == (4, 1, [1])  # fault from step 3, audits every 2
    pairs = {tuple(p) for p in err["details"]["mismatching_pairs"]}
    partners = err["details"]["partners"]
    assert pairs == {(1, partners[1]), (partners.index(1), 1)}
    # every disagreeing pair is replayed by a third rank, and each sides against rank 1
    referees = err["details"]["referees"]
    assert set(referees) == {f"{o}->{q}" for o, q in pairs}
    assert all(t not in (int(o), int(q)) for pair, t in referees.items() for o, q in [pair.split("->")])
    rulings = err["details"]["rulings"]
    assert "owner is faulty" in rulings[f"1->{partners[1]}"]
    assert "replayer is faulty" in rulings[f"{partners.index(1)}->1"]


def test_intermittent_fault_is_settled_by_a_referee(out: Path) -> None:
    err = error_on_every_rank(out, "replay_intermittent", "ReplayMismatchError")
    assert (err["step"], err["rank"]) == (2, 2)
    assert len(err["details"]["mismatching_pairs"]) == 1
    ((pair, referee),) = err["details"]["referees"].items()
    assert pair.startswith("2->") and referee not in (2, int(pair.split("->")[1]))
    assert "owner is faulty" in err["details"]["rulings"][pair]


def test_user_comm_hook_is_kept_not_replaced(out: Path) -> None:
    per_rank = results(out, "comm_hook", WORLD)
    assert all(r["tap_inner"] == ["fp16_compress_hook"] for r in per_rank)
    err = error_on_every_rank(out, "comm_hook", "NonFiniteGradientError")
    assert (err["rank"], err["step"]) == (0, 4)
    # the audits before the fault, on top of fp16 compression, raised nothing
    assert per_rank[0]["states"]["RingReplayAudit"]["runs"] == 4


def test_fp16_scaler_overflow_is_not_an_alarm(out: Path) -> None:
    for r in results(out, "fp16_one_overflow", WORLD):
        assert r["error"] is None
        assert r["states"]["NonFiniteGradientCheck"]["extra"]["scaler_overflows"] >= 2  # start-up + injected


def test_fp16_lone_rank_overflowing_repeatedly_is_flagged(out: Path) -> None:
    err = error_on_every_rank(out, "fp16_sole_overflow", "NonFiniteGradientError")
    assert (err["rank"], err["step"]) == (1, 5)
    assert err["details"]["pattern"] == "one_rank_repeatedly"


def test_counters_and_the_screen_band_survive_checkpoint_and_resume(out: Path) -> None:
    saved = results(out, "save", WORLD)[0]["states"]
    resumed = results(out, "resume", WORLD)
    for r in resumed:
        assert r["error"] is None and r["global_step"] == 8
    states = resumed[0]["states"]
    # 4 steps before the checkpoint plus 4 after: the counters continued
    assert saved["NonFiniteGradientCheck"]["runs"] == 4
    assert states["NonFiniteGradientCheck"]["runs"] == 8
    # the fingerprint: 4 steps plus the comparison of the final weights when fit ends
    assert states["WeightFingerprintCheck"]["runs"] == saved["WeightFingerprintCheck"]["runs"] + 4 + 1
    assert states["RingReplayAudit"]["last_verified_step"] == 6
    # the screen's band: the 4 steps of history saved are still there after the resume, 4 more beside them
    band_saved, band = saved["NonFiniteGradientCheck"]["screen"], states["NonFiniteGradientCheck"]["screen"]
    assert (band_saved["filled"], band["filled"]) == (4, 8) and band["shape"] == band_saved["shape"]
    per_step = len(band["history"]) // band["shape"][0]
    assert band["history"][: 4 * per_step] == band_saved["history"][: 4 * per_step]
    assert any(v is not None for v in band["history"][4 * per_step : 8 * per_step])  # the resumed steps' own


def test_sdc_replay_step_is_used_when_defined(out: Path) -> None:
    for r in results(out, "replay_step_hook", WORLD):
        assert r["error"] is None
        assert r["states"]["RingReplayAudit"]["runs"] == 2
        # one replayed micro-batch per audit (steps 0 and 2), plus the first audit's same-device re-run
        # and its probe under strict determinism, and the second audit's re-run in strict mode
        assert r["replay_calls"] == 5


def test_a_replay_that_fails_on_one_rank_raises_on_every_rank(out: Path) -> None:
    err = error_on_every_rank(out, "replay_crash", "ReplayUnavailableError")
    assert "rank 1 replaying rank 0: KeyError: 'feature_x'" in err["message"]
    assert "sdc_replay_step" in err["message"]


def test_rank_zero_writes_one_incident_per_verdict(out: Path) -> None:
    import json

    (path,) = (out / "logs" / "nonfinite" / "version_0" / "sdc" / "incidents").glob("*.json")
    incident = json.loads(path.read_text())
    assert (incident["check"], incident["step"], incident["rank"], incident["policy"]) == (
        "nonfinite_gradient", 3, 1, "raise")  # fmt: skip
    facts = incident["suspects"]["1"]
    assert facts["rank"] == 1 and facts["host"] == incident["exclude_hosts"][0]
    assert facts["device"] and facts["versions"]["torch"].startswith("2.")
    assert incident["config"]["on_failure"] == "raise" and incident["error"]["type"] == "NonFiniteGradientError"
    (skipped,) = (out / "logs" / "nonfinite_skip" / "version_0" / "sdc" / "incidents").glob("*.json")
    assert json.loads(skipped.read_text())["policy"] == "skip_step"
    assert not (out / "logs" / "clean" / "version_0" / "sdc").exists()


def test_report_and_exclude_list_read_incidents_back(out: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from sdc_core.cli import main as sdc

    assert sdc(["report", str(out / "logs"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and rows[0]["named"] >= 1 and "nonfinite_gradient" in {c for r in rows for c in r["checks"]}
    assert sdc(["exclude-list", str(out / "logs"), "--format", "lines"]) == 0
    hosts = capsys.readouterr().out.split()
    assert hosts == sorted({r["host"] for r in rows if r["named"]})


def test_heal_restores_identical_replicas_and_training_finishes(out: Path) -> None:
    import json

    per_rank = results(out, "heal", WORLD)
    for r in per_rank:
        assert r["error"] is None and r["global_step"] == 8 and r["finite"]
        state = r["states"]["WeightFingerprintCheck"]
        assert state["failures"] == 1 and state["extra"]["heals"] == 1 and state["last_verified_step"] == 7
    assert len({r["weights"] for r in per_rank}) == 1  # bit-identical again
    (path,) = (out / "logs" / "heal" / "version_0" / "sdc" / "incidents").glob("*.json")
    incident = json.loads(path.read_text())
    assert (incident["policy"], incident["rank"], incident["step"]) == ("heal", 2, 3)
    assert incident["error"]["details"]["action"] == "healed from rank 0"


def test_heal_stops_after_max_heals(out: Path) -> None:
    err = error_on_every_rank(out, "heal_limit", "FingerprintMismatchError")
    assert (err["rank"], err["step"]) == (1, 6)
    assert err["details"]["action"] == "not healed: more than max_heals=2 heals"


def test_transient_replay_fault_skips_the_step_persistent_one_raises(out: Path) -> None:
    import json

    per_rank = results(out, "replay_transient_skip", WORLD)
    for r in per_rank:
        assert r["error"] is None and r["global_step"] == 8
        assert r["states"]["RingReplayAudit"]["extra"]["skipped_steps"] == 1
        assert r["states"]["WeightFingerprintCheck"]["failures"] == 0
    assert len({r["weights"] for r in per_rank}) == 1
    (path,) = (out / "logs" / "replay_transient_skip" / "version_0" / "sdc" / "incidents").glob("*.json")
    incident = json.loads(path.read_text())
    assert (incident["policy"], incident["rank"], incident["step"]) == ("skip_step", 2, 2)
    assert incident["error"]["details"]["classification"] == "transient"
    err = error_on_every_rank(out, "replay_persistent_skip", "ReplayMismatchError")
    assert (err["rank"], err["details"]["classification"]) == (1, "persistent")


def test_rollback_reloads_the_newest_verified_checkpoint(out: Path) -> None:
    import json

    per_rank = results(out, "rollback", WORLD)
    for r in per_rank:
        assert r["error"] is None and r["global_step"] == 8 and r["finite"]
        assert r["states"]["WeightFingerprintCheck"]["extra"]["rollbacks"] == 1
    assert len({r["weights"] for r in per_rank}) == 1  # replicas identical again
    (path,) = (out / "logs" / "rollback" / "version_0" / "sdc" / "incidents").glob("*.json")
    incident = json.loads(path.read_text())
    assert (incident["policy"], incident["rank"], incident["step"]) == ("rollback", 2, 4)
    action = incident["error"]["details"]["action"]
    assert action.startswith("rolled back to") and action.endswith("(step 4)")


def test_rollback_without_a_checkpoint_fails_clearly(out: Path) -> None:
    err = error_on_every_rank(out, "rollback_none", "NonFiniteGradientError")
    assert err["details"]["action"].startswith("rollback failed: no checkpoint verified clean at or before step 2")


def test_a_check_of_ones_own_runs_in_every_phase_on_every_rank_and_its_verdict_reaches_all(out: Path) -> None:
    """``StepCheckCallback(PhaseRecorder)``: one class and one registration; the driver runs it through the phases
    in the step's order on every rank, and what it raises is delivered like a built-in verdict."""
    err = error_on_every_rank(out, "own_check", "SDCError")
    assert (err["step"], err["rank"], err["suspects"]) == (3, 1, [1]) and "phase recorder" in err["message"]
    for r in results(out, "own_check", WORLD):
        steps = [[name, step] for name, step, *_ in r["seen"]]
        assert steps[:3] == [["after_backward", 0], ["before_update", 0], ["after_update", 0]], steps
        assert [s for s in steps if s[0] == "before_update"] == [["before_update", i] for i in range(4)]
        assert all(e[2] is True for e in r["seen"] if e[0] in ("after_backward", "after_update"))  # agreed; updated
        assert r["global_step"] == 3  # stopped before the update of step 3
        assert r["states"]["StepCheckCallback"]["runs"] == 4 and r["states"]["StepCheckCallback"]["failures"] == 1
    incidents = list((out / "logs" / "own_check" / "version_0" / "sdc" / "incidents").glob("*.json"))
    assert len(incidents) == 1 and json.loads(incidents[0].read_text())["step"] == 3
