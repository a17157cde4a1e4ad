"""``SDCHooks``: the three SDC checks for hand-written Accelerate training loops.

It translates Accelerate's events into ``sdc_core`` calls and nothing more:

* the shared gradient tap (a hook per parameter, ahead of DDP's reducer) feeds the non-finite
  check and the replay audit with each rank's LOCAL gradients; a
  ``DistributedDataParallelKwargs(comm_hook=...)`` hook stays the model's communication hook;
* ``replayable(fn)`` wraps the user's loss computation: on audited steps it records its arguments,
  RNG and module state, and the loss the user back-propagates; without it, a forward pre-/post-hook
  on the unwrapped model records the model's inputs, RNG and module state, and the loss
  (``outputs.loss``, a scalar output, or ``loss_fn``);
* ``optimizer.step`` is wrapped on the instance: on sync steps the non-finite check takes the
  step's evidence and the replay audit runs before the update, and the fingerprint after each
  real update (not on accumulation steps, not on steps an fp16 GradScaler skipped); the
  non-finite verdict is read at the next ``optimizer.step`` (``"raise"``/``"warn"``), before the
  update (``"skip_step"``, fp16 GradScaler, audited steps), before ``save_state``, and in
  ``finish()``;
* counters go to ``accelerator.log`` under ``sdc/<check>/...`` and into ``save_state``;
* a ``save_state`` pre-hook compares the replicas' current weights before anything is written
  and stores a fingerprint of the saved model and optimizer state with the counters;
  ``load_state`` checks the loaded tensors against it (``FingerprintMismatchError`` naming them).

What the hook set needs from the framework (number of processes, unwrapping, sync steps, the
GradScaler, logging, the run folder, checkpoint registration, the comm-hook hand-over) goes
through one small seam, ``Framework`` (it adapts an ``Accelerator``; ``FabricFramework`` in
``lightning_sdc.fabric`` and the Trainer's in ``accelerate_sdc.transformers`` subclass it), so one
hook set serves Accelerate, Lightning Fabric and the Hugging Face Trainer.

Cost: as ``sdc_core`` documents per check; the wrapper itself adds a few Python calls per step.
"""

from __future__ import annotations

import atexit
import functools
import gc
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from accelerate.utils import DDPCommunicationHookType, send_to_device
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accelerate_sdc import _sharded, config
from sdc_core import shutdown
from sdc_core.checkpoint import FINGERPRINT_KEY, check_loaded_checkpoint, fingerprint_checkpoint
from sdc_core.errors import SDCError
from sdc_core.fingerprint import WeightFingerprint
from sdc_core.gradients import GradientTap, NonFiniteGradient, drop_step
from sdc_core.incidents import install_exit_code, mark_verdict, record_verdict
from sdc_core.replay import RingReplay, StateCapture
from sdc_core.sharded import is_sharded
from sdc_core.topology import Topology

LossFn = Callable[..., torch.Tensor]
_CONSUMER_LISTS = ("consumers", "writers")  # the gradient tap's consumer lists


