"""What the Lightning callbacks share: the Trainer's seam and its one core driver, and the base of every SDC
callback (strategy check, counters in checkpoints, the driver's events, weights-only saves)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.dist.topology import Topology
from sdc_core.driver.settings import SDCConfigError, SDCSettings, checked_keywords
from sdc_core.driver.step import Seam, StepContext, StepDriver
from sdc_core.errors import SDCError, as_sdc_error
from sdc_core.ops import process_exit
from sdc_core.ops.process_exit import install_exit_code, mark_verdict, one_line_when_uncaught, spawn_marker, take_marker
from sdc_core.ops.summary import log_run_summary
from sdc_core.schema import documented, settings_of
from sdc_core.stats import CheckStats

_STASH = "_sdc_user_comm_hook"


def require_supported_strategy(trainer: pl.Trainer, check: str) -> None:
    """Raise ``ValueError`` naming the strategy unless it is DDP, ``ModelParallelStrategy``
    (FSDP2 / HSDP / tensor parallel) or a single device."""
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(
        strategy, DDPStrategy | ModelParallelStrategy | SingleDeviceStrategy
    ):
        raise ValueError(
            f"{check} supports strategy='ddp' (and its variants), ModelParallelStrategy (FSDP2 via "
            f"fully_shard, HSDP, tensor parallel) or a single device; got {type(strategy).__name__}. "
            "FSDPStrategy (FSDP1) and DeepSpeed are not supported: use ModelParallelStrategy with fully_shard.")
    if isinstance(strategy, DDPStrategy) and not hasattr(strategy, _STASH):
        # the user's DDP comm hook (Lightning registers it on CUDA only): the tap registers it, on every device
        setattr(strategy, _STASH, (strategy._ddp_comm_hook, strategy._ddp_comm_state, strategy._ddp_comm_wrapper))
        strategy._ddp_comm_hook = None


def is_ddp(trainer: pl.Trainer) -> bool:
    return isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1


def is_sharded(trainer: pl.Trainer) -> bool:
    """FSDP2 / HSDP / tensor parallel (``ModelParallelStrategy``) over more than one process."""
    return isinstance(trainer.strategy, ModelParallelStrategy) and trainer.world_size > 1


def gradient_tap(trainer: pl.Trainer, pl_module: pl.LightningModule) -> GradientTap:
    """The single gradient tap on the DDP model; registers the user's comm hook, if any."""
    hook, state, wrapper = getattr(trainer.strategy, _STASH, (None, None, None))
    if hook is not None and wrapper is not None:
        hook = wrapper(hook)
    names = {id(p): n for n, p in pl_module.named_parameters()}
    tap = GradientTap.attach(trainer.strategy.model, names, inner_hook=hook, inner_state=state)
    trainer.strategy._sdc_gradient_tap = tap  # type: ignore[attr-defined]
    return tap


def warn_inactive(check: str, why: str) -> None:
    warnings.warn(f"{check} is inactive: {why}", UserWarning, stacklevel=3)


def log_stats(trainer: pl.Trainer, stats: CheckStats, force: bool = False) -> None:
    """The counters in ``trainer.callback_metrics`` (0-d tensors, for ``EarlyStopping`` and ``ModelCheckpoint(monitor=
    "sdc/...")``), and to every logger every ``log_every_n_steps`` or with ``force`` (then saved). Cost: one small
    CPU tensor per metric per batch."""
    if trainer.sanity_checking:
        return
    metrics = stats.metrics()
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
    step = trainer.global_step
    if not force and step % max(trainer.log_every_n_steps, 1) != 0:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        if force:
            logger.save()


@contextmanager
def no_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Silence ``self.log``, ``self.log_dict`` and ``self.print`` of a LightningModule (replays must not log);
    whatever the instance held before comes back."""
    own, names = vars(pl_module), ("log", "log_dict", "print")
    before = {n: own[n] for n in names if n in own}  # what the instance itself held
    own.update(dict.fromkeys(names, lambda *_args, **_kwargs: None))
    try:
        yield
    finally:
        for n in names:
            own.pop(n, None)
        own.update(before)


@functools.lru_cache(maxsize=1)
def lightning_internals() -> frozenset[str]:
    """Attribute names a bare ``LightningModule`` holds: framework state the replay's state capture leaves alone."""
    return frozenset(vars(pl.LightningModule())) | {"_hparams", "_hparams_initial", "_hparams_name"}


