"""The rule that turns a screen hit and a partner's recomputation into a verdict
(``sdc_core.replay.confirm._judge``), on hand-made evidence: pure host arithmetic, identical on every
rank. A reproduced value clears (a genuine spike), a recomputation inside the band confirms, and
anything that proves nothing (no recomputation, a partner out of band or non-finite) accuses no one."""

from __future__ import annotations

import math

from sdc_core.checks.screen import ScreenResult
from sdc_core.replay.confirm import _escalated, _judge

NAN, INF = math.nan, math.inf
BANDS = (5.0, 5.0, 5.0, 5.0)  # two groups, the loss, the level


def result(flagged: tuple[float, float, float], reason: str = "band") -> ScreenResult:
    """Rank 1 flagged; ranks 0 and 2 healthy (values: group 0, group 1, loss; log2)."""
    values = ((0.0, 1.0, -1.0), flagged, (0.2, 1.1, -0.9))
    return ScreenResult(step=7, ranks=(1,), details={1: {"reason": reason}}, values=values, bands=BANDS)


def test_a_reproduced_spike_is_cleared() -> None:
    assert _judge(result((12.0, 1.0, -1.0)), 1, [12.3, 1.0, -1.0]) == "cleared"


def test_a_recomputation_inside_the_band_confirms() -> None:
    assert _judge(result((12.0, 1.0, -1.0)), 1, [0.1, 1.0, -1.0]) == "confirmed"
    assert _judge(result((0.0, 1.0, 20.0)), 1, [0.1, 1.0, -1.0]) == "confirmed"  # a wrong loss


def test_nothing_recomputed_or_a_partner_out_of_band_accuses_no_one() -> None:
    flagged = result((12.0, 1.0, -1.0))
    assert _judge(flagged, 1, [NAN, NAN, NAN]) == "unconfirmed"
    assert _judge(flagged, 1, [8.0, 1.0, -1.0]) == "unconfirmed"  # neither reproduces nor in band
    assert _judge(flagged, 1, [0.1, INF, -1.0]) == "unconfirmed"  # the partner's own gradients overflowed


def test_a_non_finite_loss_from_finite_gradients_is_escalated_and_judged() -> None:
    flagged = result((0.0, 1.0, INF), reason="nonfinite")
    assert _escalated(flagged, 1)
    assert _judge(flagged, 1, [0.1, 1.0, INF]) == "cleared"  # the batch overflows on the partner too
    assert _judge(flagged, 1, [0.1, 1.0, -1.0]) == "confirmed"
    assert not _escalated(result((INF, 1.0, -1.0), reason="nonfinite"), 1)  # the non-finite check's verdict
    assert not _escalated(result((0.0, 1.0, -1.0), reason="malformed"), 1)
