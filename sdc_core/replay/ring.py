"""Ring replay audit: replicas recompute each other's micro-batches and compare.

Contract: on every ``every_n_steps``-th step rank ``r`` sends its micro-batches (inputs, captured state, loss and a
digest of its LOCAL gradients) to ``partners[r]``, which recomputes them side-effect free and compares; every rank
reaches the same verdict (``StepAudit``, ``referee``). Cost, on audited steps only: deterministic kernels for the
owner's micro-batches (+9 to 11% on an H200), one extra forward and backward (three at the first audit), the transfer, a
state clone (at most ``max_state_mb``) and one all-gather of seven float64 per rank. docs/replay-contract.md has the
user's side of the contract."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from sdc_core.checks.contract import Role, check_settings
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.dist.payload import PayloadError
from sdc_core.dist.payload_checks import check_replay_payload
from sdc_core.dist.topology import Topology, exchange, is_distributed
from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.replay.attribution import DEFAULT_ADVICE, describe, received_batches, send_payload
from sdc_core.replay.audit import StepAudit, attempt
from sdc_core.replay.calibration import Calibration
from sdc_core.replay.compare import Digest, Row, assemble, digest_row
from sdc_core.replay.determinism import DeterministicWindow
from sdc_core.replay.referee import attribute_step
from sdc_core.replay.rerun import GradientsAside, replay_each_gradient
from sdc_core.replay.rng import all_rng
from sdc_core.replay.state import MicroBatch, Rerun, StateCapture, StepFn, fresh
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

ReplayExact = bool | Literal["auto"]  # ReplayConfig.exact
ReplayFailurePolicy = Literal["raise", "skip_step", "rollback"]  # ReplayConfig.on_failure
UnreplayablePolicy = Literal["raise", "warn"]  # ReplayConfig.on_unreplayable


@documented
@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Settings of the ring replay audit (keyword-only, validated on construction)."""

    every_n_steps: int = setting(100, "ring replay audit cadence in optimizer steps", "Steps 0, n, 2n, ... (>= 1).")
    exact: ReplayExact = setting(
        "auto",
        "replay comparison: auto (bit equality where the step replays bit for bit), true or false",
        "``auto``: bit equality where the first audit shows the step replays bit for bit, else a tolerance from "
        "the measured noise floor (at most ``rtol``); ``True``: bit equality; ``False``: the tolerance ``rtol``.",
    )
    rtol: float = setting(
        1e-3,
        "relative tolerance of the replay comparison",
        "It applies to loss, gradient norms and sums with ``exact=False``; the loosest tolerance ``exact='auto'`` may "
        "choose (> 0, < 1).",
    )
    atol: float = setting(1e-6, "absolute floor of the replay comparison", "The floor of the denominators (>= 0).")
    on_failure: ReplayFailurePolicy = setting(
        "raise",
        "what a replay mismatch does: raise, or skip_step when the fault proves transient",
        "With ``skip_step``, when the faulty rank is named and its fault proves transient (re-running the disagreeing "
        "computation gives a different result), every rank drops the step instead; a persistent fault still "
        "raises.",
    )
    on_unreplayable: UnreplayablePolicy = setting(
        "raise",
        "a step the replay cannot reproduce: raise, or warn once and turn the audit off",
        "With ``raise``, a step that cannot be replayed faithfully raises ``ReplayUnavailableError``.",
    )
    max_state_mb: float = setting(
        256.0,
        "MiB of module state copied per audited step for the replay",
        "State tensors are cloned up to this many MiB per audited step (all its micro-batches together, held until "
        "the audit); tensors past it are read live, and a replay that changes one of them in place is refused.",
    )
    deterministic: bool = setting(
        True,
        "replay with deterministic kernels, bit-comparable on GPUs (false: your own settings)",
        "``True``: the owner's audited micro-batches and every replay run with deterministic kernels "
        "(``RingReplay`` docstring); ``False``: nondeterministic kernels are tolerated as measured noise, up to "
        "``rtol``, with ``exact='auto'``.",
    )
    allow_pickled_batches: bool | None = setting(
        None,
        "unpickle a partner's non-tensor micro-batch in the replay (trust every rank)",
        "Whether THIS rank unpickles a partner's micro-batch that does not travel as plain data "
        "(``sdc_core.dist.payload``); ``None``: the environment variable ``SDC_ALLOW_PICKLED_BATCHES``, off unless "
        "set. Only if every rank is trusted: unpickling runs code a peer chose.",
    )

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "skip_step", "rollback"):
            raise ValueError(f"on_failure must be 'raise', 'skip_step' or 'rollback', got {self.on_failure!r}")
        check_settings(self, ints=("every_n_steps",))
        if not (self.exact is True or self.exact is False or (isinstance(self.exact, str) and self.exact == "auto")):
            raise ValueError(f"exact must be True, False or 'auto', got {self.exact!r}")
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, int | float) or not 0 < self.rtol < 1:
            raise ValueError(f"rtol must be a number in (0, 1), got {self.rtol!r}")
        if isinstance(self.atol, bool) or not isinstance(self.atol, int | float) or not 0 <= self.atol < math.inf:
            raise ValueError(f"atol must be a finite number >= 0, got {self.atol!r}")
        if self.on_unreplayable not in ("raise", "warn"):
            raise ValueError(f"on_unreplayable must be 'raise' or 'warn', got {self.on_unreplayable!r}")
        mb = self.max_state_mb
        if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 <= mb < math.inf:
            raise ValueError(f"max_state_mb must be a finite number >= 0, got {mb!r}")
        check_settings(self, flags=("deterministic",))
        if self.allow_pickled_batches is not None and not isinstance(self.allow_pickled_batches, bool):
            raise ValueError(f"allow_pickled_batches must be True, False or None, got {self.allow_pickled_batches!r}")


