"""The DDP gradient tap (per-parameter gradient hooks ahead of DDP's own reduction) on raw DDP,
3 gloo ranks under torchrun: bit-identical training, a local NaN named with and without bucket
views and in channels-last gradients, gradient accumulation, a user's communication hook (also
one that zeroes non-finite reduced values), clean removal."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import results, torchrun

SCRIPT = Path(__file__).with_name("gradient_tap_scenarios.py")
WORLD = 3


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tap")
    torchrun(SCRIPT, out, None, WORLD)
    return out


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_training_is_bit_identical_with_the_tap_on_and_off(out: Path) -> None:
    for plain, tapped in (("plain", "tapped"), ("plain_view", "tapped_view")):
        off, on = results(out, plain, WORLD), results(out, tapped, WORLD)
        assert len({r["weights"] for r in off}) == 1  # replicas agree
        assert off[0]["weights"] == on[0]["weights"], plain
        assert all(r["error"] is None for r in on)
        # one norm per parameter on every sync backward (6 parameters), nothing otherwise
        assert on[0]["recorded"] == [6] * 4


@pytest.mark.parametrize("scenario", ["nan", "nan_view"])
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_nan_on_one_rank_is_named_on_every_rank_in_its_step(out: Path, scenario: str) -> None:
    for r in results(out, scenario, WORLD):
        assert r["error"] == {"step": 2, "rank": 1, "parameters": {"1": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_static_graph_ddp_trains_identically_and_carries_the_flag(out: Path) -> None:
    off, on = results(out, "plain_static", WORLD), results(out, "tapped_static", WORLD)
    assert off[0]["weights"] == on[0]["weights"] and on[0]["error"] is None
    for r in results(out, "nan_static_first", WORLD):  # the first iteration: DDP delays its reduction
        assert r["error"] == {"step": 0, "rank": 1, "parameters": {"1": ["0.weight"]}}
    for r in results(out, "nan_static", WORLD):
        assert r["error"] == {"step": 2, "rank": 0, "parameters": {"0": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_reentrant_checkpointing_is_read_whole_and_named(out: Path) -> None:
    """Parameter gradients computed in nested backward passes (the last layer's first): every
    parameter is still read, and the first layer's NaN names its rank, not "all ranks"."""
    off, on = results(out, "plain_ckpt", WORLD), results(out, "tapped_ckpt", WORLD)
    assert off[0]["weights"] == on[0]["weights"] and on[0]["error"] is None
    assert on[0]["recorded"] == [6] * 4
    for r in results(out, "nan_ckpt", WORLD):
        assert r["error"] == {"step": 1, "rank": 1, "parameters": {"1": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_channels_last_gradients_train_identically_and_carry_the_flag(out: Path) -> None:
    off, on = results(out, "plain_conv", WORLD), results(out, "tapped_conv", WORLD)
    assert off[0]["weights"] == on[0]["weights"] and on[0]["error"] is None
    assert not on[0]["grad_contiguous"]  # the case under test: a non-contiguous gradient
    for r in results(out, "nan_conv", WORLD):
        assert r["error"] == {"step": 3, "rank": 2, "parameters": {"2": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_nan_in_a_no_sync_micro_batch_is_seen_at_the_sync_one(out: Path) -> None:
    for r in results(out, "nan_accumulated", WORLD):
        assert r["error"] == {"step": 1, "rank": 2, "parameters": {"2": ["0.weight"]}}
        assert r["recorded"][:3] == [0, 0, 6]  # only the sync micro-batch is read


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_users_comm_hook_registered_first_composes_with_the_tap(out: Path) -> None:
    for r in results(out, "nan_comm_hook", WORLD):
        assert r["inner_hook"] == "allreduce_hook"
        assert r["error"] == {"step": 1, "rank": 0, "parameters": {"0": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_comm_hook_that_zeroes_non_finite_reduced_values_cannot_hide_a_local_nan(out: Path) -> None:
    """The reduced gradients are finite here (the hook zeroed the NaN): the ranks' shared flags name it."""
    for r in results(out, "nan_sanitised", WORLD):
        assert r["inner_hook"] == "sanitising_hook"
        assert r["error"] == {"step": 1, "rank": 0, "parameters": {"0": ["0.weight"]}}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_the_tap_reads_nothing_outside_ddp_and_removes_its_hooks(out: Path) -> None:
    for r in results(out, "tapped", WORLD):
        assert r["read_outside_ddp"] == 0 and r["hooks_left"] == 0
