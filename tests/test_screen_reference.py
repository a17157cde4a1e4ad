"""The every-step screen's plain-Python ``judge`` against the torch one it replaced (kept here,
verbatim, as ``TorchScreen``): the same verdicts, details, margins, bands, history and deviations
on random and adversarial rows (NaN, Inf, malformed headers and values, ties, signed zeros, a
value only one rank has, a window shorter than the recalibration period); ``in_band`` and
``reference`` against the judge's own rule."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from sdc_core.checks.screen import GradientScreen
from sdc_core.checks.screen_rule import (
    _MAD_TO_SIGMA,
    _REFRESH,
    _REFRESH_CALIBRATED,
    HEADER,
    LOG2_LIMIT,
    ScreenConfig,
    ScreenResult,
    early_band,
    history_tensor,
    in_band,
    judge_rows,
    reference,
    tail_bands,
)
from sdc_core.dist.topology import RankFacts, Topology

K = 4


class TorchScreen(GradientScreen):
    """The screen as it was before the plain-Python judge: ``bands`` and ``judge`` in torch ops,
    writing the history of its ``band`` directly (``_cached``: its band and age, as the old screen
    kept them)."""

    last_deviations: Any = None  # as ``judge_rows`` gives them
    _cached: Any = None
    _age = 0

    def bands(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        assert self.band is not None
        h = self.band.history[: self.band.filled].reshape(-1, self.width + 1)
        samples = (~torch.isnan(h)).sum(0)
        calibrated = samples >= cfg.calibration_samples
        waiting = torch.full((self.width + 1,), float(cfg.initial_band), dtype=torch.float64)
        if not bool(calibrated.all()) and not math.isnan(early := early_band(h, cfg, self.world_size)):
            waiting[: self.width - 1] = early  # the groups' pooled early band (the rule's own function)
        few = samples[-2:] >= max(1, cfg.calibration_samples // 2)
        if not bool(calibrated.all()) and bool(few.any()):  # the loss and the level: own bulk rule, half the samples
            hh = h[:, -2:]
            med_ = torch.nanmedian(hh, 0).values
            own = (med_ + cfg.z * _MAD_TO_SIGMA * torch.nanmedian((hh - med_).abs(), 0).values + 1.0)
            waiting[-2:] = torch.where(few, own.clamp(cfg.min_band, cfg.initial_band), waiting[-2:])
        if not bool(calibrated.any()):
            return waiting, calibrated
        med = torch.nanmedian(h, 0).values
        mad = torch.nanmedian((h - med).abs(), 0).values
        band = torch.fmax(med + cfg.z * _MAD_TO_SIGMA * mad, tail_bands(h, self.world_size))  # the world's tail
        band = band.clamp(cfg.min_band, cfg.max_band)
        return torch.where(calibrated, band, waiting), calibrated

    def judge(self, step: int, rows: torch.Tensor) -> ScreenResult:
        world = rows.shape[0]
        self.stats.runs += 1
        if rows.shape != (world, HEADER + self.width) or world != self.world_size:
            raise ValueError("shape")
        head, vals = rows[:, :HEADER], rows[:, HEADER:]
        expect = torch.nanmedian(head, 0).values
        malformed = ~((head[:, 0] == expect[0]) & (head[:, 1] == self.width))
        legal = torch.isnan(vals) | (vals == float("inf")) | (torch.isfinite(vals) & (vals.abs() <= LOG2_LIMIT))
        malformed |= ~legal.all(1)
        nonfinite = (vals == float("inf")).any(1) & ~malformed
        x = vals.clone()
        x[malformed] = float("nan")
        x[x == float("inf")] = float("nan")
        ref = torch.nanmedian(x, 0).values
        count = (~torch.isnan(x)).sum(0)
        raw = x - ref
        raw[:, count < 2] = float("nan")
        level = torch.nanmedian(raw, 1, keepdim=True).values
        dev = torch.cat([raw - torch.fmin(level, raw[:, -1:]), level], 1)
        calibrated_all = self._cached is not None and bool(self._cached[1].all())
        every = 1 if self.band.filled < _REFRESH else _REFRESH_CALIBRATED if calibrated_all else _REFRESH
        if self._cached is None or self._age >= every:
            self._cached, self._age = self.bands(), 0
        self._age += 1
        band, calibrated = self._cached
        self.last_deviations = dev
        over = dev > band
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
        b = self.band
        assert b is not None
        b.history[b.cursor] = healthy.clamp(max=self.config.max_band)
        b.cursor = (b.cursor + 1) % self.config.window
        b.filled = min(b.filled + 1, self.config.window)
        ranks = tuple(details)
        if ranks:
            self.stats.bump("hits")
            self.stats.bump("suspect_ranks", len(ranks))
            for info in details.values():
                self.stats.bump(f"{info['reason']}_suspects")
        else:
            self.stats.last_verified_step = step
        excess = torch.nan_to_num(dev - band, nan=-math.inf).max()
        return ScreenResult(step=step, ranks=ranks, details=details, calibrated=bool(calibrated.all()),
                            margin=float(excess))  # fmt: skip


def pair(world: int, **config: Any) -> tuple[GradientScreen, TorchScreen]:
    facts = tuple(RankFacts(rank=r, host="h", node_rank=0, local_rank=r) for r in range(world))
    out = []
    for cls in (GradientScreen, TorchScreen):
        s = cls(ScreenConfig(**config), Topology(ranks=facts, rank=0))
        s._setup(K, [f"p{j}" for j in range(K)])
        out.append(s)
    return out[0], out[1]  # type: ignore[return-value]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN, and the same bits otherwise (signed zeros aside)."""
    return a.shape == b.shape and bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(
        torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))  # fmt: skip