class Framework:
    """The seam between the hook set and a training framework (here: an ``Accelerator``).

    Every framework-specific question ``SDCHooks`` asks goes through one of these members;
    subclasses adapt Lightning Fabric and the Hugging Face Trainer. None of them communicates.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def ddp_model(self, model: nn.Module) -> DistributedDataParallel | None:
        """The ``DistributedDataParallel`` object of a prepared model, or None."""
        return model if isinstance(model, DistributedDataParallel) else None

    def describe(self, model: nn.Module) -> str:
        """Why ``model`` is not a DDP model (for the error ``attach`` raises)."""
        if self.unwrap(model) is model:
            return (f"a plain {type(model).__name__} (not the DDP model `accelerator.prepare` returns: attach the "
                    f"prepared model; distributed_type={self.accelerator.distributed_type})")  # fmt: skip
        return (f"distributed_type={self.accelerator.distributed_type} with a {type(model).__name__} model "
                "(sharded strategies such as FSDP and DeepSpeed are not supported)")  # fmt: skip

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch whose gradients are all-reduced (the optimizer step)."""
        return self.accelerator.sync_gradients

    @property
    def loss_divisor(self) -> int:
        """What the framework divides the loss by before backward (gradient accumulation)."""
        return self.accelerator.gradient_accumulation_steps

    @property
    def scaler(self) -> Any:
        return self.accelerator.scaler

    def step_was_skipped(self, optimizer: Any) -> bool:
        """True when the optimizer step just taken did not update (fp16 GradScaler overflow)."""
        return bool(getattr(optimizer, "step_was_skipped", False))

    def to_device(self, batch: Any) -> Any:
        return send_to_device(batch, self.accelerator.device)

    def replay_context(self) -> AbstractContextManager[Any]:
        """Entered around a replayed forward of the unwrapped module, whose inputs were recorded
        where the module received them (Accelerate's autocast stays on the unwrapped forward)."""
        return nullcontext()

    def replay_model(self, module: nn.Module) -> Any:
        """What a ``replayable`` function gets as its model in a replay: the unwrapped module
        behaving as the prepared model does for its caller (input casting, autocast), minus DDP."""
        return module

    @property
    def run_dir(self) -> str:
        """Where incidents go (``<run_dir>/sdc/incidents``)."""
        acc = self.accelerator
        return getattr(acc, "project_dir", None) or getattr(acc, "logging_dir", None) or "."

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.accelerator.log(metrics, step=step)

    def flush(self) -> None:
        for tracker in getattr(self.accelerator, "trackers", []):
            writer = getattr(tracker, "writer", None)
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()

    def register_for_checkpointing(self, obj: Any) -> None:
        self.accelerator.register_for_checkpointing(obj)

    def before_checkpoint(self, fn: Callable[..., None]) -> Any:
        """Run ``fn(models, weights, output_dir)`` on every process before ``save_state`` writes
        anything; a removable handle, or None where the adapter arranges it otherwise."""
        return self.accelerator.register_save_state_pre_hook(fn)

    def take_comm_hook(self) -> tuple[Any, Any]:
        """Take the hook ``DistributedDataParallelKwargs(comm_hook=...)`` would register, so the
        tap registers it on the DDP model (after ``prepare`` Accelerate has registered it already)."""
        handler = getattr(self.accelerator, "ddp_handler", None)
        taken = getattr(self.accelerator, "_sdc_taken_comm_hook", None)
        if taken is not None:
            return taken  # taken by an earlier SDCHooks of this accelerator
        if handler is None or handler.comm_hook == DDPCommunicationHookType.NO:
            return None, None
        captured: dict[str, Any] = {}

        class _Capture:
            def register_comm_hook(self, state: Any, hook: Any) -> None:
                captured.update(state=state, hook=hook)

        handler.register_comm_hook(_Capture())
        handler.comm_hook = DDPCommunicationHookType.NO
        handler.comm_wrapper = DDPCommunicationHookType.NO
        self.accelerator._sdc_taken_comm_hook = (captured.get("hook"), captured.get("state"))
        return self.accelerator._sdc_taken_comm_hook


