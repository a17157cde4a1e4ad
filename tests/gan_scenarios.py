"""Manual optimization with two optimizers (a GAN-style step) under Lightning DDP, 3 CPU ranks.

``torchrun --nproc-per-node 3 tests/gan_scenarios.py --out DIR --only clean,nan_generator`` runs
each scenario with the three SDC callbacks at their defaults (``RingReplayAudit(every_n_steps=1)``
where the scenario says) and writes ``DIR/<scenario>.rank<r>.json``. Four batches: eight
optimizer steps (``trainer.global_step`` counts each optimizer's step).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import cpu_ddp_trainer, main_for

from lightning_sdc import (
    Fault,
    FaultInjector,
    NonFiniteGradientCheck,
    RingReplayAudit,
    SDCError,
    WeightFingerprintCheck,
)
from sdc_core.checks.digest import combine, tensor_digests

BATCHES = 4


class GAN(L.LightningModule):
    """A generator and a discriminator, each with its own optimizer, stepped in one training_step
    (Lightning's GAN example: toggle_optimizer, manual_backward, step, zero_grad, untoggle)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def generator_loss(self, z: torch.Tensor) -> torch.Tensor:
        fake = self.generator(z)
        return nn.functional.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(len(z), 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(len(real), 4)
        self.toggle_optimizer(opt_g)
        g_loss = self.generator_loss(z)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        logits = self.discriminator(torch.cat([real, fake]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)])
        d_loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.SGD(self.discriminator.parameters(), lr=1e-2)]  # fmt: skip


class GANWithReplayStep(GAN):
    def sdc_replay_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The loss the batch's first optimizer step back-propagated: the generator's (same z:
        the replay starts from the RNG state training_step started from)."""
        (real,) = batch
        return self.generator_loss(torch.randn(len(real), 4))


def data() -> DataLoader:
    g = torch.Generator().manual_seed(5)
    return DataLoader(TensorDataset(torch.randn(8 * BATCHES * 3, 8, generator=g)), batch_size=8)


def run(out: Path, name: str, faults: list[Fault] = (), replay_step: bool = True, sdc: bool = True,
        **replay: int) -> dict[str, Any]:  # fmt: skip
    L.seed_everything(1, verbose=False)
    checks = [NonFiniteGradientCheck(), RingReplayAudit(**replay), WeightFingerprintCheck()] if sdc else []
    trainer = cpu_ddp_trainer(
        timeout_s=60,
        ddp={"find_unused_parameters": True},  # what a GAN under DDP needs
        devices=3,
        max_epochs=1,
        callbacks=[*checks, FaultInjector(list(faults))],
        default_root_dir=str(out / name),
    )
    model = GANWithReplayStep() if replay_step else GAN()
    error = None
    try:
        trainer.fit(model, data())
    except SDCError as err:
        error = err.to_dict()
    except ValueError as err:
        error = {"type": "ValueError", "message": str(err)}
    return {
        "error": error,
        "global_step": trainer.global_step,
        "weights": int(combine(tensor_digests(list(model.parameters())))),
        "checks": {type(cb).__name__: cb._core.stats.state_dict() for cb in checks},
    }


main_for({
    "plain": lambda o: run(o, "plain", sdc=False),
    "clean": lambda o: run(o, "clean", every_n_steps=1),
    "default": lambda o: run(o, "default"),
    "no_replay_step": lambda o: run(o, "no_replay_step", replay_step=False),
    "nan_generator": lambda o: run(o, "nan_generator", every_n_steps=1, faults=[
        Fault("nonfinite_gradient", rank=1, step=2, target="generator.0.weight")]),
    # the second optimizer's step (global step 3, batch 1): named by the gradient check
    "nan_discriminator": lambda o: run(o, "nan_discriminator", every_n_steps=1, faults=[
        Fault("nonfinite_gradient", rank=2, step=2, target="discriminator.0.weight")]),
    # a finite wrong generator output on rank 0 in batch 1: the replay of the first step names it
    "activation": lambda o: run(o, "activation", every_n_steps=1, faults=[
        Fault("module_output", rank=0, step=2, target="generator.2", factor=1000.0)]),
})  # fmt: skip