def rollback(trainer: pl.Trainer, pl_module: pl.LightningModule, error: Any, max_step: int) -> Any:
    """``sdc_core.ops.rollback.roll_back`` over the checkpoint callbacks' folders (weights-only reads unless
    ``SDC_TRUST_PICKLE=1``): weights and optimizer state reloaded; data and step counters go on."""
    from sdc_core.io.safe_files import load_torch, trust_pickle_from_env
    from sdc_core.ops.rollback import roll_back

    trust = trust_pickle_from_env()

    def restore(path: str) -> Any:
        ckpt = load_torch(path, trust_pickle=trust, map_location=pl_module.device)
        pl_module.load_state_dict(ckpt["state_dict"])
        for optimizer, state in zip(trainer.optimizers, ckpt.get("optimizer_states", []), strict=False):
            optimizer.load_state_dict(state)
        return ckpt.get("global_step")

    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    return roll_back(error, max_step, folders, is_main=trainer.is_global_zero, trust_pickle=trust,
                     broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0), restore=restore)  # fmt: skip


class TrainerSeam(Seam):
    """The core driver's seam of one Trainer."""

    def __init__(self, trainer: pl.Trainer, marker: str) -> None:
        self.trainer = trainer
        self.marker = marker  # the ddp_spawn marker of the first SDC callback (read in the caller of fit)
        self.resolved_run_dir: str | None = None
        self.seen_step: int | None = None  # the global step at the last after-update work (or fit start)
        self.last_loss: torch.Tensor | None = None  # the step's loss so far (the screen's loss value)
        self.dropped = False  # the driver dropped the last update (its gradients set aside): the weights did not change

    @property
    def run_dir(self) -> str:
        return self.resolved_run_dir or self.trainer.default_root_dir

    @property
    def is_main(self) -> bool:
        return self.trainer.is_global_zero

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def report(self, check: Any, policy: str) -> None:
        try:
            log_stats(self.trainer, check.stats, force=True)
        except Exception as err:
            warnings.warn(f"SDC counters not logged: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)

    def tracker_targets(self) -> list[tuple[str, Any]]:
        """The Trainer's loggers that take text: TensorBoard, MLflow, W&B."""
        targets = {
            "TensorBoardLogger": lambda logger: ("tensorboard", logger.experiment),
            "MLFlowLogger": lambda logger: ("mlflow", (logger.experiment, logger.run_id)),
            "WandbLogger": lambda logger: ("wandb", logger.experiment),
        }
        return [targets[type(lg).__name__](lg) for lg in self.trainer.loggers if type(lg).__name__ in targets]

    def mark(self, error: SDCError) -> None:
        spawned = isinstance(self.trainer.strategy.launcher, _MultiProcessingLauncher)
        mark_verdict(error, self.marker if spawned else None)

    def rollback(self, error: SDCError, max_step: int) -> SDCError:
        return rollback(self.trainer, self.trainer.lightning_module, error, max_step)

    def replay_functions(self, replay: Any, step: StepContext) -> tuple[Any, Any, Any]:
        owner: Any = next(cb for cb in self.trainer.callbacks if isinstance(cb, SDCCallback) and cb._core is replay)
        return owner._replay_functions(self.trainer)  # the RingReplayAudit that owns the replay

    def loss(self) -> torch.Tensor | None:
        loss, self.last_loss = self.last_loss, None
        return loss


_DRIVER = "_sdc_driver"


def trainer_checks(trainer: pl.Trainer) -> list[Any]:
    """The core checks of every SDC callback of this Trainer, in the callbacks' order."""
    return [check for cb in trainer.callbacks if isinstance(cb, SDCCallback) for check in cb._checks()]


def trainer_driver(trainer: pl.Trainer) -> StepDriver:
    """The one core driver of this Trainer's SDC callbacks (made at the first callback's ``setup``)."""
    driver = vars(trainer).get(_DRIVER)
    if driver is None:
        marker = next((cb._spawn_marker for cb in trainer.callbacks if isinstance(cb, SDCCallback)), "")
        driver = vars(trainer)[_DRIVER] = StepDriver(TrainerSeam(trainer, marker), lambda: trainer_checks(trainer))
    return driver


def trainer_seam(trainer: pl.Trainer) -> TrainerSeam:
    return cast(TrainerSeam, trainer_driver(trainer).seam)  # trainer_driver makes the driver with a TrainerSeam


def step_context(trainer: pl.Trainer, pl_module: pl.LightningModule, index: int | None = None) -> StepContext:
    """The step as the driver sees it: ``trainer.global_step`` (or ``index``) is both step and update index."""
    step = trainer.global_step if index is None else index
    return StepContext(
        step, step, pl_module, list(trainer.optimizers),
        scaler_active=getattr(trainer.precision_plugin, "scaler", None) is not None,
    )  # fmt: skip


def documented_by(config: type, **own: str) -> Callable[[type], type]:
    """Class decorator: the callback's ``Args:`` section from the settings schema (LightningCLI's help reads it): the
    ``config`` setting of the argument's name, or the ``SDCSettings`` field that ``own`` names for it."""
    fields = {f.name: f for f in dataclasses.fields(SDCSettings)}
    docs = {**settings_of(config), **{argument: fields[name] for argument, name in own.items()}}

    def decorate(cls: type) -> type:
        return documented(cls, {name: docs[name] for name in list(inspect.signature(cls.__init__).parameters)[1:]})

    return decorate


class SDCCallback(Callback):
    """Common plumbing: strategy check, topology, counters in checkpoints, logging, the driver's events."""

    _core: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A misspelled keyword names the check, the keyword and the closest argument."""
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__ and not getattr(cls.__init__, "_sdc_checked", False):
            cls.__init__ = checked_keywords(cls.__dict__["__init__"])  # type: ignore[method-assign]

    def __init__(self) -> None:
        # carried to ddp_spawn workers inside the callback: where a worker leaves its verdict for the caller of fit
        self._spawn_marker = spawn_marker()

    def _checks(self) -> list[Any]:
        return [self._core]

    def _settings(self, config: type, arguments: dict[str, Any]) -> Any:
        """``config`` from the constructor's ``locals()``, a bad value's ``ValueError`` naming this callback."""
        try:
            return config(**{name: arguments[name] for name in settings_of(config) if name in arguments})
        except ValueError as err:
            one_line_when_uncaught(SDCConfigError)  # a configuration error is one line per rank, not a traceback
            raise SDCConfigError(f"{type(self).__name__}: {err}") from None

    @functools.cached_property
    def state_key(self) -> str:
        """Unique per configuration (a check of one's own: per name), so two instances of one check can coexist."""
        config = self._core.config
        config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {"check": self._core.stats.check}
        return self._generate_state_key(**{k: v for k, v in config.items() if (k, v) != ("rolling", 1)})  # as before

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            require_supported_strategy(trainer, type(self).__name__)
            install_exit_code()
            if next(cb for cb in trainer.callbacks if isinstance(cb, SDCCallback)) is self:
                vars(trainer).pop(_DRIVER, None)  # a new fit: a new driver

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy: Any = trainer.strategy
        if getattr(strategy, "_sdc_topology", None) is None:  # every rank's host, node and local rank: a collective
            strategy._sdc_topology = Topology.gather(node_rank=trainer.node_rank, local_rank=trainer.local_rank)
        self._core.topology = strategy._sdc_topology  # gathered once per strategy, shared by the SDC callbacks
        seam = trainer_seam(trainer)
        if seam.resolved_run_dir is None:
            # Resolved here, on every rank: `trainer.log_dir` is a broadcast, never safe on an error path.
            seam.resolved_run_dir = trainer.log_dir or trainer.default_root_dir
        seam.seen_step = trainer.global_step
        route_weights_only_saves(trainer, pl_module)
        if trainer.world_size > 1:  # the communication threads finish with Python before it shuts down
            process_exit.arm()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unroute_weights_only_saves(pl_module)
        tap = vars(trainer.strategy).pop("_sdc_gradient_tap", None)  # the module outlives the DDP wrapper
        if tap is not None:  # its hooks off the parameters (the first SDC callback's teardown: idempotent)
            tap.remove()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """The verdicts due before the update (the driver runs each step's once, whichever callback comes first)."""
        trainer_seam(trainer).dropped = trainer_driver(trainer).before_optimizer_step(step_context(trainer, pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """After an update (once per global step): the driver's after-update phase; counters logged."""
        driver, seam = trainer_driver(trainer), trainer_seam(trainer)
        if seam.seen_step != trainer.global_step:  # an update since the last batch end
            seam.seen_step = trainer.global_step
            driver.resolve_comparison(step_context(trainer, pl_module))
            driver.after_update(step_context(trainer, pl_module, trainer.global_step - 1), not seam.dropped)
        for check in self._checks():
            log_stats(trainer, check.stats)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """The driver's ``before_save`` (once per checkpoint, every rank: Lightning builds it on all of them)."""
        self._before_save(trainer, pl_module, checkpoint)

    def _before_save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> bool:
        """The driver's comparison before this checkpoint, whose counters of this callback are refreshed. True when a
        heal or rollback changed the weights."""
        key = (id(checkpoint), trainer.global_step)
        changed = trainer_driver(trainer).before_save(step_context(trainer, pl_module), key=key)
        if isinstance(checkpoint.get("callbacks"), dict) and self.state_key in checkpoint["callbacks"]:
            checkpoint["callbacks"][self.state_key] = self.state_dict()  # counters with this comparison
        return changed

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last pending verdicts read and the final weights compared before ``fit`` returns (once)."""
        driver = trainer_driver(trainer)
        driver.before_save(step_context(trainer, pl_module), key=("end", trainer.global_step), at_end=True)
        for check in self._checks():
            log_stats(trainer, check.stats, force=True)
        log_run_summary(trainer.global_step, trainer_checks(trainer), driver.seam)  # rank 0: one line, once per Trainer

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Every path out: no collective left in flight; the verdict marked for the launcher; under ``ddp_spawn``, in
        the caller of ``fit``, the worker's text-only exception becomes the ``SDCError`` it was."""
        unroute_weights_only_saves(pl_module)
        trainer_driver(trainer).discard()  # no all-reduce of a check left in flight into the exit
        if isinstance(exception, SDCError):
            mark_verdict(exception)
            return
        error = take_marker(self._spawn_marker)
        if error is not None:
            as_sdc_error(exception, error)
            install_exit_code()  # the caller's process exits with the SDC code too when it goes uncaught

    def state_dict(self) -> dict[str, Any]:
        return self._core.stats.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._core.stats.load_state_dict(state_dict)


_WEIGHTS_ONLY_ROUTE = "_sdc_weights_only_route"


def route_weights_only_saves(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Give the SDC callbacks their ``on_save_checkpoint`` for weights-only checkpoints too, for which Lightning calls
    only the module's ``on_save_checkpoint`` (every rank, before anything is written): it is wrapped on the instance
    (once; the user's override still runs, last). Undone by ``unroute_weights_only_saves``."""
    if getattr(vars(pl_module).get("on_save_checkpoint"), _WEIGHTS_ONLY_ROUTE, None) is not None:
        return
    original = pl_module.on_save_checkpoint

    @functools.wraps(original)
    def on_save_checkpoint(checkpoint: dict[str, Any]) -> Any:
        if "callbacks" not in checkpoint:  # weights only: Lightning called no callback hook
            for cb in trainer.callbacks:
                if isinstance(cb, SDCCallback):
                    cb.on_save_checkpoint(trainer, pl_module, checkpoint)
        return original(checkpoint)

    # what to put back: an attribute set on the instance before, or nothing (the class's method)
    setattr(on_save_checkpoint, _WEIGHTS_ONLY_ROUTE, (vars(pl_module).get("on_save_checkpoint"),))
    pl_module.on_save_checkpoint = on_save_checkpoint  # type: ignore[method-assign]


def unroute_weights_only_saves(pl_module: pl.LightningModule) -> None:
    """Undo ``route_weights_only_saves`` (idempotent): the module's own method is back."""
    route = getattr(vars(pl_module).get("on_save_checkpoint"), _WEIGHTS_ONLY_ROUTE, None)
    if route is not None:
        del pl_module.on_save_checkpoint
        if route[0] is not None:
            pl_module.on_save_checkpoint = route[0]  # type: ignore[method-assign]
