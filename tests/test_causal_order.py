"""Verdicts in causal order under Lightning DDP (3 gloo CPU ranks, ``Trainer(strategy="ddp")``).

A weight flipped on one rank after step ``s`` makes the ring replay of step ``s + 1`` disagree;
every rank must raise the weight fault (``FingerprintMismatchError`` at step ``s`` naming the
rank and the tensor), whatever the order of the callbacks. Real ``torchrun`` launches of
``tests/ddp_scenarios.py``: the default run reads the launch it shares with test_lightning_ddp
(``conftest.lightning_ddp``), the rest is marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SCENARIOS, results, torchrun

WORLD = 3


def same_error(out: Path, scenario: str) -> dict[str, Any]:
    """The error every rank raised: one and the same on all of them."""
    errors = [r["error"] for r in results(out, scenario, WORLD)]
    assert all(e is not None for e in errors), errors
    assert all(e == errors[0] for e in errors), errors
    return errors[0]


def assert_weight_fault(err: dict[str, Any], step: int, tensor: str) -> None:
    assert err["type"] == "FingerprintMismatchError", err  # before the fix: ReplayMismatchError one step later
    assert (err["step"], err["rank"], err["suspects"]) == (step, 1, [1])
    assert err["details"]["differing_tensors"] == {"1": [f"param:{tensor}"]}


@pytest.fixture(scope="module")
def flips(lightning_ddp: Path) -> Path:
    return lightning_ddp  # "flip" and "flip_reversed" are among conftest.LIGHTNING_DDP_DEFAULT


@pytest.mark.parametrize("scenario", ["flip", "flip_reversed"])
def test_weight_flip_is_reported_as_a_weight_fault_at_its_step_in_either_callback_order(
    flips: Path, scenario: str
) -> None:
    err = same_error(flips, scenario)
    assert_weight_fault(err, 3, "body.weight")  # flipped after step 3; the replay of step 4 would disagree
    assert all(r["global_step"] == 4 for r in results(flips, scenario, WORLD))  # raised before step 4's update
    incidents = sorted(p.name for p in (flips / "logs" / scenario / "version_0" / "sdc" / "incidents").glob("*.json"))
    assert len(incidents) == 1 and "weight_fingerprint" in incidents[0], incidents  # no replay incident


@pytest.fixture(scope="module")
def more(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scenarios = ["flip_cadence", "flip_no_fingerprint", "flip_heal", "compute"]
    out = tmp_path_factory.mktemp("causal_more")
    torchrun(SCENARIOS, out, scenarios, WORLD)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["flip_cadence", "flip_no_fingerprint"])
def test_replay_disagreement_with_differing_weights_is_a_weight_fault(more: Path, scenario: str) -> None:
    err = same_error(more, scenario)
    assert_weight_fault(err, 2, "head.weight")  # flipped after step 2; compared when the replay of step 3 disagreed
    incidents = list((more / "logs" / scenario / "version_0" / "sdc" / "incidents").glob("*.json"))
    assert [json.loads(p.read_text())["error"]["type"] for p in incidents] == ["FingerprintMismatchError"]


@pytest.mark.slow
def test_wrong_result_with_equal_weights_stays_a_compute_fault(more: Path) -> None:
    err = same_error(more, "compute")
    assert err["type"] == "ReplayMismatchError" and (err["step"], err["rank"]) == (3, 1)


@pytest.mark.slow
def test_replay_disagreement_explained_by_a_healed_replica_drops_the_step_and_training_goes_on(more: Path) -> None:
    per_rank = results(more, "flip_heal", WORLD)
    assert all(r["error"] is None and r["global_step"] == 6 and r["finite"] for r in per_rank), per_rank
    assert len({r["weights"] for r in per_rank}) == 1  # replicas identical again
    assert per_rank[0]["states"]["WeightFingerprintCheck"]["extra"]["heals"] == 1
    folder = more / "logs" / "flip_heal" / "version_0" / "sdc" / "incidents"
    incidents = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    assert [(i["policy"], i["rank"], i["step"]) for i in incidents] == [("heal", 1, 2)]
