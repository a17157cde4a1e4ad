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

The Accelerate, Fabric and Hugging Face Trainer seams are thin subclasses that answer the
framework questions through ``Framework`` (the number of processes, unwrapping, sync steps, the
GradScaler, logging, the run folder, checkpoint registration, the comm-hook hand-over); this
module's ``Framework`` is the plain-PyTorch answer. What the driver does, whatever the seam:

* the shared gradient tap (a hook per parameter, ahead of DDP's reducer) feeds the non-finite
  check and the replay audit with each rank's LOCAL gradients;
* ``replayable(fn)`` wraps the user's loss computation: on audited steps it records its arguments,
  RNG, module state and the autocast state it ran under, and the loss the user back-propagates;
  without it, a forward pre-/post-hook on the unwrapped model records the model's inputs (and the
  autocast state of the forward), RNG and module state, and the loss (``outputs.loss``, a scalar
  output, or ``loss_fn``);
* the optimizer's ``step`` (the GradScaler's, when one is given to ``attach``) is wrapped on the
  instance: the non-finite check takes the step's evidence and the replay audit runs before the
  update, the fingerprint after each real update (not on steps a GradScaler skipped); the
  non-finite verdict is read at the next step (``"raise"``/``"warn"``), before the update
  (``"skip_step"``, GradScaler, audited steps), in ``before_save()`` and in ``finish()``;
* ``before_save()`` reads the pending verdicts and compares the replicas' current weights before
  a checkpoint is written, and (DDP) fingerprints the model and optimizer state that
  ``state_dict()`` then carries; ``load_state_dict`` verifies the loaded tensors against it;
* an FSDP2 (``fully_shard``) model gets the sharded cores: the non-finite check in the
  reduce-scatter, the sharded fingerprint, the sharded replay and the optional update audit.

A failure raises the ``SDCError`` on every rank in the same step, writes an incident under
``<run_dir>/sdc/incidents`` (rank 0) and sets the process exit code (``sdc_core.ops.incidents``).
Cost: as ``sdc_core`` documents per check; the driver itself adds a few Python calls per step.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_core.checks.fingerprint import WeightFingerprint
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.checks.screen import GradientScreen
from sdc_core.dist import shutdown
from sdc_core.dist.topology import Topology
from sdc_core.driver.settings import PLAIN, Sources, resolve
from sdc_core.driver.step import Seam, StepContext, StepDriver
from sdc_core.errors import SDCError
from sdc_core.io.checkpoints import FINGERPRINT_KEY, check_loaded_checkpoint, fingerprint_checkpoint
from sdc_core.ops.incidents import install_exit_code
from sdc_core.replay.ring import RingReplay, StateCapture
from sdc_core.sharded.checks import ShardedFingerprint, ShardedNonFinite, is_sharded
from sdc_core.sharded.replay import ShardedReplay

LossFn = Callable[..., torch.Tensor]
MetricsFn = Callable[[dict[str, float], int], None]
_CONSUMER_LISTS = ("consumers", "writers")  # the gradient tap's consumer lists

LOOP_ADVICE = (
    "If the loss you back-propagate is not the model's own output (labels outside the model, extra loss "
    "terms, a loss scaled by the number of processes), wrap its computation with SDCHooks.replayable(fn); "
    "expose state the capture cannot see with SDCHooks(replay_state=..., load_replay_state=...)"
)


