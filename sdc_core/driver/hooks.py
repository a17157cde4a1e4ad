"""``SDCHooks``: the loop driver of the three SDC checks, for any training loop.

A plain ``torchrun`` loop uses it as it is (torch and torch.distributed only)::

    hooks = SDCHooks(replay_every_n_steps=100, run_dir="runs/x", log=print_metrics)
    hooks.attach(model, optimizer)   # a DistributedDataParallel or fully_shard model (or a plain one)
    for batch in loader:
        loss = model(**batch).loss   # or hooks.replayable(fn) for a loss computed outside the model
        loss.backward()
        optimizer.step()             # the checks run around the real update
        optimizer.zero_grad()
    hooks.finish()

The Accelerate, Fabric and Hugging Face Trainer seams are thin subclasses that answer the framework
questions through ``Framework``. Collaborators: ``LoopChecks`` (the check cores and how they meet
the model), ``LoopCapture`` (what the replay records of the loop's forwards), ``CounterLog`` (the
tracker points), ``counters`` (its checkpoint state) and the core ``StepDriver``. The optimizer's
``step`` is wrapped on the instance: the non-finite check and the replay audit run before the
update, the fingerprint after each real one; an FSDP2 (``fully_shard``) model gets the sharded
cores.

A failure raises the ``SDCError`` on every rank in the same step, writes an incident under
``<run_dir>/sdc/incidents`` (rank 0) and sets the process exit code (``sdc_core.ops.incidents``).
Cost: as each check documents; the driver adds a few Python calls per step.
"""

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
    """The tracker points of ``checks()``' counters, one per step and metric, written through ``fw.log``.

    A point is never written twice for one step with different values: a periodic point is only noted (``due``) and
    written once the next step's verdicts are in (``write_due``), or by a forced write (``now``: at the end, or when a
    verdict leaves the loop), which also flushes the trackers. No communication."""

    def __init__(self, fw: Framework, checks: Callable[[], list[Any]]) -> None:
        self._fw = fw
        self._checks = checks
        self._due: int | None = None  # step of the periodic point not written yet
        self._written: int | None = None  # the last step written

    def metrics(self) -> dict[str, float]:
        """Every check's counters, by metric name."""
        out: dict[str, float] = {}
        for check in self._checks():
            out.update(check.stats.metrics())
        return out

    def due(self, step: int) -> None:
        """A periodic point at ``step``: written by ``write_due`` or ``now``, whichever comes first."""
        self._due = step

    def write_due(self) -> None:
        """Write the pending periodic point (its step's verdicts are in), unless its step was written."""
        if self._due is not None:
            step, self._due = self._due, None
            if self._written != step:
                self._write(step)

    def now(self, step: int) -> None:
        """Write the point of ``step`` now (unless written already) and flush the trackers."""
        self._due = None
        if self._written != step:
            self._write(step)
        self._fw.flush()

    def _write(self, step: int) -> None:
        self._fw.log(self.metrics(), step)
        self._written = step



# -- the hook set's checkpoint state: its counters as plain data (no pickle) and the fingerprint of the saved
# model and optimizer state, taken before a save and checked after a load


def counters(step: int, updates: int, checks: list[Any], fingerprint: dict[str, Any] | None) -> dict[str, Any]:
    """The hook set's state: its step and update counts, each check's counters and, when one was
    taken, the fingerprint of the saved model and optimizer state."""
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
    """Each of ``checks`` gets its counters back from ``state`` (``counters``' form); returns the
    step and update counts and the fingerprint saved with them (or None). ``ValueError`` for a
    state that is not of that form."""
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
    """The state a checkpoint of the hook set's model holds: the unwrapped model's and the torch optimizer's."""
    return {"model": module.state_dict(), "optimizer": inner_optimizer(optimizer).state_dict()}


def take_fingerprint(module: nn.Module | None, optimizer: Any) -> dict[str, Any] | None:
    """The fingerprint of the state a checkpoint of ``module`` holds (DDP or one process); None
    before ``attach`` and for a ``fully_shard`` model (its DTensor shards are compared, not fingerprinted)."""
    if module is None or is_sharded(module):
        return None
    return fingerprint_checkpoint(saved_tensors(module, optimizer))


def verify_loaded(module: nn.Module | None, optimizer: Any, stored: dict[str, Any], step: int) -> None:
    """Raise ``FingerprintMismatchError`` when the loaded state of ``module`` and ``optimizer``
    differs from ``stored``, the fingerprint saved with it (every process loads the same files)."""
    assert module is not None
    check_loaded_checkpoint({**saved_tensors(module, optimizer), FINGERPRINT_KEY: stored}, step)



def _core(name: str) -> Any:
    """What the hook set's ``LoopChecks`` holds now under ``name``: a check core (None when off), or ``checks``."""
    return property(lambda self: getattr(self._cores, name), doc=f"The hook set's {name} (LoopChecks.{name}).")


