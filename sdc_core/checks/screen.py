"""Every-step screen: each rank's local-gradient magnitudes compared across the ranks.

Each step each rank sends a row: the log2 of the largest LOCAL gradient magnitude in each of ``k`` groups of parameters
and of its loss. ``observe`` starts the exchange, ``suspects`` names the ranks that stand out (the rule:
``screen_rule``); every rank judges the same rows with the same history, so every rank returns the same suspects. Up to
``ALL_ROWS_UP_TO`` (16) ranks: one asynchronous ``all_gather`` of every row. Larger worlds: each rank sends its row to
the ``NEIGHBOURS`` (8) ranks after it on the replay's ring and judges the 9-row window it receives; one all_reduce (SUM)
carries how many windows stood out and a rotating sample of 16 rows (the band's calibration); only then are all rows
gathered and judged, so the verdict is identical on every rank.

Cost per step: a handful of tiny kernels, no host synchronisation until ``suspects``; Python on ``world x (k + 3)``
numbers, or in larger worlds 8 sends, 8 receives and one all_reduce of ``1 + 16 x (k + 3)`` values, whatever the
world."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from sdc_core.checks.contract import Role
from sdc_core.checks.screen_rule import HEADER, Band, ScreenConfig, ScreenResult, in_band, judge_rows, reference
from sdc_core.dist.topology import HostRead, Topology, collective_device, is_distributed, owners_of
from sdc_core.stats import CheckStats

if TYPE_CHECKING:
    from sdc_core.checks.gradients import NonFiniteGradient

_MAX_PENDING = 2  # observed steps whose verdict may wait (the driver reads one step later at most)
ALL_ROWS_UP_TO = 16  # worlds up to this size gather every row every step; larger ones compare neighbourhoods
NEIGHBOURS = 8  # in a larger world, the ranks before this one on the ring whose rows it judges with its own
DIVERGING, DIVERGING_STEPS = 16.0, 8  # log2: a median loss this far above its lowest of the last 8 steps, this high
__all__ = ["GradientScreen", "ScreenConfig", "ScreenResult", "in_band", "loss_magnitude", "reference"]


@dataclass
class _AllOf:
    """Several asynchronous works waited for as one."""

    works: list[Any]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@dataclass
class _Neighbourhood:
    """A larger world's step in flight: this rank's row and its window (neighbours' rows, then its own)."""

    row: torch.Tensor
    window: HostRead


def ring_neighbours(topology: Topology | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """In a world above ``ALL_ROWS_UP_TO``: the ``NEIGHBOURS`` ranks after this one on the replay's
    ring (they receive its row) and those before it (it receives theirs); else none."""
    if topology is None or topology.world_size <= ALL_ROWS_UP_TO:
        return (), ()
    after = topology.partners()
    before = owners_of(after)
    sends, receives, up, down = [], [], topology.rank, topology.rank
    for _ in range(min(NEIGHBOURS, topology.world_size - 1)):
        up, down = after[up], before[down]
        sends.append(up)
        receives.append(down)
    return tuple(sends), tuple(receives)


def loss_magnitude(loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """log2 of |loss|, 1-element float32 on ``device``, no host synchronisation: NaN for no loss or a
    zero loss, +Inf for a non-finite one."""
    if loss is None:
        return torch.full((1,), float("nan"), device=device)
    v = loss.detach().reshape(-1)[:1].to(device, torch.float32).abs().log2()  # NaN, +Inf, -Inf (zero)
    return torch.nan_to_num(v, nan=math.inf, posinf=math.inf, neginf=math.nan)


class GradientScreen:
    """Framework-neutral every-step screen. On every rank alike: ``attach(nonfinite)`` once (one
    blocking collective), then per step ``observe(step, nonfinite.take_magnitudes(), loss)`` right
    after the sync backward and ``suspects(step)`` before the update or one step later (at most
    ``_MAX_PENDING`` steps wait; older ones are judged first). ``discard()``: no collective."""

    role: ClassVar[Role] = Role.SCREEN

    def __init__(self, config: ScreenConfig | None = None, topology: Topology | None = None) -> None:
        self.config = config or ScreenConfig()
        self.topology = topology
        self.stats = CheckStats("gradient_screen")
        self.width = 0  # values per row: groups + the loss (0 before attach)
        self.names: list[str] = []  # the values' names: a group's first parameter, or "loss"
        self._device: torch.device | None = None
        self._targets: dict[torch.device | None, torch.device] = {}  # ``collective_device`` per source device
        self._pending: OrderedDict[int, HostRead | _Neighbourhood] = OrderedDict()  # step -> its rows in flight
        self._sends_to: tuple[int, ...] = ()  # a larger world: the ranks this one sends its row to (after it)
        self._receives_from: tuple[int, ...] = ()  # ... and those whose rows it judges with its own (before it)
        self._judged: dict[int, ScreenResult] = {}
        self.band: Band | None = None  # the bands and their history (made by ``attach``)
        self._restored: dict[str, Any] | None = None  # a band's state loaded before ``attach`` (a resume)
        self._losses: deque[tuple[int, float]] = deque(maxlen=DIVERGING_STEPS)  # (step, the ranks' median log2 loss)

    @property
    def world_size(self) -> int:
        return self.topology.world_size if self.topology is not None else 1

    def attach(self, nonfinite: NonFiniteGradient) -> int:
        """Opt ``nonfinite`` in to its magnitudes and agree on the row's width (one blocking
        all_reduce; ``ValueError`` on every rank when the widths differ). Returns the width."""
        self.topology = self.topology or Topology.gather()
        k = nonfinite.want_magnitudes(self.config.groups)
        tap = nonfinite.tap
        names = [tap.names.get(id(p), "?") for p in tap.params] if tap is not None else []
        first = [next(n for i, n in enumerate(names) if i * k // len(names) == j) for j in range(k)]
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
        self.band = Band(self.config, self.world_size, width)
        self._sends_to, self._receives_from = ring_neighbours(self.topology)
        if self._restored is not None:  # loaded from a checkpoint before the screen was attached
            restored, self._restored = self._restored, None
            self.band.load_state_dict(restored)
        self._targets = {}

    def observe(self, step: int, magnitudes: torch.Tensor | None, loss: torch.Tensor | None = None) -> None:
        """Start step ``step``'s exchange of this rank's row (``magnitudes``: ``take_magnitudes``'
        values, None for no opinion). No host synchronisation. Every rank, every step, alike."""
        if self.width == 0:
            raise RuntimeError("GradientScreen.observe before attach")
        t0 = time.perf_counter()
        if step in self._pending or step in self._judged:
            raise ValueError(f"step {step} was already observed")
        while len(self._pending) >= _MAX_PENDING:
            self._judge_oldest()
        k = self.width - 1
        if magnitudes is not None and self._device is None:
            self._device = magnitudes.device
        device = self._target(magnitudes.device if magnitudes is not None else self._device)
        if device.type == "cpu":
            head = torch.tensor([float(step), float(self.width)], dtype=torch.float64)
        else:  # no host-to-device copy (it would wait for the device's queue)
            head = torch.full((HEADER,), float(self.width), dtype=torch.float64, device=device)
            head[0] = float(step)
        if magnitudes is None or magnitudes.numel() != k:  # a read this rank could not make: no opinion
            mags = torch.full((k,), float("nan"), dtype=torch.float64, device=device)
        else:
            mags = magnitudes.reshape(-1).to(device)
        row = torch.cat([head, mags, loss_magnitude(loss, device)]).to(torch.float64)  # float64 by promotion
        self._start(step, row, device)
        self.stats.add_time(time.perf_counter() - t0)

    def _target(self, source: torch.device | None) -> torch.device:
        """``collective_device(source)``, cached per source device (None: values made on the host)."""
        target = self._targets.get(source)
        if target is None:
            target = self._targets[source] = collective_device(source)
        return target

    def _start(self, step: int, row: torch.Tensor, device: torch.device) -> None:
        """Start the exchange of this rank's ``row`` for ``step`` (every rank alike; async)."""
        if self.world_size == 1:
            self._pending[step] = HostRead(row.reshape(1, -1))
        elif not self._receives_from:
            self._pending[step] = self._gather(row, device)
        else:
            window = torch.empty(len(self._receives_from) + 1, row.numel(), dtype=torch.float64, device=device)
            window[-1].copy_(row)
            ops = [dist.P2POp(dist.isend, row, peer) for peer in self._sends_to]
            ops += [dist.P2POp(dist.irecv, window[i], peer) for i, peer in enumerate(self._receives_from)]
            self._pending[step] = _Neighbourhood(row, HostRead(window, _AllOf(dist.batch_isend_irecv(ops))))

    def _gather(self, row: torch.Tensor, device: torch.device) -> HostRead:
        out = torch.empty(self.world_size, row.numel(), dtype=torch.float64, device=device)
        work = dist.all_gather(list(out.unbind(0)), row, async_op=True)
        return HostRead(out, work)

    def suspects(self, step: int) -> ScreenResult:
        """The verdict on ``step`` (judges older pending steps first). ``LookupError`` for a step
        never observed or already returned."""
        while step in self._pending and step not in self._judged:
            self._judge_oldest()
        if step not in self._judged:
            raise LookupError(f"step {step} was not observed (or its verdict was already taken)")
        return self._judged.pop(step)

    def discard(self) -> None:
        """Forget every pending step without waiting for a peer (no collective)."""
        self._pending.clear()
        self._judged.clear()

    def _judge_oldest(self) -> None:
        step, read = self._pending.popitem(last=False)
        if isinstance(read, _Neighbourhood):
            self._judged[step] = self._judge_neighbourhood(step, read)
            return
        table = read.get().tolist()  # waits for the all_gather
        t0 = time.perf_counter()
        self._judged[step] = self.judge(step, table)
        self.stats.add_time(time.perf_counter() - t0)

    def _judge_neighbourhood(self, step: int, read: _Neighbourhood) -> ScreenResult:
        """A larger world's verdict on ``step`` (module docstring). Identical on every rank."""
        window = read.window.tolist()  # waits for the neighbours' rows
        t0 = time.perf_counter()
        band, calibrated = self._next_band()
        flagged = bool(judge_rows(window, band, self.names)[0])
        n, sampled = HEADER + self.width, self.band.sampled
        summed = torch.zeros(1 + sampled * n, dtype=torch.float64, device=read.row.device)
        slot = (self.topology.rank - step * sampled) % self.world_size if self.topology is not None else 0
        if slot < sampled:  # this rank's row is in this step's sample
            summed[1 + slot * n : 1 + (slot + 1) * n] = read.row
        if flagged:
            summed[0] = 1.0
        self.stats.add_time(time.perf_counter() - t0)
        dist.all_reduce(summed)  # SUM: only the sampled ranks write their slots
        totals = HostRead(summed).tolist()
        t0 = time.perf_counter()
        sample = [totals[1 + j * n : 1 + (j + 1) * n] for j in range(sampled)]
        _, healthy, _, _, _, ref = judge_rows(sample, band, self.names)  # the band's calibration, the median loss
        if not totals[0] <= 0:  # some window stood out (NaN from a hostile peer too): judge every row
            self.stats.bump("neighbourhood_flags")
            self.stats.add_time(time.perf_counter() - t0)
            table = self._gather(read.row, read.row.device).tolist()
            t0 = time.perf_counter()
            result = self._verdict(step, table, band, calibrated)
        else:
            self.stats.last_verified_step = step
            result = ScreenResult(step=step, calibrated=calibrated, bands=tuple(band))
            self._losses.append((step, ref[-1]))  # as ``_verdict`` does, from the sample
        self.band.add(healthy)
        self.stats.add_time(time.perf_counter() - t0)
        return result

    def diverging(self, step: int) -> tuple[float, float] | None:
        """``(low, high)`` log2 of the ranks' median loss when, in the last ``DIVERGING_STEPS`` steps judged before
        ``step``, it rose from ``low`` to ``high`` >= 2^DIVERGING, ``DIVERGING`` or more (the highest such): every
        rank's loss growing toward overflow (a diverging run, even one whose loss fell again), which no healthy run
        does. Waits for the rows of the steps before ``step`` still in flight (every rank alike; a verdict's path)."""
        while self._pending and next(iter(self._pending)) < step:  # every rank alike: the rows before ``step``
            self._judge_oldest()
        seen = [v for s, v in self._losses if s < step and v == v]  # NaN: fewer than two ranks' loss finite
        rises = [(min(seen[: i + 1]), v) for i, v in enumerate(seen) if v >= DIVERGING]  # a value, the lowest before it
        return max((r for r in rises if r[1] - r[0] >= DIVERGING), key=lambda r: r[1], default=None)

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per value its band now (log2 units, float64) and whether it is calibrated."""
        assert self.band is not None, "GradientScreen.bands before attach"
        return self.band.bands()

    def judge(self, step: int, rows: torch.Tensor | list[list[float]]) -> ScreenResult:
        """The verdict on every rank's rows (``world x (2 + width)``, a tensor or lists), the history
        updated with its healthy deviations. Pure host arithmetic."""
        table = rows.to("cpu", torch.float64).tolist() if isinstance(rows, torch.Tensor) else rows
        if len(table) != self.world_size or any(len(r) != HEADER + self.width for r in table):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else (len(table),)
            raise ValueError(f"screen rows of shape {shape}, expected ({self.world_size}, {HEADER + self.width})")
        band, calibrated = self._next_band()
        return self._verdict(step, table, band, calibrated, learn=True)

    def _next_band(self) -> tuple[list[float], bool]:
        """``Band.current``, one run counted and the band's predicted hits a day recorded."""
        assert self.band is not None
        self.stats.runs += 1
        band, calibrated = self.band.current()
        predicted = self.band.predicted_hits_per_day
        if predicted == predicted:  # not NaN
            self.stats.extra = {**(self.stats.extra or {}), "predicted_hits_per_day": predicted}
        return band, calibrated

    def _verdict(self, step: int, table: list[list[float]], band: list[float], calibrated: bool,
                 learn: bool = False) -> ScreenResult:  # fmt: skip
        """Every rank's rows judged against ``band`` (``learn``: into the history); counters updated."""
        details, healthy, margin, values, _, ref = judge_rows(table, band, self.names)
        self._losses.append((step, ref[-1]))  # the ranks' median loss (``diverging``), as the judge computed it
        if learn:
            assert self.band is not None
            self.band.add(healthy)
        ranks = tuple(details)
        if ranks:  # a hit is no verdict (a partner confirms it or not): counted apart from failures
            self.stats.bump("hits")
            self.stats.bump("suspect_ranks", len(ranks))
            for info in details.values():
                self.stats.bump(f"{info['reason']}_suspects")
        else:
            self.stats.last_verified_step = step
        return ScreenResult(step=step, ranks=ranks, details=details, calibrated=calibrated, margin=margin,
                            values=tuple(values), bands=tuple(band))  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Counters and the band's history (identical on every rank: rank 0's restores all)."""
        # before attach: what a checkpoint restored, if anything, is kept as it came
        kept = self._restored or {"history": None, "shape": None, "cursor": 0, "filled": 0}
        return {"stats": self.stats.state_dict(), **(kept if self.band is None else self.band.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved, before or after ``attach`` (a history of another shape
        is dropped). Raises ``ValueError`` on a malformed state."""
        self.stats.load_state_dict(state["stats"])
        if self.band is not None:
            self.band.load_state_dict(state)
        elif state.get("history") is not None:
            self._restored = {k: state.get(k) for k in ("history", "shape", "cursor", "filled")}
