"""The non-finite gradient check: each rank's LOCAL gradients (before the all-reduce) are checked for NaN and Inf on the
step's sync micro-batch; when some rank's were non-finite, every rank names the same ranks and parameters and acts alike
(raise, skip the step, or warn).

DDP: the ``GradientTap`` keeps each local gradient's largest magnitude on the device (``peaks``: exact, a finite value
never flags). Each step every rank starts one asynchronous MAX all-reduce of a one-element flag (this rank's local
gradients held NaN or Inf), so every rank learns whether any rank's did, and only then gathers the local flags to name
ranks and parameters. Cost of a clean step: a constant number of Python calls, one batched read of the local gradients,
a 4-byte all-reduce. ``"raise"`` and ``"warn"`` read step ``s``'s verdict one step later (``resolve()``);
``"skip_step"``, ``"rollback"``, a GradScaler, replay-audited steps and a single process read it before the update (a
host wait for the all-reduce).

Limits: finite faults are invisible here (the replay's job); a NaN or Inf formed inside the reduction from finite local
gradients (summed values overflowing, a fault on the wire) is not seen at its step (the optimizer writes it into every
replica; the next step's local gradients show it on every rank); single process, a clipping before the verdict names
every parameter it contaminated."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from sdc_core.checks.contract import Role, check_settings
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.reductions import any_nonfinite, log2_peaks_by_group, peaks
from sdc_core.dist.topology import HostRead, Topology, all_gather_objects, collective_device, is_distributed
from sdc_core.errors import NonFiniteGradientError
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

_ON_FAILURE = ("raise", "skip_step", "warn", "rollback")
_DEFERRED = ("raise", "warn")  # policies whose verdict may be read one step later

NonFiniteFailurePolicy = Literal["raise", "skip_step", "warn", "rollback"]  # NonFiniteConfig.on_failure


@documented
@dataclass(frozen=True, kw_only=True)
class NonFiniteConfig:
    """Settings of the non-finite gradient check (keyword-only, validated on construction)."""

    on_failure: NonFiniteFailurePolicy = setting(
        "raise",
        "what the gradient check does on a non-finite gradient: raise, skip_step or warn",
        "``skip_step``: every rank drops the optimizer step, the weights stay clean; ``rollback``: the core "
        "raises and the Lightning adapter reloads the newest verified checkpoint. Under DDP, ``raise`` and "
        "``warn`` read the verdict one step later (no host synchronisation in the step); the others read it "
        "before the update.",
    )
    overflow_patience: int = setting(
        3,
        "fp16: consecutive steps a lone rank may overflow before it is flagged (>= 1)",
        "With a GradScaler, overflow is the scaler's business: a rank is flagged only when it is the only rank "
        "with non-finite local gradients on this many consecutive steps.",
    )
    max_names: int = setting(5, "offending parameter names reported per rank (>= 1)")

    def __post_init__(self) -> None:
        if self.on_failure not in _ON_FAILURE:
            raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {self.on_failure!r}")
        check_settings(self, ints=("overflow_patience", "max_names"))


@dataclass
class _StepFlags:
    """One step's flag (some rank's local gradients held NaN or Inf: a MAX all-reduce in flight)
    and this rank's local evidence (for the names)."""

    step: int
    any_rank: HostRead  # 1-element float32, 1.0 when some rank's local gradients were non-finite
    local: list[tuple[torch.Tensor, list[nn.Parameter]]]  # (local peaks, their parameters)
    scaler_active: bool = False

    def nonfinite(self) -> bool:
        """The host read of the flag: waits for its all-reduce (long landed when read one step later)."""
        return bool(self.any_rank.get().item())


