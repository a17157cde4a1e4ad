"""Every-step screen: each rank's local-gradient magnitudes compared across the ranks.

Contract: on every step each rank contributes a small vector, the log2 of the largest LOCAL
gradient magnitude in each of ``k`` groups of parameters (``NonFiniteGradient.want_magnitudes``:
read from the peaks the non-finite check reads anyway at the end of backward) and the log2 of
its loss; ``observe`` starts ONE asynchronous ``all_gather`` of those rows, ``suspects`` waits for
it and names the ranks whose values stand out. Every rank computes the verdict from the same
gathered rows and the same history, so every rank returns the same suspects and keeps the same
band: no collective depends on one rank's view.

The comparison, at each step, in log2 units: each value's deviation from the ranks' (lower)
median of that value; a rank's ``level``, the median of its deviations (a batch with harder or
fewer samples makes EVERY gradient of that rank larger: measured up to 2^7 on healthy steps);
each value's deviation less the rank's level (what a faulty multiply-accumulate or a flipped
exponent bit changes: a few values, not all; on healthy steps within 2^3.4 here). A rank is a
suspect when a level-corrected deviation, or its level, exceeds its band. Comparing ranks AT THE
SAME STEP cancels what every rank shares (the phase of training, a learning-rate warm-up, the
scale of the loss). One-sided: only values that GREW are flagged (a flip that makes an element
tiny changes its gradient by at most that element); a genuine spike batch on one rank can be
flagged too (the partner replay clears it).

The band is calibrated from the run itself, per value and for the level: the positive
deviations of the ranks not flagged, over the last ``window`` steps, give ``median + z * 1.4826 *
MAD``, clamped to ``[min_band, max_band]`` and recomputed every ``_REFRESH`` steps while some
value is not calibrated, every ``_REFRESH_CALIBRATED`` steps once all are; until a value has
``calibration_samples`` such deviations its band is ``initial_band``.

Peers are hostile: each row carries its step and width, which must equal the ranks' median
(else the row is ``malformed`` and its rank a suspect); values must be NaN (no opinion), +Inf
(the rank's gradients held NaN/Inf: a suspect, ``nonfinite``) or finite within the float range
of log2 magnitudes. A rank can only accuse itself: the reference is a median, rows of suspects
never enter the history, and the band is capped at ``max_band``.

Cost per step: on the device a handful of tiny kernels (the row), one all_gather of
``world x (k + 3)`` float64 values started right after backward, no host synchronisation in the
step; at ``suspects`` one wait (long finished when read one step later), one ``tolist`` of the
rows and plain-Python arithmetic on them (no torch op per value), and at each recalibration
two torch medians over the history (``window x world x (k + 2)`` values).

To confirm a hit elsewhere (a partner's recomputation of the suspect's step), ``ScreenResult``
carries the step's ``values`` and ``bands``; ``in_band(row, reference(result.values, rank),
result.bands)`` applies the judge's rule to one recomputed row against the other ranks' median.
"""

from __future__ import annotations

import ctypes
import math
import operator
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sdc_core.dist.topology import HostRead, Topology, collective_device, is_distributed
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

if TYPE_CHECKING:
    from sdc_core.checks.gradients import NonFiniteGradient

_HEADER = 2  # step, width
_CARRIED = 3  # int64 values another check may send in a row instead of a collective of its own (``carry``)
_TAIL = 2 * _CARRIED  # each as two exact float64 halves of 32 bits, NaN when none
_NO_TAIL = [math.nan] * _TAIL
_INT64_MAX = (1 << 63) - 1
_LOG2_LIMIT = 1100.0  # |log2| of any finite float64 magnitude is below this
_MAX_PENDING = 2  # observed steps whose verdict may wait (the driver reads one step later at most)
_MAD_TO_SIGMA = 1.4826
_REFRESH = 32  # judged steps between two recalibrations of the band while some value is not calibrated (its two
# medians over the history, and writing the history: a fifth of `judge`'s host cost at 32)
_REFRESH_CALIBRATED = 128  # ... and once all are: the band is a median over `window` steps and moves slowly
_isfinite = math.isfinite
_sub = operator.sub
_CPU = torch.device("cpu")


