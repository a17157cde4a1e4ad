"""Multi-process scenarios for the tests: run under ``torchrun``; each rank writes JSON results.

``torchrun --nproc-per-node 3 tests/ddp_scenarios.py --out DIR --only a,b`` runs the named
scenarios one after the other in the same process group (start-up is paid once), each a real
``Trainer(strategy="ddp")`` fit, and writes ``DIR/<scenario>.rank<r>.json`` with what the rank
saw: the exception's ``to_dict()`` (or None), the final weight digest, the callbacks' counters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import cpu_ddp_trainer, main_for

from lightning_sdc import (
    Fault,
    FaultInjector,
    NonFiniteGradientCheck,
    ReplayUnavailableError,
    RingReplayAudit,
    SDCError,
    StepCheckCallback,
    WeightFingerprintCheck,
)
from sdc_core.checks.contract import StepCheck
from sdc_core.checks.digest import combine, tensor_digests


class Net(L.LightningModule):
    """A small MLP with BatchNorm, dropout, a frozen layer and two parameter groups."""

    def __init__(self, optimizer: str = "sgd", frozen: bool = True, log_loss: bool = True) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.body = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)
        self.fixed = nn.Linear(16, 16)
        if frozen:
            self.fixed.requires_grad_(False)
        self.optimizer = optimizer
        self.log_loss = log_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.stem(x)))
        h = self.drop(torch.relu(self.body(h))) + 0.1 * self.fixed(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [
            {"params": list(self.stem.parameters()) + list(self.norm.parameters())},
            {"params": list(self.body.parameters()) + list(self.head.parameters()), "lr": 0.02},
        ]
        if self.optimizer == "adam":
            return torch.optim.Adam(groups, lr=0.01)
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


class NetWithValidation(Net):
    """Validates every second step (``val_check_interval=2``), logging a loss synced across the ranks."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)


class BrokenReplayOnRank1(Net):
    """A replay step that fails on rank 1 only: the audit must not leave the others waiting."""

    def sdc_replay_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1:
            raise KeyError("feature_x")
        return self.training_step(batch, batch_idx)


class NetWithReplayStep(Net):
    """Defines the side-effect free replay step the audit prefers over ``training_step``."""

    replay_calls = 0  # counted on the class: a replay undoes changes to the instance's attributes

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": super().training_step(batch, batch_idx)}

    def sdc_replay_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        NetWithReplayStep.replay_calls += 1
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)


