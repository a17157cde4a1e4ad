"""The every-step screen's band and payload checks, one process (``GradientScreen.judge`` on rows as
the all_gather delivers them), and the magnitude read of the non-finite check."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn

from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.checks.screen import GradientScreen, ScreenConfig, ScreenResult, loss_magnitude
from sdc_core.checks.screen_rule import STEPS_PER_DAY, predicted_hits_per_day, tail_bands
from sdc_core.dist.topology import RankFacts, Topology

K = 4  # groups; rows carry K + 1 values (the loss last)


def screen(world: int = 4, **config: object) -> GradientScreen:
    facts = tuple(RankFacts(rank=r, host="h", node_rank=0, local_rank=r) for r in range(world))
    s = GradientScreen(ScreenConfig(**config), Topology(ranks=facts, rank=0))  # type: ignore[arg-type]
    s._setup(K, [f"p{j}" for j in range(K)])
    return s


def rows(step: int, values: torch.Tensor) -> torch.Tensor:
    """The gathered rows: header (step, width) and each rank's values (world x (K + 1))."""
    world = values.shape[0]
    head = torch.tensor([[float(step), float(K + 1)]] * world, dtype=torch.float64)
    return torch.cat([head, values.double()], 1)


def healthy(g: torch.Generator, world: int, spread: float = 0.7, level: float = -8.0) -> torch.Tensor:
    """log2 magnitudes of ranks on heterogeneous batches: a common level (the phase of training)
    plus a per-rank spread of ``spread`` log2 units (a factor of 1.6)."""
    return level + spread * torch.randn(world, K + 1, generator=g, dtype=torch.float64)


def test_config_validates() -> None:
    bad_configs = ({"groups": 0}, {"groups": True}, {"window": 0}, {"z": 0.0}, {"z": math.inf}, {"min_band": -1.0},
                   {"min_band": 5.0, "initial_band": 4.0}, {"initial_band": 13.0},
                   {"calibration_samples": 1.5})  # fmt: skip
    for bad in bad_configs:
        with pytest.raises(ValueError):
            ScreenConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ScreenConfig(16)  # type: ignore[misc]  # keyword-only
    assert "min_band:" in (ScreenConfig.__doc__ or "")


def test_healthy_steps_never_flag_and_the_band_calibrates() -> None:
    """2000 healthy steps with a moving level (warm-up, training) and a spread that grows: no flag."""
    s, g = screen(), torch.Generator().manual_seed(0)
    flags = 0
    for step in range(2000):
        level = -2.0 - 10.0 * min(1.0, step / 100) + 3.0 * math.sin(step / 50)  # warm-up, then drifting
        spread = 0.5 + 1.0 * step / 2000
        flags += bool(s.judge(step, rows(step, healthy(g, 4, spread, level))))
    assert flags == 0
    band, calibrated = s.bands()
    assert bool(calibrated.all()) and bool((band >= 5.0).all()) and bool((band <= 12.0).all())
    assert s.stats.runs == 2000 and s.stats.failures == 0 and s.stats.last_verified_step == 1999


