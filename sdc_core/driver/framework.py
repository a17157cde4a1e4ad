"""``Framework``: what the hook set (``sdc_core.driver.hooks.SDCHooks``) asks of a training loop, answered here for a
plain PyTorch loop; it is also the hook set's ``Seam``. Also here: the callables a loop hands the hook set."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_core.driver.step import Seam, StepContext

LossFn = Callable[..., torch.Tensor]
MetricsFn = Callable[[dict[str, float], int], None]


class Framework(Seam):
    """The seam between the hook set and a plain PyTorch loop; the other seams subclass it. None of its members
    communicates.

    Args:
        run_dir: where incidents go (``<run_dir>/sdc/incidents``); default: the working directory.
        log: ``log(metrics, step)`` receives the counters (every rank calls it; write on rank 0).
        accumulation_steps: what you divide the loss by before ``backward`` (the replay
            recomputes that loss); 1 when you do not."""

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, log: MetricsFn | None = None,
                 accumulation_steps: int = 1) -> None:  # fmt: skip
        if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be a whole number >= 1, got {accumulation_steps!r}")
        if log is not None and not callable(log):
            raise TypeError(f"log must be a callable log(metrics, step), got {type(log).__name__}")
        self._run_dir = None if run_dir is None else os.fspath(run_dir)
        self._log = log
        self._divisor = accumulation_steps
        self._scaler: Any = None
        self._updated = False  # set by a step post-hook on the inner optimizer
        self.capture: Any = None  # the hook set's ``LoopCapture`` (a weak proxy), set when the hook set is made

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def is_main(self) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def ddp_model(self, model: nn.Module) -> DistributedDataParallel | None:
        """The ``DistributedDataParallel`` object of the model, or None."""
        return model if isinstance(model, DistributedDataParallel) else None

    def unsupported(self, model: nn.Module) -> str | None:
        """Why this set-up cannot be checked whatever the number of processes (for the error
        ``attach`` raises), or None: e.g. an engine that steps the optimizer itself."""
        return None

    def describe(self, model: nn.Module) -> str:
        """Why ``model`` is not a DDP model (for the error ``attach`` raises)."""
        return (f"a {type(model).__name__} in a run of {self.world_size} processes: wrap the model in "
                "DistributedDataParallel or apply fully_shard before attach")  # fmt: skip

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch whose gradients are all-reduced: a plain loop steps only then."""
        return True

    @property
    def loss_divisor(self) -> int:
        """What the loop divides the loss by before backward (gradient accumulation)."""
        return self._divisor

    @property
    def scaler(self) -> Any:
        """The ``torch.amp.GradScaler`` scaling the loss, or None."""
        return self._scaler

    def use_scaler(self, scaler: Any) -> None:
        """Take the plain loop's GradScaler (given to ``attach``); ``TypeError`` for another object."""
        if not hasattr(scaler, "step") or not hasattr(scaler, "scale"):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self._scaler = scaler

    def step_owner(self, optimizer: Any) -> Any:
        """The object whose ``step`` the hook set wraps: the GradScaler when there is one (a plain
        loop calls ``scaler.step(optimizer)``, which skips ``optimizer.step`` on overflow)."""
        return self._scaler if self._scaler is not None else optimizer

    def begin_step(self) -> None:
        self._updated = False

    def mark_updated(self) -> None:
        self._updated = True

    def step_was_skipped(self, optimizer: Any) -> bool:
        """True when the step just taken did not update (a GradScaler skipped it on overflow)."""
        updated, self._updated = self._updated, False
        return self.scaler is not None and not updated

    def to_device(self, batch: Any, device: torch.device | None = None) -> Any:
        """``batch`` with its tensors moved to ``device`` (the model's device)."""
        return _to_device(batch, device)

    def replay_context(self) -> AbstractContextManager[Any]:
        """Entered around a replayed forward of the unwrapped module (besides the recorded autocast)."""
        return nullcontext()

    def replay_model(self, module: nn.Module) -> Any:
        """What a ``replayable`` function gets as its model in a replay: the unwrapped module."""
        return module

    @property
    def run_dir(self) -> str:
        return self._run_dir or "."

    def replay_functions(self, replay: Any, step: StepContext) -> tuple[Any, Any, Any]:
        return self.capture.replay_step, self.capture.to_device, nullcontext

    def replay_inputs(self, batch: Any) -> Any:
        return batch[2:4]  # a capture's record: the call's arguments (``replay_capture._record``)

    def loss(self) -> torch.Tensor | None:
        return self.capture.take_loss() if self.capture is not None else None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._log is not None:
            self._log(metrics, step)

    def flush(self) -> None:
        return None

    def register_for_checkpointing(self, obj: Any) -> None:
        return None  # a plain loop saves hooks.state_dict() itself

    def before_checkpoint(self, fn: Callable[..., None]) -> Any:
        """Run ``fn(models, weights, output_dir)`` before the framework writes a checkpoint; a removable handle, or
        None where saving goes through ``SDCHooks.before_save()``."""
        return None

    def take_comm_hook(self) -> tuple[Any, Any]:
        """A communication hook the framework would register, for the tap to register instead."""
        return None, None


def wrap_step(owner: Any, step: Callable[[Callable[..., Any], tuple, dict], Any],
              on_error: Callable[[BaseException], None]) -> Any:  # fmt: skip
    """Replace ``owner.step`` on the instance by ``step(original, args, kwargs)``; ``on_error(err)`` runs when an
    exception leaves it (which goes on). Returns the handle that puts the object's own ``step`` back."""
    original = owner.step

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(original, args, kwargs)
        except BaseException as err:
            on_error(err)
            raise

    owner.step = wrapped
    return Removal(lambda: owner.__dict__.pop("step", None))


class Removal:
    """A removable handle whose ``remove`` calls ``fn``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def remove(self) -> None:
        self.fn()


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate, Fabric), or itself."""
    return getattr(optimizer, "optimizer", optimizer)


def _to_device(value: Any, device: torch.device | None) -> Any:
    """``value`` with every tensor in (nested) lists, tuples and dicts moved to ``device``."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        moved = {k: _to_device(v, device) for k, v in value.items()}
        try:
            return type(value)(moved)
        except TypeError:  # a mapping type that cannot be built from a dict
            return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    return value


__all__ = ["Framework", "LossFn", "MetricsFn", "inner_optimizer", "wrap_step"]
