"""Sharded scenarios (FSDP2 / HSDP under Lightning ``ModelParallelStrategy``): run under torchrun.

``torchrun --nproc-per-node 4 tests/sharded_scenarios.py --out DIR --only a,b`` runs the named
scenarios in one process group; each rank writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
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
from sdc_core import flip_bit
from sdc_core.checks.digest import combine, tensor_digests
from sdc_core.sharded.checks import local


class CountingReduceScatter(DefaultReduceScatter):
    """A user's custom reduce-scatter (counts its calls): the SDC tap must wrap it, not replace it."""

    calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        CountingReduceScatter.calls += 1
        return super().__call__(*args, **kwargs)


class ShardedNet(L.LightningModule):
    """An MLP with dropout, each layer and the root sharded with ``fully_shard`` in ``configure_model``."""

    def __init__(self, hsdp: int = 0, bf16: bool = False, nan_at: tuple[list[int], int] | None = None,
                 user_rs: bool = False) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(7)  # FSDP2 does not broadcast initial weights: HSDP replicas must start equal
        self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1)])
        self.drop = nn.Dropout(0.1)
        self.hsdp, self.bf16, self.nan_at, self.user_rs = hsdp, bf16, nan_at, user_rs

    def configure_model(self) -> None:
        if self.hsdp:
            world = torch.distributed.get_world_size()
            mesh = init_device_mesh("cpu", (self.hsdp, world // self.hsdp), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = self.device_mesh["data_parallel"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        kw = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
        for layer in self.layers:
            fully_shard(layer, **kw)
            if self.user_rs:
                layer.set_custom_reduce_scatter(CountingReduceScatter())
        fully_shard(self, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.layers[0](x)))
        return self.layers[2](torch.relu(self.layers[1](h)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.nan_at and self.global_rank in self.nan_at[0] and self.trainer.global_step == self.nan_at[1]:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class FlipShard(L.Callback):
    """Flip one bit of ``rank``'s local shard of ``target`` at ``step``: ``when="at_rest"`` at the
    start of the batch (between the update and the forward), ``"update"`` right after the update,
    ``"optimizer"`` inside the optimizer step (a wrong update)."""

    def __init__(self, rank: int, step: int, target: str = "layers.1.weight", when: str = "at_rest") -> None:
        self.rank, self.step, self.target, self.when = rank, step, target, when

    def _flip(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if trainer.global_rank == self.rank and step == self.step:
            flip_bit(local(dict(pl_module.named_parameters())[self.target]), 3, 22)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "optimizer":  # inside the update: a post-hook registered before the checks' own

            def hook(*_: Any) -> None:
                self._flip(trainer, pl_module, trainer.global_step)

            trainer.optimizers[0].register_step_post_hook(hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.when == "at_rest":
            self._flip(trainer, pl_module, trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.when == "update":
            self._flip(trainer, pl_module, trainer.global_step - 1)


def loader(n: int = 512, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def fit(out: Path, name: str, callbacks: list[Any], steps: int = 8, model: ShardedNet | None = None,
        make: Callable[[], ShardedNet] = ShardedNet, tensor_parallel: int = 1,
        **trainer_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """Train under ``ModelParallelStrategy`` (``tensor_parallel`` x the rest data parallel); ``make``
    builds the model after seeding unless ``model`` is given."""
    L.seed_everything(7, workers=True, verbose=False)
    CountingReduceScatter.calls = 0
    model = model or make()
    world = int(os.environ["WORLD_SIZE"])
    trainer = cpu_ddp_trainer(
        devices=world,
        strategy=ModelParallelStrategy(
            data_parallel_size=world // tensor_parallel, tensor_parallel_size=tensor_parallel,
            timeout=timedelta(seconds=90),
        ),
        max_steps=steps,
        default_root_dir=out,  # incidents: <out>/sdc/incidents/
        callbacks=callbacks,
        **trainer_kwargs,
    )
    error = None
    try:
        trainer.fit(model, loader())
    except SDCError as err:
        error = err.to_dict()
    except ValueError as err:
        error = {"type": "ValueError", "message": str(err)}
    params = [local(p) for p in model.parameters()]
    return {
        "error": error,
        "weights": int(combine(tensor_digests([p.detach() for p in params]))),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "global_step": trainer.global_step,
        "states": {type(cb).__name__: cb.state_dict() for cb in callbacks if hasattr(cb, "_core")},
        "user_rs_calls": CountingReduceScatter.calls,
        "groups": next((cb._core.groups for cb in callbacks if isinstance(cb, RingReplayAudit)), None),
    }


def checks(**kw: Any) -> list[Any]:
    return [NonFiniteGradientCheck(**kw), WeightFingerprintCheck(every_n_steps=1)]


SCENARIOS: dict[str, Any] = {
    # clean: bf16 parameters, dropout, gradient accumulation; bit-identical with the checks off
    "off": lambda o: fit(o, "off", [], model=ShardedNet(bf16=True), accumulate_grad_batches=2),
    "clean": lambda o: fit(
        o,
        "clean",
        [RingReplayAudit(every_n_steps=2, exact=True), *checks()],
        model=ShardedNet(bf16=True),
        accumulate_grad_batches=2,
    ),
    "nan_one": lambda o: fit(o, "nan_one", checks(), model=ShardedNet(nan_at=([2], 3))),
    "nan_all": lambda o: fit(o, "nan_all", checks(), model=ShardedNet(nan_at=([0, 1, 2, 3], 2))),
    "skip": lambda o: fit(o, "skip", checks(on_failure="skip_step"), model=ShardedNet(nan_at=([1], 2))),
    "at_rest": lambda o: fit(o, "at_rest", [FlipShard(rank=3, step=4), *checks()]),
    "user_rs": lambda o: fit(o, "user_rs", checks(), model=ShardedNet(user_rs=True, nan_at=([1], 3))),
    "replay_fault": lambda o: fit(
        o,
        "replay_fault",
        [
            FaultInjector([Fault("module_output", rank=2, step=2, target="layers.2", factor=1.2)]),
            RingReplayAudit(every_n_steps=2, exact=True),
        ],
    ),
    "update_fault": lambda o: fit(
        o,
        "update_fault",
        [FlipShard(rank=1, step=4, when="optimizer"), WeightFingerprintCheck(update_audit_every_n_steps=2)],
        model=ShardedNet(bf16=True),
    ),
    "update_clean": lambda o: fit(
        o,
        "update_clean",
        [WeightFingerprintCheck(update_audit_every_n_steps=1)],
        model=ShardedNet(bf16=True),
        accumulate_grad_batches=2,
    ),
    "update_skip": lambda o: fit(
        o,
        "update_skip",
        [WeightFingerprintCheck(update_audit_every_n_steps=1), NonFiniteGradientCheck(on_failure="skip_step")],
        model=ShardedNet(nan_at=([1], 2)),
    ),
    "checkpoint": lambda o: fit(
        o,
        "checkpoint",
        [*checks(), ModelCheckpoint(dirpath=o / "ckpt", every_n_train_steps=3)],
        enable_checkpointing=True,
    ),
    # HSDP 3 x 2 (6 ranks): ranks 0, 2, 4 and 1, 3, 5 hold the same shards
    "hsdp_clean": lambda o: fit(o, "hsdp_clean", checks(), model=ShardedNet(hsdp=3, bf16=True)),
    "hsdp_update": lambda o: fit(
        o, "hsdp_update", [FlipShard(rank=3, step=4, when="update"), *checks()], model=ShardedNet(hsdp=3)
    ),
    "hsdp_nan": lambda o: fit(o, "hsdp_nan", checks(), model=ShardedNet(hsdp=3, nan_at=([4], 2))),
    "hsdp_heal": lambda o: fit(
        o,
        "hsdp_heal",
        [FlipShard(rank=2, step=3, when="update"), NonFiniteGradientCheck(), WeightFingerprintCheck(on_failure="heal")],
        model=ShardedNet(hsdp=3),
    ),
}


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
