"""Lightning weights-only checkpoints (issue 11): run under ``torchrun``.

``ModelCheckpoint(save_weights_only=True)`` gets no callback hook from Lightning; these scenarios
show the SDC checks still read their verdicts and compare the replicas before such a file is
written. ``torchrun --nproc-per-node 3 tests/weights_only_scenarios.py --out DIR --only a,b``
writes ``DIR/<scenario>.rank<r>.json`` (see ddp_scenarios.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_scenarios import Net, fit
from scenario_runner import main_for

from lightning_sdc import Fault, FaultInjector, NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck


class NetWithSaveHook(Net):
    """Overrides ``on_save_checkpoint``: the user's hook must still run once per checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.saves = 0

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.saves += 1
        checkpoint["user_key"] = self.saves


def _files(folder: Path) -> dict[str, dict[str, Any]]:
    """What each checkpoint in ``folder`` holds, by ``<folder name>/<file name>``."""
    out = {}
    for path in sorted(folder.glob("*.ckpt")):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        out[f"{folder.name}/{path.name}"] = {
            "global_step": ckpt["global_step"],
            "weights_only": "optimizer_states" not in ckpt and "callbacks" not in ckpt,
            "version": ckpt.get("sdc_fingerprint", {}).get("version"),
            "user_key": ckpt.get("user_key"),
        }
    return out


def _weights_only(o: Path, name: str, every: int = 4) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=o / "ckpts" / name, every_n_train_steps=every, save_top_k=-1, save_weights_only=True)


def wo_flip(o: Path) -> dict[str, Any]:
    """Cadence 3 (steps 2, 5 compared); a weights-only checkpoint every 4 steps; rank 0 (the
    writer) flips a bit right after step 7, the update before the step-8 checkpoint."""
    flip = Fault("weight_bit_flip", rank=0, step=7, target="head.weight", index=2, bit=20)
    callbacks = [WeightFingerprintCheck(every_n_steps=3), _weights_only(o, "wo_flip"), FaultInjector([flip])]
    result = fit(o, "wo_flip", callbacks)
    result["ckpts"] = _files(o / "ckpts" / "wo_flip")
    return result


def wo_nonfinite(o: Path) -> dict[str, Any]:
    """Rank 1's local gradient is NaN at step 3; the verdict (read one step later) is still
    unread when the step-4 weights-only checkpoint is built, and must be read there."""
    nan = Fault("nonfinite_gradient", rank=1, step=3, target="body.weight")
    callbacks = [NonFiniteGradientCheck(), _weights_only(o, "wo_nonfinite"), FaultInjector([nan])]
    result = fit(o, "wo_nonfinite", callbacks)
    result["ckpts"] = _files(o / "ckpts" / "wo_nonfinite")
    return result


def wo_clean(o: Path) -> dict[str, Any]:
    """All three checks, a weights-only checkpoint every 2 steps and a full one every 4, a user
    ``on_save_checkpoint``: no alarm, every file fingerprinted, the user's hook once per file, and
    the module's own method back after ``fit``."""
    model = NetWithSaveHook()
    full = ModelCheckpoint(dirpath=o / "ckpts" / "wo_clean_full", every_n_train_steps=4, save_top_k=-1)
    callbacks = [NonFiniteGradientCheck(), RingReplayAudit(every_n_steps=2), WeightFingerprintCheck(every_n_steps=3),
                 _weights_only(o, "wo_clean", every=2), full]  # fmt: skip
    result = fit(o, "wo_clean", callbacks, model=model)
    result["ckpts"] = _files(o / "ckpts" / "wo_clean") | _files(o / "ckpts" / "wo_clean_full")
    result["saves"] = model.saves
    result["unrouted"] = "on_save_checkpoint" not in vars(model)
    return result


SCENARIOS: dict[str, Any] = {"wo_flip": wo_flip, "wo_nonfinite": wo_nonfinite, "wo_clean": wo_clean}


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
