"""Stateful training steps under the ring replay audit: run under ``torchrun``, like ddp_scenarios.

``torchrun --nproc-per-node 3 tests/replay_scenarios.py --out DIR --only a,b`` runs real
``Trainer(strategy="ddp")`` fits of LightningModules whose ``training_step`` reads and changes
state besides its batch, and writes ``DIR/<scenario>.rank<r>.json`` (error, digest of all
weights and buffers, metric state, counters).
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import cpu_ddp_trainer, parse, run_each

from lightning_sdc import Fault, FaultInjector, ReplayUnavailableError, RingReplayAudit, SDCError
from sdc_core.checks.digest import combine, tensor_digests


class Stateful(L.LightningModule):
    """An LSTM regressor whose step uses the stateful patterns named in ``pattern`` ("a+b")."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.patterns = set(pattern.split("+"))
        self.proj = nn.Linear(8, 8)
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 1)
        self.teacher = nn.Linear(16, 1)  # EMA of the head, updated in place in training_step
        self.teacher.requires_grad_(False)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None  # TBPTT: carried in self
        self.calls = 0  # a plain Python counter the step reads and bumps
        self.seen = torchmetrics.SumMetric()  # a metric updated in training_step
        self.mean_loss = torchmetrics.MeanMetric()
        self.memory = Memory()  # an opaque object: only the explicit hook can carry it

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        hidden = self.hidden if "tbptt" in self.patterns else None
        if "reentrant" in self.patterns:
            out, _ = checkpoint(self.lstm, x, use_reentrant=True)
            return out[:, -1]
        out, hidden = self.lstm(x, hidden)
        if "tbptt" in self.patterns:
            self.hidden = (hidden[0].detach(), hidden[1].detach())
        return out[:, -1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.view(x.shape[0], 2, 4).repeat(1, 1, 2)  # sequences of 2 steps of 8 features
        h = self.features(x)
        loss = nn.functional.mse_loss(self.head(h), y)
        if "ema" in self.patterns:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.head.parameters(), strict=True):
                    t.mul_(0.9).add_(s, alpha=0.1)
            loss = loss + 0.5 * nn.functional.mse_loss(self.head(h), self.teacher(h))
        if "counter" in self.patterns:
            self.calls += 1
            loss = loss * (1.0 + 0.1 * self.calls)
        if "metric" in self.patterns:
            self.seen.update(torch.full((x.shape[0],), 1.0))
            self.mean_loss(loss.detach())
            self.log("mean_loss", self.mean_loss)
        if "random" in self.patterns:
            loss = loss * (1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand()))
        if self.patterns & {"hook", "no_hook"}:
            loss = loss * (1.0 + self.memory.step())
        if "gather" in self.patterns:
            everyone = self.all_gather(loss.detach())
            loss = loss * (1.0 + 0.0 * everyone.sum())
        if "rank" in self.patterns:
            loss = loss * (1.0 + 0.1 * self.global_rank)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Memory:
    """State the generic capture cannot see: an object (not a tensor or a plain value)."""

    def __init__(self) -> None:
        self.level = torch.zeros(())

    def step(self) -> torch.Tensor:
        self.level += 0.25
        return self.level.clone()


class WithHook(Stateful):
    """Carries ``Memory`` through the explicit replay-state hook."""

    def sdc_replay_state(self) -> Any:
        return self.memory.level.clone()

    def sdc_load_replay_state(self, state: Any) -> None:
        self.memory.level = state.clone()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(192, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - 0.5 * x[:, 1:2]), batch_size=8, shuffle=False)


def digest(module: nn.Module) -> int:
    """All parameters (trained or not) and all buffers of this rank."""
    return int(combine(tensor_digests([*module.parameters(), *module.buffers()])))


def fit(pattern: str, audit: bool, steps: int = 6, model_cls: type = Stateful, faults: list[Fault] = (),
        **kw: Any) -> dict[str, Any]:  # fmt: skip
    L.seed_everything(11, workers=True, verbose=False)
    random.seed(3)
    np.random.seed(3)
    model = model_cls(pattern)
    callbacks: list[Any] = [RingReplayAudit(every_n_steps=1, **kw)] if audit else []
    callbacks += [FaultInjector(list(faults))] if faults else []
    trainer = cpu_ddp_trainer(
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=OUT[0],  # incidents of the failing scenarios go there
    )
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, loader())
        except SDCError as err:
            error = err.to_dict()
        except ReplayUnavailableError as err:
            error = {"type": type(err).__name__, "message": str(err)}
    replay = next((cb._core for cb in callbacks if isinstance(cb, RingReplayAudit)), None)
    return {
        "error": error,
        "weights": digest(model),
        "global_step": trainer.global_step,
        "calls": model.calls,
        "seen": float(model.seen.sum_value),
        "metric_updates": model.seen._update_count,
        "memory": float(model.memory.level),
        "stats": replay.stats.state_dict() if replay else None,
        "disabled": replay.disabled if replay else None,
        "warnings": [str(w.message) for w in caught if "RingReplayAudit" in str(w.message)],
        "leftover": sorted(k for k in vars(model) if k in ("log", "log_dict", "print", "training_step")),
    }


OUT: list[Path] = [Path(".")]
PATTERNS = ("tbptt", "ema", "counter", "metric", "random", "hook")
ALL = "+".join(PATTERNS)
SCENARIOS: dict[str, Any] = {
    **{f"{p}_on": lambda p=p: fit(p, True, model_cls=WithHook) for p in PATTERNS},
    **{f"{p}_off": lambda p=p: fit(p, False, model_cls=WithHook) for p in PATTERNS},
    "all_on": lambda: fit(ALL, True, model_cls=WithHook),  # every pattern in one step
    "all_off": lambda: fit(ALL, False, model_cls=WithHook),
    "no_hook": lambda: fit("no_hook", True),
    "gather": lambda: fit("gather", True),
    "gather_warn": lambda: fit("gather", True, on_unreplayable="warn"),
    "gather_off": lambda: fit("gather", False),
    "reentrant": lambda: fit("reentrant", True, steps=2),
    "rank": lambda: fit("rank", True, steps=2),
    # real faults in stateful steps are still named
    "tbptt_fault": lambda: fit("tbptt", True, faults=[Fault("module_output", rank=1, step=3, target="head")]),
    "ema_fault": lambda: fit("ema", True, faults=[Fault("module_output", rank=2, step=2, target="head", factor=1.01)]),
}


def main() -> None:
    args = parse(",".join(SCENARIOS))
    OUT[0] = args.out
    run_each(args.only, lambda name: SCENARIOS[name](), args.out, int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
