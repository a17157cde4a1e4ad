"""Ring replay audit: replicas recompute each other's micro-batches and compare.

Contract: on every ``every_n_steps``-th optimizer step, rank ``r`` sends the micro-batches of
that step (inputs, the state the step reads besides its batch, its loss and a digest of its
LOCAL gradients, taken in each parameter's gradient hook before DDP's all-reduce) to its partner
``partners[r]``: a rank on another node when there are several, else the next rank. The partner
recomputes loss and gradients with the same weights and the owner's state and compares. Every
rank then learns which (owner, replayer) pairs disagree and reaches the same attribution:

* no rank is named before a disagreement is confirmed: both sides of every disagreeing pair
  re-run what they computed (the owner its own micro-batches, the replayer its replay), and a
  difference within ``AUTO_MARGIN`` times what those re-runs show (at most ``rtol``) is noise:
  no verdict, and the tolerance moves to cover it;
* every pair that still disagrees gets a referee (a third rank, on yet another node where
  possible) replaying the disputed batch; ``attribute`` then weighs every comparison and names
  a rank alone only when it is the one smallest explanation of what was seen, else lists every
  rank that could be faulty (several faulty ranks: never a healthy rank named alone while the
  faulty ones are fewer than the healthy ones);
* with two ranks no third opinion exists: ``rank`` is None and both are suspects. With three
  replicas two ranks sharing one fault look exactly like the third one being faulty: that
  verdict names it and says so.

Faithful replay: at the start of each audited micro-batch the owner captures what its step reads
besides the batch (``StateCapture``): Python ``random``, NumPy and torch CPU/CUDA RNG state,
buffers and parameters that do not train, tensor and plain Python attributes of the module and
its submodules, and the user's ``sdc_replay_state()``. The replayer runs the unwrapped module on
detached aliases of its trainable parameters with that state swapped in, and afterwards puts its
own state back (every submodule's attributes, RNG, user state): the replay has no side effect,
``.grad``, optimizer, DDP, metrics objects and loggers are untouched, and a run with the audit on
trains bit-identically to one with it off. Collectives the replayed step calls are refused
(``CollectiveInReplay``) before they reach the transport, so no rank is ever left in a
collective the others do not enter; other threads' collectives and a signal handler's pass.

Trust before accusation: at the first audit of a process, and at every audit with a
disagreement, each rank also re-runs its OWN micro-batches on its own device. A step that two or
more ranks cannot reproduce on their own device (nondeterminism, state the capture cannot see),
or a step where every replay pair disagrees while each rank reproduces itself and no referee
agrees with either side of any pair (the step depends on the rank, or ranks run different
software; with two replicas, at the first audit, without referees), is not replayable: ``ReplayUnavailableError`` on
every rank (not an ``SDCError``), or with ``on_unreplayable="warn"`` one warning and the audit
off. A failure inside any replay (an exception, a refused collective) ends the same way.

Deterministic kernels (``deterministic=True``, default): the owner's audited micro-batches and
every replay run under ``torch.use_deterministic_algorithms(True)`` (``warn_only=True`` until a
probe replay at the first audit proves the step runs without it, ``strict`` after that), the
user's settings restored after each; see ``RingReplay``.

Comparison: ``exact="auto"`` (default) calibrates from same-device re-runs: when each rank's
re-run of its own micro-batches is bit-identical (the lower median over ranks), comparisons are
exact; otherwise the tolerance is ``min(rtol, 100 * noise floor)``, the noise floor being the
lower median of the ranks' same-device differences. In ``strict`` mode one round sets it; else
three audits do. Exactness stays a hypothesis in every mode: a kernel may be nondeterministic on
some calls only, so a later disagreement is confirmed as above, and noise it reveals raises the
tolerance (``exact_audits`` counts the audits whose every pair agreed bit for bit). ``rtol``
caps what any evidence can do: a difference above it is never noise.
``exact=True`` demands bit equality; ``exact=False`` uses ``rtol`` as is. Differences are
measured per parameter on loss, gradient norm and gradient sum (the latter relative to
``sqrt(numel) * norm``), with ``atol`` the floor of the denominators.

Cost of a disagreement (clean audits pay none of it): one more run of its own micro-batches on
every rank, one more replay on every replayer, then one referee replay per disagreeing pair and
one re-run by a named rank.

Cost: on audited steps, deterministic kernels for the owner's micro-batches (+9 to 11% on an
H200, docs/coverage.md) and one extra forward and backward of the partner's micro-batches (three
at the first audit: the self re-run and the strict probe; two at the next and, without strict
determinism, the first three audits), its gradients digested as they are produced (no second
full set of gradients is held; with DDP's default layout the step's own ``.grad`` waits in DDP's
buckets meanwhile, ``GradientsAside``), the batch and state transfer (point to point, never
gathered), a per-parameter digest of the local gradients read with one device-to-host copy, a
clone of the state per audited step (at most ``max_state_mb``, 256 MiB; larger tensors are read live and
guarded against in-place change) and one all-gather of six float64 per rank. Other steps pay
nothing. The referee and self re-run rounds run only when a pair disagrees.

Modules: ``replay_state`` (what a step reads besides its batch, the side-effect free re-run),
``replay_compare`` (digests, comparison, calibration), ``replay_exchange`` (what the ranks send,
attribution, verdict texts); this module keeps ``ReplayConfig`` and ``RingReplay`` and re-exports
their public names.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.dist.payload import PayloadError
from sdc_core.dist.payload_checks import check_replay_payload
from sdc_core.dist.topology import (
    TRANSFER_ERROR,
    Topology,
    all_gather_objects,
    all_gather_tensor,
    exchange,
    is_distributed,
    owners_of,
)
from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.replay.attribution import (
    DEFAULT_ADVICE,
    SEVERAL,
    attribute,
    describe,
    every_pair_message,
    evidence,
    explain,
    failed_message,
    for_transfer,
    group_index,
    mismatch_reason,
    pick_referee,
    referee_jobs,
    referee_sends,
    replay_partners,
    ruling_note,
    settle,
    unreproducible_message,
)
from sdc_core.replay.compare import (
    AUTO_MARGIN,
    Digest,
    Row,
    assemble,
    calibrate,
    compare,
    compare_raw,
    digest_row,
    disagree,
    grad_digest,
    lower_median,
)
from sdc_core.replay.state import (
    SEND_BY_DIGEST_BYTES,
    CollectiveInReplay,
    DeterministicWindow,
    GradientsAside,
    MicroBatch,
    StateCapture,
    StepFn,
    StepState,
    TensorRef,
    _all_rng,
    _fresh,
    capture_rng,
    deterministic,
    forbid_collectives,
    is_determinism_error,
    replay_each_gradient,
    replay_gradients,
)
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

__all__ = [
    "AUTO_MARGIN", "CALIBRATION_ROUNDS", "DEFAULT_ADVICE", "EXACT_MODES", "SEND_BY_DIGEST_BYTES",
    "CollectiveInReplay", "DeterministicWindow", "Digest", "MicroBatch", "ReplayConfig", "RingReplay", "Row",
    "StateCapture", "StepFn", "StepState", "TensorRef", "assemble", "calibrate", "capture_rng", "compare",
    "compare_raw", "deterministic", "describe", "digest_row", "disagree", "every_pair_message", "explain",
    "is_determinism_error", "failed_message", "for_transfer", "forbid_collectives", "grad_digest", "group_index",
    "lower_median", "mismatch_reason", "pick_referee", "referee_jobs", "referee_sends", "replay_each_gradient",
    "replay_gradients", "replay_partners", "settle", "unreproducible_message",
]  # fmt: skip

EXACT_MODES = (True, False, "auto")
CALIBRATION_ROUNDS = 3  # exact="auto" without strict determinism: same-device rounds before the tolerance settles


@documented
@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Settings of the ring replay audit (keyword-only, validated on construction)."""

    every_n_steps: int = setting(100, "ring replay audit cadence in optimizer steps", "Steps 0, n, 2n, ... (>= 1).")
    exact: bool | str = setting(
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
    on_failure: str = setting(
        "raise",
        "what a replay mismatch does: raise, or skip_step when the fault proves transient",
        "With ``skip_step``, when the faulty rank is named and its fault proves transient (re-running the disagreeing "
        "computation gives a different result), every rank drops the step instead; a persistent fault still "
        "raises.",
    )
    on_unreplayable: str = setting(
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
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        if not any(self.exact is m or (isinstance(self.exact, str) and self.exact == m) for m in EXACT_MODES):
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
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.allow_pickled_batches is not None and not isinstance(self.allow_pickled_batches, bool):
            raise ValueError(f"allow_pickled_batches must be True, False or None, got {self.allow_pickled_batches!r}")


@dataclass
class RingReplay:
    """Framework-neutral ring replay audit.

    Adapter calls, per optimizer step: ``arm(step)`` (is this step audited?), ``record(...)``
    per micro-batch (``begin()`` where the step itself starts, when later than ``record``) and
    ``record_loss(...)``, then ``audit(...)`` after backward and before the update, on every rank.
    ``capture`` (a ``StateCapture``), ``advice`` (the adapter's hint for unreplayable steps, in
    its users' terms) and ``label`` (the audit's name in failure texts) are set by the adapter.

    Deterministic kernels (``config.deterministic``): ``begin()`` (called by ``record``) switches
    torch to deterministic algorithms for the owner's audited micro-batch, forward and backward,
    until ``audit()`` starts (or ``disarm()``, or ``arm()`` of a step that is not audited), and
    every replay runs in the same mode; the caller's settings are restored after each. Until the
    first audit has shown that the step runs under ``warn_only=False`` (a probe replay, one more
    forward and backward at that audit), the mode is ``warn_only=True`` so that the user's step
    never fails on a kernel without a deterministic implementation; after it, ``warn_only=False``
    (which also makes flash and memory-efficient attention backward deterministic) and the
    calibration starts over in that mode. Without that proof (or with ``deterministic=False``),
    ``exact="auto"`` takes ``CALIBRATION_ROUNDS`` audits of same-device re-runs before its
    tolerance settles. In every mode a disagreeing pair is re-run on both sides before any
    accusation: differences within ``AUTO_MARGIN`` times the noise the pair's own re-runs show
    (at most ``rtol``) are noise, not a fault.
    """

    config: ReplayConfig = field(default_factory=ReplayConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("ring_replay"))
    topology: Topology | None = None
    names: list[str] = field(default_factory=list)
    capture: StateCapture | None = None
    advice: str = DEFAULT_ADVICE
    label: str = "The ring replay audit"  # how failure texts name the audit (adapters: their class name)
    disabled: bool = False
    replaying: bool = False
    lockstep: bool = False  # replays run collectives (sharded models): every rank replays in every round
    groups: list[tuple[int, ...]] | None = None  # ranks computing one batch together (tensor parallel), or None
    _armed_step: int | None = None
    _micro: list[MicroBatch] = field(default_factory=list)
    _loss: torch.Tensor | None = None
    _local: dict[str, Row] = field(default_factory=dict)
    _tap: GradientTap | None = None
    _calibrated: bool = False
    _tolerance: float | None = None
    _rounds: int = 0  # same-device calibration rounds in the current mode
    _agreed: bool = False  # some audit of this process found the replay pairs agreeing
    _exact_audits: int = 0  # audits in the current mode whose every pair agreed bit for bit
    _strict: bool | None = None  # None: not probed yet; True: the step runs under warn_only=False
    _probed: bool | None = None  # the probe's result, applied when its audit ends
    _window: DeterministicWindow = field(default_factory=DeterministicWindow)
    _aside: GradientsAside = field(default_factory=GradientsAside)  # the step's own .grad during its re-runs
    _capture_error: str = ""
    keep_every_step: bool = False  # the screen's escalation: record every step's micro-batches (``kept``)
    _kept_step: int | None = None
    _kept: list[MicroBatch] = field(default_factory=list)
    screen_strikes: dict[int, int] = field(default_factory=dict)  # confirmed screen hits per rank
    last_error: ReplayMismatchError | None = None

    @property
    def active(self) -> bool:
        return is_distributed() and not self.disabled

    def attach(self, tap: GradientTap, names: Sequence[str]) -> None:
        """Digest local gradients from the tap on audited steps; ``names``: trainable params."""
        self._tap = tap
        self.names = list(names)
        tap.consumers.append(self._consume)
        tap.finishers.append(self._end_of_backward)

    def arm(self, step: int) -> bool:
        """Called at each micro-batch start; True when this step's micro-batches are audited."""
        due = self.active and not self.replaying and step % self.config.every_n_steps == 0
        if not due:
            self._armed_step = None
            self._window.exit()
            self._aside.clear()
            if self.keep_every_step and self.active and not self.replaying:  # kept for a possible escalation
                if self._kept_step != step:
                    self._kept_step, self._kept = step, []
                return True
            self._kept_step, self._kept = None, []
            return False
        self._kept_step, self._kept = None, []
        if self._armed_step != step:
            self._armed_step, self._micro, self._loss, self._local = step, [], None, {}
            self._aside.clear()
            self._capture_error = ""
        return True

    def disarm(self) -> None:
        """Drop the micro-batches recorded for the armed step: it is not audited (every rank alike),
        e.g. because another check already dropped that optimizer step."""
        self._armed_step, self._micro, self._loss, self._local = None, [], None, {}
        self._window.exit()
        self._aside.clear()

    @property
    def strict(self) -> bool:
        """True once the step is known to run under ``torch.use_deterministic_algorithms(True)``
        without ``warn_only``: replays are then deterministic and compare bit for bit."""
        return self.config.deterministic and self._strict is True

    @property
    def mode(self) -> str:
        """``"strict"``, ``"warn_only"`` (deterministic kernels where torch has them) or ``"off"``."""
        return "off" if not self.config.deterministic else "strict" if self.strict else "warn_only"

    @property
    def keeping(self) -> bool:
        """True while a step that is not audited is recorded for a possible escalation."""
        return self._armed_step is None and self._kept_step is not None

    def take_kept(self, step: int) -> list[MicroBatch]:
        """The micro-batches kept for ``step`` (its state as captured), then forgotten; empty when
        none were kept for that step."""
        kept, step_kept = self._kept, self._kept_step
        self._kept_step, self._kept = None, []
        return kept if step_kept == step else []

    @property
    def armed(self) -> bool:
        """True between ``arm`` of an audited step and its ``audit``."""
        return self._armed_step is not None

    @property
    def recorded(self) -> int:
        """Micro-batches recorded for the armed (or kept) step so far."""
        return len(self._kept if self.keeping else self._micro)

    @property
    def tolerance(self) -> float:
        """The tolerance comparisons use now (0: bit equality)."""
        if self.config.exact is True:
            return 0.0
        if self.config.exact is False:
            return float(self.config.rtol)
        return self._tolerance if self._tolerance is not None else 0.0

    def record(self, batch: Any, batch_idx: int, device: torch.device | None = None, state: bool = True) -> None:
        """Remember an audited micro-batch, the RNG state and (``state=True``) the module state
        it starts from. Cost: the capture's clones, on audited micro-batches (and, with
        ``keep_every_step``, on every micro-batch: references and the RNG, plus the capture)."""
        (self._kept if self.keeping else self._micro).append(MicroBatch(batch, batch_idx, *_all_rng(device)))
        if state:
            self.begin(device)

    def begin(self, device: torch.device | None = None) -> None:
        """The step of the last recorded micro-batch starts now: (re)capture its RNG and state."""
        kept = self.keeping
        micro = self._kept if kept else self._micro
        if (self._armed_step is None and not kept) or not micro or self.replaying:
            return
        mb = micro[-1]
        mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng = _all_rng(device)
        if self.config.deterministic and not kept:  # the owner's forward and backward: in the replays' mode
            self._window.enter(self.strict)
        if self.capture is not None:  # one budget for all micro-batches of the step (held until the audit)
            used = sum(m.state.nbytes for m in micro[:-1] if m.state is not None)
            try:  # a failure here is reported by the audit, on every rank alike
                mb.state = self.capture.capture(self.capture.max_bytes - used)
            except Exception as err:
                mb.state = None
                self._capture_error = self._capture_error or f"capturing its state: {describe(err)}"

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the owner back-propagates for the current audited micro-batch (no host sync)."""
        if self._armed_step is not None and not self.replaying:
            loss = loss.detach().double()
            self._loss = loss if self._loss is None else self._loss + loss.to(self._loss.device)

    def _end_of_backward(self) -> None:
        """The tap's finisher: at the end of an audited step's synchronised backward, find where DDP
        keeps a copy of the reduced gradients (``GradientsAside``: its buckets, default layout)."""
        if self._armed_step is not None and not self.replaying and self._tap is not None:
            self._aside.watch(self._tap.ddp, self._tap.params)

    def _consume(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        if self._armed_step is None or self._tap is None:
            return
        self._local[self._tap.names.get(id(p), "?")] = digest_row(grad)

    def _own_digest(self) -> Digest:
        return assemble(self.names, self._local, self._loss if self._loss is not None else 0.0)

    def recompute(
        self,
        module: nn.Module,
        batches: list[MicroBatch],
        step_fn: StepFn,
        consume: Callable[[str, torch.Tensor], None],
        to_device: Callable[[Any], Any],
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> torch.Tensor:
        """Recompute ``batches`` on this rank (no collective, no side effect), handing each
        trainable parameter's gradient to ``consume(name, grad)``; returns the summed loss."""
        self.replaying = True
        try:
            return replay_each_gradient(module, self.names, batches, step_fn, consume, to_device, context,
                                        self.capture)  # fmt: skip
        finally:
            self.replaying = False

    def exchange_batches(self, sends: dict[int, list[MicroBatch]], recv_from: list[int]) -> dict[int, Any]:
        """Send micro-batches to partners (every rank alike; ``exchange``): what arrives is checked
        as a replay payload, and resolved into ``MicroBatch`` lists (a received ``TRANSFER_ERROR``
        text, and a state that cannot be resolved, become a text)."""
        empty = assemble(self.names, {}, 0.0)
        received = self._exchange({dst: _payload(micro, empty)[0] for dst, micro in sends.items()}, recv_from)
        own = [mb.state for micro in sends.values() for mb in micro]
        out: dict[int, Any] = {}
        for src, payload in received.items():
            try:  # a text instead of a list: every rank still goes on to the next collective
                out[src] = _micro_batches(payload, own)
            except Exception as err:
                out[src] = describe(err)
        return out

    def _replay_digest(
        self,
        module: nn.Module,
        batches: list[MicroBatch],
        step_fn: StepFn,
        to_device: Callable[[Any], Any],
        context: Callable[[], AbstractContextManager[Any]],
    ) -> Digest:
        """Recompute ``batches`` on this rank (no collective, no side effect) and digest the result."""
        rows: dict[str, Row] = {}

        def digest(name: str, grad: torch.Tensor) -> None:  # each gradient as produced, then freed
            rows[name] = digest_row(grad)

        loss = self.recompute(module, batches, step_fn, digest, to_device, context)
        return assemble(self.names, rows, loss)

    def _exchange(self, sends: dict[int, Any], recv_from: list[int]) -> dict[int, Any]:
        """``exchange`` of replay payloads: pickled batches as configured, every received payload
        checked for the replay's shape (``PayloadError`` on every rank otherwise)."""
        return exchange(sends, recv_from, allow_pickle=self.config.allow_pickled_batches, validate=check_replay_payload)

    def _unreplayable(self, step: int, message: str) -> bool:
        """Every rank alike: raise ``ReplayUnavailableError``, or warn once and turn the audit off."""
        self.stats.bump("unreplayable")
        message = f"{self.label} {message}"
        if self.config.on_unreplayable == "warn":
            self.disabled = True
            warnings.warn(f"{message} The ring replay audit is now off.", UserWarning, stacklevel=4)
            return False
        raise ReplayUnavailableError(message)

    @property
    def _auto(self) -> bool:
        """``exact="auto"``: measured noise is tolerated, up to ``rtol`` (``True == "auto"`` is False)."""
        return self.config.exact == "auto"

    def _calibrate(self, self_diffs: Sequence[float]) -> None:
        """``exact="auto"``: set (or raise, never above ``rtol``) the tolerance from the ranks'
        same-device differences (``calibrate``; 0: bit for bit -> exact comparisons)."""
        if not self._auto:
            return
        self._tolerance = calibrate(self._tolerance, self_diffs, float(self.config.rtol))
        self.stats.extra = {**(self.stats.extra or {}), "tolerance": self._tolerance}

    def _referee_jobs(
        self, disputed: Sequence[tuple[int, int]], mismatching: Sequence[tuple[int, int]], topo: Topology
    ) -> tuple[dict[tuple[int, int], int | None], list[tuple[int, int, int]]]:
        """``referee_jobs`` over this audit's ``groups``."""
        return referee_jobs(disputed, mismatching, topo, self.groups)

    def _failed(self, step: int, failures: Sequence[str], inverse: Sequence[int], t0: float) -> bool:
        self.stats.add_time(time.perf_counter() - t0)
        return self._unreplayable(step, failed_message(step, failures, inverse, self.advice))

    def audit(
        self,
        step: int,
        module: nn.Module,
        step_fn: StepFn,
        to_device: Callable[[Any], Any] | None = None,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Run the audit of ``step`` if it was armed (every rank alike); raise on a verdict.

        ``to_device`` moves a received batch to where the replay runs; default: its tensors to
        the module's device (batches travel between ranks as host bytes). Returns True when the
        optimizer step must be skipped (``on_failure="skip_step"`` and a transient fault). Raises
        ``ReplayMismatchError`` (a fault) or ``ReplayUnavailableError`` (the step cannot be
        replayed faithfully) on every rank."""
        self._window.exit()  # the owner's backward is done: the user's own settings from here on
        if self._armed_step != step:
            return False
        if to_device is None:
            home = next((p.device for p in module.parameters()), None)

            def to_device(batch: Any) -> Any:
                return _fresh(batch, home)

        try:  # the step's own gradients out of the way of the re-runs where DDP keeps a copy
            with self._aside.aside() as aside:
                if aside:
                    self.stats.extra = {**(self.stats.extra or {}), "gradients_set_aside_bytes": float(aside)}
                return self._audit(step, module, step_fn, to_device, context)
        except PayloadError as err:  # raised on every rank together by the exchange: a peer sent what is refused
            return self._unreplayable(step, f"could not exchange its data at step {step}: {err}.")
        finally:
            if self._probed is not None:  # the mode of the next audited step: every rank alike
                self._strict, self._probed = self._probed, None
                if self._strict:  # deterministic attention backward and the like from now on: calibrate anew
                    self._rounds, self._tolerance, self._exact_audits = 0, None, 0
                self.stats.extra = {**(self.stats.extra or {}), "strict_determinism": float(self.strict)}

    def _audit(
        self,
        step: int,
        module: nn.Module,
        step_fn: StepFn,
        to_device: Callable[[Any], Any],
        context: Callable[[], AbstractContextManager[Any]],
    ) -> bool:
        t0 = time.perf_counter()
        topo = self.topology or Topology.gather()
        world, me = topo.world_size, topo.rank
        partners = replay_partners(topo, self.groups)
        inverse = owners_of(partners)
        rings = len(self.groups) if self.groups else world  # the length of each replay cycle
        own = self._own_digest()
        micro, self._micro, self._armed_step = self._micro, [], None
        own_states = [mb.state for mb in micro]
        atol, rtol = float(self.config.atol), float(self.config.rtol)
        # exact="auto" tolerates measured noise up to rtol in every mode: a kernel may be nondeterministic
        # on some calls even under torch's deterministic switch (one exact audit proves nothing)
        lenient = self._auto
        needed = CALIBRATION_ROUNDS if lenient and not self.strict else 1
        first, calibrating = self._rounds == 0, self._rounds < needed
        probe = self.config.deterministic and self._strict is None

        def replay(batches: list[MicroBatch], strict: bool | None = None) -> Digest:
            with deterministic(self.config.deterministic, self.strict if strict is None else strict):
                return self._replay_digest(module, batches, step_fn, to_device, context)

        def prepare(payload: dict[str, Any]) -> list[MicroBatch]:
            return _micro_batches(payload, own_states)

        def replay_payload(payload: dict[str, Any]) -> Digest:
            return replay(prepare(payload))

        def self_round() -> tuple[tuple[bool, float, str], str]:
            again, err = _attempt(lambda: replay(micro))
            return (compare_raw(own, again, self.names, atol) if again is not None else (True, 0.0, "")), err

        failure, self._capture_error = self._capture_error, ""
        payload, why = _payload(micro, own)
        failure = failure or why
        received = self._exchange({partners[me]: payload}, [inverse[me]])[inverse[me]]
        batches: list[MicroBatch] = []
        if self.lockstep:  # replays are collective: every rank must be able to start one, or none does
            try:
                batches, prep_failure = prepare(received), ""
            except Exception as err:
                prep_failure = describe(err)
            failure = failure or prep_failure
            if _any_rank(bool(failure)):
                return self._failed(step, all_gather_objects(failure), inverse, t0)
            mine, replay_failure = _attempt(lambda: replay(batches))
        else:
            mine, replay_failure = _attempt(lambda: replay_payload(received))
        failure = failure or replay_failure
        cross = compare_raw(received["digest"], mine, self.names, atol) if mine is not None else (True, 0.0, "")
        mine_self, self_failure = self_round() if calibrating else ((True, 0.0, ""), "")
        if self_failure and not failure:
            failure = f"re-running its own micro-batches: {self_failure}"
        # the probe: can the step run under warn_only=False (deterministic attention backward too)?
        strict_ok = probe and _attempt(lambda: replay(micro, strict=True))[0] is not None
        row = [float(cross[0]), cross[1], float(bool(failure)), float(calibrating), float(mine_self[0]), mine_self[1],
               float(strict_ok)]  # fmt: skip
        table = all_gather_tensor(torch.tensor(row, dtype=torch.float64)).tolist()
        if probe:
            self._probed = all(r[6] for r in table)
        if any(r[2] for r in table):
            return self._failed(step, all_gather_objects(failure), inverse, t0)
        if calibrating:
            self._calibrated, self._rounds = True, self._rounds + 1
            self._calibrate(_self_diffs(table))
        self.stats.runs += 1
        noise: list[float] | None = None  # per rank: what its own re-runs show (not strict, on a disagreement)
        shaky: list[int] = []  # exact comparisons: ranks of disagreeing pairs that disagree with themselves

        def tol_for(*ranks: int) -> float:
            """The tolerance of a comparison between ``ranks``: in lenient mode, at least the noise
            their own re-runs showed (times ``AUTO_MARGIN``, at most ``rtol``)."""
            tol = self.tolerance
            if not lenient or noise is None:
                return tol
            return max(tol, min(rtol, AUTO_MARGIN * max(noise[r] for r in ranks)))

        def judge() -> tuple[list[tuple[int, int]], list[int]]:
            pairs = [(inverse[q], q) for q, r in enumerate(table) if disagree(bool(r[0]), r[1], tol_for(inverse[q], q))]
            bound = rtol if lenient else self.tolerance  # lenient: noise up to rtol is not a failure
            unrepro = [q for q, r in enumerate(table) if r[3] and disagree(bool(r[4]), r[5], bound)]
            return pairs, unrepro

        mismatching, unreproducible = judge()
        if mismatching:  # confirm before accusing: both sides of every pair re-run what they computed
            self.stats.bump("confirmations")
            if not calibrating:
                mine_self, self_failure = self_round()
            rerun, rerun_failure = (True, 0.0, ""), ""
            # the replayer re-runs its replay: noise on its side shows as a difference with itself
            again, rerun_failure = _attempt(lambda: replay(batches) if self.lockstep else replay_payload(received))
            rerun = compare_raw(mine, again, self.names, atol) if again is not None else rerun
            srow = [float(mine_self[0]), mine_self[1], float(bool(self_failure or rerun_failure)), float(rerun[0]),
                    rerun[1]]  # fmt: skip
            stable = all_gather_tensor(torch.tensor(srow, dtype=torch.float64)).tolist()
            if any(r[2] for r in stable):
                what = f"re-running its own micro-batches: {self_failure}" if self_failure else ""
                what = what or (f"re-running its replay: {rerun_failure}" if rerun_failure else "")
                return self._failed(step, all_gather_objects(what), inverse, t0)
            for q, (s_exact, s_diff, *_rest) in enumerate(stable):
                table[q][3:6] = [1.0, s_exact, s_diff]
            noise = [max(_noise(r[0], r[1]), _noise(r[3], r[4])) for r in stable]
            self.stats.extra = {**(self.stats.extra or {}), "max_noise": max(noise)}
            self._calibrate(noise)
            before = set(mismatching)
            mismatching, unreproducible = judge()
            explained = sorted(before - set(mismatching))
            if explained:  # the pair's own re-runs differ as much: noise, and the tolerance moves to cover it
                self.stats.bump("disagreements_explained_by_noise")
                self._calibrate([max(noise[r] for pair in explained for r in pair)])
            if self.config.exact is True:  # bit equality demanded: a noisy pair is no proof
                shaky = sorted({r for pair in mismatching for r in pair if noise[r] > 0})
        worst = max((r[1] for r in table if not math.isnan(r[1])), default=0.0)
        if math.isfinite(worst):
            self.stats.max_diff = max(self.stats.max_diff, worst)
        if len(unreproducible) >= 2 or shaky:
            refused = sorted(set(unreproducible) | set(shaky))
            wheres = all_gather_objects(mine_self[2])
            self.stats.add_time(time.perf_counter() - t0)
            worst_self = max(max(table[q][5], noise[q] if noise else 0.0) for q in refused)
            return self._unreplayable(step, unreproducible_message(
                step, refused, worst_self, wheres, rtol if lenient else self.tolerance, self.config.exact,
                self.advice))  # fmt: skip
        # every pair disagreeing at the first audit of two replicas means the replay does not compute
        # what the owners did; once pairs have agreed (a strict-mode re-calibration starts its rounds
        # anew), it is a fault. With three or more, referees tell: a step that depends on the rank
        # agrees with no one on any batch, devices that disagree (two faulty ranks in turn) agree with some
        every_pair = bool(mismatching) and len(mismatching) == world
        if every_pair and rings < 3 and first and not self._agreed:
            self.stats.add_time(time.perf_counter() - t0)
            return self._unreplayable(step, every_pair_message(step, topo, first, self.advice))
        if not mismatching:
            self._agreed = True
            if all(r[0] for r in table):  # evidence for bit-reproducibility, never taken as proof
                self._exact_audits += 1
                self.stats.extra = {**(self.stats.extra or {}), "exact_audits": float(self._exact_audits)}
            if unreproducible:  # verified by the partner; the one rank's re-run differed: note it
                self.stats.bump("self_replay_mismatches")
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return False
        return self._attribute(step, topo, partners, inverse, table, mismatching, micro, own, received, mine,
                               replay, prepare, replay_payload, t0, tol_for,
                               every_pair=(first if every_pair and rings >= 3 else None))  # fmt: skip

    def _attribute(self, step, topo, partners, inverse, table, mismatching, micro, own, received, mine,  # type: ignore[no-untyped-def]
                   replay, prepare, replay_payload, t0, tol_for, every_pair=None) -> bool:  # fmt: skip
        """Rare path: a referee round for every disagreeing pair (tensor parallel: for the pairs no
        culprit explains), the attribution, and the named rank's re-run that classifies its fault;
        raises ``ReplayMismatchError``.

        ``every_pair`` (whether this is the first audit; None unless every pair disagrees with
        three or more replicas): every pair gets a referee; when no referee agrees with either
        side of any pair, the step is not replayable (``ReplayUnavailableError``), else the
        ranks' devices disagree."""
        world, me = topo.world_size, topo.rank
        tol, atol = self.tolerance, float(self.config.atol)
        rings = len(self.groups) if self.groups else world
        group_of = group_index(self.groups, world)

        lenient = self._auto

        def differs(a: Digest, b: Digest, *ranks: int, scale: float = 0.0) -> bool:
            """Whether ``a`` and ``b`` disagree; ``scale``: the size of the disagreement being judged,
            a 1/``AUTO_MARGIN`` of which (at most ``rtol``) is noise for ``exact="auto"``, so that a
            referee's noisy replay still sides with the result it is near to."""
            exact, diff, _ = compare_raw(a, b, self.names, atol)
            floor = min(float(self.config.rtol), scale / AUTO_MARGIN) if lenient and math.isfinite(scale) else 0.0
            return disagree(exact, diff, max(tol_for(*ranks), floor))

        where = compare_raw(received["digest"], mine, self.names, atol)[2] if mine is not None else ""
        wheres = all_gather_objects(where)
        if self.groups and every_pair is None:  # tensor parallel: pairs no culprit explains get a referee group
            culprits, disputed = explain(rings, partners, mismatching)
        else:  # every disagreeing pair gets a referee
            culprits, disputed = set(), sorted(mismatching)
        referees, assignments = self._referee_jobs(disputed, mismatching, topo)
        sends, recv_from = referee_sends(assignments, me, micro, own, mine)
        got = self._exchange(sends, recv_from) if referees else {}
        my_rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        my_failure = ""
        jobs = [(o, q) for o, q, t in assignments if t == me]
        rounds = len(jobs)
        if self.lockstep:  # replays are collective: every rank replays in every referee round
            for o, q in jobs:
                try:
                    prepare(got[o])
                except Exception as err:
                    my_failure = my_failure or f"refereeing {o}->{q}: {describe(err)}"
            if _any_rank(bool(my_failure)):
                return self._failed(step, all_gather_objects(my_failure), inverse, t0)
            assigned = [t for _, _, t in assignments]
            rounds = max(assigned.count(r) for r in range(world))
        for i in range(rounds):
            if i >= len(jobs):  # lockstep: no pair for this rank in this round; its replay joins the others'
                _attempt(lambda: replay(micro))
                continue
            o, q = jobs[i]
            ref, err = _attempt(lambda o=o: replay_payload(got[o]))
            if ref is None:
                my_failure = f"refereeing {o}->{q}: {err}"
                continue
            if (o, q) in referees:  # a tensor-parallel peer's job that agreed: its replay served the group
                gap = compare_raw(got[o]["digest"], got[q]["replay"], self.names, atol)[1]
                with_owner = not differs(got[o]["digest"], ref, o, me, scale=gap)
                my_rulings[(o, q)] = (with_owner, not differs(got[q]["replay"], ref, q, me, scale=gap))
        rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        gathered = all_gather_objects((my_rulings, my_failure))
        if any(f for _, f in gathered):
            return self._failed(step, [f for _, f in gathered], inverse, t0)
        for part, _ in gathered:
            rulings.update(part)
        if every_pair is not None and not any(a or b for a, b in rulings.values()):
            self.stats.add_time(time.perf_counter() - t0)
            return self._unreplayable(step, every_pair_message(step, topo, every_pair, self.advice))
        if self.groups:
            rank, suspects, notes = settle(rings, culprits, disputed, rulings)
        else:  # the fewest faulty ranks that explain every comparison (``attribute``)
            rank, suspects, explanations = attribute(world, *evidence(inverse, mismatching, referees, rulings))
            notes = {f"{o}->{q}": ruling_note(rulings.get((o, q))) for o, q in disputed}
            if rank is None and world > 2:
                notes |= {"attribution": SEVERAL, "explanations": explanations}
        classification = None
        if rank is not None:  # the suspect re-runs what disagreed: does it reproduce its result?
            mine_again = None
            as_owner = (rank, partners[rank]) in mismatching
            if me == rank:
                again, err = _attempt(lambda: replay(micro) if as_owner else replay_payload(received))
                before = own if as_owner else mine
                if again is None:
                    mine_again = f"unknown ({err.split(':')[0]})"
                else:
                    gap = max((table[q][1] for q in range(world) if rank in (inverse[q], q)), default=0.0)
                    persistent = before is not None and not differs(before, again, me, scale=gap)
                    mine_again = "persistent" if persistent else "transient"
            elif self.lockstep and group_of[me] == group_of[rank]:  # its tensor-parallel peers re-run the same
                _attempt(lambda: replay(micro) if as_owner else replay_payload(received))
            elif self.lockstep:  # the suspect's re-run is collective: the others replay alongside
                _attempt(lambda: replay(micro))
            classification = all_gather_objects(mine_again)[rank]
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        bad = [q for q in range(world) if disagree(bool(table[q][0]), table[q][1], tol_for(inverse[q], q))]
        worst = max((table[q][1] for q in bad), default=0.0)
        details = {
            "mismatching_pairs": [list(p) for p in mismatching],
            "differences": {inverse[q]: table[q][1] for q in bad},
            "where": {inverse[q]: wheres[q] for q in bad},
            "self_replay": {q: "reproduced" if not disagree(bool(table[q][4]), table[q][5], tol) else "differed"
                            for q in range(world) if table[q][3]},
            "partners": list(partners),
            "referees": {f"{o}->{q}": t for (o, q), t in referees.items()},
            "rulings": notes,
            "exact": self.config.exact,
            "exact_audits": self._exact_audits,
            "tolerance": tol,
            "rtol": self.config.rtol,
            "deterministic": self.mode,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": world,
            "classification": classification,
            **({"several_ranks": True} if "attribution" in notes else {}),
            **({"tensor_parallel_groups": [list(g) for g in self.groups]} if self.groups else {}),
        }  # fmt: skip
        reproduced = all(r[3] and not disagree(bool(r[4]), r[5], tol) for r in table)
        where_worst = (wheres[partners[rank]] or wheres[rank]) if rank is not None else ""
        one_group = bool(self.groups) and len({group_of[r] for r in suspects}) == 1
        reason = mismatch_reason(rank, world, rings, mismatching, suspects, worst, where_worst, classification,
                                 reproduced, one_group)  # fmt: skip
        skip = self.config.on_failure == "skip_step" and classification == "transient"
        if skip:
            details["action"] = "step skipped on every rank"
        self.last_error = ReplayMismatchError(
            step=step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason
        )
        if not skip:
            raise self.last_error
        self.stats.bump("skipped_steps")
        return True


def _attempt(fn: Callable[[], Digest]) -> tuple[Digest | None, str]:
    """``(fn(), "")``, or ``(None, what it raised)``: replay failures are decided together, so no
    rank is ever left in a collective the others do not enter."""
    try:
        return fn(), ""
    except Exception as err:
        return None, describe(err)


def _payload(micro: list[MicroBatch], digest: Digest) -> tuple[dict[str, Any], str]:
    """What an owner sends its replayer, and why it failed to build it ("" when it did not): on a
    failure the partner still gets a message (``TRANSFER_ERROR``), so no rank is left waiting."""
    try:
        return {"micro": for_transfer(micro), "digest": digest}, ""
    except Exception as err:
        why = describe(err)
        sent = {TRANSFER_ERROR: f"the owner could not send its micro-batches: {why}"}
        return sent, f"preparing its micro-batches: {why}"


def _micro_batches(payload: dict[str, Any], own_states: list[Any]) -> list[MicroBatch]:
    """The micro-batches of a received payload, their states resolved (``StateCapture.resolve``
    against this rank's own); raises ``RuntimeError`` with the owner's text when it could not send."""
    if TRANSFER_ERROR in payload:
        raise RuntimeError(payload[TRANSFER_ERROR])
    return [MicroBatch(**{**vars(mb), "state": StateCapture.resolve(mb.state, own_states)}) for mb in payload["micro"]]


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (one all-gather of one float64 per rank)."""
    return any(all_gather_tensor(torch.tensor([float(flag)], dtype=torch.float64)).flatten().tolist())


def _noise(exact: float, diff: float) -> float:
    """A same-device difference as a number: 0 when bit-identical, else at least a tiny positive
    value (a difference the digest's sums cannot see still does not count as exact)."""
    return 0.0 if exact else (diff if diff > 0 else 1e-12)


def _self_diffs(table: Sequence[Sequence[float]]) -> list[float]:
    """Each rank's same-device difference from its audit table row."""
    return [_noise(r[4], r[5]) for r in table]
