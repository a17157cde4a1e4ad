"""``SDCHooks``: the loop driver of the SDC checks for any training loop; a plain ``torchrun`` loop uses it as is::

    hooks = SDCHooks(replay_every_n_steps=100, run_dir="runs/x").attach(model, optimizer)  # DDP, fully_shard or plain
    ...  # the loop as usual: optimizer.step() runs the checks around the real update
    hooks.finish()

``optimizer.step`` is wrapped on the instance: the non-finite check and the replay audit run before the update, the
fingerprint after each real one. A failure raises the ``SDCError`` on every rank in the same step and writes an
incident under ``<run_dir>/sdc/incidents`` (rank 0). Cost: the checks' own, plus a few Python calls per step."""

from __future__ import annotations

import atexit
import gc
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sdc_core.checks.screen import GradientScreen
from sdc_core.dist.topology import Topology
from sdc_core.driver.framework import Framework, LossFn, MetricsFn, inner_optimizer, wrap_step
from sdc_core.driver.loop_checks import LoopChecks
from sdc_core.driver.replay_capture import LoopCapture
from sdc_core.driver.settings import PLAIN, Sources, resolve
from sdc_core.driver.step import StepContext, StepDriver
from sdc_core.errors import SDCError
from sdc_core.io.checkpoints import FINGERPRINT_KEY, check_loaded_checkpoint, fingerprint_checkpoint
from sdc_core.ops import process_exit
from sdc_core.ops.process_exit import install_exit_code
from sdc_core.ops.summary import log_run_summary
from sdc_core.sharded.checks import is_sharded


class CounterLog:
    """The tracker points of ``checks()``' counters through ``fw.log``, at most one per step: a periodic point
    (``due``) is written once the next step's verdicts are in (``write_due``) or by ``now``, which also flushes the
    trackers. No communication."""

    def __init__(self, fw: Framework, checks: Callable[[], list[Any]]) -> None:
        self._fw = fw
        self._checks = checks
        self._due: int | None = None  # step of the periodic point not written yet
        self._written: int | None = None  # the last step written

    def metrics(self) -> dict[str, float]:
        return {name: value for check in self._checks() for name, value in check.stats.metrics().items()}

    def due(self, step: int) -> None:
        self._due = step

    def write_due(self) -> None:
        step, self._due = self._due, None
        if step is not None:
            self._write(step)

    def now(self, step: int) -> None:
        self._due = None
        self._write(step)
        self._fw.flush()

    def _write(self, step: int) -> None:
        if self._written != step:
            self._fw.log(self.metrics(), step)
            self._written = step


def counters(step: int, updates: int, checks: list[Any], fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The hook set's state, plain data: step and update counts, each check's counters (and screen band), the
    fingerprint of the saved model and optimizer state (taken by ``before_save``, checked after a load)."""
    state: dict[str, Any] = {
        "step": step,
        "updates": updates,
        "checks": {c.stats.check: c.stats.state_dict() for c in checks},
        "screen_bands": {c.stats.check: c.state_dict() for c in checks if isinstance(c, GradientScreen)},
    }
    if fingerprint is not None:
        state[FINGERPRINT_KEY] = fingerprint
    return state


def restore_counters(state: dict[str, Any], checks: list[Any]) -> tuple[int, int, Any]:
    """Restore ``checks`` from ``counters``' form; returns the step and update counts and the saved fingerprint
    (or None). ``ValueError`` for a state not of that form."""
    try:
        step, updates, saved = int(state["step"]), int(state["updates"]), dict(state["checks"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"corrupted SDCHooks state: {err!r} in {state!r}") from err
    for check in checks:
        if check.stats.check in saved:
            check.stats.load_state_dict(saved[check.stats.check])
        band = state.get("screen_bands", {}).get(check.stats.check)  # absent in earlier checkpoints
        if isinstance(check, GradientScreen) and isinstance(band, dict):
            check.load_state_dict(band)
    return step, updates, state.get(FINGERPRINT_KEY)


def saved_tensors(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What a checkpoint of the hook set's model holds: the unwrapped model's and the torch optimizer's state."""
    return {"model": module.state_dict(), "optimizer": inner_optimizer(optimizer).state_dict()}


def _core(name: str) -> Any:
    """What the hook set's ``LoopChecks`` holds now under ``name``: a check core (None when off), or ``checks``."""
    return property(lambda self: getattr(self._cores, name), doc=f"The hook set's {name} (LoopChecks.{name}).")


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"SDCHooks supports DDP (DistributedDataParallel), FSDP2 (fully_shard) or a single process; "
                         f"got {reason}")  # fmt: skip