ODD = (math.nan, math.inf, -math.inf, 5000.0, -1100.5, 1100.0, -1100.0, 0.0, -0.0, 1e-300)


def adversarial_rows(rng: random.Random, step: int, world: int, hostile: float) -> torch.Tensor:
    """Heterogeneous healthy rows, quantized now and then (ties), with hostile cells and headers."""
    level, spread = rng.uniform(-20, 5), rng.choice((0.0, 0.3, 1.0, 3.0))
    quantum = rng.choice((None, None, 0.5, 1.0))
    rows = []
    for _ in range(world):
        shift = rng.gauss(0, 2.0) if rng.random() < 0.2 else 0.0  # a rank whose batch raised everything
        v = [level + shift + rng.gauss(0, spread) for _ in range(K + 1)]
        if quantum is not None:
            v = [round(a / quantum) * quantum for a in v]
        rows.append([float(step), float(K + 1), *v])
    for r in rows:
        if rng.random() < hostile:
            kind = rng.randrange(7)
            col = HEADER + rng.randrange(K + 1)
            if kind == 0:
                r[col] = rng.choice(ODD)
            elif kind == 1:
                r[col] += rng.choice((6.0, 11.0, 13.0, 40.0))  # a grown value
            elif kind == 2:
                r[rng.randrange(HEADER)] = rng.choice((math.nan, step + 1.0, 99.0, -0.0, math.inf))
            elif kind == 3:
                r[HEADER:] = [math.nan] * (K + 1)  # no opinion
            elif kind == 4:
                r[-1] = math.nan  # no loss
            elif kind == 5:
                r[HEADER:] = [rows[0][HEADER + j] for j in range(K + 1)]  # a tie with rank 0
            else:
                r[HEADER + rng.randrange(K)] = math.inf  # non-finite gradients
    if rng.random() < 0.1:  # a value only one rank has
        col = HEADER + rng.randrange(K + 1)
        for r in rows[1:]:
            r[col] = math.nan
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize(("world", "config", "hostile"), [
    (1, {}, 0.2), (2, {}, 0.1), (3, {}, 0.05), (3, {}, 0.3), (4, {"window": 3, "calibration_samples": 2}, 0.2),
    (4, {"window": 50, "calibration_samples": 5, "z": 2.0, "min_band": 0.5, "initial_band": 1.0}, 0.1),
    (8, {"calibration_samples": 10}, 0.1)])  # fmt: skip
