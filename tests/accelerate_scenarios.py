"""Accelerate scenarios for the tests: run under ``accelerate launch`` (or plain python for one process).

``accelerate launch ... tests/accelerate_scenarios.py --out DIR --only a,b [--bf16-hook]`` runs
the named scenarios one after the other with one ``Accelerator`` (its state is per process) and
writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import fresh, parse, run_each

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector
from sdc_core.checks.digest import combine, tensor_digests


class Regressor(nn.Module):
    """Returns its loss when given targets, like a Hugging Face model (``outputs.loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        pred = self.head(self.drop(torch.relu(self.norm(self.stem(x)))))
        return type("Out", (), {"loss": nn.functional.mse_loss(pred.float(), y)})()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(384, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=8)


def train(acc: Accelerator, name: str, steps: int = 6, faults: list[Fault] = (), save: Path | None = None,
          load: Path | None = None, late: bool = False, compiled: bool = False,
          **settings: Any) -> dict[str, Any]:  # fmt: skip
    """``late``: ``SDCHooks`` created after ``prepare`` (which then registers a comm hook itself); ``compiled``: the
    prepared model compiled, as ``Accelerator(dynamo_backend=...)`` compiles it."""
    fresh(acc, 5)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registered_by_prepare = None
        if late:
            model, opt, data = acc.prepare(model, opt, loader())
            registered_by_prepare = [h.__name__ for h, _ in getattr(model, "_comm_hooks", [])]
            sdc = SDCHooks(acc, **settings)
        else:
            sdc = SDCHooks(acc, **settings)
            model, opt, data = acc.prepare(model, opt, loader())
        if compiled:
            model = torch.compile(model, backend="aot_eager")
        sdc.attach(model, opt)
    injector = FaultInjector(list(faults))
    # keep_torch_compile=False: with True, Accelerate 1.16 points a compiled model past DDP (it sets its _orig_mod)
    net = acc.unwrap_model(model, keep_torch_compile=False)
    injector.install(net, acc.process_index)
    opt.optimizer.register_step_post_hook(lambda *_: injector.after_step(injector.step, net, [opt.optimizer]))
    if load is not None:
        acc.load_state(str(load))
    error = None
    try:
        for batch in data:
            injector.set_step(sdc.step)
            with acc.accumulate(model):
                loss = model(*batch).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if sdc.step >= steps:
                break
        sdc.finish()
    except SDCError as err:
        error = err.to_dict()
    if save is not None and error is None:
        acc.save_state(str(save))
    hook = getattr(model, "_sdc_gradient_tap", None)
    return {
        "error": error,
        "step": sdc.step,
        "weights": int(combine(tensor_digests(list(net.parameters())))),
        "state": sdc.state_dict(),
        "settings": sdc.settings.to_dict(),
        "sources": sdc.sources,
        "inactive": [str(w.message) for w in caught if "inactive" in str(w.message)],
        "tap_inner": getattr(getattr(hook, "inner_hook", None), "__name__", None),
        "registered_by_prepare": registered_by_prepare,
        "comm_hooks": len(getattr(model, "_comm_hooks", [])),
    }


def scenarios(out: Path) -> dict[str, Any]:
    return {
        "settings": lambda acc: train(acc, "settings", steps=2),
        "clean": lambda acc: train(
            acc, "clean", replay_every_n_steps=2, fingerprint_every_n_steps=1, log_every_n_steps=1
        ),
        "audit_off": lambda acc: train(acc, "audit_off", replay_every_n_steps=0, fingerprint_every_n_steps=1),
        "audit_on": lambda acc: train(acc, "audit_on", replay_every_n_steps=1, fingerprint_every_n_steps=1),
        "nonfinite": lambda acc: train(acc, "nonfinite", replay_every_n_steps=0, faults=[
            Fault("nonfinite_gradient", rank=1, step=2, target="stem.weight")]),
        "nonfinite_late": lambda acc: train(acc, "nonfinite_late", replay_every_n_steps=0, late=True, faults=[
            Fault("nonfinite_gradient", rank=2, step=3, target="stem.weight")]),
        "fingerprint": lambda acc: train(acc, "fingerprint", replay_every_n_steps=0, faults=[
            Fault("weight_bit_flip", rank=2, step=3, target="head.weight", index=5, bit=12)]),
        "replay": lambda acc: train(acc, "replay", replay_every_n_steps=1, faults=[
            Fault("module_output", rank=0, step=2, target="head", factor=1.3)]),
        "single": lambda acc: train(acc, "single", faults=[
            Fault("nonfinite_gradient", rank=0, step=1, target="head.bias")]),
        "heal": lambda acc: train(acc, "heal", replay_every_n_steps=0, fingerprint_on_failure="heal", faults=[
            Fault("weight_bit_flip", rank=1, step=2, target="stem.weight", index=9, bit=21)]),
        "screen": lambda acc: train(acc, "screen", faults=[  # step 4: not audited (the config's replay: every 3)
            Fault("gradient_bit_flip", rank=2, step=4, target="head.bias", index=0, bit=30)]),
        "compiled": lambda acc: train(acc, "compiled", replay_every_n_steps=1, compiled=True),
        "compiled_replay": lambda acc: train(acc, "compiled_replay", replay_every_n_steps=1, compiled=True, faults=[
            Fault("module_output", rank=0, step=2, target="head", factor=1.3)]),
        "save": lambda acc: train(acc, "save", steps=3, replay_every_n_steps=1, save=out / "state"),
        "resume": lambda acc: train(acc, "resume", steps=6, replay_every_n_steps=1, load=out / "state"),
    }  # fmt: skip


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--accumulate", type=int, default=1)
        parser.add_argument("--fp16-hook", action="store_true", help="DistributedDataParallelKwargs(comm_hook=FP16)")

    args = parse(extra=options)
    handlers = [DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)] if args.fp16_hook else []
    acc = Accelerator(gradient_accumulation_steps=args.accumulate, log_with="tensorboard",
                      project_dir=str(args.out / "tb"), kwargs_handlers=handlers)  # fmt: skip
    acc.init_trackers("sdc")
    args.out.mkdir(parents=True, exist_ok=True)
    table = scenarios(args.out)
    run_each(args.only, lambda name: table[name](acc), args.out, acc.process_index, after_each=gc.collect)
    acc.end_training()


if __name__ == "__main__":
    main()
