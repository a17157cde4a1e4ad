"""Jobs that end on an SDC verdict, for the exit-code tests (tests/test_verdict_delivery.py).

``python tests/delivery_scenarios.py lightning --out DIR [--strategy ddp|ddp_spawn] [--devices 3]``
    A Lightning fit whose rank 1 gets a weight bit flip; the verdict is left uncaught (the
    caller of ``fit`` first records what it caught in ``DIR/caught.json``). Under torchrun the
    Trainer takes torchrun's ranks. ``--unwritable`` makes ``<log dir>/sdc`` a file.
``python tests/delivery_scenarios.py accelerate --out DIR [--nonfinite]``
    An Accelerate loop: first a step the gradient check skips (``on_failure="skip_step"``) with
    the replay on every step (``DIR/skip.rank<r>.json``), then a weight flip on rank 1 whose
    verdict is left uncaught. ``--nonfinite``: NaN gradients instead (for a single process).
Each rank writes ``DIR/<what>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when run through runpy from elsewhere

import lightning.pytorch as L
from lightning.pytorch.loggers import CSVLogger
from scenario_runner import cpu_ddp_trainer, fresh
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_sdc import FaultInjector as FaultCallback
from lightning_sdc import NonFiniteGradientCheck, WeightFingerprintCheck
from sdc_core import Fault, FaultInjector, SDCError


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=8)


def write(out: Path, name: str, rank: int, value: Any) -> None:
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(value, default=repr))


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(L.Callback):
    """Each rank's view of the exception (the workers of ddp_spawn included, not their parent)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SDCError) and not isinstance(exception, ProcessRaisedException):
            write(self.out, "rank_error", trainer.global_rank, exception.to_dict())


def lightning(args: argparse.Namespace) -> None:

    if args.skip_first:  # a NaN step the gradient check drops; the replay, listed first, must not audit it
        from lightning_sdc import RingReplayAudit

        callbacks = [RingReplayAudit(every_n_steps=1), NonFiniteGradientCheck(on_failure="skip_step"),
                     FaultCallback([Fault("nonfinite_gradient", rank=1, step=2, target="body.weight")])]  # fmt: skip
        skip = cpu_ddp_trainer(timeout_s=60, devices=args.devices, max_steps=4, callbacks=callbacks,
                               logger=CSVLogger(args.out / "logs", name="skip", version=0))  # fmt: skip
        skip.fit(Net(), data())  # a ReplayMismatchError here fails the test
        checks = [cb._core for cb in skip.callbacks if hasattr(cb, "_core")]
        metrics = {k: float(v) for core in checks for k, v in core.stats.metrics().items()}
        write(args.out, "skip", skip.global_rank, metrics)
    logs = args.out / "logs"
    if args.unwritable:
        (logs / "run" / "version_0").mkdir(parents=True, exist_ok=True)
        (logs / "run" / "version_0" / "sdc").write_text("a file where the incident folder should be")
    L.seed_everything(1, verbose=False)
    trainer = cpu_ddp_trainer(
        timeout_s=60,
        ddp={"start_method": "spawn"} if args.strategy == "ddp_spawn" else None,
        devices=args.devices,
        max_steps=6,
        logger=CSVLogger(logs, name="run", version=0),
        callbacks=[
            NonFiniteGradientCheck(),
            WeightFingerprintCheck(every_n_steps=1),
            WeightFingerprintCheck(every_n_steps=2),  # a second instance, other settings
            FaultCallback([Fault("weight_bit_flip", rank=1, step=3, target="head.weight", index=2, bit=22)]),
            Record(args.out),
        ],
    )
    try:
        trainer.fit(Net(), data())
    except SDCError as err:  # the caller of fit (rank 0's process, or the ddp_spawn parent)
        caught = {"type": type(err).__name__, "error": err.to_dict(),
                  "process_raised": isinstance(err, ProcessRaisedException)}  # fmt: skip
        (args.out / f"caught.{os.getpid()}.json").write_text(json.dumps(caught))
        raise


def accelerate(args: argparse.Namespace) -> None:
    from accelerate import Accelerator

    from accelerate_sdc import SDCHooks

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)

    acc = Accelerator(project_dir=str(args.out / "run"))

    def train(faults: list[Fault], steps: int, **settings: Any) -> SDCHooks:
        fresh(acc, 2)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt, loader = acc.prepare(model, opt, data())
        sdc = SDCHooks(acc, **settings).attach(model, opt)
        injector = FaultInjector(faults)
        injector.install(acc.unwrap_model(model), acc.process_index)
        opt.optimizer.register_step_post_hook(
            lambda *_: injector.after_step(injector.step, acc.unwrap_model(model), [opt.optimizer])
        )
        for x, y in loader:
            injector.set_step(sdc.step)
            acc.backward(model(x, y))
            opt.step()
            opt.zero_grad()
            if sdc.step >= steps:
                break
        sdc.finish()
        return sdc

    rank = acc.process_index
    if acc.num_processes > 1:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sdc = train([Fault("nonfinite_gradient", rank=1, step=2, target="body.weight")], 4,
                        on_failure="skip_step", replay_every_n_steps=1, fingerprint_every_n_steps=1)  # fmt: skip
        write(args.out, "skip", rank, {"metrics": sdc.metrics(), "warnings": [str(w.message) for w in caught]})
        fault = Fault("weight_bit_flip", rank=1, step=3, target="head.weight", index=2, bit=22)
    else:
        fault = Fault("nonfinite_gradient", rank=0, step=2, target="body.weight")
    try:
        train([fault], 6, replay_every_n_steps=2, fingerprint_every_n_steps=1)
    except SDCError as err:
        write(args.out, "rank_error", rank, err.to_dict())
        raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["lightning", "accelerate"])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 3)))
    parser.add_argument("--unwritable", action="store_true")
    parser.add_argument("--skip-first", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (lightning if args.mode == "lightning" else accelerate)(args)


if __name__ == "__main__":
    main()
