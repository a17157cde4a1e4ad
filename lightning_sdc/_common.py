"""Glue shared by the Lightning callbacks: strategy checks, the shared tap, topology, logging."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.dist.topology import Topology
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
            "FSDPStrategy (FSDP1) and DeepSpeed are not supported: use ModelParallelStrategy with fully_shard."
        )
    if isinstance(strategy, DDPStrategy) and not hasattr(strategy, _STASH):
        # Take the user's DDP comm hook from the strategy (Lightning registers it on CUDA only);
        # the SDC tap registers it on the DDP model, on every device.
        setattr(strategy, _STASH, (strategy._ddp_comm_hook, strategy._ddp_comm_state, strategy._ddp_comm_wrapper))
        strategy._ddp_comm_hook = None


def is_ddp(trainer: pl.Trainer) -> bool:
    return isinstance(trainer.strategy, DDPStrategy) and trainer.world_size > 1


def is_sharded(trainer: pl.Trainer) -> bool:
    """FSDP2 / HSDP / tensor parallel (``ModelParallelStrategy``) over more than one process."""
    return isinstance(trainer.strategy, ModelParallelStrategy) and trainer.world_size > 1


def topology(trainer: pl.Trainer) -> Topology:
    """Every rank's host, node and local rank: gathered once per strategy (a collective)."""
    topo = getattr(trainer.strategy, "_sdc_topology", None)
    if topo is None:
        topo = Topology.gather(node_rank=trainer.node_rank, local_rank=trainer.local_rank)
        trainer.strategy._sdc_topology = topo  # type: ignore[attr-defined]
    return topo


def gradient_tap(trainer: pl.Trainer, pl_module: pl.LightningModule) -> GradientTap:
    """The single gradient tap on the DDP model; registers the user's comm hook, if any."""
    hook, state, wrapper = getattr(trainer.strategy, _STASH, (None, None, None))
    if hook is not None and wrapper is not None:
        hook = wrapper(hook)
    names = {id(p): n for n, p in pl_module.named_parameters()}
    tap = GradientTap.attach(trainer.strategy.model, names, inner_hook=hook, inner_state=state)
    trainer.strategy._sdc_gradient_tap = tap  # type: ignore[attr-defined]
    return tap


def remove_gradient_tap(trainer: pl.Trainer) -> None:
    """Take the tap's hooks off the parameters when ``fit`` ends (the module outlives the DDP
    wrapper; another ``fit`` installs a new tap). Idempotent: every SDC callback calls it."""
    tap = vars(trainer.strategy).pop("_sdc_gradient_tap", None)
    if tap is not None:
        tap.remove()


def warn_inactive(check: str, why: str) -> None:
    warnings.warn(f"{check} is inactive: {why}", UserWarning, stacklevel=3)


def log_stats(trainer: pl.Trainer, stats: CheckStats, force: bool = False) -> None:
    """Make the counters monitorable and send them to every logger of the trainer.

    Every call puts them in ``trainer.callback_metrics`` (as 0-d tensors, what ``EarlyStopping``
    and ``ModelCheckpoint(monitor="sdc/...")`` read: current values at every step); every
    ``log_every_n_steps`` (or with ``force``) they are written to the loggers directly, so a
    failure is recorded even when the step never completes (rank 0 writes; cheap on other
    ranks). Cost: one small CPU tensor per metric per batch. Not ``self.log``: at about a
    millisecond per call it cost more than the checks themselves.
    """
    if trainer.sanity_checking:
        return
    metrics = stats.metrics()
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
    if not trainer.loggers:
        return
    step = trainer.global_step
    if not force and step % max(trainer.log_every_n_steps, 1) != 0:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        if force:
            logger.save()


@contextmanager
def no_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Silence ``self.log``, ``self.log_dict`` and ``self.print`` of a LightningModule (replays
    must not log); whatever was there before (e.g. a user's instance attribute) comes back."""

    def mute(*_args: Any, **_kwargs: Any) -> None:
        return None

    names = ("log", "log_dict", "print")
    before = {n: vars(pl_module)[n] for n in names if n in vars(pl_module)}
    for n in names:
        vars(pl_module)[n] = mute
    try:
        yield
    finally:
        for n in names:
            if n in before:
                vars(pl_module)[n] = before[n]
            else:
                vars(pl_module).pop(n, None)


@functools.lru_cache(maxsize=1)
def lightning_internals() -> frozenset[str]:
    """Attribute names a bare ``LightningModule`` holds: framework state the replay's state
    capture leaves alone (the user's own attributes are captured)."""
    return frozenset(vars(pl.LightningModule())) | {"_hparams", "_hparams_initial", "_hparams_name"}


def rollback(trainer: pl.Trainer, pl_module: pl.LightningModule, error: Any, max_step: int) -> Any:
    """Reload weights and optimizer state from the newest checkpoint verified clean at or before
    ``max_step`` (chosen on rank 0, loaded on every rank); data and step counters go on, so the
    batches since that checkpoint are skipped. Returns the error with ``details["action"]`` set;
    raises it when no such checkpoint exists.

    Files are read with ``weights_only=True``: a file dropped into the checkpoint folder cannot
    run code. ``SDC_TRUST_PICKLE=1`` unpickles in full (checkpoints holding custom objects, e.g.
    hyperparameters of your own classes), with a warning per file."""
    from sdc_core.io.checkpoints import newest_verified
    from sdc_core.io.safe_files import load_torch, trust_pickle_from_env

    trust = trust_pickle_from_env()
    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    skipped: list[str] = []
    path = None
    if trainer.is_global_zero:
        try:  # whatever happens here, every rank meets at the broadcast below
            path = newest_verified(folders, max_step, trust_pickle=trust, skipped=skipped)
        except Exception as err:
            skipped.append(f"checkpoint search failed: {type(err).__name__}: {err}")
    path, skipped = trainer.strategy.broadcast((str(path) if path else None, skipped[:20]), src=0)  # same on all
    details = dict(error.details)
    if skipped:
        details["rollback_skipped"] = skipped
    if path is None:
        details["action"] = f"rollback failed: no checkpoint verified clean at or before step {max_step} in {folders}"
        if skipped:
            details["action"] += f" ({len(skipped)} passed over, e.g. {skipped[0]})"
        raise _with_details(error, details)
    ckpt = load_torch(path, trust_pickle=trust, map_location=pl_module.device)
    pl_module.load_state_dict(ckpt["state_dict"])
    for optimizer, state in zip(trainer.optimizers, ckpt.get("optimizer_states", []), strict=False):
        optimizer.load_state_dict(state)
    details["action"] = f"rolled back to {path} (step {ckpt.get('global_step')})"
    return _with_details(error, details)


def _with_details(error: Any, details: dict[str, Any]) -> Any:
    return type(error)(step=error.step, rank=error.rank, suspects=error.suspects, hosts=error.hosts,
                       details=details, reason=error.reason)  # fmt: skip
