"""The ring replay audit on FSDP2 (4 CPU ranks, Lightning ModelParallelStrategy): stateful steps,
the trust rule, the referee round and skip_step; the non-finite check with one small all-reduce
per step. One ``torchrun`` launch of ``tests/sharded_replay_scenarios.py`` over gloo runs every scenario.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sharded import launch, results, same_error

SCENARIOS = Path(__file__).with_name("sharded_replay_scenarios.py")
WORLD = 4


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    names = ["stateful_off", "stateful_on", "opaque", "referee", "referee_skip", "data_fault", "quiet_clean",
             "quiet_nan"]
    return launch(tmp_path_factory.mktemp("sharded_replay"), names, WORLD, script=SCENARIOS)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_stateful_step_under_fsdp2_replays_exactly_without_side_effect(out: Path) -> None:
    """A counter, a torchmetrics metric, an EMA buffer, carried hidden state, a frozen sharded teacher
    updated in place, Python/NumPy RNG, gradient accumulation: exact replays, no alarm, and every
    shard, buffer, attribute, metric and RNG stream ends as with the audit off."""
    on, off = results(out, "stateful_on", WORLD), results(out, "stateful_off", WORLD)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["error"] is None and r_on["global_step"] == 8
        for key in ("weights", "everything", "calls", "seen", "hidden", "rng"):
            assert r_on[key] == r_off[key], key
    assert on[0]["calls"] == 16 and on[0]["seen"] == 512.0  # 16 micro-batches of 8 per rank, x4 ranks
    replay = on[0]["states"]["RingReplayAudit"]
    assert replay["runs"] == 4 and replay["failures"] == 0 and replay["max_diff"] == 0.0


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_step_the_capture_cannot_see_is_refused_on_every_rank_not_blamed(out: Path) -> None:
    err = same_error(out, "opaque", WORLD, "ReplayUnavailableError")
    assert "could not reproduce their own result on their own device" in err["message"]
    assert "not evidence of a faulty device" in err["message"] and "sdc_replay_state()" in err["message"]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_single_disagreeing_pair_is_settled_by_a_referee(out: Path) -> None:
    err = same_error(out, "referee", WORLD, "ReplayMismatchError")
    assert err["rank"] == 2 and err["suspects"] == [2] and err["step"] == 2
    details = err["details"]
    assert details["mismatching_pairs"] == [[2, 3]] and details["referees"] == {"2->3": 0}
    assert details["rulings"] == {"2->3": "referee agrees with the replayer: the owner is faulty"}
    assert details["classification"] == "transient"  # only the first forward of the step was wrong


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_persistent_fault_seen_by_one_pair_is_named_and_not_skipped(out: Path) -> None:
    err = same_error(out, "data_fault", WORLD, "ReplayMismatchError")
    assert err["rank"] == 2 and err["suspects"] == [2] and err["step"] == 2
    assert err["details"]["rulings"] == {"2->3": "referee agrees with the replayer: the owner is faulty"}
    assert err["details"]["classification"] == "persistent"  # on_failure="skip_step" raises all the same


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_skip_step_drops_transient_fault_steps_alike_on_every_rank(out: Path) -> None:
    rows = results(out, "referee_skip", WORLD)
    assert all(r["error"] is None and r["global_step"] == 8 and r["finite"] for r in rows)
    assert all(r["states"]["RingReplayAudit"]["extra"]["skipped_steps"] == 3 for r in rows)  # steps 2, 4, 6


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_nonfinite_check_under_fsdp2_issues_one_small_all_reduce_per_step(out: Path) -> None:
    """The flag rides in the reduce-scatter input; each rank reads its own reduced shard and the
    verdict is agreed by one 4-byte all-reduce per step (a reduced shard is one rank's alone). A
    clean bf16 run raises nothing (bit-identity with the check off: test_sharded.py's clean run)."""
    for r in results(out, "quiet_clean", WORLD):
        assert r["error"] is None and r["global_step"] == 8 and r["in_band"] is True
        assert r["sdc_all_reduces"] == r["states"]["NonFiniteGradientCheck"]["runs"] == 8
        assert r["screen_all_reduces"] == 1  # the screen's width, agreed once at attach
        assert r["other_all_reduces"] == 1  # the start-up gather of the ranks' facts agrees on its outcome
    err = same_error(out, "quiet_nan", WORLD, "NonFiniteGradientError")
    assert err["rank"] == 1 and err["step"] == 3 and err["details"]["pattern"] == "one_rank"
    assert len({r["sdc_all_reduces"] for r in results(out, "quiet_nan", WORLD)}) == 1  # every rank alike


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("hsdp_replay"), ["hsdp_stateful", "hsdp_referee"], 6, script=SCENARIOS)


@pytest.mark.slow  # a second 6-rank launch (the default run holds one per topology)
def test_hsdp_stateful_replay_is_quiet_and_a_referee_names_the_rank(hsdp: Path) -> None:
    rows = results(hsdp, "hsdp_stateful", 6)
    assert all(r["error"] is None and r["global_step"] == 8 for r in rows)
    assert rows[0]["states"]["RingReplayAudit"]["runs"] == 4 and rows[0]["states"]["RingReplayAudit"]["max_diff"] == 0
    err = same_error(hsdp, "hsdp_referee", 6, "ReplayMismatchError")
    assert err["rank"] == 3
    assert err["details"]["rulings"] == {"3->4": "referee agrees with the replayer: the owner is faulty"}