@dataclass
class KeptSteps:
    """Micro-batches of unaudited steps kept while the screen escalates, for a partner to recompute:
    the step being recorded and the one before it. Memory: at most two steps' captures."""

    step: int | None = None
    batches: list[MicroBatch] = field(default_factory=list)
    previous: tuple[int, list[MicroBatch]] | None = None  # the step before ``step``, not taken yet

    def start(self, step: int | None) -> None:
        """Keep ``step``'s micro-batches; the step kept until now becomes the previous one (None: keep none)."""
        if self.step != step:
            if self.step is not None:
                self.previous = (self.step, self.batches)
            self.step, self.batches = step, []

    def clear(self) -> None:
        self.step, self.batches, self.previous = None, [], None

    def peek(self, step: int) -> list[MicroBatch]:
        """The micro-batches kept for ``step`` (empty when none were), kept on."""
        if step == self.step:
            return self.batches
        return self.previous[1] if self.previous is not None and self.previous[0] == step else []

    def take(self, step: int) -> list[MicroBatch]:
        """The micro-batches kept for ``step``, then forgotten; empty when none were kept for it."""
        kept = self.peek(step)
        if step == self.step:
            self.step, self.batches = None, []
        elif self.previous is not None and self.previous[0] == step:
            self.previous = None
        return kept


