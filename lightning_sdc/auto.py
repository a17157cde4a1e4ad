"""Zero-code enable for Lightning: ``SDC_CHECKS=1`` adds the SDC checks to every ``Trainer`` (through the
``lightning.pytorch.callbacks_factory`` entry point). ``SDC_CHECKS``: ``1``/``true``/``all`` (any case) for all three, a
comma-separated list for some, unset/empty/``0``/``false`` for none; anything else raises ``ValueError`` when the
Trainer is created. One process: only ``NonFiniteGradientCheck``."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Checkpoint

from lightning_sdc.callbacks import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

ENV = "SDC_CHECKS"
CHECKS: dict[str, type[Callback]] = {
    "nonfinite_gradient": NonFiniteGradientCheck,
    "ring_replay": RingReplayAudit,
    "weight_fingerprint": WeightFingerprintCheck,
}
_ON = ("1", "true", "all")  # the settings' one rule for booleans (true/false or 1/0), plus "all"
_OFF = ("", "0", "false")


def requested(value: str | None = None) -> list[str]:
    """The check names ``SDC_CHECKS`` (or ``value``) asks for; ``ValueError`` for a bad value."""
    raw = os.environ.get(ENV, "") if value is None else value
    text = raw.strip().lower()
    if text in _OFF:
        return []
    if text in _ON:
        return list(CHECKS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(
            f"{ENV}={raw!r}: unknown check(s) {', '.join(unknown)}; use 1 for all, 0 for none, "
            f"or a comma-separated list of {', '.join(CHECKS)}")
    return list(dict.fromkeys(names))


def callbacks() -> list[Callback]:
    """Entry point of the ``lightning.pytorch.callbacks_factory`` group (called per Trainer)."""
    names = requested()
    return [SDCAutoEnable(names)] if names else []


def pytorch_lightning_callbacks() -> list[Any]:
    """Entry point of ``pytorch_lightning.callbacks_factory``: refuse rather than run unguarded."""
    if requested():
        raise ValueError(
            f"{ENV} is set, but sdc-checks supports the `lightning` package (import lightning.pytorch as L), "
            "not the standalone `pytorch_lightning` Trainer; switch the import or unset " + ENV)
    return []


class SDCAutoEnable(Callback):
    """Adds the named checks with their defaults when ``fit`` starts, unless the Trainer has one of that class,
    before the checkpoint callbacks (which read their metrics). ``self.added`` lists what was added."""

    def __init__(self, checks: list[str]) -> None:
        self.checks = list(checks)
        self.added: list[Callback] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.added:
            return
        names = self.checks if trainer.world_size > 1 else [n for n in self.checks if n == "nonfinite_gradient"]
        callbacks = trainer.callbacks
        me = next(i for i, cb in enumerate(callbacks) if cb is self)
        at = next((i for i, cb in enumerate(callbacks) if i > me and isinstance(cb, Checkpoint)), len(callbacks))
        for name in names:
            cls = CHECKS[name]
            if any(isinstance(cb, cls) for cb in callbacks):
                continue  # the user's own instance wins
            check = cls()
            callbacks.insert(at, check)  # after this one: the running setup pass reaches it next
            at += 1
            self.added.append(check)