def test_the_plain_python_judge_gives_the_torch_judges_verdicts(world: int, config: dict, hostile: float) -> None:
    new, old = pair(world, **config)
    rng = random.Random(world * 1000 + len(config))
    reasons = set()
    for step in range(250):
        rows = adversarial_rows(rng, step, world, hostile)
        a, b = new.judge(step, rows.clone()), old.judge(step, rows.clone())
        reasons |= {d["reason"] for d in a.details.values()}
        assert (a.step, a.ranks, a.details, a.calibrated) == (b.step, b.ranks, b.details, b.calibrated), (step, rows)
        assert a.margin == b.margin or (math.isnan(a.margin) and math.isnan(b.margin)), (step, a.margin, b.margin)
        devs = judge_rows(rows.tolist(), a.bands, new.names)[4]  # the deviations do not depend on the band
        assert same(torch.tensor(devs, dtype=torch.float64), old.last_deviations), step  # type: ignore[arg-type]
        assert list(a.bands) == old._cached[0].tolist()
        vals = rows[:, HEADER:].clone()  # what was judged: malformed rows blanked
        for r in range(world):
            if a.details.get(r, {}).get("reason") == "malformed":
                vals[r] = math.nan
        assert same(torch.tensor(a.values, dtype=torch.float64), vals), step
        if step % 37 == 0:
            assert same(new.bands()[0], old.bands()[0]) and torch.equal(new.bands()[1], old.bands()[1])
            assert same(history_tensor(new.state_dict()), history_tensor(old.state_dict()))
    new_stats = new.stats.state_dict()
    new_stats["extra"].pop("predicted_hits_per_day", None)  # a gauge the reference does not keep
    assert new_stats == old.stats.state_dict()
    assert old.stats.runs - (old.stats.extra or {}).get("hits", 0) > 0  # clean verdicts seen, every kind of suspect
    assert new.stats.failures == 0  # a hit is no verdict
    assert reasons == ({"malformed", "nonfinite", "band"} if world > 1 else {"malformed", "nonfinite"}), reasons


def test_in_band_and_reference_follow_the_judges_rule() -> None:
    """For every rank the judge did not name malformed or non-finite, ``in_band`` on its row
    against ``reference(values)`` says what the band said; a partner's clean recomputation of a
    faulty rank's row is in band against the other ranks' median, the faulty row is not."""
    s, _ = pair(4)
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for step in range(300):
        res = s.judge(step, adversarial_rows(rng, step, 4, 0.2))
        ref = reference(res.values)
        for r in range(4):
            reason = res.details.get(r, {}).get("reason")
            if reason in ("malformed", "nonfinite"):
                assert not any(math.isinf(a) for a in res.values[r]) or not in_band(res.values[r], ref, res.bands)
                continue
            ok = in_band(res.values[r], ref, res.bands)
            assert ok == (reason is None), (step, r, res.details)
            seen[ok] += 1
    assert seen[True] > 100 and seen[False] > 10
    g = torch.Generator().manual_seed(8)
    for step in range(300, 340):  # calibrate on clean rows
        s.judge(step, torch.cat([torch.tensor([[float(step), K + 1.0]] * 4, dtype=torch.float64),
                                 -8 + 0.5 * torch.randn(4, K + 1, generator=g, dtype=torch.float64)], 1))  # fmt: skip
    clean = (-8 + 0.5 * torch.randn(4, K + 1, generator=g, dtype=torch.float64)).tolist()
    faulty = [row[:] for row in clean]
    faulty[2][1] += 14.0  # 2^14 in group 1 on rank 2
    res = s.judge(340, torch.tensor([[340.0, K + 1.0, *row] for row in faulty], dtype=torch.float64))
    assert res.ranks == (2,)
    others = reference(res.values, exclude=2)
    assert not in_band(faulty[2], others, res.bands)
    assert in_band(clean[2], others, res.bands)
    assert in_band([*clean[2][:-1], math.nan], others, res.bands)  # a recomputation without its loss
    assert not in_band([*clean[2][:-1], math.inf], others, res.bands)  # non-finite
    assert not in_band([*clean[2][:-1], -math.inf], others, res.bands)  # out of the protocol
    assert in_band([math.nan] * (K + 1), others, res.bands)  # no opinion: nothing out of band
    with pytest.raises(ValueError):
        in_band(clean[2], others, res.bands[:-1])
    r = reference([[1.0, math.nan], [3.0, math.inf], [2.0, 5.0]])
    assert r[0] == 2.0 and math.isnan(r[1])  # one rank alone is compared with nobody
    assert reference([[1.0, math.nan], [3.0, math.inf], [2.0, 5.0]], exclude=0) == [2.0, 5.0]
    assert reference([[4.0, 1.0], [2.0, 3.0]]) == [2.0, 1.0]  # the lower median
    assert all(math.isnan(a) for a in reference([[1.0, 2.0]], exclude=0))