def loader(n: int = 256, batch_size: int = 8, nan_at: int | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    if nan_at is not None:  # one bad sample
        x[nan_at, 0] = float("nan")
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def weight_digest(module: nn.Module) -> int:
    return int(combine(tensor_digests([p for p in module.parameters()])))


def fit(
    out: Path,
    name: str,
    callbacks: list[Any],
    steps: int = 8,
    model: Net | None = None,
    ckpt_path: str | None = None,
    save_ckpt: bool = False,
    strategy_kwargs: dict[str, Any] | None = None,
    train: DataLoader | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """One ``trainer.fit``; returns what this rank saw."""
    L.seed_everything(7, workers=True, verbose=False)
    model = model or Net()
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = cpu_ddp_trainer(
        ddp=strategy_kwargs,
        devices=local,
        num_nodes=world // local,
        max_steps=steps,
        logger=CSVLogger(out / "logs", name=name, version=0),
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks),
        **trainer_kwargs,
    )
    error = None
    val = loader(48) if isinstance(model, NetWithValidation) else None
    try:
        trainer.fit(model, train or loader(), val, ckpt_path=ckpt_path)
    except SDCError as err:
        error = err.to_dict()
    except ReplayUnavailableError as err:
        error = {"type": type(err).__name__, "message": str(err)}
    if save_ckpt and error is None:
        trainer.save_checkpoint(out / f"{name}.ckpt")
    states = {type(cb).__name__: cb.state_dict() for cb in callbacks if hasattr(cb, "_core")}
    return {
        "error": error,
        "weights": weight_digest(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "global_step": trainer.global_step,
        "states": states,
        "fired": [f for cb in callbacks if isinstance(cb, FaultInjector) for f in cb.injector.fired],
        "replay_calls": getattr(model, "replay_calls", None),
        "tap_inner": [cb.inner for cb in callbacks if isinstance(cb, TapProbe)],
    }


class TapProbe(L.Callback):
    """Records which communication hook the SDC gradient tap found or registered on the model."""

    inner = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tap = getattr(trainer.strategy.model, "_sdc_gradient_tap", None)
        self.inner = getattr(tap, "inner_hook", None).__name__ if tap else None


def all_checks(replay_every: int = 2, **kw: Any) -> list[Any]:
    return [
        NonFiniteGradientCheck(),
        RingReplayAudit(every_n_steps=replay_every, **kw),
        WeightFingerprintCheck(every_n_steps=1),
    ]


def fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def flip_after(step: int = 3, target: str = "body.weight") -> FaultInjector:
    """Rank 1's ``target`` gets one mantissa bit flipped right after optimizer step ``step``."""
    return FaultInjector([Fault("weight_bit_flip", rank=1, step=step, target=target, index=7, bit=20)])


class PhaseRecorder(StepCheck):
    """A check of one's own: records each phase with its step and whether the ranks agree on the norm of the reduced
    gradients (one all-reduce after backward); raises a verdict naming rank 1 before the update of ``fail_at``."""

    def __init__(self, fail_at: int) -> None:
        super().__init__("phase_recorder")
        self.fail_at, self.seen = fail_at, []

    def after_backward(self, step: Any) -> None:
        norm = torch.stack([p.grad.norm() for p in step.module.parameters() if p.grad is not None]).norm()
        spread = torch.stack([norm, -norm])
        torch.distributed.all_reduce(spread, op=torch.distributed.ReduceOp.MAX)  # max and -min of the ranks' norms
        self.seen.append(["after_backward", step.index, bool(spread[0] == -spread[1])])  # DDP: reduced, equal

    def before_update(self, step: Any) -> bool:
        self.seen.append(["before_update", step.index])
        self.stats.runs += 1
        if step.index == self.fail_at:
            self.stats.failures += 1
            raise SDCError(step=step.index, rank=1, suspects=[1], reason="the phase recorder's verdict")
        return False

    def after_update(self, step: Any, updated: bool) -> None:
        self.seen.append(["after_update", step.index, updated])

    def at_end(self, step: Any) -> None:
        self.seen.append(["at_end", step.index])


def own_check(o: Path) -> dict[str, Any]:
    recorder = PhaseRecorder(fail_at=3)
    return fit(o, "own_check", [StepCheckCallback(recorder), NonFiniteGradientCheck()], steps=6) | {
        "seen": recorder.seen}


def causal_checks(fingerprint_every: int | None = 1) -> list[Any]:
    """Replay every step, the non-finite check and (unless None) the weight fingerprint."""
    out: list[Any] = [RingReplayAudit(every_n_steps=1, exact=True), NonFiniteGradientCheck()]
    if fingerprint_every is not None:
        out.append(WeightFingerprintCheck(every_n_steps=fingerprint_every))
    return out


SCENARIOS: dict[str, Any] = {
    # clean runs: no alarm in any configuration users rely on
    "clean": lambda o: fit(o, "clean", all_checks(), accumulate_grad_batches=2),
    "clean_exact": lambda o: fit(o, "clean_exact", all_checks(replay_every=1, exact=True)),
    "clean_bf16": lambda o: fit(o, "clean_bf16", all_checks(replay_every=1), precision="bf16-mixed"),
    "clean_fp16": lambda o: fit(o, "clean_fp16", all_checks(replay_every=1), plugins=[fp16_plugin()]),
    "clean_validation": lambda o: fit(o, "clean_validation", all_checks(), model=NetWithValidation(),
                                      val_check_interval=2, check_val_every_n_epoch=None),
    "clean_adam_buffers": lambda o: fit(
        o,
        "clean_adam_buffers",
        [WeightFingerprintCheck(include_buffers=True, include_optimizer_state=True), RingReplayAudit(every_n_steps=3)],
        model=Net(optimizer="adam"),
    ),
    # the audit leaves training bit-identical
    "audit_off": lambda o: fit(o, "audit_off", [WeightFingerprintCheck()], steps=6),
    "tap_only": lambda o: fit(o, "tap_only", [NonFiniteGradientCheck(), WeightFingerprintCheck()], steps=6),
    "audit_on": lambda o: fit(o, "audit_on", [RingReplayAudit(every_n_steps=1), WeightFingerprintCheck()], steps=6),
    # each check catches its fault class
    "nonfinite": lambda o: fit(
        o,
        "nonfinite",
        [
            WeightFingerprintCheck(),
            NonFiniteGradientCheck(),
            FaultInjector([Fault("nonfinite_gradient", rank=1, step=3, target="body.weight", index=5)]),
        ],
    ),
    "nonfinite_all": lambda o: fit(
        o,
        "nonfinite_all",
        [
            NonFiniteGradientCheck(),
            FaultInjector(
                [
                    Fault("nonfinite_gradient", rank=r, step=2, target="head.weight")
                    for r in range(int(os.environ["WORLD_SIZE"]))
                ]
            ),
        ],
    ),
    "nonfinite_skip": lambda o: fit(
        o,
        "nonfinite_skip",
        [
            NonFiniteGradientCheck(on_failure="skip_step"),
            WeightFingerprintCheck(),
            FaultInjector([Fault("nonfinite_gradient", rank=2, step=2, target="stem.bias", value=float("inf"))]),
        ],
        steps=5,
    ),
    "fingerprint": lambda o: fit(
        o,
        "fingerprint",
        [
            FaultInjector([Fault("weight_bit_flip", rank=2, step=3, target="body.weight", index=7, bit=3)]),
            WeightFingerprintCheck(),
        ],
    ),
    "optimizer_state": lambda o: fit(
        o,
        "optimizer_state",
        [
            WeightFingerprintCheck(every_n_steps=1, include_optimizer_state=True),
            FaultInjector(
                [Fault("optimizer_state", rank=0, step=4, target="head.weight", bit=20, state_key="exp_avg_sq")]
            ),
        ],
        model=Net(optimizer="adam"),
    ),
    "replay_persistent": lambda o: fit(
        o,
        "replay_persistent",
        [
            RingReplayAudit(every_n_steps=2),
            FaultInjector([Fault("module_output", rank=1, step=3, target="head", index=4, factor=1.5)]),
        ],
    ),
    "replay_persistent_validated": lambda o: fit(
        o,
        "replay_persistent_validated",
        [
            RingReplayAudit(every_n_steps=2),
            FaultInjector([Fault("module_output", rank=1, step=3, target="head", index=4, factor=1.5)]),
        ],
        model=NetWithValidation(),
        val_check_interval=2,
        check_val_every_n_epoch=None,
    ),
    "replay_intermittent": lambda o: fit(
        o,
        "replay_intermittent",
        [
            RingReplayAudit(every_n_steps=1),
            FaultInjector(
                [
                    Fault(
                        "module_output",
                        rank=int(os.environ["WORLD_SIZE"]) - 1,
                        step=2,
                        target="stem",
                        index=3,
                        bit=27,
                        mode="intermittent",
                    )
                ]
            ),
        ],
        accumulate_grad_batches=2,
    ),
    "comm_hook": lambda o: fit(
        o,
        "comm_hook",
        [
            NonFiniteGradientCheck(),
            RingReplayAudit(every_n_steps=1),
            TapProbe(),
            FaultInjector([Fault("nonfinite_gradient", rank=0, step=4, target="head.bias")]),
        ],
        strategy_kwargs={"ddp_comm_hook": _fp16_hook()},
    ),
    # fp16 GradScaler: one overflow is the scaler's business; the same lone rank again and again is not
    "fp16_one_overflow": lambda o: fit(
        o,
        "fp16_one_overflow",
        [
            NonFiniteGradientCheck(),
            FaultInjector([Fault("nonfinite_gradient", rank=1, step=3, target="head.weight", value=float("inf"))]),
        ],
        plugins=[fp16_plugin()],
    ),
    "fp16_sole_overflow": lambda o: fit(
        o,
        "fp16_sole_overflow",
        [
            NonFiniteGradientCheck(overflow_patience=3),
            FaultInjector(
                [
                    Fault("nonfinite_gradient", rank=1, step=s, target="head.weight", value=float("inf"))
                    for s in (3, 4, 5)
                ]
            ),
        ],
        plugins=[fp16_plugin()],
    ),
    # recovery: heal from the majority, within a limit
    "heal": lambda o: fit(
        o,
        "heal",
        [
            WeightFingerprintCheck(on_failure="heal"),
            FaultInjector([Fault("weight_bit_flip", rank=2, step=3, target="body.weight", index=7, bit=20)]),
        ],
    ),
    "heal_limit": lambda o: fit(
        o,
        "heal_limit",
        [
            WeightFingerprintCheck(on_failure="heal", max_heals=2),
            FaultInjector([Fault("weight_bit_flip", rank=1, step=s, target="head.weight", bit=21) for s in (2, 4, 6)]),
        ],
    ),
    "pair_heal": lambda o: fit(
        o,
        "pair_heal",
        [
            WeightFingerprintCheck(on_failure="heal"),
            FaultInjector([Fault("weight_bit_flip", rank=1, step=2, target="head.bias", bit=20)]),
        ],
    ),
    "replay_transient_skip": lambda o: fit(
        o,
        "replay_transient_skip",
        [
            RingReplayAudit(every_n_steps=1, on_failure="skip_step"),
            WeightFingerprintCheck(),
            FaultInjector([Fault("module_output", rank=2, step=2, target="head", factor=1.5, mode="once")]),
        ],
    ),
    "replay_persistent_skip": lambda o: fit(
        o,
        "replay_persistent_skip",
        [
            RingReplayAudit(every_n_steps=1, on_failure="skip_step"),
            FaultInjector([Fault("module_output", rank=1, step=2, target="head", factor=1.5)]),
        ],
    ),
    "rollback": lambda o: fit(
        o,
        "rollback",
        [
            ModelCheckpoint(dirpath=o / "ckpts" / "rollback", every_n_train_steps=2, save_top_k=-1),
            WeightFingerprintCheck(on_failure="rollback"),
            FaultInjector([Fault("weight_bit_flip", rank=2, step=4, target="body.weight", index=3, bit=20)]),
        ],
    ),
    "rollback_none": lambda o: fit(
        o,
        "rollback_none",
        [
            NonFiniteGradientCheck(on_failure="rollback"),
            FaultInjector([Fault("nonfinite_gradient", rank=0, step=2, target="head.weight")]),
        ],
    ),
    # two replicas: a mismatch names both sides
    "pair_fingerprint": lambda o: fit(
        o,
        "pair_fingerprint",
        [
            WeightFingerprintCheck(),
            FaultInjector([Fault("weight_bit_flip", rank=1, step=2, target="head.bias", bit=30)]),
        ],
    ),
    "pair_replay": lambda o: fit(
        o,
        "pair_replay",
        [RingReplayAudit(every_n_steps=1), FaultInjector([Fault("module_output", rank=0, step=1, target="head")])],
    ),
    # several nodes: partners sit on another node; run with two torchrun agents
    "multinode": lambda o: fit(
        o,
        "multinode",
        [
            NonFiniteGradientCheck(),
            RingReplayAudit(every_n_steps=1),
            WeightFingerprintCheck(),
            FaultInjector([Fault("module_output", rank=3, step=2, target="head", factor=2.0)]),
        ],
    ),
    "replay_step_hook": lambda o: fit(
        o, "replay_step_hook", [RingReplayAudit(every_n_steps=2)], steps=4, model=NetWithReplayStep()
    ),
    "replay_crash": lambda o: fit(
        o, "replay_crash", [RingReplayAudit(every_n_steps=1)], steps=3, model=BrokenReplayOnRank1()
    ),
    # checkpoint and resume keep the counters
    "save": lambda o: fit(o, "save", all_checks(), steps=4, save_ckpt=True),
    "resume": lambda o: fit(o, "resume", all_checks(), steps=8, ckpt_path=str(o / "save.ckpt")),
    # a check of one's own through StepCheckCallback: its phases on every rank, its verdict delivered alike
    "own_check": own_check,
    # verdicts in causal order (tests/test_causal_order.py): the pending comparison of step 3 is read before the
    # replay of step 4, in either callback order
    "flip": lambda o: fit(o, "flip", [*causal_checks(), flip_after()], steps=6),
    "flip_reversed": lambda o: fit(o, "flip_reversed", [flip_after(), *reversed(causal_checks())], steps=6),
    # no comparison pending (cadence 5): the replay's disagreement at step 3 has the weights compared first
    "flip_cadence": lambda o: fit(
        o, "flip_cadence", [*causal_checks(fingerprint_every=5), flip_after(2, "head.weight")], steps=6
    ),
    # no WeightFingerprintCheck: a one-off comparison names the tensors all the same
    "flip_no_fingerprint": lambda o: fit(
        o, "flip_no_fingerprint", [*causal_checks(None), flip_after(2, "head.weight")], steps=6
    ),
    # heal: the replay's disagreement is explained by the healed replica; the step is dropped, training goes on
    "flip_heal": lambda o: fit(
        o, "flip_heal",
        [RingReplayAudit(every_n_steps=1, exact=True), WeightFingerprintCheck(every_n_steps=5, on_failure="heal"),
         flip_after(2, "head.weight")],
        steps=6,
    ),
    # a wrong product with equal weights stays a compute fault
    "compute": lambda o: fit(
        o, "compute",
        [*causal_checks(), FaultInjector([Fault("module_output", rank=1, step=3, target="head", factor=1.5)])],
        steps=6,
    ),
}


def _fp16_hook() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