@dataclass
class RingReplay:
    """Framework-neutral ring replay audit. Adapter calls, per optimizer step: ``arm(step)``, ``record(...)``
    per micro-batch (``begin()`` where the step itself starts, when later), ``record_loss(...)``, then
    ``audit(...)`` after backward and before the update, on every rank. With ``config.deterministic`` the
    owner's audited micro-batches and every replay run under deterministic algorithms (strict once the first
    audit's probe proves it works), the caller's settings restored after each."""

    role: ClassVar[Role] = Role.REPLAY

    config: ReplayConfig = field(default_factory=ReplayConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("ring_replay"))
    topology: Topology | None = None
    names: list[str] = field(default_factory=list)
    capture: StateCapture | None = None
    advice: str = DEFAULT_ADVICE
    label: str = "The ring replay audit"  # how failure texts name the audit (adapters: their class name)
    disabled: bool = False
    replaying: bool = False
    projected: bool = False  # a re-run's loss was its outputs' projection on the owner's gradients (a loss outside)
    collective_reruns: bool = False  # a re-run runs collectives (sharded models): every rank replays in every round
    groups: list[tuple[int, ...]] | None = None  # ranks computing one batch together (tensor parallel), or None
    _armed_step: int | None = None
    _micro: list[MicroBatch] = field(default_factory=list)
    _loss: torch.Tensor | None = None
    _local: dict[str, Row] = field(default_factory=dict)
    _tap: GradientTap | None = None
    calibration: Calibration = field(default_factory=Calibration)  # what the audits learnt (tolerance, mode)
    _window: DeterministicWindow = field(default_factory=DeterministicWindow)
    _aside: GradientsAside = field(default_factory=GradientsAside)  # the step's own .grad during its re-runs
    _capture_error: str = ""
    _synced: int = 0  # the armed step's backward passes DDP all-reduced
    keep_every_step: bool = False  # the screen's escalation: record every step's micro-batches (``kept``)
    kept: KeptSteps = field(default_factory=KeptSteps)
    screen_strikes: dict[int, int] = field(default_factory=dict)  # confirmed screen hits per rank
    audit_at: int | None = None  # a step audited out of cadence: the first after an unconfirmed screen hit
    unconfirmed_hit: tuple[int, tuple[int, ...], str] | None = None  # its step, ranks, value and gap (the last one)
    last_error: ReplayMismatchError | None = None

    @property
    def active(self) -> bool:
        return is_distributed() and not self.disabled

    def attach(self, tap: GradientTap, names: Sequence[str]) -> None:
        """Digest local gradients from the tap on audited steps; ``names``: trainable params."""
        if own := sorted(tap.rank_own & {n for n, _ in tap.ddp.module.named_parameters()}):  # off: warned
            self.disabled = True
            warnings.warn(f"{self.label} is inactive: DDP leaves parameters {own[:3]} to each rank "
                          "(parameters_to_ignore), so a partner cannot recompute a rank's micro-batch", stacklevel=3)
        self._tap = tap
        self.names = list(names)
        tap.consumers.append(self._consume)
        tap.wanted_when[self._consume] = lambda: self._armed_step is not None and not self.replaying  # audited
        tap.finishers.append(self._end_of_backward)

    def arm(self, step: int) -> bool:
        """Called at each micro-batch start; True when this step's micro-batches are audited."""
        due = self.active and not self.replaying and (step % self.config.every_n_steps == 0 or step == self.audit_at)
        if not due:
            self._armed_step = None
            self._window.exit()
            self._aside.clear()
            if self.keep_every_step and self.active and not self.replaying:  # kept for a possible escalation
                self.kept.start(step)
                return True
            self.kept.clear()
            return False
        self.kept.start(None)  # an audited step is not kept; the one kept before it may still be confirmed
        if self._armed_step != step:
            self._armed_step, self._micro, self._loss, self._local = step, [], None, {}
            self._aside.clear()
            self._capture_error, self._synced = "", 0
        return True

    def disarm(self) -> None:
        """Drop the armed step's micro-batches: it is not audited (every rank alike)."""
        self._armed_step, self._micro, self._loss, self._local = None, [], None, {}
        self._window.exit()
        self._aside.clear()

    @property
    def mode(self) -> str:
        return self.calibration.mode(self.config)

    @property
    def keeping(self) -> bool:
        """True while a step that is not audited is recorded for a possible escalation."""
        return self._armed_step is None and self.kept.step is not None

    @property
    def armed(self) -> bool:
        """True between ``arm`` of an audited step and its ``audit``."""
        return self._armed_step is not None

    @property
    def recording(self) -> list[MicroBatch]:
        """The micro-batches recorded so far for the armed (or kept) step; [] when none is."""
        return self.kept.batches if self.keeping else self._micro if self.armed else []

    def batches_of(self, step: int) -> list[MicroBatch]:
        """The micro-batches recorded for ``step``, audited or kept ([] when none are), left in place."""
        return self._micro if step == self._armed_step else self.kept.peek(step)

    @property
    def tolerance(self) -> float:
        return self.calibration.tolerance(self.config)

    def record(self, batch: Any, batch_idx: int, device: torch.device | None = None, state: bool = True) -> None:
        """Remember an audited (or kept) micro-batch, its RNG and (``state``) module state; cost: the capture."""
        (self.kept.batches if self.keeping else self._micro).append(MicroBatch(batch, batch_idx, *all_rng(device)))
        if state:
            self.begin(device, rng=False)  # the RNG was just taken (NumPy's alone costs about 50 us)

    def begin(self, device: torch.device | None = None, rng: bool = True) -> None:
        """The step of the last recorded micro-batch starts now: (re)capture its RNG (``rng``) and state."""
        micro = self.recording
        if not micro or self.replaying:
            return
        mb = micro[-1]
        if rng:
            mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng = all_rng(device)
        if self.config.deterministic and not self.keeping:  # the owner's forward and backward: in the replays' mode
            self._window.enter(self.calibration.strict(self.config))
        if self.capture is not None:  # one budget for all micro-batches of the step (held until the audit)
            used = sum(m.state.nbytes for m in micro[:-1] if m.state is not None)
            try:  # a failure here is reported by the audit, on every rank alike
                mb.state = self.capture.capture(self.capture.max_bytes - used)
            except Exception as err:
                mb.state = None
                self._capture_error = self._capture_error or f"capturing its state: {describe(err)}"

    def refuse(self, why: str) -> None:
        """The armed step cannot be replayed faithfully (``why``): its audit raises ``ReplayUnavailableError``."""
        if self._armed_step is not None and not self.replaying:
            self._capture_error = self._capture_error or why

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the owner back-propagates for the current audited micro-batch (no host sync)."""
        if self._armed_step is not None and not self.replaying:
            loss = loss.detach().double()
            self._loss = loss if self._loss is None else self._loss + loss.to(self._loss.device)

    def _end_of_backward(self) -> None:
        """The tap's finisher: find where DDP keeps a copy of an audited step's gradients (``GradientsAside``)."""
        if self._armed_step is not None and not self.replaying and self._tap is not None:
            self._aside.watch(self._tap.ddp, self._tap.params)
            self._synced += 1  # finishers follow synchronised backwards only; a second mixes reduced and local
            if self._synced > 1 and not self._capture_error:
                self._capture_error = ("reading its local gradients: DDP all-reduced more than one backward of the "
                                       "step (gradient accumulation: run all but the last micro-batch under no_sync())")

    def _consume(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        if self._armed_step is not None and self._tap is not None:
            self._local[self._tap.names.get(id(p), "?")] = digest_row(grad)

    def _own_digest(self) -> Digest:
        return assemble(self.names, self._local, self._loss if self._loss is not None else 0.0)

    def recompute(self, rerun: Rerun, batches: list[MicroBatch], consume: Callable[[str, torch.Tensor], None]
                  ) -> torch.Tensor:  # fmt: skip
        """Recompute ``batches`` side-effect free, handing each gradient to ``consume``; returns the summed loss."""
        self.replaying = True
        try:
            return replay_each_gradient(rerun.module, self.names, batches, rerun.step_fn, consume, rerun.to_device,
                                        rerun.context, self.capture)  # fmt: skip
        finally:
            self.replaying = False

    def exchange_batches(self, sends: dict[int, list[MicroBatch]], recv_from: list[int]) -> dict[int, Any]:
        """Send micro-batches to partners (every rank alike): each received payload is checked and resolved
        into a ``MicroBatch`` list, or a text saying why it could not be."""
        empty = assemble(self.names, {}, 0.0)
        received = self._exchange({dst: send_payload(micro, empty)[0] for dst, micro in sends.items()}, recv_from)
        own = [mb.state for micro in sends.values() for mb in micro]
        out = {src: attempt(lambda p=payload: received_batches(p, own)) for src, payload in received.items()}
        return {src: err or batches for src, (batches, err) in out.items()}  # a text: every rank still goes on

    def _replay_digest(self, rerun: Rerun, batches: list[MicroBatch]) -> Digest:
        rows: dict[str, Row] = {}
        loss = self.recompute(rerun, batches, lambda n, g: rows.__setitem__(n, digest_row(g)))
        return assemble(self.names, rows, loss)

    def _exchange(self, sends: dict[int, Any], recv_from: list[int]) -> dict[int, Any]:
        """``exchange`` of replay payloads, each received one validated (``PayloadError`` on every rank)."""
        return exchange(sends, recv_from, allow_pickle=self.config.allow_pickled_batches, validate=check_replay_payload)

    def _unreplayable(self, message: str) -> bool:
        """Every rank alike: raise ``ReplayUnavailableError``, or warn once and turn the audit off."""
        self.stats.bump("unreplayable")
        message = f"{self.label} {message}"
        if self.config.on_unreplayable == "warn":
            self.disabled = True
            warnings.warn(f"{message} The ring replay audit is now off.", UserWarning, stacklevel=4)
            return False
        raise ReplayUnavailableError(message)

    def audit(
        self,
        step: int,
        module: nn.Module,
        step_fn: StepFn,
        to_device: Callable[[Any], Any] | None = None,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Run the audit of ``step`` if it was armed (every rank alike).

        ``to_device`` moves a received batch to the replay's device (default: the module's). Returns True
        when the step must be skipped (``skip_step`` and a transient fault); raises ``ReplayMismatchError``
        or ``ReplayUnavailableError`` on every rank."""
        self._window.exit()  # the owner's backward is done: the user's own settings from here on
        if self._armed_step != step:
            return False
        if to_device is None:
            to_device = partial(fresh, device=next((p.device for p in module.parameters()), None))
        rerun = Rerun(module, step_fn, to_device, context)
        try:  # the step's own gradients out of the way of the re-runs where DDP keeps a copy
            with self._aside.aside() as aside:
                if aside:
                    self.stats.extra = {**(self.stats.extra or {}), "gradients_set_aside_bytes": float(aside)}
                t0 = time.perf_counter()
                topo = self.topology or Topology.gather()
                own = self._own_digest()
                micro, self._micro, self._armed_step = self._micro, [], None
                failure, self._capture_error = self._capture_error, ""
                run = StepAudit(step, topo, self.config, self.stats, self.calibration, lambda: self.names,
                                self.groups, self.collective_reruns, self.advice, micro, own, failure=failure,
                                recompute=lambda b: self._replay_digest(rerun, b),
                                exchange=self._exchange, unreplayable=self._unreplayable, t0=t0)  # fmt: skip
                try:  # the StepAudit, then the referee round if pairs still disagree
                    result = run.run()
                    return attribute_step(run) if result is None else result
                finally:
                    if run.error is not None:
                        self.last_error = run.error
        except PayloadError as err:  # raised on every rank together by the exchange: a peer sent what is refused
            return self._unreplayable(f"could not exchange its data at step {step}: {err}.")
        finally:
            self.calibration.settle_probe(self.config, self.stats)  # the mode of the next audited step
