"""Accelerate scenarios of issue 11 (the last state, save_state, load_state): run under
``accelerate launch`` with 3 CPU processes; each writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate_scenarios import Regressor, loader
from scenario_runner import fresh, parse, run_each

from accelerate_sdc import SDCError, SDCHooks
from sdc_core.faults.inject import flip_bit


def train(acc: Accelerator, steps: int, flip_rank: int | None = None, save: Path | None = None,
          load: Path | None = None, **settings: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` sync steps; then (optionally) flip a weight bit on ``flip_rank`` AFTER the
    last ``optimizer.step()``, call ``finish()``, and ``save_state(save)``."""
    fresh(acc, 5)
    model, opt = Regressor(), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sdc = SDCHooks(acc, replay_every_n_steps=0, **settings)
    model, opt, data = acc.prepare(model, opt, loader())
    sdc.attach(model, opt)
    result: dict[str, Any] = {"error": None, "save_error": None, "load_error": None}
    if load is not None:
        try:
            acc.load_state(str(load))
        except SDCError as err:
            result["load_error"] = err.to_dict()
            return result
    for batch in data:
        loss = model(*batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if sdc.step >= steps:
            break
    if flip_rank == acc.process_index:
        flip_bit(acc.unwrap_model(model).stem.weight, 5, 17)
    try:
        sdc.finish()
    except SDCError as err:
        result["error"] = err.to_dict()
    if save is not None:
        try:
            acc.save_state(str(save))
        except SDCError as err:
            result["save_error"] = err.to_dict()
        acc.wait_for_everyone()
        result["saved_files"] = sorted(p.name for p in save.iterdir()) if save.exists() else []
    result["step"] = sdc.step
    result["state"] = {k: v for k, v in sdc.state_dict().items() if k != "sdc_fingerprint"}
    return result


def tamper(folder: Path, acc: Accelerator) -> None:
    """Flip one bit of ``stem.weight`` in the saved model file (main process), then wait."""
    if acc.is_main_process:
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        flip_bit(tensors["stem.weight"], 3, 22)
        save_file(tensors, str(path))
    acc.wait_for_everyone()


def scenarios(out: Path) -> dict[str, Any]:
    return {
        # cadence 3, 8 steps; a flip after the last optimizer.step(), then finish()
        "end_flip": lambda acc: train(acc, 8, flip_rank=1, fingerprint_every_n_steps=3),
        # finish() was clean; a flip on the writing rank afterwards; save_state must refuse
        "save_flip": lambda acc: train(acc, 4, save=out / "save_flip", fingerprint_every_n_steps=1),
        "clean_save": lambda acc: train(acc, 3, save=out / "clean_save", fingerprint_every_n_steps=1),
        "clean_load": lambda acc: train(acc, 6, load=out / "clean_save", fingerprint_every_n_steps=1),
        "tampered_load": lambda acc: (tamper(out / "clean_save", acc),
                                      train(acc, 6, load=out / "clean_save", fingerprint_every_n_steps=1))[1],
    }  # fmt: skip


def main() -> None:
    args = parse()
    acc = Accelerator(project_dir=str(args.out))  # incidents go under the test folder
    table = scenarios(args.out) | {"save_flip": _save_flip(args.out)}
    run_each(args.only, lambda name: table[name](acc), args.out, acc.process_index)
    acc.end_training()


def _save_flip(out: Path) -> Any:
    """Train 4 steps and finish cleanly, THEN flip a bit on rank 0 (the writer), then save_state."""

    def run(acc: Accelerator) -> dict[str, Any]:
        fresh(acc, 5)
        model = Regressor()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sdc = SDCHooks(acc, replay_every_n_steps=0, fingerprint_every_n_steps=1)
        model, opt, data = acc.prepare(model, opt, loader())
        sdc.attach(model, opt)
        for batch in data:
            acc.backward(model(*batch).loss)
            opt.step()
            opt.zero_grad()
            if sdc.step >= 4:
                break
        sdc.finish()
        if acc.process_index == 0:
            flip_bit(acc.unwrap_model(model).head.weight, 7, 25)
        result: dict[str, Any] = {"save_error": None}
        try:
            acc.save_state(str(out / "save_flip"))
        except SDCError as err:
            result["save_error"] = err.to_dict()
        acc.wait_for_everyone()
        folder = out / "save_flip"
        result["saved_files"] = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        result["folder_left"] = folder.exists()
        return result

    return run


if __name__ == "__main__":
    main()
