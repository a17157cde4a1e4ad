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
MAD``, clamped to ``[min_band, max_band]`` and recomputed every ``_REFRESH`` steps; until a value
has ``calibration_samples`` such deviations its band is ``initial_band``.

Peers are hostile: each row carries its step and width, which must equal the ranks' median
(else the row is ``malformed`` and its rank a suspect); values must be NaN (no opinion), +Inf
(the rank's gradients held NaN/Inf: a suspect, ``nonfinite``) or finite within the float range
of log2 magnitudes. A rank can only accuse itself: the reference is a median, rows of suspects
never enter the history, and the band is capped at ``max_band``.

Cost per step: on the device a handful of tiny kernels (the row), one all_gather of
``world x (k + 3)`` float64 values started right after backward, no host synchronisation in the
step; at ``suspects`` one wait (long finished when read one step later), a few small host
reductions over the rows, and every ``_REFRESH`` steps two medians over the history
(``window x world x (k + 2)`` values).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats
from sdc_core.topology import HostRead, Topology, collective_device, is_distributed

if TYPE_CHECKING:
    from sdc_core.gradients import NonFiniteGradient

_HEADER = 2  # step, width
_LOG2_LIMIT = 1100.0  # |log2| of any finite float64 magnitude is below this
_MAX_PENDING = 2  # observed steps whose verdict may wait (the driver reads one step later at most)
_MAD_TO_SIGMA = 1.4826
_REFRESH = 8  # judged steps between two recalibrations of the band (its medians are the host cost)


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
    ``excess`` over the rank's level (for ``"level"``: the level itself) and its ``band``, log2 units."""

    step: int
    ranks: tuple[int, ...] = ()
    details: dict[int, dict[str, Any]] = field(default_factory=dict)
    calibrated: bool = False  # every value's band was calibrated (not initial_band)
    margin: float = -math.inf  # the largest (deviation - band) of any rank and value: > 0 when the band flags

    def __bool__(self) -> bool:
        return bool(self.ranks)


def loss_magnitude(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """log2 of |loss| as a 1-element float32 tensor on ``device`` (no host synchronisation): NaN
    for no loss or a zero loss (no opinion), +Inf for a non-finite one."""
    if loss is None:
        return torch.full((1,), float("nan"), device=device)
    v = loss.detach().reshape(-1)[:1].to(device, torch.float32).abs()
    v = torch.where(torch.isfinite(v), v, torch.full_like(v, float("inf")))
    return torch.where(v > 0, torch.log2(v), torch.full_like(v, float("nan")))


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
        self._pending: OrderedDict[int, HostRead] = OrderedDict()
        self._judged: dict[int, ScreenResult] = {}
        self._history: torch.Tensor | None = None  # (window, world, width) healthy positive deviations, NaN: none
        self._cursor = 0
        self._filled = 0
        self._band: tuple[torch.Tensor, torch.Tensor] | None = None  # ``bands()``, refreshed every _REFRESH steps
        self.last_deviations: torch.Tensor | None = None  # the last judged step's (world x (width + 1)), log2

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
        self._cursor = self._filled = 0
        self._band = None

    def observe(self, step: int, magnitudes: torch.Tensor | None, loss: torch.Tensor | None = None) -> None:
        """Start step ``step``'s all_gather of this rank's row (``magnitudes``: the ``k`` values of
        ``take_magnitudes``, None for no opinion; ``loss``: this rank's loss of the step, or None).
        No host synchronisation. Every rank, every step, alike."""
        if self.width == 0:
            raise RuntimeError("GradientScreen.observe before attach")
        t0 = time.perf_counter()
        if step in self._pending or step in self._judged:
            raise ValueError(f"step {step} was already observed")
        while len(self._pending) >= _MAX_PENDING:
            self._judge_oldest()
        if magnitudes is not None and self._device is None:
            self._device = magnitudes.device
        device = collective_device(magnitudes.device if magnitudes is not None else self._device)
        row = torch.empty(_HEADER + self.width, dtype=torch.float64, device=device)
        row[0].fill_(float(step))
        row[1].fill_(float(self.width))
        k = self.width - 1
        if magnitudes is None or magnitudes.numel() != k:  # a read this rank could not make: no opinion
            row[_HEADER : _HEADER + k].fill_(float("nan"))
        else:
            row[_HEADER : _HEADER + k].copy_(magnitudes.reshape(-1))
        row[-1:].copy_(loss_magnitude(loss, device))
        if is_distributed():
            out = torch.empty(self.world_size, row.numel(), dtype=torch.float64, device=device)
            work = dist.all_gather(list(out.unbind(0)), row, async_op=True)
            self._pending[step] = HostRead(out, work)
        else:
            self._pending[step] = HostRead(row.reshape(1, -1))
        self.stats.add_time(time.perf_counter() - t0)

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

    def _judge_oldest(self) -> None:
        step, read = self._pending.popitem(last=False)
        rows = read.get()
        t0 = time.perf_counter()
        self._judged[step] = self.judge(step, rows.to("cpu", torch.float64))
        self.stats.add_time(time.perf_counter() - t0)

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per value its band now (log2 units, float64) and whether it is calibrated."""
        cfg = self.config
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

    def judge(self, step: int, rows: torch.Tensor) -> ScreenResult:
        """The verdict on ``rows`` (``world x (2 + width)`` float64, every rank's row; identical on
        every rank), and the history updated with its healthy deviations. Pure host arithmetic."""
        world = rows.shape[0]
        self.stats.runs += 1
        if rows.shape != (world, _HEADER + self.width) or world != self.world_size:
            raise ValueError(f"screen rows of shape {tuple(rows.shape)}, expected ({self.world_size}, "
                             f"{_HEADER + self.width})")  # fmt: skip
        head, vals = rows[:, :_HEADER], rows[:, _HEADER:]
        expect = torch.nanmedian(head, 0).values  # the step most ranks sent; the width every rank agreed on
        malformed = ~((head[:, 0] == expect[0]) & (head[:, 1] == self.width))  # rank-independent
        legal = torch.isnan(vals) | (vals == float("inf")) | (torch.isfinite(vals) & (vals.abs() <= _LOG2_LIMIT))
        malformed |= ~legal.all(1)
        nonfinite = (vals == float("inf")).any(1) & ~malformed
        x = vals.clone()
        x[malformed] = float("nan")
        x[x == float("inf")] = float("nan")
        ref = torch.nanmedian(x, 0).values  # the lower median of the ranks with a value, per value
        count = (~torch.isnan(x)).sum(0)
        raw = x - ref
        raw[:, count < 2] = float("nan")  # one rank alone has nobody to be compared with
        level = torch.nanmedian(raw, 1, keepdim=True).values  # how much larger this rank's batch made everything
        # each value against the smaller of that level and the loss's deviation (a harder batch raises its
        # loss with its gradients; a fault in backward raises gradients only); then the level itself
        dev = torch.cat([raw - torch.fmin(level, raw[:, -1:]), level], 1)
        if self._band is None or self.stats.runs % _REFRESH == 1:
            self._band = self.bands()
        band, calibrated = self._band
        self.last_deviations = dev
        over = dev > band  # NaN compares False
        flagged = over.any(1) | nonfinite | malformed
        details: dict[int, dict[str, Any]] = {}
        for r in torch.nonzero(flagged).flatten().tolist():
            if bool(malformed[r]):
                details[r] = {"reason": "malformed"}
            elif bool(nonfinite[r]):
                details[r] = {"reason": "nonfinite"}
            else:
                j = int(torch.argmax(torch.where(over[r], dev[r] - band, torch.full_like(band, -math.inf))))
                details[r] = {"reason": "band", "value": self.names[j], "excess": float(dev[r, j]),
                              "band": float(band[j])}  # fmt: skip
        healthy = dev.clone()
        healthy[flagged] = float("nan")
        healthy[~(healthy > 0)] = float("nan")
        assert self._history is not None
        self._history[self._cursor] = healthy.clamp(max=self.config.max_band)
        self._cursor = (self._cursor + 1) % self.config.window
        self._filled = min(self._filled + 1, self.config.window)
        ranks = tuple(details)
        if ranks:
            self.stats.failures += 1
            self.stats.bump("hits")
            self.stats.bump("suspect_ranks", len(ranks))
            for info in details.values():
                self.stats.bump(f"{info['reason']}_suspects")
        else:
            self.stats.last_verified_step = step
        excess = torch.nan_to_num(dev - band, nan=-math.inf).max()
        result = ScreenResult(step=step, ranks=ranks, details=details, calibrated=bool(calibrated.all()),
                              margin=float(excess))  # fmt: skip
        self.last_result = result
        return result

    def state_dict(self) -> dict[str, Any]:
        """Counters and the band's history (identical on every rank: rank 0's restores all)."""
        history = self._history.clone() if self._history is not None else None
        return {"stats": self.stats.state_dict(), "history": history, "cursor": self._cursor, "filled": self._filled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved; a history of another shape (another world size or
        model) is dropped, the band recalibrates. Raises ``ValueError`` on a malformed state."""
        self.stats.load_state_dict(state["stats"])
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
