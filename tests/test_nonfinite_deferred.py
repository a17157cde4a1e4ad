"""The non-finite check without a synchronous collective: real ``torchrun`` (Lightning DDP) and
``accelerate launch`` runs, 3 gloo CPU ranks.

Clean steps start one asynchronous all-reduce (the flag) and, with ``on_failure="raise"``, make no
host read of the step's own evidence; the verdict is read one step later and names the step it
belongs to; names come from the local flags, so gradient clipping cannot contaminate them; no
checkpoint is written after an unread non-finite step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import must_run, results, worker_env

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
WORLD = 3


@pytest.fixture(scope="module")
def out(lightning_ddp: Path) -> Path:
    """The scenarios of ``nonfinite_scenarios.py``, run in the launch shared with test_lightning_ddp."""
    return lightning_ddp


def same_error(out: Path, scenario: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    per_rank = results(out, scenario, WORLD)
    errors = [r["error"] for r in per_rank]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == "NonFiniteGradientError"
    return errors[0], per_rank


def test_clean_steps_start_one_all_reduce_and_raise_reads_nothing_in_the_step(out: Path) -> None:
    for r in results(out, "probe_raise", WORLD):
        assert r["error"] is None and r["states"]["NonFiniteGradientCheck"]["runs"] == 6
        steps = r["probe"]
        # the flag's all-reduce, started in the step; its read one step later starts none
        assert all(s.get("collectives_now", 0) == 1 and s.get("collectives_late", 0) == 0 for s in steps), steps
        assert all(s.get("reads_now", 0) == 0 for s in steps), steps  # nothing waits for this step's gradients
        assert [s.get("reads_late", 0) for s in steps] == [0] + [1] * 5  # the previous step's flag, once
    for r in results(out, "probe_skip", WORLD):  # the probe sees reads: skip_step decides before the update
        assert r["error"] is None
        assert all(s.get("collectives_now", 0) == 1 and s.get("reads_now", 0) == 1 for s in r["probe"]), r["probe"]


def test_verdict_read_one_step_later_names_its_step_and_only_the_local_offender(out: Path) -> None:
    err, per_rank = same_error(out, "clip_nan")
    # clipping after the all-reduce made every gradient NaN on every rank: only the local flags tell
    assert (err["step"], err["rank"], err["suspects"]) == (3, 2, [2])
    assert err["details"]["pattern"] == "one_rank"
    assert err["details"]["parameters"] == {"2": ["body.weight"]}
    assert all(r["global_step"] == 4 for r in per_rank)  # read before the next step's backward


def test_a_nan_sample_is_the_data_not_the_rank(out: Path) -> None:
    """At the README's defaults the verdict is read after the update, where nothing can be recomputed; the batch rank 1
    ran is still kept (the screen's) and held the NaN: no rank named, no host to take out."""
    err, _ = same_error(out, "nan_sample")
    assert (err["step"], err["rank"], err["suspects"], err["hosts"]) == (3, None, [], {})
    assert err["details"]["pattern"] == "bad_inputs" and list(err["details"]["parameters"]) == ["1"]
    assert "the micro-batches of rank 1 held NaN/Inf values" in err["message"]


def test_a_diverging_run_whose_values_overflow_first_on_one_rank_names_no_rank(out: Path) -> None:
    """The README's defaults, a learning rate that diverges the run, rank 1's values overflowing first, alone (the SDC
    signature after the update): the screen saw the ranks' median loss grow 2^16 and more before, so no rank is named
    and no host taken out (ad1935a named rank 1 faulty here)."""
    err, per_rank = same_error(out, "diverging")
    assert (err["rank"], err["suspects"], err["hosts"], err["details"]["pattern"]) == (None, [], {}, "diverging"), err
    assert list(err["details"]["parameters"]) == ["1"], err  # rank 1's local gradients alone
    assert "a diverging run, not a faulty device: the ranks' median loss had grown from 2^" in err["message"]
    assert "lower the learning rate" in err["message"] and all(r["global_step"] == err["step"] + 1 for r in per_rank)


def test_non_finite_last_step_is_read_at_the_end_of_training(out: Path) -> None:
    err, per_rank = same_error(out, "nan_last_step")
    assert (err["step"], err["rank"], err["details"]["parameters"]) == (7, 1, {"1": ["head.weight"]})
    assert all(r["global_step"] == 8 for r in per_rank)


def test_no_checkpoint_is_written_after_an_unread_non_finite_step(out: Path) -> None:
    err, _ = same_error(out, "nan_checkpoint")
    assert (err["step"], err["rank"]) == (2, 0)
    written = sorted(p.name for p in (out / "ckpts" / "nan_checkpoint").glob("*.ckpt"))
    assert written == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]  # after steps 0 and 1, not after step 2


def test_warn_reads_one_step_later_and_training_goes_on(out: Path) -> None:
    for r in results(out, "nan_warn", WORLD):
        assert r["error"] is None and r["global_step"] == 8
        assert r["states"]["NonFiniteGradientCheck"]["failures"] >= 1
    folder = out / "logs" / "nan_warn" / "version_0" / "sdc" / "incidents"
    incidents = sorted((json.loads(p.read_text()) for p in folder.glob("*.json")), key=lambda i: i["step"])
    first = incidents[0]
    assert (first["step"], first["rank"], first["policy"]) == (5, 1, "warn")
    assert first["error"]["details"]["parameters"] == {"1": ["body.weight"]}


@pytest.fixture(scope="module")
def acc_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nonfinite_acc")
    env = worker_env() | {"ACCELERATE_USE_CPU": "1", "ACCELERATE_SDC_CONFIG_FILE": os.devnull,
                          "HF_HOME": str(path / "hf")}  # fmt: skip
    must_run([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(WORLD),
              str(HERE / "nonfinite_accelerate_scenarios.py"), "--out", str(path)], env, cwd=path)  # fmt: skip
    return path


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_accelerate_clip_grad_norm_does_not_change_the_names(acc_out: Path) -> None:
    err, per_rank = same_error(acc_out, "clip")
    incidents = [json.loads(p.read_text()) for p in (acc_out / "run" / "sdc" / "incidents").glob("*.json")]
    assert sorted((i["step"], i["rank"], i["policy"]) for i in incidents) == [(2, 1, "raise")] * 2  # two scenarios
    assert (err["step"], err["rank"], err["details"]["pattern"]) == (2, 1, "one_rank")
    assert err["details"]["parameters"] == {"1": ["stem.weight"]}  # not every parameter the clipping hit
    assert all(r["raised_at"] == 3 for r in per_rank)  # read at the next optimizer.step


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_accelerate_save_state_after_an_unread_non_finite_step_raises(acc_out: Path) -> None:
    err, per_rank = same_error(acc_out, "save_after_nan")
    assert (err["step"], err["rank"]) == (2, 1)
    for r in per_rank:
        assert r["saved"] == [3] and r["raised_at"] == 3
        assert not any("model" in f or "optimizer" in f for f in r["state_files"])  # nothing written
