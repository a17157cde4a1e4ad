"""``SDCTrainerCallback``: the SDC checks for a Hugging Face ``transformers.Trainer`` run.

```python
from accelerate_sdc.transformers import SDCTrainerCallback

trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SDCTrainerCallback()])
trainer.train()  # under torchrun or accelerate launch; an SDCError names the faulty rank and host
```

The callback drives the Accelerate hook set (``SDCHooks``) through a Trainer seam. The replay unit is the Trainer's own
``compute_loss`` (an override included), post-processed as ``training_step`` does before ``accelerator.backward``, so
loss scaling, accumulation and a custom ``compute_loss_func`` replay faithfully. Metrics go through ``trainer.log``
every ``logging_steps`` (unless ``log_every_n_steps`` is set), incidents to ``<output_dir>/sdc/incidents``. Needs
``transformers`` (importing ``accelerate_sdc`` does not import this module)."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from accelerate_sdc import config
from accelerate_sdc.hooks import AccelerateFramework, SDCHooks
from sdc_core._lazy import missing
from sdc_core.checks.contract import require_check

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import DefaultFlowCallback, ExportableState
except ImportError as err:
    raise missing(err, "transformers", "transformers", "accelerate_sdc.transformers") from None


class _TrainerFramework(AccelerateFramework):
    """The Accelerate seam with the Trainer's run folder, logging and checkpoints."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer.accelerator)
        self.trainer = trainer

    def describe(self, model: Any) -> str:
        kind = self.accelerator.distributed_type
        return f"the Trainer's model_wrapped is a {type(model).__name__} ({kind}); FSDP and DeepSpeed are not supported"

    @property
    def run_dir(self) -> str:
        return str(self.trainer.args.output_dir or ".")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # trainer.log writes at state.global_step, which equals the hook set's step here
        self.trainer.log(dict(metrics))

    def flush(self) -> None:
        """MLflow's queued metrics flushed, so they reach the run before a verdict ends the process."""
        flush = getattr(sys.modules.get("mlflow"), "flush_async_logging", None)
        if callable(flush):
            try:
                flush()
            except Exception as err:  # a tracker's failure never hides the verdict
                warnings.warn(f"MLflow's queued metrics not flushed: {err!r}", RuntimeWarning, stacklevel=2)

    def register_for_checkpointing(self, obj: Any) -> None:
        return None  # the Trainer saves its own checkpoints, not accelerator.save_state

    def before_checkpoint(self, fn: Any) -> Any:
        return None  # SDCTrainerCallback.on_step_end reads the verdicts when the Trainer will save


