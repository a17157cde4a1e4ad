"""The every-step screen's part of a step: when its verdict is read, and a hit's confirmation.

Two moments to read the verdict on step ``s`` (``ScreenConfig.read``):

* ``"same_step"``: before step ``s``'s update. The host waits for the screen's rows of step
  ``s``, hence for the end of that step's backward on the device: the update is not queued while
  backward runs. A confirmed hit can then drop that step's update (``on_failure="skip_step"``).
* ``"next_step"``: before step ``s + 1``'s update. The rows of step ``s`` landed during step ``s +
  1``'s forward and backward, so reading them waits for nothing (up to 16 ranks: one all_gather;
  in a larger world the neighbourhood's all-reduce still runs at the read). Step ``s``'s update is
  made; a confirmed hit stops the run one step later (``raise``), before any checkpoint is written
  (``compare_now`` reads a pending verdict first) and before the end. The partner recomputes the
  kept micro-batches of step ``s`` on the weights after that update: one optimizer step changes a
  group's largest gradient by far less than the band (at least 2^5), so the judgement holds.
* ``"auto"`` (the default): ``"next_step"`` where the collectives run on a CUDA device (NCCL)
  unless some replay's policy is ``skip_step`` (which needs the same-step read), ``"same_step"``
  elsewhere (a CPU process waits for nothing on a device; ranks sharing a GPU over gloo copy their
  rows to the host anyway).

A hit is escalated to a partner's recomputation (``replay.confirm.confirm_hits``) by the replay
keeping every step's micro-batches; only a confirmed hit is a verdict, checked against the
replicas' weights first as the replay's own. Without such a replay, or for a step dropped or
audited anyway, hits are only counted. Every rank reads the same verdicts at the same calls, so
the confirmation's collectives match on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sdc_core.dist.topology import collective_device
from sdc_core.replay.confirm import confirm_hits, skips


@dataclass(frozen=True)
class _Observed:
    """What the driver knew of a screened step when it was planned: dropped, or audited by the replay."""

    skipped: bool
    audited: bool


class ScreenVerdicts:
    """Reads the screens' verdicts for ``StepDriver`` at the moment ``ScreenConfig.read`` asks, and
    confirms their hits. Cost: nothing beyond the screen's own read, but on a hit (a partner's
    recomputation of the suspect's micro-batches and one small all_gather)."""

    def __init__(self, driver: Any) -> None:  # the StepDriver
        self.driver = driver
        self._waiting: dict[int, dict[int, _Observed]] = {}  # id(screen) -> step -> its plan, verdict not read
        self._next_step: dict[int, bool] = {}  # id(screen) -> reads one step later (decided at its first step)

    def reads_next_step(self, screen: Any) -> bool:
        """Whether ``screen``'s verdict on a step is read before the next step's update (decided at
        its first step from what every rank has alike: the process group's device and the policy)."""
        decided = self._next_step.get(id(screen))
        if decided is None:
            read = screen.config.read
            if read == "auto":
                skip = any(r.config.on_failure == "skip_step" for r in self.driver.replays)
                decided = collective_device().type == "cuda" and not skip
            else:
                decided = read == "next_step"
            self._next_step[id(screen)] = decided
        return decided

    def before_update(self, step: Any, skipped: bool) -> bool:
        """Each screen's verdict due now: this step's (same-step read) or the previous step's (read
        one step later). True: drop this step's update (a same-step hit the policy skips, or a
        heal or rollback of the replicas before it)."""
        drop = False
        for screen in self.driver.screens:
            recording = self._recording()
            seen = _Observed(skipped, any(r.armed for r in recording))
            if not self.reads_next_step(screen):
                drop = self._judge(screen.suspects(step.index), step, seen, recording, same_step=True) or drop
                continue
            drop = self.resolve(step, screen, before=step.index) or drop
            self._waiting.setdefault(id(screen), {})[step.index] = seen
        return drop

    def resolve(self, step: Any, screen: Any = None, before: int | None = None) -> bool:
        """Read the verdicts still waiting (of steps before ``before``, when given; every screen when
        ``screen`` is None): before a checkpoint, at the end. True: the replicas were healed or
        rolled back (the coming update is stale)."""
        drop = False
        for s in [screen] if screen is not None else self.driver.screens:
            waiting = self._waiting.get(id(s), {})
            for index in sorted(waiting):
                if before is None or index < before:
                    drop = self._judge(s.suspects(index), step, waiting.pop(index), self._recording(),
                                       same_step=False) or drop  # fmt: skip
        return drop

    def discard(self) -> None:
        """Forget the verdicts waiting (an exception left the loop; the screens forget their rows)."""
        self._waiting.clear()

    def _recording(self) -> list[Any]:
        """The replays keeping every step's micro-batches for a confirmation."""
        return [r for r in self.driver.replays if r.keep_every_step and r.active]

    def _judge(self, result: Any, step: Any, seen: _Observed, recording: list[Any], same_step: bool) -> bool:
        """Deliver one screen verdict (``result``, on step ``result.step``): hits are escalated to a
        partner's recomputation on the weights as they are now (``recording``: the replays keeping
        the micro-batches); True to drop the coming update."""
        driver = self.driver
        if not result or seen.skipped or seen.audited or not recording:
            for replay in recording:
                replay.kept.take(result.step)  # forgotten: no confirmation needs them
            return False
        replay, source = recording[0], driver._magnitudes

        def confirm() -> bool:
            group_of = source.magnitude_group if source is not None else (lambda name: None)
            error = confirm_hits(replay, result, step.module, group_of, *driver.seam.replay_functions(replay, step),
                                 after_update=not same_step)  # fmt: skip
            if error is not None:
                if not same_step:
                    error.details["read"] = "one step later: the step's update was made; the run stops here"
                raise error
            return False

        return driver._replay_verdict(replay, step, confirm, skips=lambda error: skips(replay, error, same_step))


__all__ = ["ScreenVerdicts"]
