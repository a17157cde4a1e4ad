"""The rule that turns a screen hit and a partner's recomputation into a verdict
(``sdc_core.replay.confirm._judge``), on hand-made evidence: pure host arithmetic, identical on every
rank. A reproduced value clears (a genuine spike); a value the partner recomputed smaller than the owner's by more
than its band, and itself inside the band, confirms; anything that proves nothing (no recomputation, a partner out of
band or non-finite, a gap within the band) accuses no one."""

from __future__ import annotations

import math

import pytest

from sdc_core.checks.screen import ScreenConfig, ScreenResult
from sdc_core.replay.confirm import _escalated, _judge

NAN, INF = math.nan, math.inf
BANDS = (5.0, 5.0, 5.0, 5.0)  # two groups, the loss, the level


def result(flagged: tuple[float, float, float], reason: str = "band") -> ScreenResult:
    """Rank 1 flagged; ranks 0 and 2 healthy (values: group 0, group 1, loss; log2)."""
    values = ((0.0, 1.0, -1.0), flagged, (0.2, 1.1, -0.9))
    return ScreenResult(step=7, ranks=(1,), details={1: {"reason": reason}}, values=values, bands=BANDS)


def test_a_reproduced_spike_is_cleared() -> None:
    assert _judge(result((12.0, 1.0, -1.0)), 1, [12.3, 1.0, -1.0]) == "cleared"


def test_a_recomputation_inside_the_band_and_smaller_by_more_than_it_confirms() -> None:
    assert _judge(result((12.0, 1.0, -1.0)), 1, [0.1, 1.0, -1.0]) == "confirmed"
    assert _judge(result((0.0, 1.0, 20.0)), 1, [0.1, 1.0, -1.0]) == "confirmed"  # a wrong loss
    assert _judge(result((6.0, 1.0, -1.0)), 1, [3.5, 1.0, -1.0]) == "unconfirmed"  # in band, but apart by less


def test_a_genuine_hard_batch_seen_again_after_its_update_is_not_confirmed() -> None:
    """Measured on a clean run (SGD, lr 0.1, momentum 0.9; one rank's inputs x5-x50 with random labels, a loss outside
    the model): the owner's level 2^6 above the ranks', the partner's recomputation on the weights after the update
    that batch drove 2^1-2^3 lower, inside the band. It named the healthy owner when the rule asked only whether the
    recomputation fell inside the band."""
    ref = (-5.22, -6.34, -5.02, -5.84, -4.45, -3.94, -1.76)
    owner = (1.14, -3.48, 2.1, -1.79, 3.37, -0.65, 5.8)
    flagged = ScreenResult(step=15, ranks=(0,), details={0: {"reason": "band"}}, values=(owner, ref, ref),
                           bands=(5.0,) * 8)  # fmt: skip
    assert _judge(flagged, 0, [0.07, -4.77, 1.29, -2.52, 2.73, -0.65, 2.89]) == "unconfirmed"


def test_on_the_weights_after_the_update_only_a_backward_no_forward_explains_confirms() -> None:
    """Read one step later, the partner recomputes on weights that the flagged batch's own update moved, which can fit
    that batch (its values back in band). Measured on clean runs (SGD, momentum 0.9, one rank's inputs x5-x50 with
    random labels): at lr 0.3 the first layer's peak 2^5.7 over the band, the partner's 2^5.7 lower (its loss 2^2.75
    lower); at lr 0.5 the last bias 2^5.4 over and lower by more than the band with the loss within 2x (the update
    cancels the bias's own gradient); at lr 0.5 through Accelerate, the weights grown to 1e9 in all, an ordinary batch's
    loss 2^28.2 above the others' and back in band after its update. On equal weights the first two are faults; after
    the update only a gradient group ``AFTER_UPDATE_GAP`` (2^24) above with the owner's loss in its band and the
    partner's value back within the band on both sides confirms (an exponent flip in the backward), never the loss."""
    ref = (-8.35, -8.83, -3.87, -7.22, -6.18, -3.93, -1.0)
    owner = (0.14, -0.7, 1.55, -1.06, -3.02, -3.59, 1.87)
    flagged = ScreenResult(step=31, ranks=(0,), details={0: {"reason": "band"}}, values=(owner, ref, ref),
                           bands=(5.0,) * 8)  # fmt: skip
    recomputed = [-5.56, -6.31, -2.52, -6.08, -4.31, -3.59, -0.88]
    assert _judge(flagged, 0, recomputed) == "confirmed"
    assert _judge(flagged, 0, recomputed, after_update=True) == "unconfirmed"
    assert _judge(result((100.0, 1.0, -1.0)), 1, [0.1, 1.0, -1.0], after_update=True) == "confirmed"  # a backward
    assert _judge(result((100.0, 1.0, -1.0)), 1, [-40.0, 1.0, -1.0], after_update=True) == "unconfirmed"  # far below
    assert _judge(result((100.0, 1.0, -1.0)), 1, [20.0, 1.0, -1.0], after_update=True) == "unconfirmed"  # above band
    assert _judge(result((100.0, 1.0, 8.0)), 1, [0.1, 1.0, -1.0], after_update=True) == "unconfirmed"  # its loss too
    assert _judge(result((-2.0, 1.0, 27.2)), 1, [-2.0, 1.0, -1.0], after_update=True) == "unconfirmed"  # the loss
    assert _judge(result((-2.0, 1.0, 27.2)), 1, [-2.0, 1.0, -1.0], projected=True, after_update=True) == "unconfirmed"
    assert _judge(result((12.0, 1.0, -1.0)), 1, [0.1, 1.0, -0.5], after_update=True) == "unconfirmed"  # a small gap
    assert _judge(result((12.0, 12.0, 40.0)), 1, [12.1, 12.0, 40.5], projected=True, after_update=True) == "cleared"