class SDCTrainerCallback(TrainerCallback, ExportableState):
    """Turn the three SDC checks on for a ``transformers.Trainer`` run.

    Args:
        checks: checks of your own (``sdc_core.checks.contract.StepCheck``), run with the built-in ones.
        **settings: any field of ``SDCSettings``, over ``ACCELERATE_SDC_*`` and the
            ``accelerate-sdc config`` file; a bad value raises ``SDCConfigError`` here.

    Raises ``SDCError`` subclasses out of ``trainer.train()`` on every rank in the same step (``err.step`` is the
    Trainer's ``global_step``). The counters and the saved state's fingerprint travel in the Trainer's checkpoints
    (``trainer_state.json``), verified on ``train(resume_from_checkpoint=...)``. ``self.hooks`` is the underlying
    ``SDCHooks``. Cost: that of ``SDCHooks``, plus one Python call per ``compute_loss``."""

    def __init__(self, checks: Sequence[Any] = (), **settings: Any) -> None:
        config.resolve(**settings)  # fail at construction, naming the bad key
        self._settings, self._own_checks = settings, [require_check(check) for check in checks]
        self.trainer: Trainer | None = None
        self.hooks: SDCHooks | None = None
        self._attached = False
        self._live = False
        self._raw: torch.Tensor | None = None

    def _bind(self) -> Trainer:
        """Find the calling Trainer (once), create the hook set, wrap ``compute_loss`` and run right after
        ``DefaultFlowCallback`` (the final metrics reach the trackers before they close in ``on_train_end``)."""
        trainer = _calling_trainer()
        if self.trainer is not None and trainer in (None, self.trainer):
            return self.trainer
        if self.hooks is not None and self._attached:  # one callback object reused by a new Trainer
            self.hooks.detach()
            self._attached = False
        if trainer is None:
            raise RuntimeError(
                "SDCTrainerCallback must be called by a transformers.Trainer: pass it in "
                "Trainer(callbacks=[SDCTrainerCallback()]) or trainer.add_callback(...)")
        self.trainer = trainer
        self.hooks = SDCHooks(trainer.accelerator, _framework=_TrainerFramework(trainer), **self._settings)
        for check in self._own_checks:
            self.hooks.add_check(check)
        self._wrap_compute_loss(trainer)
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:  # moving ourselves backwards keeps the running event loop correct
            callbacks.remove(self)
            first = next((i + 1 for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), 0)
            callbacks.insert(first, self)
        return trainer

    def _wrap_compute_loss(self, trainer: Trainer) -> None:
        assert self.hooks is not None
        original = trainer.compute_loss  # bound: a subclass override is kept

        def backward_loss(model: Any, inputs: Any, num_items_in_batch: Any = None, divisor: int = 1) -> torch.Tensor:
            """The loss as ``training_step`` hands it to ``accelerator.backward``."""
            context = nullcontext() if self._live else trainer.compute_loss_context_manager()
            with context:  # a shallow copy: compute_loss may pop "labels", the recording keeps them
                loss = original(model, dict(inputs), num_items_in_batch=num_items_in_batch)
            self._raw = loss
            return loss / divisor if divisor != 1 else loss

        replay_unit = self.hooks.replayable(backward_loss)

        def compute_loss(
            model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None, **kwargs: Any
        ) -> Any:
            if not self._attached or return_outputs or kwargs or not model.training or not torch.is_grad_enabled():
                return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch,
                                **kwargs)  # fmt: skip
            scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
            if scaled is None:
                by_items = trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
                scaled = by_items or trainer.compute_loss_func is not None
            divisor = 1 if scaled else int(getattr(trainer, "current_gradient_accumulation_steps", 1))
            self._live = True
            try:
                replay_unit(model, inputs, num_items_in_batch=num_items_in_batch, divisor=divisor)
            finally:
                self._live = False
            loss, self._raw = self._raw, None
            return loss

        trainer.compute_loss = compute_loss  # type: ignore[method-assign]
        self._wrap_save_checkpoint(trainer)

    def _wrap_save_checkpoint(self, trainer: Trainer) -> None:
        """Every checkpoint the Trainer writes goes through ``_save_checkpoint`` on every process: ``before_save``
        runs first (``state()`` then carries the fingerprint into ``trainer_state.json``)."""
        original = trainer._save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            if self._attached and self.hooks is not None:
                self.hooks.before_save()  # raises on every process before anything is written
                stored = self.hooks.checkpoint_fingerprint
                if stored is not None and trainer.args.save_only_model:  # no optimizer.pt: the model only
                    stored["tensors"] = {k: v for k, v in stored["tensors"].items() if k.startswith("model/")}
            return original(*args, **kwargs)

        trainer._save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._bind()
        hooks = self.hooks
        assert hooks is not None
        if self._attached:  # a second train() call: hook the freshly prepared objects
            hooks.detach()
        by_steps = str(args.logging_strategy) in ("steps", "IntervalStrategy.STEPS")
        if "log_every_n_steps" not in hooks.sources and by_steps:
            every = max(1, int(state.logging_steps or 1))
            hooks.settings = dataclasses.replace(hooks.settings, log_every_n_steps=every)
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        counters = (saved or {}).get("attributes", {}).get("sdc_state") if isinstance(saved, dict) else None
        if counters and state.global_step > 0 and counters.get("step") == state.global_step:
            hooks.load_state_dict(counters)  # resumed from a checkpoint this callback saved into
        hooks.step = state.global_step  # verdicts name the Trainer's own step
        hooks.attach(trainer.model_wrapped, trainer.optimizer)
        self._attached = True

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` at each checkpoint."""
        counters = self.hooks.state_dict() if self.hooks is not None else None
        return {"args": dict(self._settings), "attributes": {"sdc_state": counters}}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hooks is None or not self._attached:
            return
        try:
            self.hooks.finish()
        finally:
            self.hooks.detach()
            self._attached = False


def _calling_trainer() -> Trainer | None:
    """The ``Trainer`` up the call stack (its ``__init__`` or ``train``), or None."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