class SDCHooks:
    """The three SDC checks for a training loop (plain PyTorch here; frameworks subclass it).

    Args:
        loss_fn: ``loss_fn(outputs, *args, **kwargs)`` giving the loss you back-propagate, when it
            is not ``outputs.loss`` or the model's scalar output (the replay recomputes it); for a
            loss that needs more than the model's inputs, use ``replayable(fn)`` instead.
        replay_state / load_replay_state: state the replay's capture cannot see: ``replay_state()``
            returns a snapshot (copies), ``load_replay_state(state)`` puts one in place (default: the
            unwrapped model's ``sdc_replay_state`` / ``sdc_load_replay_state``, when it has them).
        run_dir, log, accumulation_steps: see ``Framework`` (plain-PyTorch route only).
        framework: the seam (a ``Framework``); default: plain PyTorch.
        sources: where settings come from besides keywords (``sdc_core.driver.settings.Sources``).
        **settings: any field of ``SDCSettings``; 0 turns a cadence off. A bad value raises
            ``SDCConfigError`` naming it.

    Call ``attach(model, optimizer)`` on every process once the model is wrapped, ``finish()`` after the loop, and
    ``before_save()`` on every process before writing a checkpoint (the framework seams do it for you), saving
    ``state_dict()`` with it."""

    def __init__(
        self,
        loss_fn: LossFn | None = None,
        replay_state: Callable[[], Any] | None = None,
        load_replay_state: Callable[[Any], None] | None = None,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        log: MetricsFn | None = None,
        accumulation_steps: int = 1,
        framework: Framework | None = None,
        sources: Sources = PLAIN,
        **settings: Any,
    ) -> None:
        self._fw = framework if framework is not None else Framework(run_dir, log, accumulation_steps)
        self.settings, self.sources = resolve(sources, **settings)
        install_exit_code()
        self.loss_fn = loss_fn
        self._cores = LoopChecks(self.settings)
        self.step = 0  # optimizer steps (sync steps) so far: the index of the coming update
        self._updates = 0
        self._comm_hook = self._fw.take_comm_hook()
        self._capture = LoopCapture(self, self._fw, replay_state, load_replay_state)
        self._module: nn.Module | None = None
        self._model: nn.Module | None = None  # as wrapped (the DDP model)
        self._optimizer: Any = None
        self.checkpoint_fingerprint: dict[str, Any] | None = None  # public: of the state before_save() saw
        self._loaded_fingerprint: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._log = CounterLog(self._fw, lambda: self.checks)
        # a weak proxy: the capture holds the hook set, which holds the framework (no cycle through it)
        self._fw.capture = weakref.proxy(self._capture)
        self._driver = StepDriver(self._fw, self._cores.all)
        self._fw.register_for_checkpointing(self)

    nonfinite = _core("nonfinite")
    replay = _core("replay")
    fingerprint = _core("fingerprint")
    matmul = _core("matmul")
    screen = _core("screen")
    update_audit = _core("update_audit")
    checks = _core("checks")  # the cores in use (without the update audit)

    def add_check(self, check: Any) -> SDCHooks:
        """Register your ``sdc_core.checks.contract.StepCheck`` (every rank alike, before ``attach``)."""
        self._cores.add(check)
        return self

    @property
    def module(self) -> nn.Module | None:
        """The unwrapped model the hook set is attached to (None before ``attach``)."""
        return self._module

    def attach(self, model: nn.Module, optimizer: Any, loss_fn: LossFn | None = None, *,
               scaler: Any = None) -> SDCHooks:  # fmt: skip
        """Hook the wrapped ``model`` and ``optimizer`` (every process, after wrapping). ``scaler``:
        the ``torch.amp.GradScaler`` of a plain loop (then call ``scaler.step(optimizer)`` as usual)."""
        if self._module is not None:
            raise RuntimeError("SDCHooks.attach was already called")
        fw, model = self._fw, getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its module is hooked
        _refuse(fw.unsupported(model))
        if scaler is not None:
            fw.use_scaler(scaler)
        self.loss_fn = loss_fn or self.loss_fn
        distributed = fw.world_size > 1
        sharded = distributed and is_sharded(model)  # fully_shard in place (FSDP2, HSDP)
        ddp = None if sharded else fw.ddp_model(model)
        if distributed and not sharded and ddp is None:
            _refuse(fw.describe(model))
        module = self._module = model if sharded else fw.unwrap(model)
        if distributed:  # the communication threads finish with Python before it shuts down
            process_exit.arm()
        topo = Topology.gather(local_rank=fw.local_rank)
        if sharded:  # the sharded cores, the update audit
            self._handles += self._cores.attach_sharded(model, optimizer, self._capture, self.settings.update_audit,
                                                        topo, self.settings.screen)  # fmt: skip
            self._driver.prepare()  # with a screen, the sharded replay keeps every step's micro-batches
            # shards are compared before a save; the saved state (DTensor shards) carries no fingerprint
            self._hooked(model, optimizer, lambda *_: self.before_save())
            return self
        for check in self.checks:
            check.topology = topo
        if distributed:
            self._handles += self._cores.attach_tap(module, ddp, self._capture, self._comm_hook, self.settings.screen,
                                                    topo)  # fmt: skip
            self._driver.prepare()  # with a screen, the replay keeps every step's micro-batches for a partner
        else:
            self._cores.single_process()
        self._handles += self._cores.attach_matmul(module, topo, lambda m: None if self._capture.in_replay() else (
            self._driver.delivery.deliver(m, lambda: m.arm(self.step))))  # fmt: skip
        self._hooked(model, optimizer, self._before_save)
        self._verify_loaded()  # state loaded before attach: verified now
        return self

    def _hooked(self, model: nn.Module, optimizer: Any, before_checkpoint: Callable[..., None]) -> None:
        """``optimizer.step`` (the GradScaler's, for a plain loop with one) runs through ``_step``, and
        ``before_checkpoint`` before the framework saves."""
        fw = self._fw
        self._handles.append(wrap_step(fw.step_owner(optimizer), lambda original, args, kwargs: self._step(
            optimizer, original, *args, **kwargs), self._path_out))  # fmt: skip
        inner = inner_optimizer(optimizer)
        if hasattr(inner, "register_step_post_hook"):  # a real update happened (GradScaler may skip it)
            self._handles.append(inner.register_step_post_hook(lambda *_: fw.mark_updated()))
        atexit.register(_at_exit, weakref.ref(self))  # never keeps the model alive into interpreter teardown
        self._model, self._optimizer = model, optimizer
        handle = fw.before_checkpoint(before_checkpoint)
        if handle is not None:
            self._handles.append(handle)

    def replayable(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap the function that computes the loss you back-propagate, so the replay computes it too.

        ``fn(model, *args, **kwargs)`` returns the loss (or ``(loss, outputs)``) before the accumulation division and
        the GradScaler (the hook set applies both). The replay calls ``fn(unwrapped_model, *args, **kwargs)``, so
        everything ``fn`` reads must come through its arguments or the model. While a wrapper is in use the forward
        hooks record nothing.

        Example: ``compute_loss = hooks.replayable(lambda model, x, y: F.cross_entropy(model(x), y))``."""
        return self._capture.replayable(fn)

    def _context(self, optimizer: Any = None, index: int | None = None, update: int | None = None) -> StepContext:
        """The step as the driver sees it: by default the coming update's step and update index."""
        assert self._module is not None
        return StepContext(self.step if index is None else index, self._updates if update is None else update,
                           self._module, [inner_optimizer(optimizer or self._optimizer)],
                           scaler_active=self._fw.scaler is not None)  # fmt: skip

    def _step(self, optimizer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        fw, driver = self._fw, self._driver
        if self._module is None:  # detached: the step as it was
            return original(*args, **kwargs)
        skipped = driver.before_optimizer_step(self._context(optimizer), sync=fw.sync_gradients)
        if not fw.sync_gradients:
            return original(*args, **kwargs)
        self._log.write_due()  # this step's verdicts are in: the pending point is complete
        fw.begin_step()
        out = original(*args, **kwargs)
        step = self.step
        self.step += 1
        updated = not skipped and not fw.step_was_skipped(optimizer)
        self._updates += updated
        driver.after_update(self._context(optimizer, step, self._updates - 1), updated)
        if self.step % self.settings.log_every_n_steps == 0:
            self.log()
        return out

    def _path_out(self, err: BaseException) -> None:
        """An exception leaves the step: no fingerprint all-reduce left in flight; on a verdict, counters logged."""
        if self.fingerprint is not None:
            self.fingerprint.discard()
        if self._fw.world_size > 1:  # the script may now free the model and the process group
            process_exit.settle_threads()
        if isinstance(err, SDCError):
            try:  # at the tracker step of now: the updates done (a verdict about step s after its update: s + 1)
                self.log(force=True)
            except Exception as log_err:
                warnings.warn(f"SDC counters not logged: {log_err!r}", RuntimeWarning, stacklevel=3)

    def finish(self) -> None:
        """After the loop, on every process: the pending verdicts read and the current weights compared whatever the
        cadence (one read and one host wait); rank 0 logs the closing line. Raises the ``SDCError`` on every process."""
        try:
            self._compare_now(at_end=True)
            log_run_summary(self.step, self.checks, self._driver.seam)  # rank 0: what was checked and found
        finally:
            self.log(force=True)
            if self._fw.world_size > 1:  # the script may now free the model and the process group
                process_exit.settle_threads()

    def check_gradients_now(self) -> None:
        """Read this step's non-finite verdict now, before anything that raises on NaN gradients (a clipping with
        ``error_if_nonfinite=True``): raises the ``NonFiniteGradientError`` naming the rank on every process. Call it
        on every process, after backward. Cost: one host wait."""
        if self.nonfinite is None or self._module is None or not self._fw.sync_gradients:
            return
        step = self._context()  # the earlier steps' verdicts, then this step's
        self._driver.resolve_gradients(step, before=step.index)
        self._driver.gradients(step, now=True)

    def before_save(self, fingerprint: bool = True) -> None:
        """Call on every process before writing a checkpoint: reads the pending verdicts and compares the replicas'
        current weights (an ``SDCError`` on every process before anything is written). With ``fingerprint`` the model
        and optimizer state are fingerprinted into ``checkpoint_fingerprint``, which ``state_dict()`` carries for
        ``load_state_dict`` to verify (a ``fully_shard`` model's shards are compared, not fingerprinted). Cost: one
        host wait and one read of the weights (and of the saved state)."""
        self._compare_now()
        module = self._module
        keep = fingerprint and module is not None and not is_sharded(module)  # DTensor shards: compared only
        self.checkpoint_fingerprint = fingerprint_checkpoint(saved_tensors(module, self._optimizer)) if keep else None

    def _compare_now(self, compare: bool = True, at_end: bool = False) -> None:
        """The pending verdicts read and, with ``compare``, the current weights compared (every process)."""
        if self._module is not None and compare:
            self._driver.compare_now(self._context(), at_end)
        elif self.nonfinite is not None:  # only a non-finite verdict is read (not attached: of an earlier attachment)
            self._driver.delivery.deliver(self.nonfinite, self.nonfinite.resolve)

    def metrics(self) -> dict[str, float]:
        return self._log.metrics()

    def log(self, force: bool = False) -> None:
        """Send the counters to the trackers (or ``log``), at most one point per step (``CounterLog``): once the next
        step's verdicts are in, or with ``force`` now, flushed. The tracker step counts the optimizer steps done."""
        (self._log.now if force else self._log.due)(self.step)

    def detach(self) -> None:
        """Remove every hook this hook set installed (the tap's parameter hooks stay, reading nothing; a user's
        communication hook stays: DDP cannot drop one). Call ``finish()`` first; ``attach`` may be called again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._cores.detach()
        self._module = None

    def owns(self, models: list[Any]) -> bool:
        """True when this hook set is attached to one of ``models`` (wrapped or not), or to none yet."""
        if self._model is None and self._module is None:
            return True
        return any(m is self._model or self._fw.unwrap(m) is self._module for m in models)

    def _before_save(self, models: list[Any], weights: Any, output_dir: Any) -> None:
        """The framework's pre-save hook (every process): ``before_save()`` when this hook set's model is saved."""
        if self._module is not None and self.owns(models):
            return self.before_save()
        self.checkpoint_fingerprint = None
        self._compare_now(compare=False)  # no checkpoint after a step whose verdict is unread

    def _verify_loaded(self) -> None:
        """Raise ``FingerprintMismatchError`` (on every process: each loads the same files) when the loaded weights or
        optimizer state differ from the fingerprint saved with them (once)."""
        stored, self._loaded_fingerprint = self._loaded_fingerprint, None
        if stored is not None:
            assert self._module is not None
            loaded = {**saved_tensors(self._module, self._optimizer), FINGERPRINT_KEY: stored}
            check_loaded_checkpoint(loaded, self.step)

    def state_dict(self) -> dict[str, Any]:
        """The counters (and the fingerprint of the state ``before_save`` saw): plain data only."""
        return counters(self.step, self._updates, self.checks, self.checkpoint_fingerprint)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; call it after loading the model and optimizer, whose tensors are then verified."""
        self.step, self._updates, self._loaded_fingerprint = restore_counters(state, self.checks)
        if self._module is not None:
            self._verify_loaded()


def _at_exit(hooks: weakref.ref[SDCHooks]) -> None:
    """At exit, while Python is still whole: no fingerprint all-reduce left in flight."""
    alive = hooks()
    if alive is not None and alive.fingerprint is not None:
        alive.fingerprint.discard(timeout_s=10.0)
    del alive
    # Gloo threads finish releasing a Python comm hook's callbacks before the collection below may destroy the DDP
    # model, whose reducer joins them with the GIL held (sdc_core.ops.process_exit); the cycles are collected here.
    process_exit.settle_threads()
    gc.collect()