class SDCHooks:
    """The SDC checks for an ``Accelerator`` loop; settings from the config workflow or keywords.

    Args:
        accelerator: the ``Accelerator`` of the run.
        loss_fn: ``loss_fn(outputs, *args, **kwargs)`` giving the loss you back-propagate, when it
            is not ``outputs.loss`` or the model's scalar output (the replay recomputes it). For
            a loss that needs more than the model's inputs (labels, extra terms), use
            ``replayable(fn)`` instead.
        replay_state / load_replay_state: the explicit hook for state the replay's generic
            capture cannot see: ``replay_state()`` returns a snapshot (copies), and
            ``load_replay_state(state)`` puts one in place (default: the unwrapped model's
            ``sdc_replay_state`` / ``sdc_load_replay_state`` methods, when it has them).
        **settings: any field of ``SDCSettings`` (``nonfinite_gradient``, ``on_failure``,
            ``replay_every_n_steps``, ``fingerprint_every_n_steps``, ...); 0 turns a cadence off.

    Call ``attach(model, optimizer)`` on every process after ``accelerator.prepare`` and
    ``finish()`` after the loop (it reads the last pending verdicts, the non-finite check's
    read one step later under ``on_failure="raise"``/``"warn"``, and compares the final
    weights). Call ``save_state`` and ``load_state`` on every process, as Accelerate expects:
    the save compares the replicas.
    """

    def __init__(
        self,
        accelerator: Any,
        loss_fn: LossFn | None = None,
        replay_state: Callable[[], Any] | None = None,
        load_replay_state: Callable[[Any], None] | None = None,
        *,
        _framework: Framework | None = None,
        **settings: Any,
    ) -> None:
        self.accelerator = accelerator
        self._fw = _framework if _framework is not None else Framework(accelerator)
        self.settings, self.sources = config.resolve(**settings)
        install_exit_code()
        self.loss_fn = loss_fn
        nonfinite, replay, fingerprint = self.settings.nonfinite(), self.settings.replay(), self.settings.fingerprint()
        self.nonfinite = NonFiniteGradient(nonfinite) if nonfinite else None
        self.replay = RingReplay(replay) if replay else None
        self.fingerprint = WeightFingerprint(fingerprint) if fingerprint else None
        self.step = 0  # optimizer steps (sync steps) so far: the index of the coming update
        self._updates = 0
        self._inner_hook, self._inner_state = self._fw.take_comm_hook()
        self._replayables: list[Callable[..., torch.Tensor]] = []
        self._uses_replayable = False
        self._in_replayable = 0
        self._replaying = False
        self._replay_state = (replay_state, load_replay_state)
        self._module: nn.Module | None = None
        self._run_dir: str | None = None
        self._model: nn.Module | None = None  # as prepared (the DDP wrapper)
        self._optimizer: Any = None
        self._checkpoint_fingerprint: dict[str, Any] | None = None  # of the state being saved
        self._loaded_fingerprint: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._consumers: list[tuple[list[Any], Any]] = []  # (tap list, consumer) pairs to remove on detach
        self._log_due: int | None = None  # step of the periodic point not written yet
        self._logged_step: int | None = None
        self._fw.register_for_checkpointing(self)

    @property
    def checks(self) -> list[Any]:
        return [c for c in (self.nonfinite, self.replay, self.fingerprint) if c is not None]

    def attach(self, model: nn.Module, optimizer: Any, loss_fn: LossFn | None = None) -> SDCHooks:
        """Hook the prepared ``model`` and ``optimizer`` (every process, after ``prepare``)."""
        if self._module is not None:
            raise RuntimeError("SDCHooks.attach was already called")
        fw = self._fw
        self.loss_fn = loss_fn or self.loss_fn
        distributed = fw.num_processes > 1
        if distributed and is_sharded(model):  # FSDP2 plugin (fsdp_version=2): fully_shard in place
            return _sharded.attach(self, model, optimizer)
        ddp = fw.ddp_model(model)
        if distributed and ddp is None:
            raise ValueError(
                f"SDCHooks supports DDP (multi-GPU or multi-CPU), FSDP2 (FullyShardedDataParallelPlugin("
                f"fsdp_version=2)) or a single process; got {fw.describe(model)}"
            )
        module = fw.unwrap(model)
        self._module = module
        if distributed:  # the communication threads finish with Python before it shuts down
            shutdown.arm()
        topo = Topology.gather(local_rank=fw.local_rank)
        for check in self.checks:
            check.topology = topo
        if distributed and (self.nonfinite or self.replay):
            names = {id(p): n for n, p in module.named_parameters()}
            tap = GradientTap.attach(ddp, names, inner_hook=self._inner_hook, inner_state=self._inner_state)
            before = {name: len(getattr(tap, name, ())) for name in _CONSUMER_LISTS}
            if self.nonfinite:
                self.nonfinite.attach(tap)
            if self.replay:
                trainable = [n for n, p in module.named_parameters() if p.requires_grad]
                self.replay.attach(tap, trainable)
                get, load = self._replay_state
                if get is None and load is None:
                    get = getattr(module, "sdc_replay_state", None)
                    load = getattr(module, "sdc_load_replay_state", None)
                self.replay.capture = StateCapture(module, trainable, get_state=get, load_state=load,
                                                   max_state_mb=self.replay.config.max_state_mb)  # fmt: skip
                self.replay.advice = ACCELERATE_ADVICE
                self._handles.append(module.register_forward_pre_hook(self._before_forward, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._after_forward, with_kwargs=True))
            self._consumers = [(getattr(tap, n), c) for n in _CONSUMER_LISTS for c in getattr(tap, n, [])[before[n] :]]
        elif not distributed:
            for check, name in ((self.replay, "ring replay audit"), (self.fingerprint, "weight fingerprint check")):
                if check is not None:
                    warnings.warn(f"SDC {name} is inactive: a single process has no replica", UserWarning, stacklevel=2)
            self.replay = self.fingerprint = None
        self._wrap_step(optimizer)
        if self.nonfinite is not None:  # no checkpoint after a step whose verdict is unread
            handle = fw.before_checkpoint(lambda *_: self._resolve_nonfinite())
            if handle is not None:
                self._handles.append(handle)
        self._model, self._optimizer = model, optimizer
        handle = fw.before_checkpoint(self._before_save)
        if handle is not None:
            self._handles.append(handle)
        if self._loaded_fingerprint is not None:  # load_state ran before attach: verify now
            self._verify_loaded(self._loaded_fingerprint)
        return self

    def _resolve_nonfinite(self) -> None:
        nonfinite = self.nonfinite
        assert nonfinite is not None
        self._verdict(nonfinite, nonfinite.resolve, nonfinite.config.on_failure)

    # -- replay capture ------------------------------------------------------------------------

    def replayable(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap the function that computes the loss you back-propagate, so the replay computes it too.

        ``fn(model, *args, **kwargs)`` must return the loss (or a ``(loss, outputs)`` pair)
        exactly as you pass it to
        ``accelerator.backward`` (labels, extra terms and any scaling included; SDCHooks applies
        Accelerate's division by ``gradient_accumulation_steps`` and the GradScaler itself). The
        wrapper has the same signature; on audited steps it records ``(args, kwargs)``, the RNG
        and module state, and the loss, and the replay calls ``fn(unwrapped_model, *args,
        **kwargs)``. Everything ``fn`` reads must come through its arguments or the model.
        While a wrapper is in use the forward hooks record nothing.

        Example: ``compute_loss = sdc.replayable(lambda model, x, y: F.cross_entropy(model(x), y))``
        then ``accelerator.backward(compute_loss(model, x, y))``.
        """
        index = len(self._replayables)
        self._replayables.append(fn)
        self._uses_replayable = True  # from now on the forward hooks record nothing

        @functools.wraps(fn)
        def wrapper(model: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            module, replay = self._module, self.replay
            record = (
                replay is not None
                and module is not None
                and not self._in_replay()
                and module.training
                and torch.is_grad_enabled()
                and replay.arm(self.step)
            )
            if record:
                replay.record(("fn", index, args, kwargs), replay.recorded, _device(module))
            self._in_replayable += 1
            try:
                loss = fn(model, *args, **kwargs)
            finally:
                self._in_replayable -= 1
            if record:
                replay.record_loss(self._normalize(_loss_of(loss)).detach())
            return loss

        return wrapper

    def _recording_forward(self, module: nn.Module) -> bool:
        assert self.replay is not None
        return not (
            self._uses_replayable or self._in_replayable or self._in_replay()
            or not module.training or not torch.is_grad_enabled()
        )  # fmt: skip

    def _in_replay(self) -> bool:
        """True while a replay runs (the DDP core says so; the sharded one runs ``_replay_step``)."""
        return self._replaying or bool(getattr(self.replay, "replaying", False))

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        assert self.replay is not None
        if self._recording_forward(module) and self.replay.arm(self.step):
            self.replay.record(("forward", 0, args, kwargs), self.replay.recorded, _device(module))

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        assert self.replay is not None
        if self._recording_forward(module) and self.replay.armed:
            self.replay.record_loss(self._backward_loss(outputs, args, kwargs).detach())

    def _backward_loss(self, outputs: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The loss as ``accelerator.backward`` back-propagates it (normalised, scaled)."""
        if self.loss_fn is not None:
            loss = self.loss_fn(outputs, *args, **kwargs)
        elif getattr(outputs, "loss", None) is not None:
            loss = outputs.loss
        elif isinstance(outputs, dict) and "loss" in outputs:
            loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            loss = outputs
        else:
            raise ValueError(
                "the ring replay audit cannot find the loss: the model returns neither `.loss` nor a scalar; "
                "wrap your loss computation with SDCHooks.replayable(fn), or pass "
                "loss_fn=(outputs, *args, **kwargs) -> loss to SDCHooks or attach()"
            )
        return self._normalize(loss)

    def _normalize(self, loss: torch.Tensor) -> torch.Tensor:
        """The framework's division by the accumulation steps and the GradScaler's scaling."""
        loss = loss / self._fw.loss_divisor
        scaler = self._fw.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def _replay_step(self, batch: tuple[str, int, tuple, dict], batch_idx: int) -> torch.Tensor:
        assert self._module is not None
        kind, index, args, kwargs = batch
        self._replaying = True
        try:
            if kind == "fn":
                model = self._fw.replay_model(self._module)
                return self._normalize(_loss_of(self._replayables[index](model, *args, **kwargs)))
            with self._fw.replay_context():
                outputs = self._module(*args, **kwargs)
            return self._backward_loss(outputs, args, kwargs)
        finally:
            self._replaying = False

    # -- the step ------------------------------------------------------------------------------

    def _wrap_step(self, optimizer: Any) -> None:
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._step(optimizer, original, *args, **kwargs)
            except BaseException as err:
                self._path_out(err)
                raise

        optimizer.step = step
        self._handles.append(_Restore(optimizer))
        hooks = weakref.ref(self)  # never keeps the model alive into interpreter teardown

        def at_exit() -> None:  # while Python is still whole: no fingerprint all-reduce left in flight
            alive = hooks()
            if alive is not None and alive.fingerprint is not None:
                alive.fingerprint.discard(timeout_s=10.0)
            del alive
            # Gloo threads finish releasing a Python comm hook's callbacks first: the
            # collection below may destroy the DDP model, whose reducer drops the process group
            # with the GIL held and joins those threads (see sdc_core.shutdown).
            shutdown.settle_threads()
            # The hooks and the DDP model form reference cycles: collected here, while Python is whole.
            gc.collect()

        atexit.register(at_exit)

    def _verdict(self, check: Any, run: Callable[[], Any], policy: str) -> Any:
        """Run one check's call; record its verdict with the policy actually applied: ``policy``
        when it returned (skipped, warned, healed), ``"raise"`` when it raised."""
        try:
            out = run()
        except SDCError as err:
            if check.last_error is None:
                check.last_error = err
            self._record(check, "raise")
            mark_verdict(err)
            raise
        self._record(check, policy)
        return out

    def _step(self, optimizer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        fw = self._fw
        fp, nonfinite, replay = self.fingerprint, self.nonfinite, self.replay
        if nonfinite is not None:  # the previous step's verdict, read one step later (raise, warn)
            self._verdict(nonfinite, nonfinite.resolve, nonfinite.config.on_failure)
        if fp is not None:  # the comparison started after the previous update
            self._verdict(fp, fp.resolve, "heal")
        if not fw.sync_gradients:
            return original(*args, **kwargs)
        assert self._module is not None
        module, step = self._module, self.step
        scaler = fw.scaler is not None
        skipped = False
        if nonfinite is not None:  # read now when the replay audits this step: it must not act first
            now = replay is not None and replay.armed
            skipped = self._verdict(
                nonfinite,
                lambda: nonfinite.verdict(step, module.named_parameters(), scaler_active=scaler, now=now),
                nonfinite.config.on_failure,
            )
        if replay is not None and skipped:
            replay.disarm()  # a step the gradient check dropped is not audited
        elif replay is not None and self._verdict(
            replay,
            lambda: replay.audit(step, module, self._replay_step, fw.to_device),
            "skip_step",
        ):  # a transient fault: every rank drops this step
            drop_step(module.parameters(), scaler_active=scaler)
            skipped = True
        self._write_due_log()  # this step's verdicts are in: the pending point is complete
        out = original(*args, **kwargs)
        self.step += 1
        if not skipped and not fw.step_was_skipped(optimizer):
            self._updates += 1
            if fp is not None and fp.due(self._updates - 1):
                fp.start(step, module, [getattr(optimizer, "optimizer", optimizer)])
        if self.step % self.settings.log_every_n_steps == 0:
            self.log()
        return out

    def _record(self, check: Any, policy: str) -> None:
        """Write the incident of ``check``'s last verdict (main process; a failed write only warns)."""
        if check.last_error is None:
            return
        if self._run_dir is None:
            self._run_dir = self._fw.run_dir
        record_verdict(check, self._run_dir, self._fw.is_main, policy)

    def _path_out(self, err: BaseException) -> None:
        """An exception leaves ``optimizer.step``: the pending fingerprint all-reduce is finished,
        not left in flight into the exit; on a verdict, counters logged."""
        if self.fingerprint is not None:
            self.fingerprint.discard()
        if self._fw.num_processes > 1:  # the script may now free the model and the process group
            shutdown.settle_threads()
        if isinstance(err, SDCError):
            try:
                self.log(force=True)
            except Exception as log_err:
                warnings.warn(f"SDC counters not logged: {log_err!r}", RuntimeWarning, stacklevel=3)

    def finish(self) -> None:
        """Read the last pending verdicts, compare the final weights and log (every process,
        after the loop).

        The non-finite verdict still pending is read first; then the pending fingerprint
        comparison is resolved and the current weights compared at once, whatever the cadence
        (one extra read and one host wait): training does not end with replicas that differ
        unnoticed. Raises the ``SDCError`` on every process."""
        try:
            if self.nonfinite is not None:
                self._resolve_nonfinite()
            self._check_now()
        finally:
            self.log(force=True)
            if self._fw.num_processes > 1:  # the script may now free the model and the process group
                shutdown.settle_threads()

    def _check_now(self) -> None:
        """Resolve the pending comparison, then compare the current weights (every process)."""
        if self.fingerprint is None or self._module is None:
            return
        fp, module = self.fingerprint, self._module
        self._verdict(fp, lambda: fp.check_now(max(self.step - 1, 0), module, [self._inner_optimizer()]), "heal")

    def _inner_optimizer(self) -> Any:
        return getattr(self._optimizer, "optimizer", self._optimizer)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for check in self.checks:
            out.update(check.stats.metrics())
        return out

    def log(self, force: bool = False) -> None:
        """Send the counters to every tracker (``accelerator.log``: the main process writes).

        One point per step and metric, never two with different values: a periodic point
        (``force=False``, every ``log_every_n_steps``) is written once the next step's verdicts
        are in (or by ``finish`` or a failure, whichever comes first); ``force=True`` writes now
        and flushes, unless this step was written already.
        """
        if not force:
            self._log_due = self.step
            return
        self._log_due = None
        if self._logged_step != self.step:
            self._write(self.step)
        self._fw.flush()

    def _write_due_log(self) -> None:
        if self._log_due is not None:
            step, self._log_due = self._log_due, None
            if self._logged_step != step:
                self._write(step)

    def _write(self, step: int) -> None:
        self._fw.log(self.metrics(), step)
        self._logged_step = step

    def detach(self) -> None:
        """Remove every hook this hook set installed: the forward hooks, the ``optimizer.step``
        wrapper and its gradient-tap consumers (the tap's parameter hooks stay, reading nothing; a
        user's communication hook stays registered: DDP cannot drop one). It stays registered for
        checkpointing, so ``save_state``/``load_state`` keep their object count. Call ``finish()``
        first to read the last pending fingerprint comparison. ``attach`` may be called again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for consumers, consumer in self._consumers:
            if consumer in consumers:
                consumers.remove(consumer)
        self._consumers = []
        self._module = None

    # -- checkpoints ---------------------------------------------------------------------------

    def _before_save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        """``save_state`` pre-hook (every process, before any file is written): compare the
        replicas' current weights, raising on a mismatch, then fingerprint what is saved. Does
        nothing when this ``SDCHooks``'s model is no longer among the accelerator's models."""
        if not any(m is self._model or self._fw.unwrap(m) is self._module for m in models):
            self._checkpoint_fingerprint = None
            return
        self._check_now()
        self._checkpoint_fingerprint = fingerprint_checkpoint(self._saved_tensors())

    def _saved_tensors(self) -> dict[str, Any]:
        assert self._module is not None
        return {"model": self._module.state_dict(), "optimizer": self._inner_optimizer().state_dict()}

    def _verify_loaded(self, stored: dict[str, Any]) -> None:
        """Raise ``FingerprintMismatchError`` (on every process: each loads the same files) when
        the loaded weights or optimizer state differ from the fingerprint saved with them."""
        self._loaded_fingerprint = None
        check_loaded_checkpoint({**self._saved_tensors(), FINGERPRINT_KEY: stored}, self.step)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "updates": self._updates,
            "checks": {c.stats.check: c.stats.state_dict() for c in self.checks},
        }
        if self._checkpoint_fingerprint is not None:
            state[FINGERPRINT_KEY] = self._checkpoint_fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; ``load_state`` calls it after loading the model and optimizer, so
        the loaded tensors are verified here against the fingerprint stored at ``save_state``."""
        try:
            step, updates, checks = int(state["step"]), int(state["updates"]), dict(state["checks"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"corrupted SDCHooks state: {err!r} in {state!r}") from err
        for check in self.checks:
            if check.stats.check in checks:
                check.stats.load_state_dict(checks[check.stats.check])
        self.step, self._updates = step, updates
        stored = state.get(FINGERPRINT_KEY)
        if stored is not None:
            self._loaded_fingerprint = stored
            if self._module is not None:
                self._verify_loaded(stored)


ACCELERATE_ADVICE = (
    "If the loss you back-propagate is not the model's own output (labels outside the model, extra loss "
    "terms, a loss scaled by the number of processes), wrap its computation with SDCHooks.replayable(fn); "
    "expose state the capture cannot see with SDCHooks(replay_state=..., load_replay_state=...)"
)


def _loss_of(result: Any) -> torch.Tensor:
    """The loss in what a ``replayable`` function returned: the tensor itself, or the first item
    of a ``(loss, outputs)`` pair (the Hugging Face ``compute_loss(..., return_outputs=True)`` form)."""
    if isinstance(result, tuple | list) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"a replayable function must return the loss tensor, got {type(result).__name__}")
    return result


def _device(module: nn.Module) -> torch.device | None:
    return next((p.device for p in module.parameters()), None)


class _Restore:
    """Handle that puts the optimizer's own ``step`` back."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def remove(self) -> None:
        self.optimizer.__dict__.pop("step", None)
