"""Single-GPU runs of the Lightning callbacks and the Accelerate hook set (``tests/test_gpu.py``).

``python tests/gpu_single_scenarios.py lightning|accelerate OUT.json``: a clean run, then a run with
a NaN in a local gradient at step 2; writes what each raised. One process: the non-finite check
names no rank (no replica to compare with); the replay and fingerprint stay inactive.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_core import Fault, SDCError


def data() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :4] * 2), batch_size=8)


def lightning(nan: bool) -> dict[str, Any]:
    import lightning.pytorch as L

    from lightning_sdc import FaultInjector, NonFiniteGradientCheck

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    callbacks: list[Any] = [NonFiniteGradientCheck()]
    if nan:
        callbacks.append(FaultInjector([Fault("nonfinite_gradient", rank=0, step=2, target="body.0.weight")]))
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=6, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    try:
        trainer.fit(Net(), data())
    except SDCError as err:
        return err.to_dict()
    return {"steps": trainer.global_step}


def accelerate(nan: bool) -> dict[str, Any]:
    from accelerate import Accelerator

    from accelerate_sdc import SDCHooks
    from sdc_core import FaultInjector

    acc = Accelerator(mixed_precision="bf16")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = SDCHooks(acc, replay_every_n_steps=0, fingerprint_every_n_steps=0)
    model, opt, loader = acc.prepare(model, opt, data())
    hooks.attach(model, opt)
    injector = FaultInjector([Fault("nonfinite_gradient", rank=0, step=2, target="0.weight")] if nan else [])
    injector.install(acc.unwrap_model(model), 0)
    try:
        for x, y in loader:
            injector.set_step(hooks.step)
            acc.backward(nn.functional.mse_loss(model(x).float(), y))
            opt.step()
            opt.zero_grad()
        hooks.finish()
    except SDCError as err:
        return err.to_dict()
    return {"steps": hooks.step, "device": str(next(model.parameters()).device)}


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    run = {"lightning": lightning, "accelerate": accelerate}[sys.argv[1]]
    Path(sys.argv[2]).write_text(json.dumps({"clean": run(False), "nan": run(True)}))
