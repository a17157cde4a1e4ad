"""Zero-code enable for Lightning: this script mentions no SDC check; the environment turns them on.

    SDC_CHECKS=1 python examples/lightning_zero_code_demo.py --flip-rank 2   # 3 CPU ranks
    python examples/lightning_zero_code_demo.py                                # SDC_CHECKS unset: no checks

With sdc-checks installed (``pip install -e .``: its ``lightning.pytorch.callbacks_factory``
entry point), ``SDC_CHECKS=1`` adds NonFiniteGradientCheck, RingReplayAudit and
WeightFingerprintCheck with their defaults to every Trainer (``SDC_CHECKS=ring_replay,...`` picks
some). Callbacks you pass yourself are kept. ``--flip-rank`` makes the model flip one weight bit on
that rank after step 3 (a fire drill written as plain model code). An SDC verdict ends the run with
exit code 86 and one line per rank naming the check, step, rank, host and incident file (under
``runs/zero_code_demo/lightning_logs/version_0/sdc/incidents/``); the ``sdc/*`` metrics are in
Lightning's default logger (TensorBoard there); then ``sdc report runs/zero_code_demo``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self, flip_rank: int | None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        self.flip_rank = flip_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        if self.flip_rank == self.global_rank:

            def flip(*_: Any) -> None:  # the drill: a bit flips in this rank's copy of the weights
                if self.trainer.global_step == 3:
                    w = self.body[2].weight.data.view(-1).view(torch.int32)
                    w[5] ^= 1 << 22

            opt.register_step_post_hook(flip)
        return opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flip-rank", type=int, default=None)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    x = torch.randn(1536, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=3, max_steps=12,
                        default_root_dir="runs/zero_code_demo", enable_progress_bar=False)  # fmt: skip
    trainer.fit(Net(args.flip_rank), loader)
    if trainer.is_global_zero:
        checks = [type(cb).__name__ for cb in trainer.callbacks if type(cb).__module__.startswith("lightning_sdc")]
        print(f"\nNo SDC detected in {trainer.global_step} steps; SDC callbacks: {checks or 'none'}", flush=True)


if __name__ == "__main__":
    main()
