"""Lightning ``save_weights_only`` checkpoints are verified before they are written (issue 11):
Lightning calls no callback hook for them, so the SDC callbacks are reached through the
LightningModule's ``on_save_checkpoint``. Real ``torchrun`` + ``Trainer(strategy="ddp")``, 3 gloo
CPU ranks, one launch for the three scenarios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, results, torchrun, worker_env

BIN = Path(sys.executable).parent
HERE = Path(__file__).parent
SCENARIOS = ["wo_flip", "wo_nonfinite", "wo_clean"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weights_only")
    torchrun(HERE / "weights_only_scenarios.py", out, SCENARIOS, 3, timeout=420, cwd=ROOT)
    return out


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "sdc"), "verify-checkpoint", str(path)], env=worker_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_flip_before_a_weights_only_checkpoint_raises_before_it_is_written(run: Path) -> None:
    per_rank = results(run, "wo_flip", 3)
    errors = [r["error"] for r in per_rank]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors  # every rank, same verdict
    assert errors[0]["type"] == "FingerprintMismatchError"
    assert (errors[0]["rank"], errors[0]["step"]) == (0, 7) and "head.weight" in errors[0]["message"]
    assert all(r["global_step"] == 8 for r in per_rank)  # raised at the step-8 checkpoint, not later
    # the step-8 file was never written; the step-4 one is weights only, fingerprinted and clean
    assert per_rank[0]["ckpts"] == {
        "wo_flip/epoch=0-step=4.ckpt": {"global_step": 4, "weights_only": True, "version": 2, "user_key": None}
    }
    proc = _verify(run / "ckpts" / "wo_flip" / "epoch=0-step=4.ckpt")
    assert proc.returncode == 0 and "clean" in proc.stdout.lower(), proc.stdout + proc.stderr


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_unread_nonfinite_verdict_is_read_before_a_weights_only_checkpoint(run: Path) -> None:
    per_rank = results(run, "wo_nonfinite", 3)
    errors = [r["error"] for r in per_rank]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == "NonFiniteGradientError"
    assert (errors[0]["rank"], errors[0]["step"]) == (1, 3)
    assert all(r["global_step"] == 4 for r in per_rank)
    assert per_rank[0]["ckpts"] == {}  # the step-4 checkpoint (built after the NaN step) was not written


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_clean_run_fingerprints_weights_only_checkpoints_and_keeps_the_user_hook(run: Path) -> None:
    per_rank = results(run, "wo_clean", 3)
    for r in per_rank:
        assert r["error"] is None and r["global_step"] == 8
        assert r["saves"] == 6  # the user's on_save_checkpoint: once per file (4 weights-only, 2 full)
        assert r["unrouted"]  # the module's own method is back after fit
        # cadence 3 (steps 2, 5) + one comparison per checkpoint (4 + 2) + the final one: none twice
        assert r["states"]["WeightFingerprintCheck"]["runs"] == 9
    ckpts = per_rank[0]["ckpts"]
    assert sorted(ckpts) == [
        "wo_clean/epoch=0-step=2.ckpt", "wo_clean/epoch=0-step=4.ckpt", "wo_clean/epoch=0-step=6.ckpt",
        "wo_clean/epoch=0-step=8.ckpt", "wo_clean_full/epoch=0-step=4.ckpt", "wo_clean_full/epoch=0-step=8.ckpt",
    ]  # fmt: skip
    for name, ckpt in ckpts.items():
        assert ckpt["weights_only"] == name.startswith("wo_clean/") and ckpt["version"] == 2, name
    proc = _verify(run / "ckpts" / "wo_clean" / "epoch=0-step=8.ckpt")
    assert proc.returncode == 0 and "clean" in proc.stdout.lower(), proc.stdout + proc.stderr


def test_rollback_passes_over_weights_only_checkpoints(tmp_path: Path) -> None:
    import torch

    from sdc_core.io.checkpoints import FINGERPRINT_KEY, fingerprint_checkpoint, newest_verified

    weights = {"layer.weight": torch.arange(6.0).reshape(2, 3)}
    full = {"global_step": 2, "state_dict": weights, "optimizer_states": [{"state": {}, "param_groups": []}]}
    only = {"global_step": 4, "state_dict": weights}
    for name, ckpt in (("full.ckpt", full), ("only.ckpt", only)):
        ckpt[FINGERPRINT_KEY] = fingerprint_checkpoint(ckpt)
        torch.save(ckpt, tmp_path / name)
    skipped: list[str] = []
    # the newer weights-only file is verified clean but holds no optimizer state to roll back to
    assert newest_verified([tmp_path], max_step=10, skipped=skipped) == tmp_path / "full.ckpt"
    assert skipped == [f"{tmp_path / 'only.ckpt'}: weights only (no optimizer state to roll back to)"]


def test_rollback_passes_over_a_checkpoint_that_is_not_a_dict(tmp_path: Path) -> None:
    import torch

    from sdc_core.io.checkpoints import newest_verified

    torch.save(torch.zeros(3), tmp_path / "tensor.ckpt")
    torch.save(7, tmp_path / "number.ckpt")
    skipped: list[str] = []
    # an odd file is passed over with its reason, never raised: every rank waits for this answer
    assert newest_verified([tmp_path], max_step=10, skipped=skipped) is None
    assert skipped == [f"{tmp_path / 'number.ckpt'}: no global_step", f"{tmp_path / 'tensor.ckpt'}: no global_step"]
