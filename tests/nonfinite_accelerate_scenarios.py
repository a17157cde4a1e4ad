"""Accelerate scenarios of the non-finite check with gradient clipping: run under ``accelerate launch``.

``accelerate launch --multi_gpu --num_processes 3 tests/nonfinite_accelerate_scenarios.py --out DIR``
(with ``ACCELERATE_USE_CPU=1``) runs each scenario with one ``Accelerator`` and writes
``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate_scenarios import Regressor, loader
from scenario_runner import fresh, parse, run_each

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector


def listing(folder: Path) -> list[str]:
    """The names in ``folder``, or none: after a refused save every rank removes the empty folder
    save_state made, so it may vanish between a look and a read on another rank."""
    try:
        return sorted(p.name for p in folder.iterdir())
    except FileNotFoundError:
        return []


def train(acc: Accelerator, out: Path, name: str, save_at: int | None = None, steps: int = 6) -> dict[str, Any]:
    """A loop that clips gradients with ``accelerator.clip_grad_norm_`` before every update; rank 1
    gets a NaN in one element of ``stem.weight``'s local gradient at step 2."""
    fresh(acc, 5)
    acc._save_model_state_pre_hook.clear()
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sdc = SDCHooks(acc, replay_every_n_steps=0, fingerprint_every_n_steps=1)
    model, opt, data = acc.prepare(model, opt, loader())
    sdc.attach(model, opt)
    injector = FaultInjector([Fault("nonfinite_gradient", rank=1, step=2, target="stem.weight", index=3)])
    injector.install(acc.unwrap_model(model), acc.process_index)
    error, raised_at, saved = None, None, []
    try:
        for batch in data:
            injector.set_step(sdc.step)
            loss = model(*batch).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 0.5)  # after the all-reduce: spreads a NaN to every gradient
            opt.step()
            opt.zero_grad()
            if save_at is not None and sdc.step == save_at:
                saved.append(sdc.step)
                acc.save_state(str(out / f"{name}_state"))
            if sdc.step >= steps:
                break
        sdc.finish()
    except SDCError as err:
        error, raised_at = err.to_dict(), sdc.step
    return {
        "error": error,
        "raised_at": raised_at,
        "saved": saved,
        "state_files": listing(out / f"{name}_state"),
        "state": sdc.state_dict(),
    }


def scenarios(out: Path) -> dict[str, Any]:
    return {
        "clip": lambda acc: train(acc, out, "clip"),
        "save_after_nan": lambda acc: train(acc, out, "save_after_nan", save_at=3),
    }


def main() -> None:
    args = parse("clip,save_after_nan")
    acc = Accelerator(project_dir=str(args.out / "run"))  # incidents go to <out>/run/sdc/incidents
    table = scenarios(args.out)
    run_each(args.only, lambda name: table[name](acc), args.out, acc.process_index)
    acc.end_training()


if __name__ == "__main__":
    main()