@dataclass
class NonFiniteVerdicts:
    """What the DDP and the sharded non-finite checks share: settings, counters, the fp16 overflow
    streak, and every rank's offending names turned into one verdict acted on under ``on_failure``."""

    role: ClassVar[Role] = Role.NONFINITE

    config: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("nonfinite_gradient"))
    topology: Topology | None = None
    last_error: NonFiniteGradientError | None = None
    _sole_rank: int | None = None
    _streak: int = 0
    _pending: Any = None  # the verdict still to be read, with its ``step``
    magnitude_groups: int = 0  # opt-in (``want_magnitudes``): groups of the local magnitudes read
    _group_names: dict[str, int] = field(default_factory=dict)  # name -> group (``magnitude_group``)
    witness: Callable[[int, tuple[int, ...]], tuple[str, tuple[int, ...], str] | None] | None = None  # (step, ranks):
    # what explains their NaN/Inf (pattern, suspects, reason), if anything does

    @property
    def pending_step(self) -> int | None:
        """The step whose verdict is still to be read, if any."""
        return self._pending.step if self._pending is not None else None

    def magnitude_group(self, name: str) -> int | None:
        """The group (``want_magnitudes``) of the parameter named ``name``, or None."""
        return self._group_names.get(name)

    def _clean(self, step: int, t0: float) -> bool:
        self._streak, self._sole_rank = 0, None
        self.stats.last_verified_step = step
        self.stats.add_time(time.perf_counter() - t0)
        return False

    def _failure(self, step: int, per_rank: list[list[str] | None], scaler_active: bool, t0: float,
                 params: list[tuple[str, nn.Parameter]] | None, extra: dict[str, Any] | None = None) -> bool:
        """The verdict from every rank's offending names (``None``: finite), acted on under the policy."""
        offenders = tuple(r for r, names in enumerate(per_rank) if names is not None)
        world = len(per_rank)
        sole = offenders[0] if len(offenders) == 1 and world > 1 else None  # one process: no witness
        witness = self.witness if world > 1 and offenders and not scaler_active else None  # every rank alike
        seen = witness(step, offenders) if witness is not None else None
        if world == 1:
            pattern = "single_process"
        elif not offenders:  # every rank's local gradients were finite: the NaN/Inf formed in the reduction
            pattern = "formed_in_reduction"
        elif seen is not None:
            pattern, sole = seen[0], None  # "bad_inputs", "diverging", "reproduced", "after_screen_hit"
        elif len(offenders) == 1:
            pattern = "one_rank"
        elif len(offenders) == world:
            pattern = "all_ranks"
        else:
            pattern = "some_ranks"
        topo = self.topology or Topology.gather()
        details: dict[str, Any] = {
            "pattern": pattern,
            "parameters": {r: per_rank[r] for r in offenders},
            "world_size": world,
            "node_ranks": topo.node_ranks(offenders),
            **(extra or {}),
        }
        if scaler_active:
            self._streak = 0 if sole is None else self._streak + 1 if sole == self._sole_rank else 1
            self._sole_rank = sole
            self.stats.bump("scaler_overflows")
            if self._streak < self.config.overflow_patience:
                self.stats.add_time(time.perf_counter() - t0)
                return False  # the GradScaler skips this step itself
            details["pattern"] = "one_rank_repeatedly"
            details["consecutive_steps"] = self._streak
        self.stats.failures += 1
        first = per_rank[offenders[0]][:3] if offenders and per_rank[offenders[0]] else []
        reason = {
            "one_rank": "only this rank produced NaN/Inf local gradients (the SDC signature)",
            "one_rank_repeatedly": f"only this rank overflowed on {self._streak} consecutive fp16 steps",
            "all_ranks": "every rank produced NaN/Inf gradients: ordinary divergence (learning rate, data, "
            "numerics) is likelier than a faulty device",
            "some_ranks": "several ranks produced NaN/Inf local gradients",
            "formed_in_reduction": "every rank's local gradients were finite; the NaN/Inf formed inside the "
            "reduction (summed values overflowing, or a fault on the wire)",
            "single_process": "NaN/Inf gradients (single process: no replica to compare with)",
        }[details["pattern"]] if seen is None else seen[2]
        reason += f" in {', '.join(first)}" if first else ""
        suspects = offenders if seen is None else seen[1]
        error = NonFiniteGradientError(
            step=step, rank=sole, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason)
        self.stats.add_time(time.perf_counter() - t0)
        self.last_error = error
        if self.config.on_failure in ("raise", "rollback"):  # rollback: the adapter acts on the error
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)
        if self.config.on_failure == "skip_step":
            self.stats.bump("skipped_steps")
            if not scaler_active and params is not None:  # a GradScaler skips a non-finite step itself
                drop_step(p for _, p in params)
            return True
        return False


