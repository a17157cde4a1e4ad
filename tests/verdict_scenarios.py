"""Lightning scenarios of issue 11 (the last state, checkpoints, resume): run under ``torchrun``.

``torchrun --nproc-per-node 3 tests/verdict_scenarios.py --out DIR --only a,b`` runs the named
scenarios in one process group and writes ``DIR/<scenario>.rank<r>.json`` (see ddp_scenarios.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_scenarios import fit
from scenario_runner import main_for

from lightning_sdc import Fault, FaultInjector, WeightFingerprintCheck


def _ckpts(folder: Path) -> dict[str, dict[str, Any]]:
    """What each checkpoint in ``folder`` holds: step, fingerprint version, the check's counters."""
    out = {}
    for path in sorted(folder.glob("*.ckpt")):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        out[path.name] = {
            "global_step": ckpt["global_step"],
            "version": ckpt.get("sdc_fingerprint", {}).get("version"),
            "stats": next((v for k, v in ckpt["callbacks"].items() if k.startswith("WeightFingerprintCheck")), None),
        }
    return out


def end_flip(o: Path) -> dict[str, Any]:
    """Cadence 3, 8 steps: the last update (step 7) is not due; rank 1 flips a bit right after it."""
    flip = Fault("weight_bit_flip", rank=1, step=7, target="body.weight", index=3, bit=13)
    return fit(o, "end_flip", [WeightFingerprintCheck(every_n_steps=3), FaultInjector([flip])])


def save_flip(o: Path) -> dict[str, Any]:
    """Cadence 3, a checkpoint every 4 steps; rank 0 (the writer) flips a bit after step 7."""
    ckpt = ModelCheckpoint(dirpath=o / "ckpts" / "save_flip", every_n_train_steps=4, save_top_k=-1)
    flip = Fault("weight_bit_flip", rank=0, step=7, target="head.weight", index=2, bit=20)
    result = fit(o, "save_flip", [WeightFingerprintCheck(every_n_steps=3), ckpt, FaultInjector([flip])])
    result["ckpts"] = _ckpts(o / "ckpts" / "save_flip")
    return result


def through(o: Path, name: str, steps: int, ckpt_path: str | None = None) -> dict[str, Any]:
    ckpt = ModelCheckpoint(dirpath=o / "ckpts" / name, every_n_train_steps=3, save_top_k=-1)
    result = fit(o, name, [WeightFingerprintCheck(every_n_steps=1), ckpt], steps=steps, ckpt_path=ckpt_path)
    result["ckpts"] = _ckpts(o / "ckpts" / name)
    return result


SCENARIOS: dict[str, Any] = {
    "end_flip": end_flip,
    "save_flip": save_flip,
    "uninterrupted": lambda o: through(o, "uninterrupted", steps=6),
    "first_half": lambda o: through(o, "first_half", steps=3),
    "resumed": lambda o: through(o, "resumed", 6, ckpt_path=str(o / "ckpts" / "first_half" / "epoch=0-step=3.ckpt")),
}  # fmt: skip


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
