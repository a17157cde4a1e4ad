"""Issue 11 (items 2 and 3): the final weights are compared before training returns, no
checkpoint is written from a replica the check has not verified, every load verifies, and a
resume keeps every comparison. Real ``torchrun`` + ``Trainer(strategy="ddp")`` and real
``accelerate launch``, 3 gloo CPU ranks each (one launch per framework)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, must_run, results, torchrun, worker_env

BIN = Path(sys.executable).parent
HERE = Path(__file__).parent
LIGHTNING = ["end_flip", "save_flip", "uninterrupted", "first_half", "resumed"]
ACCELERATE = ["end_flip", "save_flip", "clean_save", "clean_load", "tampered_load"]


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verdict_pl")
    torchrun(HERE / "verdict_scenarios.py", out, LIGHTNING, 3, cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verdict_acc")
    env = worker_env() | {"HF_HOME": str(out / "hf"), "ACCELERATE_USE_CPU": "1"}
    script = HERE / "verdict_scenarios_accelerate.py"
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3",
           str(script), "--out", str(out), "--only", ",".join(ACCELERATE)]  # fmt: skip
    must_run(cmd, env, cwd=ROOT)
    return out


def _same_error(per_rank: list[dict[str, Any]], key: str = "error") -> dict[str, Any]:
    errors = [r[key] for r in per_rank]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == "FingerprintMismatchError"
    return errors[0]


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "sdc"), "verify-checkpoint", str(path)], env=worker_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# -- Lightning ---------------------------------------------------------------------------------


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_lightning_flip_after_the_last_compared_step_is_caught_at_the_end(lightning_run: Path) -> None:
    # cadence 3 with 8 steps: steps 2 and 5 are compared; the flip comes after step 7
    err = _same_error(results(lightning_run, "end_flip", 3))
    assert (err["rank"], err["step"]) == (1, 7)
    assert "body.weight" in err["message"]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_lightning_checkpoint_is_not_written_from_an_unverified_replica(lightning_run: Path) -> None:
    per_rank = results(lightning_run, "save_flip", 3)
    err = _same_error(per_rank)
    assert (err["rank"], err["step"]) == (0, 7)  # the writing rank, caught before writing
    ckpts = per_rank[0]["ckpts"]
    assert list(ckpts) == ["epoch=0-step=4.ckpt"]  # the step-8 checkpoint was never written
    folder = lightning_run / "ckpts" / "save_flip"
    proc = _verify(folder / "epoch=0-step=4.ckpt")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the one written is clean


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_lightning_checkpoints_hold_the_comparison_of_the_saved_state(lightning_run: Path) -> None:
    for name, ckpt in results(lightning_run, "uninterrupted", 3)[0]["ckpts"].items():
        assert ckpt["version"] == 2
        # the state in the file was compared before it was written, and the counters say so
        assert ckpt["stats"]["last_verified_step"] == ckpt["global_step"] - 1, name
    final = lightning_run / "ckpts" / "uninterrupted" / "epoch=0-step=6.ckpt"
    proc = _verify(final)
    assert proc.returncode == 0 and "clean" in proc.stdout.lower(), proc.stdout + proc.stderr


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_lightning_resume_loses_no_comparison(lightning_run: Path) -> None:
    whole = results(lightning_run, "uninterrupted", 3)
    resumed = results(lightning_run, "resumed", 3)
    for a, b in zip(whole, resumed, strict=True):
        assert a["error"] is None and b["error"] is None and b["global_step"] == 6
        assert b["states"]["WeightFingerprintCheck"] == a["states"]["WeightFingerprintCheck"]
    assert whole[0]["states"]["WeightFingerprintCheck"]["last_verified_step"] == 5


# -- Accelerate --------------------------------------------------------------------------------


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_accelerate_flip_after_the_last_step_is_caught_by_finish(accelerate_run: Path) -> None:
    err = _same_error(results(accelerate_run, "end_flip", 3))
    assert err["rank"] == 1 and "stem.weight" in err["message"]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_accelerate_save_state_after_a_flip_raises_before_writing(accelerate_run: Path) -> None:
    per_rank = results(accelerate_run, "save_flip", 3)
    err = _same_error(per_rank, "save_error")
    assert err["rank"] == 0 and "head.weight" in err["message"]
    for r in per_rank:
        assert not any(f.startswith(("model", "optimizer", "custom")) for f in r["saved_files"]), r["saved_files"]
        assert not r["folder_left"]  # the refused save leaves no empty folder behind


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_accelerate_load_state_verifies_what_it_loaded(accelerate_run: Path) -> None:
    for r in results(accelerate_run, "clean_save", 3):
        assert r["save_error"] is None and "model.safetensors" in r["saved_files"]
    for r in results(accelerate_run, "clean_load", 3):
        assert r["load_error"] is None and r["error"] is None and r["step"] == 6
    err = _same_error(results(accelerate_run, "tampered_load", 3), "load_error")
    assert err["details"]["checkpoint_changed_tensors"] == ["model/stem.weight"]
