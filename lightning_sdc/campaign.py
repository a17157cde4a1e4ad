"""The Lightning runner of fault-injection campaigns (``sdc campaign``, entry point ``lightning``): each training is a
Lightning DDP Trainer on 3 CPU ranks with the SDC callbacks a run asks for. Importing it imports neither torch nor
Lightning. Run as a module it is the campaign's worker (``--worker``) and the matrix-product checksum campaign's driver:
``python -m lightning_sdc.campaign matmul [--per-class N] [--doc FILE] ...``."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from sdc_core.faults.campaign_runner import CAMPAIGN_DIR_ENV, CampaignRunner, counters


def _module(optimizer: str = "adam") -> Any:
    """A fresh LightningModule around the campaign's model (under ``model.``), trained with ``optimizer`` on the mean
    squared error."""
    import lightning.pytorch as L
    import torch
    from torch import nn

    from sdc_core.faults.campaign import CampaignModel, make_optimizer

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CampaignModel()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(optimizer, self.parameters())

    return Module()


def _callbacks(checks: bool, check_set: str | None, save: str | None, fault: Any) -> list[Any]:
    """The SDC callbacks of a run (``sdc_core.faults.campaign_runner.Fit`` says which), and the fault injector."""
    from lightning_sdc import (
        FaultInjector,
        MatmulChecksumCheck,
        NonFiniteGradientCheck,
        RingReplayAudit,
        WeightFingerprintCheck,
    )

    callbacks: list[Any] = []
    if check_set is not None:  # the checks at their defaults (replay every 100 steps), with the matmul check or not
        callbacks += [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()]
        if check_set == "defaults+matmul":
            callbacks.append(MatmulChecksumCheck())
    elif checks:  # the replay audits every step: the campaign measures what each check can see
        callbacks += [NonFiniteGradientCheck(), RingReplayAudit(every_n_steps=1), WeightFingerprintCheck()]
    elif save:
        callbacks.append(WeightFingerprintCheck(every_n_steps=10**6))  # stores the fingerprint in the checkpoint
    if fault is not None:
        callbacks.append(FaultInjector([fault]))
    return callbacks


def _fit(steps: int, checks: bool, fault: Any = None, ckpt_path: str | None = None, save: str | None = None,
         check_set: str | None = None, data: dict[str, Any] | None = None,
         optimizer: str = "adam") -> dict[str, Any]:  # fmt: skip
    """One training on every rank of the launch (``sdc_core.faults.campaign_runner.Fit``)."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, SDCError
    from sdc_core.faults.campaign import BATCH, WORLD, base_data, training_data

    L.seed_everything(0, verbose=False)
    callbacks = _callbacks(checks, check_set, save, fault)
    x, y = training_data(data)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=os.environ.get(CAMPAIGN_DIR_ENV, "."))  # incidents land there  # fmt: skip
    module = _module(optimizer)
    error = crash = None
    try:
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH), ckpt_path=ckpt_path)
    except SDCError as err:
        error = err.to_dict()
    except Exception as err:  # a loud failure of training itself (same on every rank: same bits loaded)
        crash = f"{type(err).__name__}: {err}"[:300]
    if save and error is None:
        trainer.save_checkpoint(save)
    x, y = base_data()  # the final loss on the same samples for every run
    with torch.no_grad():
        weights = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        loss = float(torch.nn.functional.mse_loss(module(x[:512]), y[:512]))
    # what the screen and the replay counted (``campaign_runner.counters``)
    replay = next((cb._core.stats for cb in callbacks if isinstance(cb, RingReplayAudit)), None)
    screen = next((cb._screen.stats for cb in callbacks if isinstance(cb, NonFiniteGradientCheck)
                   and cb._screen is not None), None)  # fmt: skip
    return {"error": error, "crash": crash, "weights": weights, "loss": loss, "counters": counters(replay, screen)}


RUNNER = CampaignRunner(name="lightning", worker_module="lightning_sdc.campaign", fit=_fit, target_prefix="model.")

if __name__ == "__main__":
    from sdc_core.faults.campaign_run import main

    main(RUNNER)
