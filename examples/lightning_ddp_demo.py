"""Fire drill: 3 CPU ranks train with the SDC checks on; one rank is made faulty.

    python examples/lightning_ddp_demo.py                       # rank 1 gets a faulty compute lane
    python examples/lightning_ddp_demo.py --fault weights       # a bit flip in rank 2's weights
    python examples/lightning_ddp_demo.py --fault nan --faulty-rank 0
    python examples/lightning_ddp_demo.py --fault none          # a clean run: nothing fires

Lightning starts the 3 processes itself (``devices=3, strategy="ddp"``, gloo on CPU). Every
rank catches the same ``SDCError``; rank 0 prints it. Exit status 0 when the faulty rank was named
(or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdc import (
    Fault,
    FaultInjector,
    NonFiniteGradientCheck,
    RingReplayAudit,
    SDCError,
    WeightFingerprintCheck,
)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=16)


FAULTS = {
    "compute": lambda r: Fault("module_output", rank=r, step=5, target="head", factor=1.2),
    "weights": lambda r: Fault("weight_bit_flip", rank=r, step=7, target="net.3.weight", index=123, bit=22),
    "nan": lambda r: Fault("nonfinite_gradient", rank=r, step=9, target="net.0.weight"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=[*FAULTS, "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    callbacks = [NonFiniteGradientCheck(), RingReplayAudit(every_n_steps=5), WeightFingerprintCheck(every_n_steps=1)]
    if args.fault != "none":
        callbacks.append(FaultInjector([FAULTS[args.fault](args.faulty_rank)]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=3,
        strategy="ddp",
        max_steps=args.steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger("runs", name="lightning_demo", version=""),  # sdc/* metrics: runs/lightning_demo/metrics.csv
        default_root_dir="runs/lightning_demo",  # incidents land in runs/lightning_demo/sdc/incidents/
    )
    try:
        trainer.fit(Regressor(), data())
    except SDCError as err:
        if trainer.global_rank == 0:
            print(
                f"\nDETECTED on every rank: {err}\n  check={err.check} step={err.step} rank={err.rank} "
                f"suspects={err.suspects} hosts={err.hosts}\n"
                f"  incident: {getattr(err, 'incident', 'runs/lightning_demo/sdc/incidents')}; "
                "sdc/* metrics: runs/lightning_demo/metrics.csv\n  next: sdc report runs/lightning_demo",
                flush=True,
            )
        return 0 if err.rank == args.faulty_rank and args.fault != "none" else 1
    if trainer.global_rank == 0:
        print(f"\nNo SDC detected in {trainer.global_step} steps.", flush=True)
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
