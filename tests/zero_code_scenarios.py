"""Zero-code enable: plain Lightning Trainer scripts that mention no SDC callback.

``torchrun --nproc-per-node 3 tests/zero_code_scenarios.py --out DIR --only a,b`` with the
project's ``lightning.pytorch.callbacks_factory`` entry point visible and ``SDC_CHECKS`` set by
the caller. The checks come from the entry point; the model itself flips a weight bit on rank 2
(a fire drill that needs no callback).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import parse, run_each

from lightning_sdc import RingReplayAudit, SDCError
from sdc_core import flip_bit

STEPS = 6


class Net(L.LightningModule):
    def __init__(self, flip_at: int | None = None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.flip_at = flip_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        if self.flip_at is not None and self.global_rank == 2:
            def flip(*_: Any) -> None:
                if self.trainer.global_step == self.flip_at:
                    flip_bit(self.body[2].weight.data, 5, 12)

            opt.register_step_post_hook(flip)
        return opt


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * STEPS * 8, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=8)


def fit(out: Path, name: str, model: Net, callbacks: list[Any] | None = None) -> dict[str, Any]:
    L.seed_everything(2, verbose=False)
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"callbacks": callbacks} if callbacks is not None else {}
        trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=3, max_epochs=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out / name),
                            enable_checkpointing=callbacks is not None, **kwargs)  # fmt: skip
        try:
            trainer.fit(model, data())
        except SDCError as err:
            error = err.to_dict()
    sdc = [cb for cb in trainer.callbacks if type(cb).__module__.startswith("lightning_sdc")]
    ckpt = next((cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)), None)
    return {
        "error": error,
        "callbacks": [type(cb).__name__ for cb in sdc],
        "runs": {type(cb).__name__: cb._core.stats.runs for cb in sdc if hasattr(cb, "_core")},
        "monitorable": sorted(k for k in trainer.callback_metrics if k.startswith("sdc/")),
        "best_score": float(ckpt.best_model_score) if ckpt is not None and ckpt.best_model_score is not None else None,
    }


def scenarios(out: Path) -> dict[str, Any]:
    def off() -> dict[str, Any]:
        os.environ.pop("SDC_CHECKS", None)
        return fit(out, "off", Net())

    def bad() -> dict[str, Any]:
        os.environ["SDC_CHECKS"] = "replay"
        try:
            L.Trainer(accelerator="cpu", devices=1, logger=False)
        except ValueError as err:
            return {"message": str(err)}
        return {"message": None}

    return {
        "auto": lambda: fit(out, "auto", Net(flip_at=3)),
        "mixed": lambda: fit(out, "mixed", Net(), callbacks=[
            RingReplayAudit(every_n_steps=1),
            EarlyStopping(monitor="sdc/ring_replay/failures", mode="min", patience=100, check_on_train_epoch_end=True),
            ModelCheckpoint(dirpath=str(out / "ckpt"), monitor="sdc/ring_replay/runs", mode="max",
                            every_n_train_steps=1, save_top_k=1),
        ]),
        "off": off,
        "bad": bad,
    }  # fmt: skip


def main() -> None:
    args = parse()
    table = scenarios(args.out)
    run_each(args.only, lambda name: table[name](), args.out, int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
