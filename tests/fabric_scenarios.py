"""Lightning Fabric scenarios: ``lightning_sdc.fabric.SDCHooks`` in a hand-written Fabric loop.

``torchrun --nproc-per-node 3 tests/fabric_scenarios.py --out DIR --only a,b`` runs the named
scenarios one after the other with one launched ``Fabric`` (strategy ``"ddp"``, gloo CPU ranks)
and writes ``DIR/<scenario>.rank<r>.json``. The loop accumulates 2 micro-batches per step with
``fabric.no_backward_sync`` and divides the loss before ``fabric.backward`` (the replay unit is
given through ``hooks.replayable``, or ``--capture forward``: the forward hooks and a ``loss_fn``);
``--precision`` picks Fabric's precision.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric, seed_everything
from lightning.fabric.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate_scenarios import Regressor
from scenario_runner import parse, run_each

from lightning_sdc.fabric import SDCHooks
from sdc_core import Fault, FaultInjector, SDCError
from sdc_core.checks.digest import combine, tensor_digests

ACCUMULATE = 2
CAPTURE = "replayable"


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(384, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=8)


def train(fabric: Fabric, out: Path, name: str, steps: int = 6, faults: list[Fault] = (), save: Path | None = None,
          load: Path | None = None, clip: bool = False, **settings: Any) -> dict[str, Any]:  # fmt: skip
    seed_everything(5, verbose=False)
    module = Regressor()
    model, opt = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    if CAPTURE == "forward":  # the forward-hook capture with a loss_fn, instead of replayable
        hooks = SDCHooks(fabric, loss_fn=lambda out, *_: out.loss / ACCUMULATE, run_dir=str(out / name), **settings)
        hooks.attach(model, opt)

        def step_loss(m: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return m(x, y).loss / ACCUMULATE
    else:
        hooks = SDCHooks(fabric, run_dir=str(out / name), **settings)
        hooks.attach(model, opt)
        step_loss = hooks.replayable(lambda m, x, y: m(x, y).loss / ACCUMULATE)
    injector = FaultInjector(list(faults))
    injector.install(model.module, fabric.global_rank)
    opt.optimizer.register_step_post_hook(lambda *_: injector.after_step(injector.step, model.module, [opt.optimizer]))
    data = fabric.setup_dataloaders(loader())
    error = None
    try:
        if load is not None:  # the SDC state first: restored before the model and optimizer
            fabric.load(load, {"sdc": hooks, "model": model, "optimizer": opt})
        for i, (x, y) in enumerate(data):
            injector.set_step(hooks.step)
            accumulating = (i + 1) % ACCUMULATE != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(step_loss(model, x, y))
            if not accumulating:
                if clip:  # error_if_nonfinite=True by default: raises on NaN before opt.step()
                    fabric.clip_gradients(model, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad()
                if hooks.step >= steps:
                    break
        hooks.finish()
    except SDCError as err:
        error = err.to_dict()
    if save is not None and error is None:
        fabric.save(save, {"model": model, "optimizer": opt, "sdc": hooks})
    hooks.detach()
    return {
        "error": error,
        "step": hooks.step,
        "weights": int(combine(tensor_digests(list(model.module.parameters())))),
        "state": hooks.state_dict(),
        "step_restored": "step" not in vars(opt),  # detach put the optimizer's own step back
    }


def resume_corrupted(fabric: Fabric, out: Path) -> dict[str, Any]:
    """``sdc corrupt-checkpoint`` flips one optimizer entry of the ``save`` scenario's file (rank 0);
    every rank's ``fabric.load`` of the copy raises the verdict naming it."""
    from sdc_core.cli import main as sdc

    bad = out / "state_corrupted.ckpt"
    if fabric.global_rank == 0:
        sdc(["corrupt-checkpoint", str(out / "state.ckpt"), "-o", str(bad), "--target", "optimizer", "--seed", "3"])
    fabric.barrier()
    return train(fabric, out, "resume_corrupted", steps=6, replay_every_n_steps=1, load=bad)


def scenarios(fabric: Fabric, out: Path) -> dict[str, Any]:
    def run(name: str, **kw: Any) -> Any:
        return lambda: train(fabric, out, name, **kw)

    return {
        "clean": run("clean", replay_every_n_steps=2, log_every_n_steps=1),
        "audit_off": run("audit_off", replay_every_n_steps=0),
        "audit_on": run("audit_on", replay_every_n_steps=1),
        "nonfinite": run("nonfinite", replay_every_n_steps=0, faults=[
            Fault("nonfinite_gradient", rank=1, step=2, target="stem.weight")]),
        "fingerprint": run("fingerprint", replay_every_n_steps=0, faults=[
            Fault("weight_bit_flip", rank=2, step=3, target="head.weight", index=5, bit=12)]),
        "replay": run("replay", replay_every_n_steps=1, faults=[
            Fault("module_output", rank=0, step=2, target="head", factor=1.3)]),
        "heal": run("heal", replay_every_n_steps=0, fingerprint_on_failure="heal", faults=[
            Fault("weight_bit_flip", rank=1, step=2, target="stem.weight", index=9, bit=21)]),
        "skip": run("skip", replay_every_n_steps=0, on_failure="skip_step", faults=[
            Fault("nonfinite_gradient", rank=0, step=1, target="head.bias")]),
        "clip": run("clip", replay_every_n_steps=0, clip=True, faults=[
            Fault("nonfinite_gradient", rank=1, step=2, target="stem.weight")]),
        "save": run("save", steps=3, replay_every_n_steps=1, save=out / "state.ckpt"),
        "resume": run("resume", steps=6, replay_every_n_steps=1, load=out / "state.ckpt"),
        "resume_corrupted": lambda: resume_corrupted(fabric, out),
    }  # fmt: skip


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--precision", default="32-true")
        parser.add_argument("--capture", choices=["replayable", "forward"], default="replayable")

    args = parse(extra=options)
    global CAPTURE
    CAPTURE = args.capture
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=3, precision=args.precision,
                    loggers=TensorBoardLogger(str(args.out / "tb")))
    fabric.launch()
    table = scenarios(fabric, args.out)
    run_each(args.only, lambda name: table[name](), args.out, fabric.global_rank)
    for logger in fabric.loggers:
        logger.finalize("success")


if __name__ == "__main__":
    main()
