"""Lightning callbacks over ``sdc_core``: they translate trainer events into core calls (shared plumbing:
``lightning_sdc._common``)."""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sdc import _common as common
from sdc_core.checks.contract import require_check
from sdc_core.checks.fingerprint import FingerprintConfig, FingerprintFailurePolicy, WeightFingerprint
from sdc_core.checks.gradients import NonFiniteConfig, NonFiniteFailurePolicy, NonFiniteGradient
from sdc_core.checks.matmul import MatmulChecksum, MatmulChecksumConfig, MatmulFailurePolicy
from sdc_core.checks.screen import GradientScreen, ScreenConfig
from sdc_core.faults.inject import Fault
from sdc_core.faults.inject import FaultInjector as _CoreInjector
from sdc_core.io.checkpoints import FINGERPRINT_KEY, check_loaded_checkpoint, fingerprint_checkpoint
from sdc_core.replay.ring import ReplayConfig, ReplayExact, ReplayFailurePolicy, RingReplay, UnreplayablePolicy
from sdc_core.replay.state import StateCapture
from sdc_core.sharded.checks import ShardedFingerprint, ShardedNonFinite
from sdc_core.sharded.replay import ShardedReplay, screenable
from sdc_core.sharded.update_audit import update_audit


@common.documented_by(NonFiniteConfig, screen="gradient_screen")
class NonFiniteGradientCheck(common.SDCCallback):
    """Flag every rank whose LOCAL gradients hold NaN/Inf, before the all-reduce spreads them.

    Under DDP: a read of the local gradients at the end of backward and a 4-byte all-reduce of its flag; the ``screen``
    compares the ranks' gradient peaks from the same read every step. ``"raise"`` and ``"warn"`` are read one step later
    (also before a checkpoint and at the end of training), the other policies, an fp16 GradScaler and audited steps
    before the update. Without DDP, ``.grad`` is checked before the optimizer step. Details:
    docs/checks-and-settings.md."""

    def __init__(
        self,
        on_failure: NonFiniteFailurePolicy = "raise",
        overflow_patience: int = 3,
        max_names: int = 5,
        screen: bool = True,
    ) -> None:
        super().__init__()
        self._core = NonFiniteGradient(self._settings(NonFiniteConfig, locals()))
        self._screen: GradientScreen | None = GradientScreen(ScreenConfig()) if screen else None
        self._screening = False  # attached in this fit (DDP, FSDP2)

    def _checks(self) -> list[Any]:
        return [self._core, *([self._screen] if self._screening else [])]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        screened = False
        if common.is_sharded(trainer):  # FSDP2: the tap sits in each parameter group's reduce-scatter
            self._core = ShardedNonFinite(self._core.config, self._core.stats, self._core.topology)
            self._core.attach(pl_module)
            screened = screenable(pl_module, self._core.taps)  # FSDP2 / HSDP, not tensor parallel
        elif common.is_ddp(trainer):
            self._core.attach(common.gradient_tap(trainer, pl_module))
            screened = True
        if self._screen is not None and screened:  # every step, the local peaks compared across the ranks
            self._screen.topology = self._core.topology
            self._screen.attach(self._core)
            self._screening = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        common.trainer_driver(trainer).prepare()  # every core in place: a replay keeps steps for the screen

    def state_dict(self) -> dict[str, Any]:
        """The check's counters, and the screen's (its counters and band) under ``"screen"``."""
        state = super().state_dict()
        if self._screen is not None:
            state["screen"] = self._screen.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        screen = state.pop("screen", None)
        super().load_state_dict(state)
        if screen is not None and self._screen is not None:  # counters and band
            self._screen.load_state_dict(screen)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        driver = common.trainer_driver(trainer)
        driver.resolve_gradients(common.step_context(trainer, pl_module))  # the previous step's, one step later
        if self._screening:
            seam = common.trainer_seam(trainer)
            # as back-propagated (normalised, scaled) and summed over the step's micro-batches: what a replay returns
            seam.last_loss = loss.detach() if seam.last_loss is None else seam.last_loss + loss.detach()