def test_the_band_recalibrates_every_step_at_first_then_every_32_until_calibrated_then_every_128(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The band's two medians over the history run at each of the first 32 judged steps (each
    early step judged with all the steps before it), then every 32 while some value lacks
    ``calibration_samples`` healthy deviations, every 128 once all have them."""
    s, g = screen(calibration_samples=80), torch.Generator().manual_seed(3)
    at: list[tuple[int, bool]] = []  # (judged steps, every value calibrated) at each recalibration
    assert s.band is not None
    bands = s.band.bands

    def counted() -> tuple[torch.Tensor, torch.Tensor]:
        band, calibrated = bands()
        at.append((s.stats.runs, bool(calibrated.all())))
        return band, calibrated

    monkeypatch.setattr(s.band, "bands", counted)
    for step in range(700):
        s.judge(step, rows(step, healthy(g, 4)))
    assert [n for n, _ in at[:32]] == list(range(1, 33)), at[:33]  # every step while the history has < 32
    gaps = [(b[0] - a[0], a[1]) for a, b in itertools.pairwise(at[31:])]
    assert gaps and all(gap == (128 if cal else 32) for gap, cal in gaps), at
    assert {cal for _, cal in gaps} == {False, True}  # both schedules ran
    assert len(s.band._fresh) < 128 and s.band.filled == 200  # the history is written before each recalibration


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_grown_value_names_that_rank_only(world: int) -> None:
    s, g = screen(world), torch.Generator().manual_seed(1)
    for step in range(50):
        assert not s.judge(step, rows(step, healthy(g, world)))
    for bad_rank, value, factor in ((world - 1, 2, 2.0**10), (0, K, 2.0**20)):  # a group; the loss
        v = healthy(g, world)
        v[bad_rank, value] += math.log2(factor)
        res = s.judge(50 + bad_rank, rows(50 + bad_rank, v))
        assert res.ranks == (bad_rank,), res
        assert res.details[bad_rank]["reason"] == "band"
        assert res.details[bad_rank]["value"] == s.names[value]
        assert res.details[bad_rank]["excess"] > res.details[bad_rank]["band"]
    counted = {k: v for k, v in (s.stats.extra or {}).items() if k != "predicted_hits_per_day"}  # a gauge
    assert s.stats.failures == 0 and counted == {"hits": 2.0, "suspect_ranks": 2.0, "band_suspects": 2.0}


def test_shrunk_values_and_small_changes_pass() -> None:
    """One-sided: a value that fell, or grew by less than the band, is not flagged."""
    s, g = screen(), torch.Generator().manual_seed(2)
    for step in range(40):
        s.judge(step, rows(step, healthy(g, 4)))
    v = healthy(g, 4)
    v[1, 0] -= 30.0  # a flip that made an element tiny
    v[2, 1] += 1.0  # a mantissa-sized change
    assert not s.judge(40, rows(40, v))


def test_before_calibration_the_initial_band_holds() -> None:
    s = screen()
    band, calibrated = s.bands()
    assert not bool(calibrated.any()) and bool((band == 10.0).all())
    v = torch.full((4, K + 1), -5.0, dtype=torch.float64)
    v[3, 0] += 9.0  # 512x: within the initial band
    assert not s.judge(0, rows(0, v))
    v[3, 0] += 2.0  # 2048x
    assert s.judge(1, rows(1, v)).ranks == (3,)


def test_in_the_first_steps_the_groups_pooled_band_judges_before_each_value_calibrates() -> None:
    """Before any value has its own ``calibration_samples`` deviations, the groups' healthy
    deviations pooled give them a band under the initial 2^10 within a few steps (8 ranks, 4
    groups: about 100 pooled deviations; 60 of its own calibrate a value here, about 15 steps), at
    least ``min_band``; the loss and the level keep the initial band. A group grown 2^8 on one rank
    is then named, which the initial band would miss."""
    s, g = screen(8, calibration_samples=60), torch.Generator().manual_seed(11)
    step = 0
    while bool((s.bands()[0][:K] == 10.0).all()):
        assert not s.judge(step, rows(step, healthy(g, 8)))
        step += 1
    band, calibrated = s.bands()
    assert step <= 10 and not bool(calibrated.any()), step
    assert bool((band[:K] >= 5.0).all()) and bool((band[:K] < 10.0).all()) and bool((band[K:] == 10.0).all())
    v = healthy(g, 8)
    v[5, 1] += 8.0
    hit = s.judge(step, rows(step, v))
    assert hit.ranks == (5,) and hit.details[5]["value"] == "group 1 (p1)" and hit.details[5]["band"] < 8.0
    v = healthy(g, 8)
    v[5, K] += 8.0  # the loss: the initial band until it has half its own calibration samples
    assert not s.judge(step + 1, rows(step + 1, v))


def test_in_the_first_steps_the_level_has_a_band_from_half_its_samples() -> None:
    """The level (a rank's batch raising everything, or a fault in the forward doing the same) has
    nothing to pool with: once it has half its ``calibration_samples`` healthy deviations (3 ranks:
    about 10 steps here), its own bulk rule plus the margin, at least ``min_band``, replaces the
    initial 2^10, before it has calibrated; a rank whose every value grew 2^8 is then named."""
    s, g = screen(3), torch.Generator().manual_seed(12)
    step = 0
    while float(s.bands()[0][-1]) == 10.0:
        assert not s.judge(step, rows(step, healthy(g, 3)))
        step += 1
    band, calibrated = s.bands()
    assert step <= 25 and not bool(calibrated[-1]) and 5.0 <= float(band[-1]) < 8.0, (step, band)
    v = healthy(g, 3)
    v[2] += 8.0  # every gradient and the loss of rank 2
    hit = s.judge(step, rows(step, v))
    assert hit.ranks == (2,) and hit.details[2]["value"] == "level", hit.details


def test_a_faulty_rank_cannot_widen_the_band() -> None:
    """A rank that always sits just under the band never ratchets it past ``max_band``; flagged rows stay out."""
    s, g = screen(3), torch.Generator().manual_seed(3)
    for step in range(600):
        v = healthy(g, 3)
        band, _ = s.bands()
        v[2] = v[:2].max(0).values + band[: K + 1] - 0.01
        s.judge(step, rows(step, v))
    band, _ = s.bands()
    assert bool((band <= 12.0).all())
    v = healthy(g, 3)
    v[1, 0] += 13.0
    assert s.judge(600, rows(600, v)).ranks == (1,)


def test_hostile_rows() -> None:
    """Wrong step or width, values out of the float range, NaN headers, -Inf: the sender, and only
    the sender, is a suspect; +Inf (non-finite gradients) names the rank; NaN is no opinion."""
    s, g = screen(4), torch.Generator().manual_seed(4)
    for step in range(30):
        s.judge(step, rows(step, healthy(g, 4)))
    cases = [((0, 0), 31.0, "malformed"), ((1, 1), 99.0, "malformed"), ((2, 0), math.nan, "malformed"),
             ((3, 2 + 1), 5000.0, "malformed"), ((0, 2 + 2), -math.inf, "malformed"),
             ((1, 2 + 3), math.inf, "nonfinite")]  # fmt: skip
    for step, ((rank, col), value, reason) in enumerate(cases, start=30):
        r = rows(step, healthy(g, 4))
        r[rank, col] = value
        res = s.judge(step, r)
        assert res.ranks == (rank,) and res.details[rank]["reason"] == reason, (rank, col, value, res)
    r = rows(40, healthy(g, 4))
    r[:3, 2:] = math.nan  # three ranks without an opinion: one rank alone is compared with nobody
    r[3, 2:] = 50.0
    assert not s.judge(40, r)
    with pytest.raises(ValueError):
        s.judge(41, torch.zeros(4, K + 2, dtype=torch.float64))  # the wrong shape: a local bug, not a peer's


def test_zero_peers_do_not_make_others_suspects() -> None:
    """Groups whose gradients were exactly zero on most ranks (a module only some batches use)
    send NaN: the rank that used it is not compared with them."""
    s, g = screen(4), torch.Generator().manual_seed(5)
    for step in range(30):
        s.judge(step, rows(step, healthy(g, 4)))
    v = healthy(g, 4)
    v[:3, 1] = math.nan
    assert not s.judge(30, rows(30, v))


def test_state_round_trip() -> None:
    s, g = screen(4), torch.Generator().manual_seed(6)
    for step in range(60):
        s.judge(step, rows(step, healthy(g, 4, spread=2.0)))
    t = screen(4)
    t.load_state_dict(s.state_dict())
    assert torch.equal(t.bands()[0], s.bands()[0]) and t.stats.runs == 60
    state = s.state_dict()
    json.dumps(state, allow_nan=False)  # every route can store it (Accelerate's state file is strict JSON)
    state["history"][0] = 1e9
    with pytest.raises(ValueError):
        screen(4).load_state_dict(state)
    state["history"][0] = "text"
    with pytest.raises(ValueError):
        screen(4).load_state_dict(state)
    other = screen(3)
    other.load_state_dict(s.state_dict())  # another world size: recalibrates
    assert not bool(other.bands()[1].any())


def test_observe_and_suspects_one_process() -> None:
    """Without a process group: no witness, no suspect; steps are judged in order; unknown steps raise."""
    s = GradientScreen()
    s._setup(K, ["a"] * K)
    s.observe(0, torch.zeros(K), torch.tensor(1.0))
    s.observe(1, None, None)
    s.observe(2, torch.zeros(K), torch.tensor(2.0))  # a third pending step judges the first
    assert sorted(set(s._pending) | set(s._judged)) == [0, 1, 2]  # observed, verdict not taken
    assert s.suspects(1) == ScreenResult(step=1) and s.suspects(0).ranks == ()
    with pytest.raises(LookupError):
        s.suspects(0)
    with pytest.raises(ValueError):
        s.observe(2, None)
    s.discard()
    assert not s._pending and not s._judged


def test_the_row_carries_the_magnitudes_and_the_loss_or_no_opinion() -> None:
    """The row is the magnitudes, then log2 of the loss; magnitudes of the wrong length and no loss
    are no opinion (NaN)."""
    s = GradientScreen()
    s._setup(K, ["a"] * K)
    values = [1.5, -3.0, math.nan, math.inf]  # K of them
    s.observe(0, torch.tensor(values, dtype=torch.float32), torch.tensor(2.0))
    s.observe(1, torch.zeros(K + 1), None)
    assert str(s.suspects(0).values[0]) == str((*values, 1.0))  # the groups, then log2 of the loss
    assert all(math.isnan(v) for v in s.suspects(1).values[0])


def test_loss_magnitude() -> None:
    dev = torch.device("cpu")
    assert loss_magnitude(torch.tensor(8.0), dev).item() == 3.0
    assert loss_magnitude(torch.tensor(-0.25), dev).item() == -2.0
    assert math.isnan(loss_magnitude(torch.tensor(0.0), dev).item())
    assert math.isnan(loss_magnitude(None, dev).item())
    assert loss_magnitude(torch.tensor(float("nan")), dev).item() == math.inf


def test_group_magnitudes_of_the_read() -> None:
    """``_group_magnitudes`` (the read's last part): per group the log2 of its largest peak; NaN
    for unseen or all-zero groups, +Inf for NaN/Inf; parameters in model order."""

    class Tap:
        def __init__(self, params: list[nn.Parameter]) -> None:
            self.params, self.names = params, {id(p): f"p{i}" for i, p in enumerate(params)}

    params = [nn.Parameter(torch.zeros(3)) for _ in range(6)]
    nf = NonFiniteGradient()
    nf.tap = Tap(params)  # type: ignore[assignment]
    assert nf.want_magnitudes(3) == 3 and nf.want_magnitudes(100) == 6
    nf.want_magnitudes(3)  # groups {0, 1}, {2, 3}, {4, 5}
    local = [(torch.tensor([4.0, 0.5, 0.0]), [params[0], params[1], params[2]]),
             (torch.tensor([float("nan")], dtype=torch.float64), [params[5]])]  # fmt: skip
    out = nf._group_magnitudes(local)
    assert out is not None and out.dtype == torch.float32 and out.shape == (3,)
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == math.inf
    assert nf.take_magnitudes() is None
    with pytest.raises(ValueError):
        nf.want_magnitudes(0)


def test_observe_builds_the_row_on_a_device_without_a_host_copy() -> None:
    """Off the host the row's header is filled on the device (no host-to-device copy): the same
    float64 layout (header, values, the loss), here on the ``meta`` device (no
    process group: the row stays where it was made)."""
    s = GradientScreen()
    s._setup(K, ["a"] * K)
    s.observe(3, torch.zeros(K, device="meta"), torch.tensor(2.0, device="meta"))
    s.observe(4, None, None)
    for step in (3, 4):
        row = s._pending[step].value  # its HostRead
        assert row.device.type == "meta" and row.dtype == torch.float64 and row.shape == (1, 2 + K + 1)
    s.discard()


def test_a_result_carries_the_judged_values_and_bands() -> None:
    """``values``: the rows as judged (NaN for a malformed row, +Inf kept); ``bands``: one per value
    and the level; neither takes part in ``==``."""
    s, g = screen(3), torch.Generator().manual_seed(9)
    v = healthy(g, 3)
    r = rows(0, v)
    r[1, 0] = 7.0  # a wrong step: malformed
    r[2, 3] = math.inf
    res = s.judge(0, r)
    assert res.ranks == (1, 2) and len(res.values) == 3 and len(res.bands) == K + 2
    assert list(res.values[0]) == v[0].tolist() and all(math.isnan(a) for a in res.values[1])
    assert res.values[2][1] == math.inf and res.bands == (10.0,) * (K + 2)
    assert res == ScreenResult(step=0, ranks=res.ranks, details=res.details, margin=res.margin)


def test_rows_as_lists_judge_as_the_tensor_does() -> None:
    """``judge`` takes the gathered rows as lists too (``tolist`` of the gathered rows): the same
    verdicts, values and band history as the tensor; a row of the wrong width is refused."""
    a, b, g = screen(3), screen(3), torch.Generator().manual_seed(4)
    for step in range(40):
        values = healthy(g, 3)
        if step == 30:
            values[1, 2] += 14.0  # a grown value: rank 1 out of any band
        t = rows(step, values)
        ra, rb = a.judge(step, t), b.judge(step, t.tolist())
        assert ra == rb and ra.values == rb.values and ra.bands == rb.bands
    assert ra.step == 39 and ra.ranks == () and a.stats.extra["hits"] == b.stats.extra["hits"] == 1
    assert torch.equal(a.bands()[0], b.bands()[0])
    with pytest.raises(ValueError, match="expected"):
        b.judge(41, [row[:-1] for row in rows(41, healthy(g, 3)).tolist()])




def test_the_band_history_is_bounded_whatever_the_world() -> None:
    """The band's history keeps at most 16 ranks' healthy deviations a step, taken in rotation, so
    its memory does not grow with the world; a hit among 64 ranks is still named and the band
    calibrates on every rank's deviations over the steps (each rank sampled in turn)."""
    small, large, g = screen(4), screen(64), torch.Generator().manual_seed(7)
    assert small.band is not None and large.band is not None
    assert small.band.history.shape[1] == 4 and large.band.history.shape[1] == 16
    hits = []
    for step in range(60):
        values = healthy(g, 64)
        if step == 50:
            values[37, 1] += 14.0
        hits += list(large.judge(step, rows(step, values)).ranks)
    assert hits == [37]
    assert large.band.history.numel() * 8 == 200 * 16 * (K + 2) * 8  # bytes: independent of the world
    assert bool(large.bands()[1].all())  # calibrated from the sampled rows


def test_the_band_is_restored_from_a_checkpoint_loaded_before_attach() -> None:
    """A resume loads the checks' state before the screen is attached (Lightning restores callbacks
    first): the band's history waits and is taken at attach, so the resumed screen judges with the
    calibrated band at once; the hook set's counters carry it too."""
    from sdc_core.driver.hooks import counters, restore_counters

    s, g = screen(3), torch.Generator().manual_seed(5)
    for step in range(40):
        s.judge(step, rows(step, healthy(g, 3)))
    saved = s.state_dict()
    assert bool(s.bands()[1].all())
    facts = tuple(RankFacts(rank=r, host="h", node_rank=0, local_rank=r) for r in range(3))
    resumed = GradientScreen(ScreenConfig(), Topology(ranks=facts, rank=0))
    resumed.load_state_dict(saved)  # before attach
    assert resumed.state_dict()["filled"] == saved["filled"]
    resumed._setup(K, [f"p{j}" for j in range(K)])
    assert torch.equal(resumed.bands()[0], s.bands()[0]) and bool(resumed.bands()[1].all())
    other = screen(3)
    restore_counters(counters(40, 40, [s], None), [other])
    assert torch.equal(other.bands()[0], s.bands()[0])


def test_the_tail_band_keeps_the_worlds_hits_under_one_a_day_and_grows_with_the_world() -> None:
    """On healthy deviations with an exponential tail in log2 units (half the rank-steps positive,
    mean 0.4), the tail band lands where that distribution's exceedance is one hit a day across
    the world at one step a second, per value: near the exact quantile at 8 and at 16,384 ranks
    (a history of 16,000 rank-steps: 800 excesses estimate the slope to 3.5%, times an
    extrapolation of ln(1e7) to ln(1e10): 0.2-0.3 log2 units of noise per value), and higher in
    the larger world; too few deviations give no tail band."""
    g = torch.Generator().manual_seed(5)
    steps, ranks, values, scale = 1000, 16, 4, 0.4
    exp = torch.empty(steps, ranks, values, dtype=torch.float64).exponential_(1 / scale, generator=g)
    positive = torch.rand(steps, ranks, values, generator=g, dtype=torch.float64) < 0.5
    history = torch.where(positive, exp, math.nan)
    for world in (8, 16384):
        budget = 1 / (STEPS_PER_DAY * world * values)
        exact = scale * math.log(0.5 / budget)  # P(d > x) = 0.5 exp(-x / scale)
        band = tail_bands(history, world)
        assert ((band - exact).abs() < 1.0).all() and abs(float(band.mean()) - exact) < 0.5, (world, band, exact)
    assert (tail_bands(history, 16384) > tail_bands(history, 8) + 2.5).all()  # scale x ln(2048) = 3.05 higher
    assert tail_bands(history[:2, :4], 8).isnan().all()  # 16 rank-steps: no tail to fit


def test_the_screen_reports_the_hits_a_day_its_band_predicts_across_the_world() -> None:
    """At the tail band every value's predicted exceedance is its budget: one hit a day across the
    world in all; a lower band predicts more. A screen calibrated on healthy Gaussian rows reports
    its prediction (``sdc/gradient_screen/predicted_hits_per_day``): far under one a day, since
    its band is floored at 2^5 and a Gaussian spread of 0.7 log2 units has a thin tail."""
    g = torch.Generator().manual_seed(2)
    exp = torch.empty(1000, 16, 4, dtype=torch.float64).exponential_(1 / 0.4, generator=g)
    history = torch.where(torch.rand(1000, 16, 4, generator=g, dtype=torch.float64) < 0.5, exp, math.nan)
    for world in (8, 16384):
        band = tail_bands(history, world)
        assert predicted_hits_per_day(history, band, world) == pytest.approx(1.0, rel=1e-6)
        assert predicted_hits_per_day(history, band - 1.0, world) > 5.0  # a band 1 log2 unit lower: e^(1/0.4) more
    s = screen(16)
    for step in range(300):
        s.judge(step, rows(step, healthy(g, 16)))
    predicted = s.stats.metrics()["sdc/gradient_screen/predicted_hits_per_day"]
    assert 0.0 <= predicted < 1.0, predicted


def test_a_loss_grown_toward_overflow_on_every_rank_is_a_diverging_run_and_one_rank_cannot_fake_it() -> None:
    """``diverging(step)``: the ranks' median loss rose by 2^16 or more to 2^16 or more within the last 8 steps
    judged before ``step`` (a run diverging toward overflow, even if its loss fell again). A calm run, a loss spike
    2^10 above the run's, a loss that rose 2^16 from near zero to 2^4, and one rank's own huge loss (a hostile peer or
    a faulty rank) are not; a step whose loss overflowed on most ranks has no median. Only steps before ``step``
    count."""
    g = torch.Generator().manual_seed(11)

    def run(losses: list[float], world: int = 3, only_rank: int | None = None) -> GradientScreen:
        s = screen(world)
        for step, loss in enumerate(losses):
            v = healthy(g, world, level=1.0)
            v[:, -1] = v[:, -1].clamp(max=1.0) if only_rank is not None else loss  # log2 loss of each rank
            if only_rank is not None:
                v[only_rank, -1] = loss
            s.judge(step, rows(step, v))
        return s

    assert run([1.0] * 12).diverging(12) is None
    assert run([1.0] * 8 + [11.0]).diverging(9) is None  # a spike of 2^10
    assert run([-12.0] * 6 + [4.0, 4.0]).diverging(8) is None  # 2^16 from near zero, but to 2^4 only
    assert run([1.0] * 6 + [20.0, 40.0, 60.0], only_rank=2).diverging(9) is None  # one rank's loss: not the median
    grown = run([1.0, 1.0, 8.0, 20.0, 40.0]).diverging(5)
    assert grown == (1.0, 40.0)
    assert run([1.0, 1.0, 8.0, 20.0, 40.0]).diverging(4) == (1.0, 20.0)  # the steps before 4 only
    assert run([1.0, 1.0, 8.0, 20.0, 40.0]).diverging(3) is None
    assert run([1.0, 1.0, 30.0, math.inf]).diverging(4) == (1.0, 30.0)  # overflowed on most ranks: no opinion
    assert run([40.0] * 4 + [1.0] * 9 + [40.0]).diverging(14) == (1.0, 40.0)  # the last 8 steps: 1.0 is in them
    assert run([1.0] + [40.0] * 9).diverging(10) is None  # ... but not a low loss 9 steps back: a steady high loss
    assert run([1.0, 10.0, 60.0, 30.0, 2.0]).diverging(5) == (1.0, 60.0)  # a loss that fell again: still diverging
    assert run([30.0, 40.0, 20.0, 2.0]).diverging(4) is None  # high, but it rose 2^10 only