@documented
@dataclass(frozen=True, kw_only=True)
class ScreenConfig:
    """Settings of the every-step gradient screen (keyword-only, validated on construction)."""

    groups: int = setting(
        16,
        "groups of parameters whose local-gradient magnitudes the screen compares across ranks (>= 1)",
        "The trainable parameters in model order, cut into this many contiguous groups (fewer when the model has "
        "fewer tensors); each rank sends one value per group and its loss each step.",
    )
    min_band: float = setting(
        5.0,
        "smallest band, in log2 units above the ranks' median (5: a value 32x the median)",
        "A value is out of band when it exceeds the median of the ranks by more than the band; the calibrated "
        "band never goes below this.",
    )
    max_band: float = setting(
        12.0, "largest band, in log2 units (12: 4096x the median); a faulty rank cannot widen it further"
    )
    initial_band: float = setting(
        10.0, "band of a value until it is calibrated, in log2 units (between min_band and max_band)"
    )
    z: float = setting(
        10.0,
        "band width in robust standard deviations of the healthy cross-rank spread (> 0)",
        "band = median + z * 1.4826 * MAD of the healthy positive deviations from the ranks' median, per value.",
    )
    window: int = setting(200, "steps of healthy spread the band is calibrated on (>= 1)")
    calibration_samples: int = setting(
        20, "healthy deviations a value needs before its band is calibrated (>= 1; before: initial_band)"
    )

    def __post_init__(self) -> None:
        for name in ("groups", "window", "calibration_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("min_band", "max_band", "initial_band", "z"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not self.min_band <= self.initial_band <= self.max_band:
            raise ValueError(
                f"need min_band <= initial_band <= max_band, got {self.min_band}, {self.initial_band}, {self.max_band}"
            )


@dataclass(frozen=True)
class ScreenResult:
    """The screen's verdict on one step, identical on every rank.

    ``ranks``: the suspects, ascending. ``details[rank]``: ``reason`` (``"band"``: a value above
    its band; ``"nonfinite"``: the rank's gradients held NaN/Inf; ``"malformed"``: its row broke
    the protocol), and for ``"band"`` the ``value`` (group name or ``"loss"``) furthest out, its
    ``excess`` over the rank's level (for ``"level"``: the level itself) and its ``band``, log2 units.

    ``values[rank]``: that rank's gathered row as judged, ``GradientScreen.names`` order without
    ``"level"`` (the groups, then the loss), log2: NaN for no opinion and for every value of a
    malformed row, +Inf where the rank's gradients held NaN/Inf. ``bands``: the band of each value
    and, last, of the level, used for this step. Both are evidence, not verdict: left out of
    ``==`` and ``repr``; compare a recomputed row with ``in_band(row, reference(values, rank), bands)``."""

    step: int
    ranks: tuple[int, ...] = ()
    details: dict[int, dict[str, Any]] = field(default_factory=dict)
    calibrated: bool = False  # every value's band was calibrated (not initial_band)
    margin: float = -math.inf  # the largest (deviation - band) of any rank and value: > 0 when the band flags
    values: tuple[tuple[float, ...], ...] = field(default=(), compare=False, repr=False)
    bands: tuple[float, ...] = field(default=(), compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.ranks)


def _median(values: Sequence[float]) -> float:
    """The lower median of the values that are not NaN (``torch.nanmedian``'s), NaN when none."""
    v = sorted(values) if _isfinite(sum(values)) else sorted(a for a in values if a == a)  # a finite sum: no NaN
    return v[(len(v) - 1) // 2] if v else math.nan


def reference(values: Sequence[Sequence[float]], exclude: int | None = None) -> list[float]:
    """Per value what a rank's row is compared with: the lower median of the ranks' values
    (``ScreenResult.values``; NaN and +Inf are no opinion). Without ``exclude`` (what ``judge``
    uses) all ranks, NaN where fewer than two have a value; with it the ranks other than
    ``exclude``, NaN where none has one."""
    need = 2 if exclude is None else 1
    others = [v for i, v in enumerate(values) if i != exclude]
    if not others:  # nobody to compare with
        return [math.nan] * (len(values[0]) if values else 0)
    if len(others) >= need and all(map(_isfinite, map(sum, others))):  # no NaN nor Inf anywhere
        m = (len(others) - 1) // 2
        return [sorted(col)[m] for col in zip(*others, strict=True)]
    out = []
    for col in zip(*others, strict=True):
        v = sorted(a for a in col if a == a and a != math.inf)
        out.append(v[(len(v) - 1) // 2] if len(v) >= need else math.nan)
    return out


def _read_rows(
    table: list[list[float]], width: int
) -> tuple[list[tuple[float, ...]], list[list[float]], list[bool], list[bool]]:
    """The gathered rows (``step, width, values...`` per rank; peers are hostile) as ``(values,
    judged, malformed, nonfinite)``: per rank its values as reported (all NaN for a malformed row:
    a step or width other than the ranks' median, or a value neither NaN, +Inf nor finite within
    the range of log2 magnitudes; +Inf kept), as compared (+Inf is no opinion too), whether the
    row was malformed and whether it held +Inf (the rank's gradients held NaN/Inf)."""
    nan, inf, limit = math.nan, math.inf, _LOG2_LIMIT
    expect = _median([r[0] for r in table])  # the step most ranks sent
    values: list[tuple[float, ...]] = []
    judged: list[list[float]] = []
    malformed: list[bool] = []
    nonfinite: list[bool] = []
    for r in table:
        v = r[_HEADER:]
        if _isfinite(sum(v)):  # every value finite (a NaN or an Inf makes the sum non-finite)
            legal = -limit <= min(v) and max(v) <= limit
        else:
            legal = all(a != a or a == inf or -limit <= a <= limit for a in v)
        bad = r[0] != expect or r[1] != width or not legal
        malformed.append(bad)
        if bad:
            v = [nan] * width
            nonfinite.append(False)
        elif inf in v:
            nonfinite.append(True)
            values.append(tuple(v))
            judged.append([nan if a == inf else a for a in v])
            continue
        else:
            nonfinite.append(False)
        values.append(tuple(v))
        judged.append(v)
    return values, judged, malformed, nonfinite


def _deviations(row: Sequence[float], ref: Sequence[float]) -> list[float]:
    """``row``'s level-corrected deviations from ``ref``, then its level (log2; NaN: none). The
    level is the median deviation (how much larger this rank's batch made everything); each value
    is corrected by the smaller of the level and the loss's (last) deviation (``torch.fmin``: NaN
    only when both are): a harder batch raises its loss with its gradients, a fault in backward
    raises gradients only."""
    if len(row) != len(ref):
        raise ValueError(f"{len(row)} values, {len(ref)} references")
    raw = list(map(_sub, row, ref))
    level, loss = _median(raw), raw[-1]
    shift = loss if level != level or loss < level else level
    dev = [a - shift for a in raw]
    dev.append(level)
    return dev


def in_band(row: Sequence[float], ref: Sequence[float], bands: Sequence[float]) -> bool:
    """Whether one row of values stays within ``bands`` relative to ``ref``, by the rule ``judge``
    applies to each rank: no level-corrected deviation, nor the level, above its band.

    ``row``: the groups then the loss, log2 (``ScreenResult.values``' layout, e.g. a partner's
    recomputation of a suspect's step; NaN: no opinion, the loss may be NaN). ``ref``: the
    reference of that step, same layout (``reference(result.values, rank)``: the other ranks'
    median). ``bands``: ``ScreenResult.bands`` (one more: the level's, last). A value that is
    neither NaN nor finite within the range of log2 magnitudes (+Inf: non-finite gradients) is out
    of band. Pure host arithmetic. Raises ``ValueError`` when the lengths do not match."""
    if not len(row) == len(ref) == len(bands) - 1:
        raise ValueError(f"in_band: {len(row)} values, {len(ref)} references, {len(bands)} bands")
    if not all(a != a or -_LOG2_LIMIT <= a <= _LOG2_LIMIT for a in row):
        return False
    return not any(d > b for d, b in zip(_deviations(row, ref), bands, strict=True))


def loss_magnitude(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """log2 of |loss| as a 1-element float32 tensor on ``device`` (no host synchronisation): NaN
    for no loss or a zero loss (no opinion), +Inf for a non-finite one."""
    if loss is None:
        return torch.full((1,), float("nan"), device=device)
    v = loss.detach().reshape(-1)[:1].to(device, torch.float32).abs().log2()  # NaN, +Inf, -Inf (zero)
    return torch.nan_to_num(v, nan=math.inf, posinf=math.inf, neginf=math.nan)


def _loss_log2(loss: torch.Tensor | None) -> float:
    """``loss_magnitude``'s value for a loss on the host, as a Python float (no op but the read):
    log2 of |loss| rounded to float32; NaN for no loss or a zero one, +Inf for a non-finite one."""
    if loss is None:
        return math.nan
    if type(loss) is torch.Tensor and loss.dtype is torch.float32 and loss.numel() == 1:  # read in place (item: an op)
        v = abs(ctypes.c_float.from_address(loss.data_ptr()).value)
    else:
        first = loss.item() if loss.numel() == 1 else float(loss.detach().reshape(-1)[0])
        v = abs(ctypes.c_float(first).value)  # float32, as loss_magnitude reads it
    if not v < math.inf:  # NaN or Inf (an overflow to float32 included)
        return math.inf
    return math.log2(v) if v > 0 else math.nan


class _HostSlot:
    """A reused host buffer of the screen's all_gather: this rank's row and the gathered rows,
    filled in place through a ``ctypes`` view of the row's memory (no torch op: on a busy host
    each small op costs tens of microseconds right after backward)."""

    def __init__(self, width: int, world: int) -> None:
        self.row = torch.empty(width, dtype=torch.float64)
        self.out = torch.empty(world, width, dtype=torch.float64)
        self.views = list(self.out.unbind(0))
        self.width, self.world = width, world
        self.work: Any = None  # the all_gather writing into ``out``
        self._raw = (ctypes.c_double * width).from_address(self.row.data_ptr())  # live as long as the tensors
        self._raw_out = (ctypes.c_double * (width * world)).from_address(self.out.data_ptr())

    def fill(self, values: list[float]) -> None:
        """Write ``values`` (exactly the row's width) into the row."""
        self._raw[:] = values

    def read(self) -> list[list[float]]:
        """The gathered rows (call once the all_gather has landed), as ``out.tolist()`` gives them."""
        flat, n = self._raw_out[:], self.width
        return [flat[i * n : (i + 1) * n] for i in range(self.world)]


class Carried:
    """Values another check sends in the screen's rows (``GradientScreen.carry``), read as if
    reduced by ``all_reduce(MAX)``: ``get()`` (computed once; may wait for the carrying step)."""

    def __init__(self, screen: GradientScreen, values: torch.Tensor, absent: tuple[int, ...]) -> None:
        self.screen, self.values, self.absent = screen, values, absent
        self.step: int | None = None  # the observed step whose all_gather carries them
        self._result: list[int] | None = None
        self.halves: list[float] | None = None  # on the host: the row's tail (``_TAIL`` values), made here
        if values.is_cpu:
            self.halves = []
            for v in values.tolist():
                u = v & 0xFFFFFFFFFFFFFFFF
                self.halves += [float(u >> 32), float(u & 0xFFFFFFFF)]
            self.halves += _NO_TAIL[len(self.halves) :]

    def get(self) -> torch.Tensor:
        return torch.tensor(self.tolist(), dtype=torch.int64)

    def tolist(self) -> list[int]:
        """``get()`` as a list of ints (no tensor made)."""
        if self._result is None:
            self._result = self.screen._carried_max(self)
        return self._result

    @property
    def work(self) -> Carried:
        """What ``is_completed`` asks (the ``work`` of a collective, as a ``HostRead`` has it)."""
        return self

    def is_completed(self) -> bool:
        """Whether ``get()`` runs no collective and waits for no peer: the carrying step's all_gather
        has landed (False before any step carried the values: ``get()`` would all_reduce them)."""
        screen, step = self.screen, self.step
        if self._result is not None:
            return True
        if step is None:
            return False
        pending = screen._pending.get(step)
        if pending is None:
            return bool(screen._tails.get(step))
        read, slot = pending
        work = slot.work if slot is not None else read.work if read is not None else None
        return work is None or not hasattr(work, "is_completed") or bool(work.is_completed())


def _carried_value(tail: list[float], i: int, absent: int) -> int:
    """The ``i``-th int64 of one rank's row tail (a pair of 32-bit halves; peers are hostile: a
    pair that is not two whole numbers in [0, 2^32), or a tail too short, gives ``absent``)."""
    pair = tail[2 * i : 2 * i + 2]
    if len(pair) != 2 or not all(_isfinite(h) and h == int(h) and 0 <= h < 2**32 for h in pair):
        return absent
    u = (int(pair[0]) << 32) | int(pair[1])
    return u - (1 << 64) if u > _INT64_MAX else u


def _largest(tails: list[list[float]], absent: Sequence[int]) -> list[int]:
    """Per carried value the largest over the ranks' row tails (``_carried_value``)."""
    return [max((_carried_value(t, i, a) for t in tails), default=a) for i, a in enumerate(absent)]


class GradientScreen:
    """Framework-neutral every-step screen (module docstring). The driver calls, on every rank
    alike: ``attach(nonfinite)`` once (one blocking collective: the ranks agree on the width),
    then per optimizer step ``observe(step, nonfinite.take_magnitudes(), loss)`` right after the
    sync backward (before anything else queues a collective of its own for that step) and
    ``suspects(step)`` before the update when the decision must precede it, else one step later
    (at most ``_MAX_PENDING`` steps may wait; older ones are judged first, in order).
    ``discard()`` forgets pending steps without any collective (training stops on another error).
    """

    def __init__(self, config: ScreenConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or ScreenConfig()
        self.topology = topology
        self.stats = CheckStats("gradient_screen")
        self.width = 0  # values per row: groups + the loss (0 before attach)
        self.names: list[str] = []  # the values' names: a group's first parameter, or "loss"
        self.last_result: ScreenResult | None = None
        self._device: torch.device | None = None
        self._targets: dict[torch.device | None, torch.device] = {}  # ``collective_device`` per source device
        self._pending: OrderedDict[int, tuple[HostRead | None, _HostSlot | None]] = OrderedDict()  # step -> its gather
        self._judged: dict[int, ScreenResult] = {}
        self._history: torch.Tensor | None = None  # (window, world, width) healthy positive deviations, NaN: none
        self._fresh: list[tuple[int, list[list[float]]]] = []  # (slot, deviations of healthy ranks) not in _history
        self._cursor = 0
        self._filled = 0
        self._band: tuple[list[float], bool] | None = None  # ``bands()``, all calibrated; refreshed (_band_due)
        self._band_age = 0  # judged steps since ``_band`` was computed
        self._last_dev: list[list[float]] | None = None
        self._slots: list[_HostSlot] = []  # the host path's reused buffers (``_host_slot``)
        self._carried: Carried | None = None  # values waiting for the next observed step (``carry``)
        self._tails: dict[int, list[list[float]]] = {}  # step -> the ranks' carried halves, once judged
        self._slot_index = 0

    @property
    def world_size(self) -> int:
        return self.topology.world_size if self.topology is not None else 1

    def attach(self, nonfinite: NonFiniteGradient) -> int:
        """Opt ``nonfinite`` in to its magnitude read (``want_magnitudes``) and agree on the row's
        width across the ranks (one blocking all_reduce; raises ``ValueError`` on every rank when
        the ranks' models give different widths). Returns the width."""
        if self.topology is None:
            self.topology = Topology.gather()
        k = nonfinite.want_magnitudes(self.config.groups)
        tap = nonfinite.tap
        params = tap.params if tap is not None else []
        names = [tap.names.get(id(p), "?") if tap is not None else "?" for p in params]
        first = [next(n for i, n in enumerate(names) if i * k // len(params) == j) for j in range(k)]
        self._setup(k, first)
        return self.width

    def _setup(self, groups: int, names: list[str]) -> None:
        """Agree on ``groups`` + 1 values per row (every rank; one blocking all_reduce)."""
        width = groups + 1
        if is_distributed():
            t = torch.tensor([width, -width], dtype=torch.float64, device=collective_device(None))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if int(t[0]) != -int(t[1]):
                raise ValueError(f"the ranks' models give screens of different widths ({-int(t[1])} to {int(t[0])})")
        self.width = width
        self.names = [f"group {j} ({n})" for j, n in enumerate(names)] + ["loss", "level"]
        shape = (self.config.window, self.world_size, width + 1)
        self._history = torch.full(shape, float("nan"), dtype=torch.float64)
        self._fresh = []
        self._targets = {}
        self._slots = []
        self._cursor = self._filled = 0
        self._band = None

    def observe(
        self, step: int, magnitudes: torch.Tensor | list[float] | None, loss: torch.Tensor | None = None
    ) -> None:
        """Start step ``step``'s all_gather of this rank's row (``magnitudes``: the ``k`` values of
        ``take_magnitudes``, a tensor or, read on the host, a list; None for no opinion; ``loss``:
        this rank's loss of the step, or None). No host synchronisation. Every rank, every step, alike."""
        if self.width == 0:
            raise RuntimeError("GradientScreen.observe before attach")
        t0 = time.perf_counter()
        if step in self._pending or step in self._judged:
            raise ValueError(f"step {step} was already observed")
        while len(self._pending) >= _MAX_PENDING:
            self._judge_oldest()
        k = self.width - 1
        carried = self._carried if self._carried is not None and self._carried.step is None else None
        if isinstance(magnitudes, torch.Tensor) and magnitudes.is_cpu:
            magnitudes = magnitudes.tolist()
        if (  # all on the host (CPU gradients: read there already), as the collectives take them: no wait here
            (isinstance(magnitudes, list) or (magnitudes is None and self._device in (None, _CPU)))
            and (loss is None or loss.is_cpu)
            and (carried is None or carried.halves is not None)
            and self._host_target()
        ):
            if self._device is None and magnitudes is not None:
                self._device = _CPU
            slot = self._host_slot()
            mags_host = magnitudes if magnitudes is not None and len(magnitudes) == k else [math.nan] * k
            slot.fill([float(step), float(self.width), *mags_host, _loss_log2(loss), *self._tail(step, None)])
            self._start(step, slot.row, _CPU, slot)
            self.stats.add_time(time.perf_counter() - t0)
            return
        if isinstance(magnitudes, list):  # read on the host already (CPU gradients)
            listed: list[float] | None = magnitudes
            magnitudes = None
            made_on: torch.device | None = _CPU
        else:
            listed, made_on = None, magnitudes.device if magnitudes is not None else None
        if made_on is not None and self._device is None:
            self._device = made_on
        source = made_on if made_on is not None else self._device
        device = self._targets.get(source)
        if device is None:
            device = self._targets[source] = collective_device(source)
        if device.type == "cpu":
            head = torch.tensor([float(step), float(self.width)], dtype=torch.float64)
        else:  # no host-to-device copy (it would wait for the device's queue)
            head = torch.full((_HEADER,), float(self.width), dtype=torch.float64, device=device)
            head[0] = float(step)
        if listed is not None:
            magnitudes = torch.tensor(listed, dtype=torch.float64)
        if magnitudes is None or magnitudes.numel() != k:  # a read this rank could not make: no opinion
            mags = torch.full((k,), float("nan"), dtype=torch.float64, device=device)
        else:
            mags = magnitudes.reshape(-1).to(device)
        tail = self._tail(step, device)
        row = torch.cat([head, mags, loss_magnitude(loss, device), tail]).to(torch.float64)  # float64 by promotion
        self._start(step, row, device)
        self.stats.add_time(time.perf_counter() - t0)

    def _host_target(self) -> bool:
        """Whether host-made values go to the collectives on the host (gloo, or no process group)."""
        target = self._targets.get(None)
        if target is None:
            target = self._targets[None] = collective_device(None)
        return target.type == "cpu"

    def _start(self, step: int, row: torch.Tensor, device: torch.device, slot: _HostSlot | None = None) -> None:
        """Start the all_gather of this rank's ``row`` for ``step`` (every rank alike; async), into
        ``slot``'s buffer where given (the host path), else a new one."""
        group = dist.group.WORLD if self.world_size > 1 else None  # None: no process group (``is_distributed``)
        if group is not None:
            if slot is None:
                out = torch.empty(self.world_size, row.numel(), dtype=torch.float64, device=device)
                views = list(out.unbind(0))
            else:
                out, views = slot.out, slot.views
            if hasattr(group, "allgather"):  # the process group's own call: dist.all_gather's Python checks cost
                work = group.allgather([views], [row])  # as much as the launch; an async work, as async_op=True
            else:  # pragma: no cover - a backend without the method
                work = dist.all_gather(views, row, async_op=True)
            if slot is not None:  # the host path: waited for and read in place (``_judge_oldest``)
                slot.work = work
                self._pending[step] = (None, slot)
            else:
                self._pending[step] = (HostRead(out, work), None)
        else:
            self._pending[step] = (HostRead(row.reshape(1, -1)), None)

    def _host_slot(self) -> _HostSlot:
        """The next of the host path's ``_MAX_PENDING + 1`` reused buffers: a row and its gathered
        rows. Reused only after its step was judged: at most ``_MAX_PENDING`` steps are pending,
        each in another of the last ``_MAX_PENDING`` buffers."""
        if not self._slots:
            self._slots = [_HostSlot(_HEADER + self.width + _TAIL, self.world_size) for _ in range(_MAX_PENDING + 1)]
        self._slot_index = (self._slot_index + 1) % len(self._slots)
        return self._slots[self._slot_index]

    def suspects(self, step: int) -> ScreenResult:
        """The verdict on ``step`` (waits for its all_gather; judges older pending steps first).
        Raises ``LookupError`` for a step never observed or already returned."""
        while step in self._pending and step not in self._judged:
            self._judge_oldest()
        if step not in self._judged:
            raise LookupError(f"step {step} was not observed (or its verdict was already taken)")
        return self._judged.pop(step)

    @property
    def pending_steps(self) -> list[int]:
        """Observed steps whose verdict is not taken yet, oldest first."""
        return sorted(set(self._pending) | set(self._judged))

    def discard(self) -> None:
        """Forget every pending step without waiting for a peer (no collective)."""
        self._pending.clear()
        self._judged.clear()
        self._tails.clear()
        self._carried = None
        self._slots = []  # a forgotten all_gather may still write into its buffer: never reuse one

    def _judge_oldest(self) -> None:
        step, (read, slot) = self._pending.popitem(last=False)
        if slot is not None:
            slot.work.wait()  # the all_gather into the slot's buffer
            table = slot.read()
        else:
            assert read is not None
            table = read.get().tolist()  # waits for the all_gather
        t0 = time.perf_counter()
        n = _HEADER + self.width  # then the tail of carried values
        if step in self._tails:  # a carried value rode this step's rows
            self._tails[step] = [r[n:] for r in table]
        self._judged[step] = self.judge(step, [r[:n] for r in table])
        self.stats.add_time(time.perf_counter() - t0)

    # -- values carried for another check ------------------------------------------------------

    def carry(self, values: torch.Tensor, absent: Sequence[int]) -> Carried:
        """Send ``values`` (at most 3 int64s, e.g. a weight digest) in the next observed step's
        all_gather instead of a collective of their own; the returned reader's ``get()`` is what an
        ``all_reduce(MAX)`` of them over the ranks gives (a CPU int64 tensor, identical on every
        rank), a rank whose values did not arrive counting as ``absent`` (one per value). Read
        before any step carried them (a save, the end of training), they take that all_reduce
        then. Every rank alike; one value set at a time (a newer one replaces one not yet sent)."""
        flat = values.detach().reshape(-1)
        if flat.numel() > _CARRIED or flat.numel() != len(absent) or flat.dtype != torch.int64:
            raise ValueError(f"carry takes up to {_CARRIED} int64 values and their absent values")
        self._carried = Carried(self, flat, tuple(absent))
        return self._carried

    def _tail(self, step: int, device: torch.device | None) -> Any:
        """This step's carried values as exact 32-bit halves (NaN: none), as a list (``device`` None)
        or a float64 tensor on ``device`` (no host read there); the carrier now rides ``step``."""
        carried = self._carried
        if carried is None or carried.step is not None:
            return _NO_TAIL if device is None else torch.full((_TAIL,), math.nan, dtype=torch.float64, device=device)
        carried.step, self._carried = step, None
        self._tails[step] = []
        n = carried.values.numel()
        if device is None:
            assert carried.halves is not None  # ``observe`` takes the host path only then
            return carried.halves
        v = carried.values.to(device)
        halves = torch.stack([(v >> 32) & 0xFFFFFFFF, v & 0xFFFFFFFF], 1).reshape(-1).to(torch.float64)
        return torch.cat([halves, torch.full((_TAIL - 2 * n,), math.nan, dtype=torch.float64, device=device)])

    def _carried_max(self, carried: Carried) -> list[int]:
        """``Carried.get``: the ranks' largest of each value from the rows of the step that carried
        them (waiting for that step's all_gather and judging it: its verdict stays for
        ``suspects``), or from an all_reduce now when no step has carried them yet."""
        if carried.step is None:  # not sent: its own all_reduce, now (every rank alike: none has observed since)
            if self._carried is carried:
                self._carried = None
            t = carried.values.to(collective_device(carried.values.device)).clone()
            if is_distributed():
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()
        step = carried.step
        while step in self._pending:
            self._judge_oldest()
        tails = self._tails.pop(step, None)
        if not tails:
            raise RuntimeError(f"the screen's rows of step {step}, which carried another check's values, are gone")
        return _largest(tails, carried.absent)

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per value its band now (log2 units, float64) and whether it is calibrated."""
        cfg = self.config
        self._flush()
        assert self._history is not None
        h = self._history[: self._filled].reshape(-1, self.width + 1)
        samples = (~torch.isnan(h)).sum(0)
        calibrated = samples >= cfg.calibration_samples
        if not bool(calibrated.any()):
            return torch.full((self.width + 1,), float(cfg.initial_band), dtype=torch.float64), calibrated
        med = torch.nanmedian(h, 0).values
        mad = torch.nanmedian((h - med).abs(), 0).values
        band = (med + cfg.z * _MAD_TO_SIGMA * mad).clamp(cfg.min_band, cfg.max_band)
        return torch.where(calibrated, band, torch.full_like(band, float(cfg.initial_band))), calibrated

    def _band_due(self) -> bool:
        """Whether ``judge`` recalibrates the band now: first, then every ``_REFRESH`` judged steps
        while some value is not calibrated, every ``_REFRESH_CALIBRATED`` once all are."""
        if self._band is None:
            return True
        return self._band_age >= (_REFRESH_CALIBRATED if self._band[1] else _REFRESH)

    @property
    def last_deviations(self) -> torch.Tensor | None:
        """The last judged step's deviations (world x (width + 1), log2; the level last), or None."""
        return None if self._last_dev is None else torch.tensor(self._last_dev, dtype=torch.float64)

    def _flush(self) -> None:
        """Write the healthy deviations judged since the last flush into the history tensor."""
        if not self._fresh:
            return
        assert self._history is not None
        latest = dict(self._fresh)  # the last rows per slot (a window shorter than the flush)
        self._fresh = []
        rows = torch.tensor(list(latest.values()), dtype=torch.float64)
        rows = torch.where(rows > 0, rows.clamp(max=self.config.max_band), math.nan)  # positive ones, capped
        self._history.index_copy_(0, torch.tensor(list(latest)), rows)

    def judge(self, step: int, rows: torch.Tensor | list[list[float]]) -> ScreenResult:
        """The verdict on ``rows`` (``world x (2 + width)`` float64, every rank's row, or those rows
        as lists; identical on every rank), and the history updated with its healthy deviations.
        Pure host arithmetic: one ``tolist`` of a tensor, then plain Python on ``world x (width + 3)``
        numbers."""
        table = rows.to("cpu", torch.float64).tolist() if isinstance(rows, torch.Tensor) else rows
        self.stats.runs += 1
        if len(table) != self.world_size or any(len(r) != _HEADER + self.width for r in table):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else (len(table),)
            raise ValueError(f"screen rows of shape {shape}, expected ({self.world_size}, {_HEADER + self.width})")
        width, inf = self.width, math.inf
        values, judged, malformed, nonfinite = _read_rows(table, width)
        ref = reference(judged)
        if self._band_due():
            band_t, calibrated_t = self.bands()
            self._band, self._band_age = (band_t.tolist(), bool(calibrated_t.all())), 0
        self._band_age += 1
        band, calibrated = self._band  # type: ignore[misc]
        devs = [_deviations(x, ref) for x in judged]
        self._last_dev = devs
        margin, none = -inf, [math.nan] * (width + 1)
        details: dict[int, dict[str, Any]] = {}
        healthy: list[list[float]] = []
        for r, dev in enumerate(devs):
            excess = list(map(_sub, dev, band))  # as long: ``bands`` has the level's too
            if _isfinite(sum(excess)):
                worst = max(excess)
                at = excess.index(worst)  # the first on ties
            else:  # NaN never wins
                worst, at = -inf, -1
                for j, e in enumerate(excess):
                    if e > worst:
                        worst, at = e, j
            margin = max(margin, worst)
            if malformed[r]:
                details[r] = {"reason": "malformed"}
            elif nonfinite[r]:
                details[r] = {"reason": "nonfinite"}
            elif worst > 0:  # d > b exactly when d - b > 0 (finite floats)
                details[r] = {"reason": "band", "value": self.names[at], "excess": dev[at], "band": band[at]}
            healthy.append(none if r in details else dev)  # clamped to (0, max_band] in ``_flush``
        self._fresh.append((self._cursor, healthy))
        self._cursor = (self._cursor + 1) % self.config.window
        self._filled = min(self._filled + 1, self.config.window)
        if len(self._fresh) >= _REFRESH_CALIBRATED:  # else at the next recalibration
            self._flush()
        ranks = tuple(details)
        if ranks:
            self.stats.failures += 1
            self.stats.bump("hits")
            self.stats.bump("suspect_ranks", len(ranks))
            for info in details.values():
                self.stats.bump(f"{info['reason']}_suspects")
        else:
            self.stats.last_verified_step = step
        result = ScreenResult(step=step, ranks=ranks, details=details, calibrated=calibrated, margin=margin,
                              values=tuple(values), bands=tuple(band))  # fmt: skip
        self.last_result = result
        return result

    def state_dict(self) -> dict[str, Any]:
        """Counters and the band's history (identical on every rank: rank 0's restores all)."""
        self._flush()
        history = self._history.clone() if self._history is not None else None
        return {"stats": self.stats.state_dict(), "history": history, "cursor": self._cursor, "filled": self._filled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved; a history of another shape (another world size or
        model) is dropped, the band recalibrates. Raises ``ValueError`` on a malformed state."""
        self.stats.load_state_dict(state["stats"])
        self._flush()
        history = state.get("history")
        if history is None or self._history is None or not isinstance(history, torch.Tensor):
            return
        if history.shape != self._history.shape or history.dtype != torch.float64:
            return
        finite = torch.isnan(history) | (torch.isfinite(history) & (history > 0) & (history <= self.config.max_band))
        cursor, filled = int(state["cursor"]), int(state["filled"])
        if not bool(finite.all()) or not 0 <= cursor < self.config.window or not 0 <= filled <= self.config.window:
            raise ValueError("corrupted SDC 'gradient_screen' checkpoint state: history out of range")
        self._history, self._cursor, self._filled = history.clone(), cursor, filled
        self._band = None