@common.documented_by(FingerprintConfig, update_audit_every_n_steps="update_audit_every_n_steps")
class WeightFingerprintCheck(common.SDCCallback):
    """Compare exact fingerprints of the replicas' weights after every ``every_n_steps`` steps.

    The comparison of step ``s`` is read in the next step, before its update and before the replay's verdict, so the
    host never waits in the step that computed it and a weight fault is never reported as a compute fault. Before a
    checkpoint is written and when training ends the weights are compared at once, whatever the cadence. Raises
    ``FingerprintMismatchError`` on every rank; with 3+ replicas the minority rank is named. Checkpoints (weights-only
    ones too) carry a fingerprint of their weights and optimizer state, verified on resume. Sharded models (FSDP2):
    docs/sharded.md. Details: docs/checks-and-settings.md."""

    def __init__(
        self,
        every_n_steps: int = 1,
        include_buffers: bool = False,
        include_optimizer_state: bool = False,
        on_failure: FingerprintFailurePolicy = "raise",
        max_heals: int = 3,
        update_audit_every_n_steps: int = 0,
        rolling: int = 1,
    ) -> None:
        super().__init__()
        self._core = WeightFingerprint(self._settings(FingerprintConfig, locals()))
        self._update_audit = update_audit(update_audit_every_n_steps)

    def _checks(self) -> list[Any]:
        return [self._core, *([self._update_audit] if self._update_audit is not None else [])]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if common.is_sharded(trainer):  # shards compared in their replica groups, unreplicated ones at rest
            self._core = ShardedFingerprint(self._core.config, self._core.stats, self._core.topology)
            if self._update_audit is not None:
                self._update_audit.topology = self._core.topology
                self._update_audit.attach(trainer.optimizers[0], pl_module)
        elif not common.is_ddp(trainer):
            common.warn_inactive(type(self).__name__, "a single process has no replica to compare with")
        if not common.is_sharded(trainer):
            self._update_audit = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if isinstance(self._core, ShardedFingerprint):
            self._core.before_use()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """The replicas compared (every rank) before the checkpoint is written, then its fingerprint stored; a heal
        or rollback refreshes its tensors. Sharded models' DTensor shards: compared, not fingerprinted."""
        if self._before_save(trainer, pl_module, checkpoint) and common.is_ddp(trainer):  # save the new state
            checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()
            if "optimizer_states" in checkpoint:
                checkpoint["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
        if not common.is_sharded(trainer):
            checkpoint[FINGERPRINT_KEY] = fingerprint_checkpoint(checkpoint)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if not common.is_sharded(trainer):
            check_loaded_checkpoint(checkpoint, int(checkpoint.get("global_step", trainer.global_step)))


LIGHTNING_ADVICE = (  # the replay's advice for unreplayable steps, in Lightning's terms
    "Expose state the capture cannot see with sdc_replay_state()/sdc_load_replay_state(state) on the "
    "LightningModule, or define a side-effect free sdc_replay_step(batch, batch_idx)")


@common.documented_by(ReplayConfig)
class RingReplayAudit(common.SDCCallback):
    """Every ``every_n_steps`` steps, a partner rank replays each rank's micro-batches.

    The replay runs ``pl_module.sdc_replay_step(batch, batch_idx)`` when defined (it returns the loss, or a dict with
    ``"loss"``), else ``training_step`` with logging muted, with the owner's RNG and module state (define
    ``sdc_replay_state()`` / ``sdc_load_replay_state(state)`` for state the capture cannot see), without side effects.
    Raises ``ReplayMismatchError`` (a fault) or ``ReplayUnavailableError`` on every rank; a disagreement is first
    checked against the replicas' weights. Manual optimization needs ``sdc_replay_step``, returning the loss of the
    backward passes before the batch's first ``optimizer.step()``: only that first step is audited (a GAN's later steps
    are covered by ``NonFiniteGradientCheck`` and ``WeightFingerprintCheck``). Details: docs/checks-and-settings.md,
    docs/replay-contract.md."""

    def __init__(
        self,
        every_n_steps: int = 100,
        exact: ReplayExact = "auto",
        rtol: float = 1e-3,
        atol: float = 1e-6,
        on_failure: ReplayFailurePolicy = "raise",
        on_unreplayable: UnreplayablePolicy = "raise",
        max_state_mb: float = 256.0,
        deterministic: bool = True,
    ) -> None:
        super().__init__()
        config = self._settings(ReplayConfig, locals())
        self._core = RingReplay(config, advice=LIGHTNING_ADVICE, label="RingReplayAudit")
        self._training_step: Any = None
        self._names: list[str] = []  # the parameters that trained when fit started (DDP)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and not pl_module.automatic_optimization and not hasattr(pl_module, "sdc_replay_step"):
            raise ValueError(
                "RingReplayAudit with manual optimization needs a side-effect free "
                "`sdc_replay_step(batch, batch_idx)` on the LightningModule that returns the loss the batch's "
                "first optimizer step back-propagates (with several optimizers, e.g. a GAN, only that first "
                "step is replayed; NonFiniteGradientCheck and WeightFingerprintCheck cover every step), "
                "or leave RingReplayAudit out")
        if stage == "fit" and hasattr(pl_module, "sdc_replay_state") != hasattr(pl_module, "sdc_load_replay_state"):
            raise ValueError("define both sdc_replay_state() and sdc_load_replay_state(state) on the LightningModule")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if not (common.is_sharded(trainer) or common.is_ddp(trainer)):
            common.warn_inactive(type(self).__name__, "a single process has no partner to replay its batches")
            return
        state = {"exclude": common.lightning_internals(), "get_state": getattr(pl_module, "sdc_replay_state", None),
                 "load_state": getattr(pl_module, "sdc_load_replay_state", None)}  # fmt: skip
        core = self._core
        if common.is_sharded(trainer):  # FSDP2: every rank replays its partner's batch through the sharded model
            self._core = ShardedReplay(core.config, core.stats, core.topology, advice=core.advice, label=core.label)
            self._core.attach(pl_module, **state)
        else:
            self._names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
            core.attach(common.gradient_tap(trainer, pl_module), self._names)
            core.capture = StateCapture(pl_module, self._names, max_state_mb=core.config.max_state_mb, **state)
        self._wrap_training_step(pl_module)

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        """Capture state where the step really starts (after the module's own batch-start hooks)."""
        original = pl_module.training_step
        core = self._core

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if core.armed or core.keeping:
                core.begin(pl_module.device)
            return original(*args, **kwargs)

        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._training_step = (original, training_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap(pl_module)
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unwrap(pl_module)
        super().on_exception(trainer, pl_module, exception)

    def _unwrap(self, pl_module: pl.LightningModule) -> None:
        if self._training_step is not None and vars(pl_module).get("training_step") is self._training_step[1]:
            del pl_module.training_step
        self._training_step = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._core.arm(trainer.global_step):
            # the state is captured where training_step starts (the wrapper calls begin)
            self._core.record(batch, batch_idx, pl_module.device, state=self._training_step is None)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._core.record_loss(loss)

    def _replay_functions(self, trainer: pl.Trainer) -> tuple[Any, Any, Any]:
        """``(step_fn, to_device, context)`` of a replay in Lightning's terms."""
        pl_module = trainer.lightning_module
        if self._names:  # only what trains now is compared: a parameter frozen since gets no local gradient
            trains = {n for n, p in pl_module.named_parameters() if p.requires_grad}
            self._core.names = [n for n in self._names if n in trains]
        original = self._training_step[0] if self._training_step is not None else pl_module.training_step
        replay_fn = getattr(pl_module, "sdc_replay_step", None) or original
        scaler = getattr(trainer.precision_plugin, "scaler", None)

        def step_fn(batch: Any, batch_idx: int) -> torch.Tensor:
            with common.no_logging(pl_module):
                out = replay_fn(batch, batch_idx)
            loss = out["loss"] if isinstance(out, dict) else out
            loss = loss / trainer.accumulate_grad_batches
            return scaler.scale(loss) if scaler is not None else loss

        return step_fn, trainer.strategy.batch_to_device, trainer.precision_plugin.train_step_context


class FaultInjector(Callback):
    """Fire drills: simulate a faulty rank (see ``sdc_core.faults.inject``). Never use in production.

    Args:
        faults: ``sdc_core.Fault`` objects or dicts of their fields (for YAML configs)."""

    def __init__(self, faults: list[Fault] | list[dict[str, Any]]) -> None:
        self.injector = _CoreInjector([f if isinstance(f, Fault) else Fault(**f) for f in faults])
        self._handles: list[Any] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.injector.install(pl_module, trainer.global_rank)

        def after(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            self.injector.after_step(self.injector.step, pl_module, trainer.optimizers)

        self._handles = [opt.register_step_post_hook(after) for opt in trainer.optimizers]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.injector.set_step(trainer.global_step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.injector.remove()
        for h in self._handles:
            h.remove()
        self._handles = []


@common.documented_by(MatmulChecksumConfig)
class MatmulChecksumCheck(common.SDCCallback):
    """Verify every matrix product of each rank against a checksum, forward and backward, and raise
    ``ChecksumMismatchError`` on every rank naming the rank, host, module and phase of a product that came out wrong, in
    the step it happened.

    Covers ``nn.Linear`` layers and ``nn.MultiheadAttention`` projections (docs/coverage.md). Cost:
    memory-bound reads and thin products per product (``every_n_steps`` divides it) and one
    asynchronous 4-byte all-reduce per step; the verdict of step s is read when step s + 1 starts,
    before a checkpoint and at the end of training. Training stays bit-identical."""

    def __init__(
        self,
        on_failure: MatmulFailurePolicy = "raise",
        every_n_steps: int = 1,
        safety: float = 2.0,
        block: int = 32,
        attention: bool = True,
        max_names: int = 5,
    ) -> None:
        super().__init__()
        self._core = MatmulChecksum(self._settings(MatmulChecksumConfig, locals()))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._core.attach(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        core, step = self._core, trainer.global_step
        common.trainer_driver(trainer).delivery.deliver(core, lambda: core.arm(step))  # reads the last verdict

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._core.detach()
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        super().on_exception(trainer, pl_module, exception)  # discards the pending verdict: no collective
        self._core.detach()


class StepCheckCallback(common.SDCCallback):
    """Run a check of your own (a ``sdc_core.checks.contract.StepCheck``) in every step of the fit, in the phases and
    order the built-in checks use; what it raises is delivered like their verdicts (incident, exit code), its counters
    logged as ``sdc/<name>/...``. Cost: what the check does, a method call per phase."""

    def __init__(self, check: Any) -> None:
        super().__init__()
        self._core = require_check(check)
