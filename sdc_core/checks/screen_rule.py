"""The every-step screen's rule, on the host: its settings, its verdict, the comparison of the ranks' rows and the band
they are compared with (``Band``); ``screen`` gathers the rows.

In log2 units: each value's deviation from the ranks' (lower) median; a rank's ``level``, the median of its deviations
(a harder batch raises EVERY gradient of a rank); each deviation less the level (a faulty multiply-accumulate or
exponent flip changes a few values, not all). A rank is a suspect when a corrected deviation, or its level, exceeds its
band; only values that GREW count.

The band, per value and for the level: ``median + z * 1.4826 * MAD`` of the healthy ranks' positive deviations over the
last ``window`` steps or, when higher, a fitted exponential tail's quantile that keeps the world's hits under one a day
at one step a second, clamped to ``[min_band, max_band]``. Until calibrated (``calibration_samples``) the groups use the
pooled ``early_band`` (``initial_band`` before), the loss and level their own bulk rule plus ``_EARLY_MARGIN``.

Peers are hostile: a row's step and width must equal the ranks' median (else ``malformed``); values must be NaN (no
opinion), +Inf (``nonfinite``) or finite within the range of log2 magnitudes. A rank can only accuse itself: the
reference is a median, suspects' rows never enter the history, the band is capped at ``max_band``."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sdc_core.checks.contract import check_settings
from sdc_core.schema import documented, setting

HEADER = 2  # a row starts with its step and width
LOG2_LIMIT = 1100.0  # |log2| of any finite float64 magnitude is below this
_MAD_TO_SIGMA = 1.4826
_REFRESH = 32  # judged steps between two recalibrations of the band while some value is not calibrated
_REFRESH_CALIBRATED = 128  # ... and once all are: the band is a median over `window` steps and moves slowly
_SAMPLED_RANKS = 16  # ranks whose deviations the history keeps per step (rotating, identically on every rank)
_TAIL_SHARE = 0.1  # the largest tenth of a value's healthy positive deviations gives its tail's slope
_TAIL_MIN = 10  # deviations above that threshold a tail fit needs (fewer: the band is the MAD rule's alone)
_EARLY_MARGIN = 1.0  # log2: the early band's allowance for a group more spread than the groups pooled (2x)
STEPS_PER_DAY = 86_400  # the false-alarm budget's pace: one step a second
_isfinite = math.isfinite
_sub = operator.sub


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
        12.0, "largest band, in log2 units (12: 4096x the median); a faulty rank cannot widen it further")
    initial_band: float = setting(
        10.0, "band of a value until it is calibrated, in log2 units (between min_band and max_band)")
    z: float = setting(
        10.0,
        "band width in robust standard deviations of the healthy cross-rank spread (> 0)",
        "band = median + z * 1.4826 * MAD of the healthy positive deviations from the ranks' median, per value.",
    )
    window: int = setting(200, "steps of healthy spread the band is calibrated on (>= 1)")
    calibration_samples: int = setting(
        20, "healthy deviations a value needs before its band is calibrated (>= 1; before: initial_band)")
    read: str = setting(
        "auto",
        "when a step's verdict is read: before its update (same_step) or the next one's (next_step), or auto",
        "``auto``: ``next_step`` unless a replay's policy is ``skip_step``, then ``same_step`` "
        "(``sdc_core.driver.screen_step``). ``next_step`` keeps the host from waiting in the step; a confirmed "
        "hit then stops the run one step later, its update made.",
    )

    def __post_init__(self) -> None:
        check_settings(self, ints=("groups", "window", "calibration_samples"))
        for name in ("min_band", "max_band", "initial_band", "z"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.read not in ("auto", "same_step", "next_step"):
            raise ValueError(f"read must be 'auto', 'same_step' or 'next_step', got {self.read!r}")
        if not self.min_band <= self.initial_band <= self.max_band:
            raise ValueError(
                f"need min_band <= initial_band <= max_band, got {self.min_band}, {self.initial_band}, {self.max_band}")


@dataclass(frozen=True)
class ScreenResult:
    """The screen's verdict on one step, identical on every rank.

    ``ranks``: the suspects, ascending. ``details[rank]``: ``reason`` (``"band"``, ``"nonfinite"`` or ``"malformed"``)
    and for ``"band"`` the ``value`` furthest out (group name, ``"loss"`` or ``"level"``), its ``excess`` over the
    rank's level and its ``band`` (log2).

    Evidence, left out of ``==`` and ``repr``: ``values[rank]``, the rank's row as judged (the groups, then the loss;
    NaN: no opinion or malformed; +Inf: NaN/Inf gradients), and ``bands``, each value's band then the level's."""

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
    """Per value the lower median of the ranks' values (NaN and +Inf: no opinion): of all ranks,
    NaN where fewer than two have one; with ``exclude``, of the others, NaN where none has one."""
    need = 2 if exclude is None else 1
    others = [v for i, v in enumerate(values) if i != exclude]
    if not others:  # nobody to compare with
        return [math.nan] * (len(values[0]) if values else 0)
    if len(others) >= need and all(map(_isfinite, map(sum, others))):  # no NaN nor Inf anywhere
        m = (len(others) - 1) // 2
        return [sorted(col)[m] for col in zip(*others, strict=True)]
    cols = [sorted(a for a in col if a == a and a != math.inf) for col in zip(*others, strict=True)]
    return [v[(len(v) - 1) // 2] if len(v) >= need else math.nan for v in cols]


def read_rows(
    table: list[list[float]], width: int
) -> tuple[list[tuple[float, ...]], list[list[float]], list[bool], list[bool]]:
    """The gathered rows (``step, width, values...``; hostile) as per-rank lists ``(values, judged,
    malformed, nonfinite)``: the values as reported (all NaN when malformed), as compared (+Inf is
    no opinion too), whether the row was malformed and whether it held +Inf."""
    nan, inf, limit = math.nan, math.inf, LOG2_LIMIT
    expect = _median([r[0] for r in table])  # the step most ranks sent
    values: list[tuple[float, ...]] = []
    judged: list[list[float]] = []
    malformed: list[bool] = []
    nonfinite: list[bool] = []
    for r in table:
        v = r[HEADER:]
        if _isfinite(sum(v)):  # every value finite (a NaN or an Inf makes the sum non-finite)
            legal = -limit <= min(v) and max(v) <= limit
        else:
            legal = all(a != a or a == inf or -limit <= a <= limit for a in v)
        bad = r[0] != expect or r[1] != width or not legal
        if bad:
            v = [nan] * width
        hot = not bad and inf in v
        malformed.append(bad)
        nonfinite.append(hot)
        values.append(tuple(v))
        judged.append([nan if a == inf else a for a in v] if hot else v)
    return values, judged, malformed, nonfinite


def deviations(row: Sequence[float], ref: Sequence[float]) -> list[float]:
    """``row``'s deviations from ``ref`` less the smaller of its level (median deviation) and its
    loss's (last) deviation (NaN only when both are: a harder batch raises its loss with its
    gradients, a fault in backward gradients only), then the level (log2; NaN: none)."""
    if len(row) != len(ref):
        raise ValueError(f"{len(row)} values, {len(ref)} references")
    raw = list(map(_sub, row, ref))
    level, loss = _median(raw), raw[-1]
    shift = loss if level != level or loss < level else level
    return [a - shift for a in raw] + [level]


def in_band(row: Sequence[float], ref: Sequence[float], bands: Sequence[float]) -> bool:
    """Whether one row (e.g. a partner's recomputation) stays within ``ScreenResult.bands`` relative to
    ``reference(result.values, rank)`` by ``judge``'s rule; a value neither NaN nor a finite log2
    magnitude is out. ``ValueError`` when the lengths do not match."""
    if not len(row) == len(ref) == len(bands) - 1:
        raise ValueError(f"in_band: {len(row)} values, {len(ref)} references, {len(bands)} bands")
    legal = all(a != a or -LOG2_LIMIT <= a <= LOG2_LIMIT for a in row)
    return legal and not any(d > b for d, b in zip(deviations(row, ref), bands, strict=True))


def classify(
    devs: list[list[float]], band: Sequence[float], malformed: Sequence[bool], nonfinite: Sequence[bool],
    names: Sequence[str],
) -> tuple[dict[int, dict[str, Any]], list[list[float]], float]:  # fmt: skip
    """The suspects of one step from each rank's ``deviations`` against ``band`` as ``(details,
    healthy, margin)``: ``ScreenResult.details`` (malformed, then non-finite, then the value
    furthest above its band, the first on ties), per rank its deviations for the history (all NaN
    for a suspect) and the largest (deviation - band) (-inf when none has a value)."""
    inf = math.inf
    margin, none = -inf, [math.nan] * len(band)
    details: dict[int, dict[str, Any]] = {}
    healthy: list[list[float]] = []
    for r, dev in enumerate(devs):
        excess = list(map(_sub, dev, band))  # as long: ``band`` has the level's too
        if _isfinite(sum(excess)):
            worst = max(excess)
            at = excess.index(worst)  # the first on ties
        else:  # NaN never wins; the first on ties
            worst, at = max(((e, j) for j, e in enumerate(excess) if e == e), key=lambda p: p[0], default=(-inf, -1))
        margin = max(margin, worst)
        if malformed[r]:
            details[r] = {"reason": "malformed"}
        elif nonfinite[r]:
            details[r] = {"reason": "nonfinite"}
        elif worst > 0:  # d > b exactly when d - b > 0 (finite floats)
            details[r] = {"reason": "band", "value": names[at], "excess": dev[at], "band": band[at]}
        healthy.append(none if r in details else dev)
    return details, healthy, margin


def judge_rows(table: list[list[float]], band: Sequence[float], names: Sequence[str]) -> tuple[
        dict[int, dict[str, Any]], list[list[float]], float, list[tuple[float, ...]], list[list[float]], list[float]]:
    """``classify``'s ``(details, healthy, margin)`` on some ranks' rows, then each rank's values as
    reported (``read_rows``), its deviations, and the ``reference``. ``names``: the values', the level's last."""
    values, judged, malformed, nonfinite = read_rows(table, len(names) - 1)
    ref = reference(judged)
    devs = [deviations(x, ref) for x in judged]
    return (*classify(devs, band, malformed, nonfinite, names), values, devs, ref)


def bulk_bands(history: torch.Tensor, config: ScreenConfig) -> torch.Tensor:
    """Per value (the history's last dimension; NaN: none) ``median + z x 1.4826 x MAD`` of the
    history's deviations, unclamped; NaN where a value has none. Two torch medians."""
    h = history.reshape(-1, history.shape[-1])
    med = torch.nanmedian(h, 0).values
    return med + config.z * _MAD_TO_SIGMA * torch.nanmedian((h - med).abs(), 0).values


def tail_fit(history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per value an exponential tail in log2 units, ``(u, scale, p_u)``: the ``1 - _TAIL_SHARE`` quantile of its
    deviations, the mean excess above it and the share of rank-steps above it, so ``P(deviation > b) = p_u * exp(-(b -
    u) / scale)`` for ``b >= u``; NaN where fewer than ``_TAIL_MIN`` lie above ``u``. One sort per value."""
    flat = history.reshape(-1, history.shape[-1])
    fit = torch.full((3, flat.shape[1]), math.nan, dtype=torch.float64)
    for j in range(flat.shape[1]):
        col = flat[:, j]
        positive = col[~torch.isnan(col)].sort().values
        above = int(len(positive) * _TAIL_SHARE)
        if above >= _TAIL_MIN:
            u = positive[-above - 1]
            fit[:, j] = torch.stack([u, (positive[-above:] - u).mean(), torch.tensor(above / flat.shape[0])])
    return fit[0], fit[1], fit[2]


def tail_bands(history: torch.Tensor, world: int, fit: tuple[torch.Tensor, ...] | None = None,
               values: int | None = None) -> torch.Tensor:  # fmt: skip
    """Per value the deviation that keeps the world's hits under one a day at one step a second
    (``tail_fit``'s tail at ``p = 1 / (STEPS_PER_DAY x world x values)``; ``values`` defaults to
    ``history``'s last dimension); NaN where no tail was fitted."""
    u, scale, p_u = fit if fit is not None else tail_fit(history)
    budget = 1.0 / (STEPS_PER_DAY * max(world, 1) * (values or history.shape[-1]))
    return u + scale * torch.log(p_u / budget)


def early_band(history: torch.Tensor, config: ScreenConfig, world: int) -> float:
    """A group's band before it is calibrated: the bulk or tail band (the higher) of every group's
    deviations pooled (not the loss and level, last in ``history``) plus ``_EARLY_MARGIN``, clamped to
    ``[min_band, initial_band]``; NaN until the pool has a tail fit (5-7 steps with 3 ranks)."""
    pool = history[:, :-2].reshape(-1, 1)
    fit = tail_fit(pool)
    if math.isnan(float(fit[0][0])):
        return math.nan
    groups = history.shape[-1] - 2
    band = max(float(bulk_bands(pool, config)[0]), float(tail_bands(pool, world, fit, values=groups)[0]))
    return min(max(band + _EARLY_MARGIN, config.min_band), config.initial_band)


def predicted_hits_per_day(history: torch.Tensor, band: torch.Tensor, world: int,
                           fit: tuple[torch.Tensor, ...] | None = None) -> float:  # fmt: skip
    """The hits a day ``tail_fit``'s tails predict for ``world`` ranks at one step a second with
    ``band`` (values without a tail count none; NaN when none has)."""
    u, scale, p_u = fit if fit is not None else tail_fit(history)
    rate = p_u * torch.exp(-(torch.fmax(band, u) - u) / scale)
    fitted = ~torch.isnan(rate)
    return float(rate[fitted].sum()) * STEPS_PER_DAY * world if bool(fitted.any()) else math.nan


def history_tensor(state: dict[str, Any]) -> torch.Tensor | None:
    """``Band.state_dict``'s history as a float64 tensor (NaN: no value; a tensor is taken as it
    is), or None when the state holds none of a readable shape."""
    history, shape = state.get("history"), state.get("shape")
    if isinstance(history, torch.Tensor):
        return history
    if not isinstance(history, list) or not isinstance(shape, list) or len(shape) != 3:
        return None
    if not all(isinstance(n, int) and n > 0 for n in shape) or math.prod(shape) != len(history):
        return None
    if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in history):
        raise ValueError("corrupted SDC 'gradient_screen' checkpoint state: its history holds other than numbers")
    return torch.tensor([math.nan if v is None else float(v) for v in history], dtype=torch.float64).reshape(shape)


class Band:
    """Each value's band (the level's last) and its history: ``window`` steps of ``min(world, 16) x (width + 1)``
    healthy deviations (16 ranks a step in rotation), the positive ones capped at ``max_band`` (NaN: none).
    ``current()`` recalibrates at every step of the first ``_REFRESH``, then every ``_REFRESH`` steps
    (``_REFRESH_CALIBRATED`` once all are calibrated). Identical on every rank when fed the same steps."""

    def __init__(self, config: ScreenConfig, world: int, width: int) -> None:
        self.config, self.width, self.world = config, width, world
        self.sampled = min(world, _SAMPLED_RANKS)  # rows of the history per step
        self.history = torch.full((config.window, self.sampled, width + 1), math.nan, dtype=torch.float64)
        self._rotation = 0  # the first rank sampled at the next step (``add``)
        self.cursor = 0  # the history's slot of the next judged step
        self.filled = 0  # slots written at least once
        self._fresh: list[tuple[int, list[list[float]]]] = []  # (slot, deviations of healthy ranks) not yet written
        self._current: tuple[list[float], bool] | None = None  # ``bands()`` as lists, all calibrated
        self._age = 0  # judged steps since ``_current`` was computed
        self.predicted_hits_per_day = math.nan  # at the last recalibration (``predicted_hits_per_day``)

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per value its band now (log2 units, float64) and whether it is calibrated."""
        cfg = self.config
        self.flush()
        h = self.history[: self.filled].reshape(-1, self.width + 1)
        samples = (~torch.isnan(h)).sum(0)
        calibrated = samples >= cfg.calibration_samples
        waiting = torch.full((self.width + 1,), float(cfg.initial_band), dtype=torch.float64)
        bulk = bulk_bands(h, cfg) if bool(samples.any()) else None  # per value, for the early and calibrated bands
        if not bool(calibrated.all()):
            if self.width > 1:  # the groups: their pooled early band
                early = early_band(h, cfg, self.world)
                if not math.isnan(early):
                    waiting[: self.width - 1] = early
            # the loss and the level, nothing to pool with: their own bulk rule from half the samples, plus the margin
            few = samples[-2:] >= max(1, cfg.calibration_samples // 2)
            if bulk is not None and bool(few.any()):
                own = (bulk[-2:] + _EARLY_MARGIN).clamp(cfg.min_band, cfg.initial_band)
                waiting[-2:] = torch.where(few, own, waiting[-2:])
        if not bool(calibrated.any()):
            return waiting, calibrated
        assert bulk is not None  # some value calibrated: it has samples
        fit = tail_fit(h)  # one fit: the band and its prediction
        band = torch.fmax(bulk, tail_bands(h, self.world, fit))  # fmax: NaN loses
        band = band.clamp(cfg.min_band, cfg.max_band)
        judged = torch.where(calibrated, band, waiting)
        self.predicted_hits_per_day = predicted_hits_per_day(h, judged, self.world, fit)
        return judged, calibrated

    def current(self) -> tuple[list[float], bool]:
        """The band to judge the next step with, and whether every value is calibrated."""
        current = self._current
        every = _REFRESH_CALIBRATED if current is not None and current[1] else _REFRESH
        if self.filled < _REFRESH:  # the first steps: each judged with the band of all the steps before it
            every = 1
        if current is None or self._age >= every:
            band, calibrated = self.bands()
            current = self._current = (band.tolist(), bool(calibrated.all()))
            self._age = 0
        self._age += 1
        return current

    def add(self, healthy: list[list[float]]) -> None:
        """Record one judged step's ``healthy`` deviations (``sampled`` ranks, in rotation)."""
        n = len(healthy)
        if n > self.sampled:
            start = self._rotation
            healthy = [healthy[(start + i) % n] for i in range(self.sampled)]
            self._rotation = (start + self.sampled) % n
        self._fresh.append((self.cursor, healthy))
        self.cursor = (self.cursor + 1) % self.config.window
        self.filled = min(self.filled + 1, self.config.window)
        if len(self._fresh) >= _REFRESH_CALIBRATED:  # else at the next recalibration
            self.flush()

    def flush(self) -> None:
        """Write the healthy deviations recorded since the last flush into the history."""
        if not self._fresh:
            return
        latest = dict(self._fresh)  # the last rows per slot (a window shorter than the flush)
        self._fresh = []
        rows = torch.tensor(list(latest.values()), dtype=torch.float64)
        rows = torch.where(rows > 0, rows.clamp(max=self.config.max_band), math.nan)  # positive ones, capped
        self.history.index_copy_(0, torch.tensor(list(latest)), rows)

    def state_dict(self) -> dict[str, Any]:
        """The history as plain JSON values (a flat list, ``None`` for no value, and its shape)."""
        self.flush()
        flat = [None if v != v else v for v in self.history.flatten().tolist()]  # NaN: None
        return {"history": flat, "shape": list(self.history.shape), "cursor": self.cursor, "filled": self.filled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s history (one of another shape is dropped). Raises ``ValueError``
        on values out of range."""
        self.flush()
        history = history_tensor(state)
        if history is None or history.shape != self.history.shape or history.dtype != torch.float64:
            return
        cfg = self.config
        finite = torch.isnan(history) | (torch.isfinite(history) & (history > 0) & (history <= cfg.max_band))
        cursor, filled = int(state["cursor"]), int(state["filled"])
        if not bool(finite.all()) or not 0 <= cursor < cfg.window or not 0 <= filled <= cfg.window:
            raise ValueError("corrupted SDC 'gradient_screen' checkpoint state: history out of range")
        self.history, self.cursor, self.filled = history.clone(), cursor, filled
        self._current = None