@dataclass
class NonFiniteGradient(NonFiniteVerdicts):
    """Framework-neutral non-finite gradient check. On every rank alike: ``attach`` (DDP) once, then
    ``verdict(step, params, ...)`` per step before the update, and ``resolve()`` where a verdict
    read one step later must be known (before the next backward, a checkpoint, the end)."""

    tap: GradientTap | None = None
    _local: list[tuple[torch.Tensor, list[nn.Parameter]]] = field(default_factory=list)
    _pending: _StepFlags | None = None
    _seen: list[tuple[nn.Parameter, torch.Tensor, int]] = field(default_factory=list)
    batched: bool = False  # local gradients read in one multi-tensor pass at the end of backward
    _probes: int = 0  # read backwards checked so far (the mode is chosen after two)
    _intact: bool = True  # the local gradients were intact at the end of every probed backward
    _group_of: dict[int, int] = field(default_factory=dict)  # id(parameter) -> its group
    _group_index: dict[tuple[Any, ...], torch.Tensor | list[int]] = field(default_factory=dict)  # cached indices
    _peaked: list[tuple[torch.Tensor, list[nn.Parameter]]] = field(default_factory=list)  # per-parameter peaks
    _magnitudes: torch.Tensor | None = None  # the last read backward's, until ``take_magnitudes``

    def attach(self, tap: GradientTap) -> None:
        """Read each local gradient in its hook on the first two synchronised backwards, then, where DDP
        left them intact until the end of backward, all at once there (``peaks``). Read-only."""
        self.tap = tap
        tap.consumers.append(self._read)
        tap.wanted_when[self._read] = lambda: not self.batched  # batched: no per-parameter hook needed
        tap.finishers.append(self._end_of_backward)

    def want_magnitudes(self, groups: int) -> int:
        """Opt in (after ``attach``, every rank alike) to ``k = min(groups, trainable parameters)``
        values per read backward (``take_magnitudes``): the log2 of the largest LOCAL gradient
        magnitude in each of ``k`` contiguous groups of the parameters in model order. Returns ``k``."""
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
        if self.tap is None:
            raise RuntimeError("want_magnitudes needs the gradient tap: call attach first")
        params = self.tap.params
        k = min(groups, len(params))
        self.magnitude_groups = k
        self._group_of = {id(p): i * k // len(params) for i, p in enumerate(params)}
        self._group_index = {}
        self._group_names = {self.tap.names.get(pid, "?"): g for pid, g in self._group_of.items()}
        return k

    def take_magnitudes(self) -> torch.Tensor | None:
        """The last read backward's magnitudes, then forgotten: 1-d float32 on the gradients' device, NaN for a group
        with nothing or all zero, +Inf for one holding NaN or Inf; None when nothing was read since the last call."""
        if self._seen and self.magnitude_groups:
            self._end_of_backward()
        out, self._magnitudes = self._magnitudes, None
        return out

    def _read(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        self._seen.append((p, grad, grad._version))
        if not self.batched:
            read = (peaks([grad]), [p])
            self._local.append(read)
            if self.magnitude_groups:
                self._peaked.append(read)

    def _group_magnitudes(self, local: list[tuple[torch.Tensor, list[nn.Parameter]]]) -> torch.Tensor | None:
        """Per group the log2 of the largest of ``local``'s peaks (see ``take_magnitudes``)."""
        pairs = [(v, ps) for v, ps in local if ps]
        if not pairs:
            return None
        home = pairs[0][0].device
        return log2_peaks_by_group([(v, self._index(ps, home)) for v, ps in pairs], self.magnitude_groups)

    def _index(self, params: list[nn.Parameter], home: torch.device) -> torch.Tensor | list[int]:
        """The group of each of ``params``: a list on the CPU, else a tensor on ``home`` (first 64 cached)."""
        key = (home, *map(id, params))
        index = self._group_index.get(key)
        if index is None:
            index = [self._group_of.get(i, 0) for i in key[1:]]
            if home.type != "cpu":
                index = torch.tensor(index, device=home)
            if len(self._group_index) < 64:
                self._group_index[key] = index
        return index

    def _end_of_backward(self) -> None:
        """Take this backward's local evidence (batched mode), after checking that no gradient was
        written since its hook read it (else fall back for good)."""
        seen, self._seen = self._seen, []
        peaked, self._peaked = self._peaked, []
        if not seen:  # batched, the tap's per-parameter hooks off: read what the parameters hold now
            if self.batched and self.tap is not None and not self.tap.reading_each:
                self._read_batched(self.tap.present())
            return
        intact = [g._version for _, g, _ in seen] == [v for _, _, v in seen]  # lists: no call per gradient
        if not self.batched:
            if self.magnitude_groups:
                self._magnitudes = self._group_magnitudes(peaked)
            # decide once, from the first two read backwards (DDP's first iteration differs from
            # the steady state: static graphs delay its reduction to the end of backward)
            self._probes += 1
            self._intact = self._intact and intact
            if self._probes == 2:
                self.batched = self._intact and not getattr(self.tap.ddp, "gradient_as_bucket_view", True)
            return
        if not intact:  # the local values are gone: flag this rank, read per parameter from now on
            self.batched = False
            self._local.append((torch.full((1,), float("nan")), []))
            return
        self._read_batched([(p, g) for p, g, _ in seen])

    def _read_batched(self, present: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """The local evidence of ``present`` in one ``peaks`` pass per dtype and device."""
        if not present:
            return
        groups: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], list[nn.Parameter]]] = {}
        for p, g in present:
            grads, params = groups.setdefault((g.dtype, g.device), ([], []))
            grads.append(g)
            params.append(p)
        read = [(peaks(grads), params) for grads, params in groups.values()]
        self._local += read
        if self.magnitude_groups:
            self._magnitudes = self._group_magnitudes(read)

    def verdict(self, step: int, params: Iterable[tuple[str, nn.Parameter]], scaler_active: bool = False,
                now: bool = False) -> bool:
        """Take step ``step``'s evidence (after resolving the previous step's); under DDP with ``"raise"``
        or ``"warn"``, no GradScaler and not ``now`` the decision waits for ``resolve()``. True: skip
        the optimizer step; raises ``NonFiniteGradientError`` under ``"raise"`` and ``"rollback"``."""
        self.resolve()
        t0 = time.perf_counter()
        if self._seen and self.batched:  # a backward whose end the tap did not see
            self._end_of_backward()
        self._seen, self._peaked = [], []
        local, self._local = self._local, []
        if self.tap is None or not (local or is_distributed()):  # no DDP backward (one process): .grad
            return self._single_process(step, list(params), scaler_active, t0)
        flags = _StepFlags(step, self._any_rank(local), local, scaler_active)
        if self.config.on_failure in _DEFERRED and not scaler_active and not now:
            self._pending = flags
            self.stats.add_time(time.perf_counter() - t0)
            return False
        return self._decide(flags, t0, list(params))

    def _any_rank(self, local: list[tuple[torch.Tensor, list[nn.Parameter]]]) -> HostRead:
        """Start the MAX all-reduce of this rank's flag (1.0: some local value non-finite or unreadable);
        every rank alike, asynchronous, 4 bytes."""
        device = collective_device(local[0][0].device if local else None)
        values = torch.cat([v.reshape(-1).to(device) for v, _ in local]) if local else torch.zeros(0, device=device)
        flag = (~torch.isfinite(values)).any().to(torch.float32).reshape(1)
        return HostRead(flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True) if is_distributed() else None)

    def resolve(self) -> None:
        """Read the pending verdict, if any (every rank, same place); raise or warn naming its step."""
        flags, self._pending = self._pending, None
        if flags is not None:
            self._decide(flags, time.perf_counter())

    def discard(self, timeout_s: float = 30.0) -> int | None:
        """Drop the pending verdict without reading it: its all-reduce is finished (at most ``timeout_s``,
        never raises: no collective left in flight on a path out); warns when this rank's local
        gradients of that step were non-finite. Returns that step, or None."""
        flags, self._pending = self._pending, None
        self._local, self._seen, self._peaked, self._magnitudes = [], [], [], None
        if flags is not None:
            flags.any_rank.finish(timeout_s)
        if flags is None or all(bool(torch.isfinite(values).all()) for values, _ in flags.local):  # this rank's own
            return None
        warnings.warn(
            f"SDC check 'nonfinite_gradient': this rank's local gradients of step {flags.step} were non-finite; "
            "the ranks were not named because training stopped on another error first",
            RuntimeWarning,
            stacklevel=2,
        )
        return flags.step

    def _decide(self, flags: _StepFlags, t0: float, params: list[tuple[str, nn.Parameter]] | None = None) -> bool:
        """The verdict of ``flags.step`` from the all-reduced flag (identical on every rank)."""
        self.stats.runs += 1
        if not flags.nonfinite():  # the host read
            return self._clean(flags.step, t0)
        # Rare path, entered by every rank together: gather the local flags to name ranks and parameters.
        per_rank = all_gather_objects(self._local_names(flags.local))
        if all(names is None for names in per_rank):  # no rank names what its flag said: nothing to judge
            return self._clean(flags.step, t0)
        return self._failure(flags.step, per_rank, flags.scaler_active, t0, params)

    def _single_process(
        self, step: int, params: list[tuple[str, nn.Parameter]], scaler_active: bool, t0: float
    ) -> bool:
        """Without DDP: check ``.grad`` now (one host read) and name from it."""
        self.stats.runs += 1
        grads = [p.grad for _, p in params if p.grad is not None]
        if not grads or not bool(any_nonfinite(grads)):
            return self._clean(step, t0)
        bad = [n for (n, p) in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        return self._failure(step, [bad[: self.config.max_names]], scaler_active, t0, params=params)

    def _local_names(self, local: list[tuple[torch.Tensor, list[nn.Parameter]]]) -> list[str] | None:
        """This rank's parameters whose LOCAL gradient was non-finite (rare path: host reads), or None.
        Unreadable local values count as non-finite, named ``"?"``."""
        if not local:
            return None
        lookup = self.tap.names if self.tap is not None else {}
        names: list[str] = []
        for values, params in local:
            finite = torch.isfinite(values).cpu().tolist()
            if not params:  # unreadable local values
                names += [] if all(finite) else ["?"]
                continue
            names += [lookup.get(id(p), "?") for p, ok in zip(params, finite, strict=True) if not ok]
        names = list(dict.fromkeys(names))
        return names[: self.config.max_names] if names else None


def drop_step(params: Iterable[torch.Tensor], scaler_active: bool = False) -> None:
    """Make the coming optimizer step a no-op (every rank alike): gradients set to None, or, with a
    GradScaler, one element set to Inf so the scaler skips it."""
    params = [p for p in params if p.grad is not None]
    if scaler_active and params:
        params[0].grad.view(-1)[0] = float("inf")
        return
    for p in params:
        p.grad = None