class Framework:
    """The seam between the hook set and a training loop: here, a plain PyTorch loop.

    Every framework-specific question ``SDCHooks`` asks goes through one of these members;
    the Accelerate, Fabric and Trainer seams subclass it. None of them communicates.

    Args:
        run_dir: where incidents go (``<run_dir>/sdc/incidents``); default: the working directory.
        log: ``log(metrics, step)`` receives the counters (every rank calls it; write on rank 0).
        accumulation_steps: what you divide the loss by before ``backward`` (the replay
            recomputes that loss); 1 when you do not.
    """

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

    @property
    def num_processes(self) -> int:
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

    def describe(self, model: nn.Module) -> str:
        """Why ``model`` is not a DDP model (for the error ``attach`` raises)."""
        return (f"a {type(model).__name__} in a run of {self.num_processes} processes: wrap the model in "
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
        """The ``torch.amp.GradScaler`` given to ``attach``, or None."""
        return self._scaler

    def step_owner(self, optimizer: Any) -> Any:
        """The object whose ``step`` the hook set wraps: the GradScaler when there is one (a plain
        loop calls ``scaler.step(optimizer)``, which skips ``optimizer.step`` on overflow)."""
        return self._scaler if self._scaler is not None else optimizer

    def mark_updated(self) -> None:
        """Called by a step post-hook of the inner optimizer: a real update happened."""
        self._updated = True

    def step_was_skipped(self, optimizer: Any) -> bool:
        """True when the step just taken did not update (a GradScaler skipped it on overflow)."""
        updated, self._updated = self._updated, False
        return self.scaler is not None and not updated

    def to_device(self, batch: Any, device: torch.device | None = None) -> Any:
        """``batch`` with its tensors moved to ``device`` (the model's device)."""
        return _to_device(batch, device)

    def replay_context(self) -> AbstractContextManager[Any]:
        """Entered around a replayed forward of the unwrapped module (the autocast state recorded
        at the owner's forward is entered by the hook set itself)."""
        return nullcontext()

    def replay_model(self, module: nn.Module) -> Any:
        """What a ``replayable`` function gets as its model in a replay: the unwrapped module."""
        return module

    @property
    def run_dir(self) -> str:
        return self._run_dir or "."

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._log is not None:
            self._log(metrics, step)

    def flush(self) -> None:
        return None

    def register_for_checkpointing(self, obj: Any) -> None:
        return None  # a plain loop saves hooks.state_dict() itself

    def before_checkpoint(self, fn: Callable[..., None]) -> Any:
        """Run ``fn(models, weights, output_dir)`` before the framework writes a checkpoint; a
        removable handle, or None where saving goes through ``SDCHooks.before_save()``."""
        return None

    def take_comm_hook(self) -> tuple[Any, Any]:
        """A communication hook the framework would register, for the tap to register instead."""
        return None, None


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
        nonfinite, replay, fingerprint = self.settings.nonfinite(), self.settings.replay(), self.settings.fingerprint()
        self.nonfinite: Any = NonFiniteGradient(nonfinite) if nonfinite else None
        self.replay: Any = RingReplay(replay) if replay else None
        self.fingerprint: Any = WeightFingerprint(fingerprint) if fingerprint else None
        self.update_audit: Any = None
        self.screen: Any = None  # the every-step screen: made at attach (DDP, with the gradient check)
        self._screen_loss: torch.Tensor | None = None  # the loss of the step's last forward (the screen's value)
        matmul = self.settings.matmul()
        if matmul is not None:
            from sdc_core.checks.matmul import MatmulChecksum

            self.matmul: Any = MatmulChecksum(matmul)
        else:
            self.matmul = None
        self.step = 0  # optimizer steps (sync steps) so far: the index of the coming update
        self._updates = 0
        self._inner_hook, self._inner_state = self._fw.take_comm_hook()
        self._replayables: list[Callable[..., torch.Tensor]] = []
        self._uses_replayable = False
        self._in_replayable = 0
        self._replaying = False
        self._replay_state = (replay_state, load_replay_state)
        self._module: nn.Module | None = None
        self._model: nn.Module | None = None  # as wrapped (the DDP model)
        self._optimizer: Any = None
        self._checkpoint_fingerprint: dict[str, Any] | None = None  # of the state being saved
        self._loaded_fingerprint: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._consumers: list[tuple[list[Any], Any]] = []  # (tap list, consumer) pairs to remove on detach
        self._log_due: int | None = None  # step of the periodic point not written yet
        self._logged_step: int | None = None
        self._driver = StepDriver(_LoopSeam(self), self._all_checks)
        self._fw.register_for_checkpointing(self)

    @property
    def checks(self) -> list[Any]:
        return [c for c in (self.nonfinite, self.replay, self.fingerprint, self.matmul, self.screen) if c is not None]

    def _all_checks(self) -> list[Any]:
        return [*self.checks, *([self.update_audit] if self.update_audit is not None else [])]

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
        if scaler is not None:
            if not hasattr(scaler, "step") or not hasattr(scaler, "scale"):
                raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
            fw._scaler = scaler
        self.loss_fn = loss_fn or self.loss_fn
        distributed = fw.num_processes > 1
        if distributed and is_sharded(model):  # fully_shard in place (FSDP2, HSDP)
            return self._attach_sharded(model, optimizer)
        ddp = fw.ddp_model(model)
        if distributed and ddp is None:
            raise ValueError(
                f"SDCHooks supports DDP (DistributedDataParallel), FSDP2 (fully_shard) or a single process; "
                f"got {fw.describe(model)}"
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
                self._attach_screen(topo)
            if self.replay:
                trainable = [n for n, p in module.named_parameters() if p.requires_grad]
                self.replay.attach(tap, trainable)
                get, load = self._state_hooks(module)
                self.replay.capture = StateCapture(module, trainable, get_state=get, load_state=load,
                                                   max_state_mb=self.replay.config.max_state_mb)  # fmt: skip
                self.replay.advice = LOOP_ADVICE
                self._hook_forward(module)
            self._consumers = [(getattr(tap, n), c) for n in _CONSUMER_LISTS for c in getattr(tap, n, [])[before[n] :]]
        elif not distributed:
            for check, name in ((self.replay, "ring replay audit"), (self.fingerprint, "weight fingerprint check")):
                if check is not None:
                    warnings.warn(f"SDC {name} is inactive: a single process has no replica", UserWarning, stacklevel=2)
            self.replay = self.fingerprint = None
        self._attach_matmul(module, topo)
        self._wrap_step(optimizer)
        self._model, self._optimizer = model, optimizer
        handle = fw.before_checkpoint(self._before_save)
        if handle is not None:
            self._handles.append(handle)
        if self._loaded_fingerprint is not None:  # state loaded before attach: verify now
            self._verify_loaded(self._loaded_fingerprint)
        return self

    def _attach_sharded(self, model: nn.Module, optimizer: Any) -> SDCHooks:
        """The same settings on a ``fully_shard`` model (FSDP2, HSDP): the non-finite check reads
        each rank's local gradients in the reduce-scatter, the fingerprint compares shards within
        their replica groups and re-checks unreplicated shards before each forward, the ring
        replay has every rank replay its partner's recorded inputs through the sharded model
        together; with ``update_audit_every_n_steps`` a partner recomputes each rank's update."""
        self._module = model
        shutdown.arm()
        topo = Topology.gather(local_rank=self._fw.local_rank)
        if self.matmul is not None:  # DTensor weights are not covered (sdc_core.checks.matmul)
            warnings.warn("SDC matmul_checksum is inactive on a fully_shard model", UserWarning, stacklevel=3)
            self.matmul = None
        if self.replay is not None:
            self.replay = ShardedReplay(self.replay.config, self.replay.stats, topo)
            get, load = self._state_hooks(model)
            self.replay.attach(model, get_state=get, load_state=load)
            self.replay.advice = LOOP_ADVICE
            self._hook_forward(model)
        if self.nonfinite is not None:
            self.nonfinite = ShardedNonFinite(self.nonfinite.config, self.nonfinite.stats, topo)
            self.nonfinite.attach(model)
        if self.fingerprint is not None:
            fingerprint = self.fingerprint = ShardedFingerprint(self.fingerprint.config, self.fingerprint.stats, topo)

            def before_forward(module: nn.Module, args: Any) -> None:
                if module.training:
                    fingerprint.before_use()

            self._handles.append(model.register_forward_pre_hook(before_forward))
        self.update_audit = audit = self.settings.update_audit()
        if audit is not None:  # wrong updates of shards without replicas: a partner recomputes them
            audit.topology = topo
            audit.attach(optimizer, model)  # the driver snapshots before each update and audits after it
        self._wrap_step(optimizer)
        self._model, self._optimizer = model, optimizer
        # shards are compared before a save; the saved state (DTensor shards) carries no fingerprint
        handle = self._fw.before_checkpoint(lambda *_: self.before_save())
        if handle is not None:
            self._handles.append(handle)
        return self

    def _attach_screen(self, topo: Topology) -> None:
        """The every-step screen on the gradient check's read (``gradient_screen``); the replay keeps
        every step's micro-batches so that a partner can confirm a hit in its step."""
        config = self.settings.screen()
        if config is None or self.nonfinite is None:
            return
        self.screen = GradientScreen(config, topo)
        self.screen.attach(self.nonfinite)
        self._driver.prepare()

    def _attach_matmul(self, module: nn.Module, topo: Topology) -> None:
        """The matrix-product checksums (``matmul_checksum``): every ``nn.Linear`` (and attention
        projection) of ``module`` verified in its forward and backward; armed before the step's
        first forward, its verdict sent before the replay audit and read at the next step."""
        matmul = self.matmul
        if matmul is None:
            return
        matmul.topology = topo
        matmul.attach(module)

        def arm(mod: nn.Module, args: Any) -> None:  # the first forward of a step reads the previous verdict
            if mod.training and torch.is_grad_enabled() and not self._in_replay():
                self._driver.deliver(matmul, lambda: matmul.arm(self.step))

        self._handles.append(module.register_forward_pre_hook(arm))
        self._handles.append(_Call(matmul.detach))

    def _state_hooks(self, module: nn.Module) -> tuple[Any, Any]:
        get, load = self._replay_state
        if get is None and load is None:  # the model's own methods, when it has them
            get, load = getattr(module, "sdc_replay_state", None), getattr(module, "sdc_load_replay_state", None)
        return get, load

    def _hook_forward(self, module: nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._after_forward, with_kwargs=True))

    # -- replay capture ------------------------------------------------------------------------

    def replayable(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Wrap the function that computes the loss you back-propagate, so the replay computes it too.

        ``fn(model, *args, **kwargs)`` must return the loss (or a ``(loss, outputs)`` pair)
        exactly as you back-propagate it (labels, extra terms and any scaling included; the hook
        set applies the framework's division by the accumulation steps and the GradScaler
        itself). The wrapper has the same signature; on audited steps it records ``(args,
        kwargs)``, the RNG, module state and autocast state, and the loss, and the replay calls
        ``fn(unwrapped_model, *args, **kwargs)``. Everything ``fn`` reads must come through its
        arguments or the model. While a wrapper is in use the forward hooks record nothing.

        Example: ``compute_loss = hooks.replayable(lambda model, x, y: F.cross_entropy(model(x), y))``
        then ``compute_loss(model, x, y).backward()``.
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
                device = _device(module)
                replay.record(("fn", index, args, kwargs, _autocast_state(device), _sdpa_state()), replay.recorded,
                              device)  # fmt: skip
            self._in_replayable += 1
            try:
                loss = fn(model, *args, **kwargs)
            finally:
                self._in_replayable -= 1
            if record:
                normalized = self._normalize(_loss_of(loss)).detach()
                replay.record_loss(normalized)
                if self.screen is not None:
                    self._add_screen_loss(normalized)
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
            device = _device(module)
            self.replay.record(("forward", 0, args, kwargs, _autocast_state(device), _sdpa_state()),
                               self.replay.recorded, device)  # fmt: skip

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
        assert self.replay is not None
        if not self._recording_forward(module):
            return
        loss = self._backward_loss(outputs, args, kwargs).detach() if self.replay.armed else None
        if loss is not None:
            self.replay.record_loss(loss)
        if self.screen is not None and self.loss_fn is None:  # the screen's value: the model's own loss (no compute)
            own = _own_loss(outputs)
            if loss is None and isinstance(own, torch.Tensor):
                loss = self._normalize(own.detach())
            if loss is not None:
                self._add_screen_loss(loss)

    def _backward_loss(self, outputs: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The loss as the loop back-propagates it (normalised, scaled)."""
        loss = self.loss_fn(outputs, *args, **kwargs) if self.loss_fn is not None else _own_loss(outputs)
        if loss is None:
            raise ValueError(
                "the ring replay audit cannot find the loss: the model returns neither `.loss` nor a scalar; "
                "wrap your loss computation with SDCHooks.replayable(fn), or pass "
                "loss_fn=(outputs, *args, **kwargs) -> loss to SDCHooks or attach()"
            )
        return self._normalize(loss)

    def _add_screen_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss, as back-propagated (normalised, scaled), to the step's loss for
        the screen: summed over the micro-batches, what a partner's recomputation returns."""
        self._screen_loss = loss if self._screen_loss is None else self._screen_loss + loss

    def _normalize(self, loss: torch.Tensor) -> torch.Tensor:
        """The framework's division by the accumulation steps and the GradScaler's scaling."""
        divisor = self._fw.loss_divisor
        loss = loss / divisor if divisor != 1 else loss
        scaler = self._fw.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def _replay_step(self, batch: tuple[Any, ...], batch_idx: int) -> torch.Tensor:
        assert self._module is not None
        kind, index, args, kwargs, *rest = batch
        amp = rest[0] if rest else None
        sdpa = rest[1] if len(rest) > 1 else None
        self._replaying = True
        try:
            with _autocast(amp), _sdpa_backends(sdpa):
                if kind == "fn":
                    model = self._fw.replay_model(self._module)
                    return self._normalize(_loss_of(self._replayables[index](model, *args, **kwargs)))
                with self._fw.replay_context():
                    outputs = self._module(*args, **kwargs)
                return self._backward_loss(outputs, args, kwargs)
        finally:
            self._replaying = False

    def _to_device(self, batch: Any) -> Any:
        return self._fw.to_device(batch, _device(self._module) if self._module is not None else None)

    # -- the step ------------------------------------------------------------------------------

    def _wrap_step(self, optimizer: Any) -> None:
        owner = self._fw.step_owner(optimizer)
        original = owner.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._step(optimizer, original, *args, **kwargs)
            except BaseException as err:
                self._path_out(err)
                raise

        owner.step = step
        self._handles.append(_Restore(owner))
        fw = self._fw
        inner = _inner(optimizer)
        if hasattr(inner, "register_step_post_hook"):  # a real update happened (GradScaler may skip it)
            self._handles.append(inner.register_step_post_hook(lambda *_: fw.mark_updated()))
        hooks = weakref.ref(self)  # never keeps the model alive into interpreter teardown

        def at_exit() -> None:  # while Python is still whole: no fingerprint all-reduce left in flight
            alive = hooks()
            if alive is not None and alive.fingerprint is not None:
                alive.fingerprint.discard(timeout_s=10.0)
            del alive
            # Gloo threads finish releasing a Python comm hook's callbacks first: the
            # collection below may destroy the DDP model, whose reducer drops the process group
            # with the GIL held and joins those threads (see sdc_core.dist.shutdown).
            shutdown.settle_threads()
            # The hooks and the DDP model form reference cycles: collected here, while Python is whole.
            gc.collect()

        atexit.register(at_exit)

    def _context(self, optimizer: Any = None, index: int | None = None, update: int | None = None) -> StepContext:
        """The step as the driver sees it: by default the coming update's step and update index."""
        assert self._module is not None
        return StepContext(self.step if index is None else index, self._updates if update is None else update,
                           self._module, [_inner(optimizer or self._optimizer)],
                           scaler_active=self._fw.scaler is not None)  # fmt: skip

    def _step(self, optimizer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        fw, driver = self._fw, self._driver
        if self._module is None:  # detached: the step as it was
            return original(*args, **kwargs)
        driver.resolve_pending(self._context(optimizer))  # the earlier steps' verdicts, also on accumulation steps
        if not fw.sync_gradients:
            return original(*args, **kwargs)
        plan = driver.before_update(self._context(optimizer))
        self._write_due_log()  # this step's verdicts are in: the pending point is complete
        fw._updated = False
        try:
            out = original(*args, **kwargs)
        except BaseException:
            driver.update_failed(plan)
            raise
        step = self.step
        self.step += 1
        updated = not plan.skipped and not fw.step_was_skipped(optimizer)
        if updated:
            self._updates += 1
        driver.after_update(self._context(optimizer, step, self._updates - 1), updated, plan)
        if self.step % self.settings.log_every_n_steps == 0:
            self.log()
        return out

    def _path_out(self, err: BaseException) -> None:
        """An exception leaves the step: the pending fingerprint all-reduce is finished, not left
        in flight into the exit; on a verdict, counters logged."""
        if self.fingerprint is not None:
            self.fingerprint.discard()
        if self._fw.num_processes > 1:  # the script may now free the model and the process group
            shutdown.settle_threads()
        if isinstance(err, SDCError):
            try:  # at the tracker step of now: the updates done (a verdict about step s after its update: s + 1)
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
            self._compare_now()
        finally:
            self.log(force=True)
            if self._fw.num_processes > 1:  # the script may now free the model and the process group
                shutdown.settle_threads()

    def check_gradients_now(self) -> None:
        """Read this step's non-finite verdict now, before anything that raises on NaN gradients
        (a clipping with ``error_if_nonfinite=True``, a norm you check yourself): raises the
        ``NonFiniteGradientError`` naming the rank on every process, as ``optimizer.step`` would
        have. Call it on every process, after backward. Cost: one host wait; nothing on a finite
        step beyond that (the step's own verdict is then read as usual)."""
        if self.nonfinite is None or self._module is None or not self._fw.sync_gradients:
            return
        step = self._context()
        self._driver.resolve_gradients(step, before=self.step)  # the previous step's, first
        self._driver.gradients(step, now=True)  # taken once: optimizer.step will not take it again

    def before_save(self, fingerprint: bool = True) -> None:
        """Call on every process before writing a checkpoint: reads the pending non-finite
        verdict and compares the replicas' current weights (raising the ``SDCError`` on every
        process, before anything is written). With ``fingerprint`` (DDP or one process), the
        model and optimizer state are fingerprinted and ``state_dict()`` carries it, so that
        ``load_state_dict`` verifies what was loaded. Works the same before
        ``torch.distributed.checkpoint.save`` (sharded models: compared, not fingerprinted).
        Cost: one host wait and one read of the weights (and of the saved state)."""
        self._compare_now()
        sharded = self._module is not None and is_sharded(self._module)
        self._checkpoint_fingerprint = (
            fingerprint_checkpoint(self._saved_tensors()) if fingerprint and self._module is not None and not sharded
            else None
        )  # fmt: skip

    def _compare_now(self) -> None:
        """The pending verdicts read and the current weights compared (every process)."""
        if self._module is not None:
            self._driver.compare_now(self._context())
        elif self.nonfinite is not None:  # not attached: only a verdict of an earlier attachment can be pending
            self._driver.deliver(self.nonfinite, self.nonfinite.resolve)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for check in self.checks:
            out.update(check.stats.metrics())
        return out

    def log(self, force: bool = False) -> None:
        """Send the counters to the framework's trackers (or the ``log`` callable).

        One point per step and metric, never two with different values: a periodic point
        (``force=False``, every ``log_every_n_steps``) is written once the next step's verdicts
        are in (or by ``finish`` or a failure, whichever comes first); ``force=True`` writes now
        and flushes, unless this step was written already. The tracker step is the number of
        optimizer updates done (Lightning's ``global_step``): the point of a verdict about step
        ``s`` (0-based, as ``SDCError.step`` and ``Fault(step=)``) read after that step's update
        is ``s + 1``, one read before it ``s``.
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
        """Remove every hook this hook set installed: the forward hooks, the ``step`` wrapper and
        its gradient-tap consumers (the tap's parameter hooks stay, reading nothing; a user's
        communication hook stays registered: DDP cannot drop one). Call ``finish()`` first to
        read the last pending fingerprint comparison. ``attach`` may be called again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for consumers, consumer in self._consumers:
            if consumer in consumers:
                consumers.remove(consumer)
        self._consumers = []
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
        if self._module is None or not self.owns(models):
            self._checkpoint_fingerprint = None
            if self.nonfinite is not None:  # no checkpoint after a step whose verdict is unread
                self._driver.deliver(self.nonfinite, self.nonfinite.resolve)
            return
        self.before_save()

    def _saved_tensors(self) -> dict[str, Any]:
        assert self._module is not None
        return {"model": self._module.state_dict(), "optimizer": _inner(self._optimizer).state_dict()}

    def _verify_loaded(self, stored: dict[str, Any]) -> None:
        """Raise ``FingerprintMismatchError`` (on every process: each loads the same files) when
        the loaded weights or optimizer state differ from the fingerprint saved with them."""
        self._loaded_fingerprint = None
        check_loaded_checkpoint({**self._saved_tensors(), FINGERPRINT_KEY: stored}, self.step)

    def state_dict(self) -> dict[str, Any]:
        """The counters (and the fingerprint of the state ``before_save`` saw): plain data only."""
        state: dict[str, Any] = {
            "step": self.step,
            "updates": self._updates,
            "checks": {c.stats.check: c.stats.state_dict() for c in self.checks},
        }
        if self._checkpoint_fingerprint is not None:
            state[FINGERPRINT_KEY] = self._checkpoint_fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; call it after loading the model and optimizer, so the loaded
        tensors are verified against the fingerprint stored at ``before_save``."""
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


class _LoopSeam(Seam):
    """The driver's seam of a hook set: its framework's run folder and rank; a replay runs the
    recorded micro-batch through ``replayable`` or the model's forward."""

    def __init__(self, hooks: SDCHooks) -> None:
        self._hooks = weakref.proxy(hooks)  # the hook set owns the driver, which owns this seam
        self._run_dir: str | None = None

    @property
    def run_dir(self) -> str:
        if self._run_dir is None:  # resolved once: a framework's answer may be a collective
            self._run_dir = self._hooks._fw.run_dir
        return self._run_dir

    @property
    def is_main(self) -> bool:
        return self._hooks._fw.is_main

    @property
    def world_size(self) -> int:
        return self._hooks._fw.num_processes

    def replay_functions(self, replay: Any, step: StepContext) -> tuple[Any, Any, Any]:
        return self._hooks._replay_step, self._hooks._to_device, nullcontext

    def loss(self) -> torch.Tensor | None:
        loss, self._hooks._screen_loss = self._hooks._screen_loss, None
        return loss


def _own_loss(outputs: Any) -> Any:
    """The loss a model's output carries (``outputs.loss``, a dict's ``"loss"``, a scalar output), or None."""
    if getattr(outputs, "loss", None) is not None:
        return outputs.loss
    if isinstance(outputs, dict) and "loss" in outputs:
        return outputs["loss"]
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs
    return None


def _loss_of(result: Any) -> torch.Tensor:
    """The loss in what a ``replayable`` function returned: the tensor itself, or the first item
    of a ``(loss, outputs)`` pair (the Hugging Face ``compute_loss(..., return_outputs=True)`` form)."""
    if isinstance(result, tuple | list) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"a replayable function must return the loss tensor, got {type(result).__name__}")
    return result


def _device(module: nn.Module | None) -> torch.device | None:
    return None if module is None else next((p.device for p in module.parameters()), None)


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (Accelerate, Fabric), or itself."""
    return getattr(optimizer, "optimizer", optimizer)


def _autocast_state(device: torch.device | None) -> tuple[str, str] | None:
    """``(device_type, dtype name)`` of the autocast the current code runs under, or None."""
    kind = device.type if device is not None else "cpu"
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return kind, str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None


def _autocast(state: Any) -> AbstractContextManager[Any]:
    """Re-enter the autocast recorded by ``_autocast_state`` (nothing when it was off)."""
    if state is None:
        return nullcontext()
    kind, dtype = state
    if not isinstance(kind, str) or not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None),
                                                                                 torch.dtype):  # fmt: skip
        raise ValueError(f"bad recorded autocast state {state!r}")
    return torch.autocast(kind, dtype=getattr(torch, dtype))


_SDPA = ("flash", "mem_efficient", "math", "cudnn")


def _sdpa_state() -> tuple[bool, ...]:
    """Which scaled-dot-product-attention backends the forward may use (``sdpa_kernel`` sets these
    flags): the replay must pick the same kernel, or dropout masks and roundings differ."""
    b = torch.backends.cuda
    return tuple(bool(getattr(b, f"{name}_sdp_enabled")()) for name in _SDPA)


@contextmanager
def _sdpa_backends(state: Any) -> Iterator[None]:
    """Re-enter the SDPA backend flags recorded by ``_sdpa_state`` (nothing when none were recorded)."""
    if state is None:
        yield
        return
    if not (isinstance(state, tuple | list) and len(state) == len(_SDPA) and all(isinstance(v, bool) for v in state)):
        raise ValueError(f"bad recorded attention backends {state!r}")
    b = torch.backends.cuda
    before = _sdpa_state()
    for name, on in zip(_SDPA, state, strict=True):
        getattr(b, f"enable_{name}_sdp")(on)
    try:
        yield
    finally:
        for name, on in zip(_SDPA, before, strict=True):
            getattr(b, f"enable_{name}_sdp")(on)


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


class _Call:
    """Handle whose ``remove`` calls ``fn``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def remove(self) -> None:
        self.fn()


class _Restore:
    """Handle that puts the object's own ``step`` back."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def remove(self) -> None:
        self.owner.__dict__.pop("step", None)