def test_a_loss_outside_the_model_confirms_by_the_outputs_projection() -> None:
    """The partner back-propagates the owner's gradients of the outputs, so its gradients and its projection share a
    spike the loss sent; the outputs' projection larger on the owner by more than the loss's band is a wrong forward,
    whatever the partner's band. Only with ``projected``, only larger on the owner, never from a non-finite value."""
    flagged = result((12.0, 12.0, 30.0))
    assert _judge(flagged, 1, [12.1, 12.0, 20.0], projected=True) == "confirmed"
    assert _judge(flagged, 1, [12.1, 12.0, 20.0]) == "unconfirmed"  # a loss of its own: out of band, proves nothing
    assert _judge(flagged, 1, [12.1, 12.0, 26.0], projected=True) == "unconfirmed"  # within the band of the owner's
    assert _judge(result((12.0, 12.0, 20.0)), 1, [12.1, 12.0, 30.0], projected=True) == "unconfirmed"  # larger
    assert _judge(result((12.0, 12.0, 30.0)), 1, [12.1, 12.0, INF], projected=True) == "unconfirmed"
    assert _judge(result((12.0, 12.0, 30.1)), 1, [12.1, 12.0, 30.0], projected=True) == "cleared"


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


def test_kept_steps_hold_the_step_being_recorded_and_the_one_before() -> None:
    """A verdict read one step later confirms the step before the one being recorded: both are
    kept; an audited step keeps none of its own but leaves the one before it; older ones go."""
    from sdc_core.replay.ring import KeptSteps

    kept = KeptSteps()
    kept.start(4)
    kept.batches.append("step 4")  # type: ignore[arg-type]
    kept.start(5)
    kept.batches.append("step 5")  # type: ignore[arg-type]
    assert kept.take(4) == ["step 4"] and kept.take(4) == []
    kept.start(None)  # step 6 is audited
    assert kept.take(5) == ["step 5"]
    kept.start(7)
    kept.batches.append("step 7")  # type: ignore[arg-type]
    kept.start(8)
    kept.start(9)
    assert kept.take(7) == [] and kept.take(8) == []  # two steps back: forgotten, and 8 kept nothing
    kept.clear()
    assert kept.take(9) == []


def test_the_verdict_is_read_one_step_later_unless_a_replay_skips_steps() -> None:
    """``ScreenConfig(read="auto")``: the next step on every device (no host wait for backward),
    and the same step wherever a replay's ``skip_step`` must drop the faulty step's own update;
    ``same_step`` and ``next_step`` are taken as they are."""
    from types import SimpleNamespace

    from sdc_core.driver import screen_step
    from sdc_core.replay.ring import ReplayConfig

    def reads_next(read: str, on_failure: str) -> bool:
        replay = SimpleNamespace(config=ReplayConfig(on_failure=on_failure))
        screen = SimpleNamespace(config=ScreenConfig(read=read))
        return screen_step.ScreenVerdicts(SimpleNamespace(replays=[replay])).reads_next_step(screen)

    assert reads_next("auto", "raise") and reads_next("auto", "rollback")
    assert not reads_next("auto", "skip_step")
    assert reads_next("next_step", "raise") and not reads_next("same_step", "raise")
    assert reads_next("next_step", "skip_step")
    with pytest.raises(ValueError, match="read must be"):
        ScreenConfig(read="later")