class SDCHooks:
    """The three SDC checks for a training loop (plain PyTorch here; frameworks subclass it).

    Args:
        loss_fn: ``loss_fn(outputs, *args, **kwargs)`` giving the loss you back-propagate, when it
            is not ``outputs.loss`` or the model's scalar output (the replay recomputes it). For
            a loss that needs more than the model's inputs (labels, extra terms), use
            ``replayable(fn)`` instead.
        replay_state / load_replay_state: the explicit hook for state the replay's generic
            capture cannot see: ``replay_state()`` returns a snapshot (copies), and
            ``load_replay_state(state)`` puts one in place (default: the unwrapped model's
            ``sdc_replay_state`` / ``sdc_load_replay_state`` methods, when it has them).
        run_dir, log, accumulation_steps: see ``Framework`` (plain-PyTorch route only).
        framework: the seam (``Framework`` subclasses of the adapters); default: plain PyTorch.
        sources: where settings come from besides keywords (``sdc_core.driver.settings.Sources``).
        **settings: any field of ``SDCSettings`` (``nonfinite_gradient``, ``on_failure``,
            ``replay_every_n_steps``, ``fingerprint_every_n_steps``, ...); 0 turns a cadence off.
            A bad value raises ``SDCConfigError`` naming it.

    Call ``attach(model, optimizer)`` on every process once the model is wrapped, and
    ``finish()`` after the loop (it reads the last pending verdicts and compares the final
    weights). Before writing a checkpoint, call ``before_save()`` on every process (the
    framework seams do it for you), and save ``state_dict()`` with it.
    """

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
        fw = self._fw
        fw.refuse_unsupported(model)
        if scaler is not None:
            fw.use_scaler(scaler)
        self.loss_fn = loss_fn or self.loss_fn
        distributed = fw.num_processes > 1
        if distributed and is_sharded(model):  # fully_shard in place (FSDP2, HSDP): the sharded cores, the update audit
            self._module = model
            process_exit.arm()
            topo = Topology.gather(local_rank=fw.local_rank)
            self._handles += self._cores.attach_sharded(model, optimizer, self._capture, self.settings.update_audit,
                                                        topo, self.settings.screen)  # fmt: skip
            self._driver.prepare()  # with a screen, the sharded replay keeps every step's micro-batches
            # shards are compared before a save; the saved state (DTensor shards) carries no fingerprint
            self._hooked(model, optimizer, lambda *_: self.before_save())
            return self
        ddp = fw.ddp_model(model)
        if distributed and ddp is None:
            raise ValueError(
                f"SDCHooks supports DDP (DistributedDataParallel), FSDP2 (fully_shard) or a single process; "
                f"got {fw.describe(model)}"
            )
        module = fw.unwrap(model)
        self._module = module
        if distributed:  # the communication threads finish with Python before it shuts down
            process_exit.arm()
        topo = Topology.gather(local_rank=fw.local_rank)
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

        ``fn(model, *args, **kwargs)`` returns the loss (or ``(loss, outputs)``) exactly as you back-propagate it
        (the hook set applies the accumulation division and the GradScaler itself). On audited steps the wrapper
        records ``(args, kwargs)``, the RNG, module and autocast state and the loss; the replay calls
        ``fn(unwrapped_model, *args, **kwargs)``, so everything ``fn`` reads must come through its arguments or the
        model. While a wrapper is in use the forward hooks record nothing.

        Example: ``compute_loss = hooks.replayable(lambda model, x, y: F.cross_entropy(model(x), y))``."""
        return self._capture.replayable(fn)

    # -- the step ------------------------------------------------------------------------------

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
        if fw.sync_gradients:  # the screen's all_gather first, started right after backward
            driver.observe(self._context(optimizer))
        driver.resolve_pending(self._context(optimizer))  # the earlier steps' verdicts, also on accumulation steps
        if not fw.sync_gradients:
            return original(*args, **kwargs)
        plan = driver.before_update(self._context(optimizer))
        self._log.write_due()  # this step's verdicts are in: the pending point is complete
        fw.begin_step()
        out = original(*args, **kwargs)
        step = self.step
        self.step += 1
        updated = not plan.skipped and not fw.step_was_skipped(optimizer)
        if updated:
            self._updates += 1
        driver.after_update(self._context(optimizer, step, self._updates - 1), updated)
        if self.step % self.settings.log_every_n_steps == 0:
            self.log()
        return out

    def _path_out(self, err: BaseException) -> None:
        """An exception leaves the step: the pending fingerprint all-reduce is finished, not left
        in flight into the exit; on a verdict, counters logged."""
        if self.fingerprint is not None:
            self.fingerprint.discard()
        if self._fw.num_processes > 1:  # the script may now free the model and the process group
            process_exit.settle_threads()
        if isinstance(err, SDCError):
            try:  # at the tracker step of now: the updates done (a verdict about step s after its update: s + 1)
                self.log(force=True)
            except Exception as log_err:
                warnings.warn(f"SDC counters not logged: {log_err!r}", RuntimeWarning, stacklevel=3)

    def finish(self) -> None:
        """After the loop, on every process: the pending verdicts read, then the current weights
        compared whatever the cadence (one extra read and one host wait); rank 0 logs the run's
        closing line. Raises the ``SDCError`` on every process."""
        try:
            self._compare_now(at_end=True)
            log_run_summary(self.step, self.checks, self._driver.seam)  # rank 0: what was checked and found
        finally:
            self.log(force=True)
            if self._fw.num_processes > 1:  # the script may now free the model and the process group
                process_exit.settle_threads()

    def check_gradients_now(self) -> None:
        """Read this step's non-finite verdict now, before anything that raises on NaN gradients
        (a clipping with ``error_if_nonfinite=True``, a norm you check yourself): raises the
        ``NonFiniteGradientError`` naming the rank on every process, as ``optimizer.step`` would
        have. Call it on every process, after backward. Cost: one host wait; nothing on a finite
        step beyond that (the step's own verdict is then read as usual)."""
        if self.nonfinite is None or self._module is None or not self._fw.sync_gradients:
            return
        self._driver.gradients_now(self._context())

    def before_save(self, fingerprint: bool = True) -> None:
        """Call on every process before writing a checkpoint: reads the pending non-finite verdict and compares the
        replicas' current weights (raising the ``SDCError`` on every process before anything is written). With
        ``fingerprint`` (DDP or one process) the model and optimizer state are fingerprinted into
        ``checkpoint_fingerprint``, which ``state_dict()`` carries for ``load_state_dict`` to verify. Sharded models:
        compared, not fingerprinted. Cost: one host wait and one read of the weights (and of the saved state)."""
        self._compare_now()
        self.checkpoint_fingerprint = take_fingerprint(self._module, self._optimizer) if fingerprint else None

    def _compare_now(self, compare: bool = True, at_end: bool = False) -> None:
        """The pending verdicts read and, with ``compare``, the current weights compared (every process)."""
        if self._module is not None and compare:
            self._driver.compare_now(self._context(), at_end)
        elif self.nonfinite is not None:  # only a non-finite verdict is read (not attached: of an earlier attachment)
            self._driver.delivery.deliver(self.nonfinite, self.nonfinite.resolve)

    def metrics(self) -> dict[str, float]:
        return self._log.metrics()

    def log(self, force: bool = False) -> None:
        """Send the counters to the framework's trackers (or ``log``), one point per step and metric (``CounterLog``):
        ``force=False`` writes it once the next step's verdicts are in, ``force=True`` now, and flushes. The tracker
        step is the number of optimizer updates done: a verdict about step ``s`` read after its update is logged at
        ``s + 1``, one read before it at ``s``."""
        if force:
            self._log.now(self.step)
        else:
            self._log.due(self.step)

    def detach(self) -> None:
        """Remove every hook this hook set installed: the forward hooks, the ``step`` wrapper and
        its gradient-tap consumers (the tap's parameter hooks stay, reading nothing; a user's
        communication hook stays registered: DDP cannot drop one). Call ``finish()`` first to
        read the last pending fingerprint comparison. ``attach`` may be called again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._cores.detach()
        self._module = None

    # -- checkpoints ---------------------------------------------------------------------------

    def owns(self, models: list[Any]) -> bool:
        """True when this hook set is attached to one of ``models`` (wrapped or not), or to none yet:
        a framework's save or load of those models concerns it."""
        if self._model is None and self._module is None:
            return True
        return any(m is self._model or self._fw.unwrap(m) is self._module for m in models)

    def _before_save(self, models: list[Any], weights: Any, output_dir: Any) -> None:
        """The framework's pre-save hook (every process, before any file is written): what
        ``before_save()`` does, unless this hook set's model is not among the saved ``models``."""
        if self._module is not None and self.owns(models):
            return self.before_save()
        self.checkpoint_fingerprint = None
        self._compare_now(compare=False)  # no checkpoint after a step whose verdict is unread

    def _verify_loaded(self) -> None:
        """Raise ``FingerprintMismatchError`` (on every process: each loads the same files) when
        the loaded weights or optimizer state differ from the fingerprint saved with them (once)."""
        stored, self._loaded_fingerprint = self._loaded_fingerprint, None
        if stored is not None:
            verify_loaded(self._module, self._optimizer, stored, self.step)

    def state_dict(self) -> dict[str, Any]:
        """The counters (and the fingerprint of the state ``before_save`` saw): plain data only."""
        return counters(self.step, self._updates, self.checks, self.checkpoint_fingerprint)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; call it after loading the model and optimizer, so the loaded
        tensors are verified against the fingerprint stored at ``before_save``."""
        self.step, self._updates, self._loaded_fingerprint = restore_counters(state, self.checks)
        if self._module is not None:
            self._verify_loaded()


def _at_exit(hooks: weakref.ref[SDCHooks]) -> None:
    """At exit, while Python is still whole: no fingerprint all-reduce left in flight."""
    alive = hooks()
    if alive is not None and alive.fingerprint is not None:
        alive.fingerprint.discard(timeout_s=10.0)
    del alive
    # Gloo threads finish releasing a Python comm hook's callbacks first: the
    # collection below may destroy the DDP model, whose reducer drops the process group
    # with the GIL held and joins those threads (see sdc_core.ops.process_exit).
    process_exit.settle_threads()
    # The hooks and the DDP model form reference cycles: collected here, while Python is whole.
    gc.collect()
