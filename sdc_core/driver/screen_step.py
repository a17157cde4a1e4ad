"""The every-step screen's part of a step: when its verdict is read, and a hit's confirmation.

The verdict on step ``s`` is read (``ScreenConfig.read``) before step ``s``'s update (``"same_step"``: the host waits
for that step's backward; a confirmed hit can drop the update) or before step ``s + 1``'s (``"next_step"``: waits for
nothing; a confirmed hit stops the run one step later, before any checkpoint and the end; the recomputation is on the
updated weights, so it confirms less: ``confirm._judge``). ``"auto"``: ``"next_step"`` on every device unless some
replay's policy is ``skip_step`` (which must drop the faulty step's own update); on a 3-rank CPU Lightning run, waiting
in the step cost about 8% of a 0.1 s step.

A hit is escalated to a partner's recomputation (``replay.confirm.confirm_hits``) of the micro-batches the replay kept;
only a confirmed hit is a verdict, checked against the replicas' weights first. Without such a replay, or for a step
dropped or audited anyway, hits are only counted. Every rank reads the same verdicts at the same calls, so the
confirmation's collectives match on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sdc_core.replay.confirm import confirm_hits, skips


@dataclass(frozen=True)
class _Observed:
    """What the driver knew of a screened step when it was planned: dropped, or audited by the replay."""

    skipped: bool
    audited: bool


class ScreenVerdicts:
    """Reads the screens' verdicts for ``StepDriver`` when ``ScreenConfig.read`` asks, and confirms their hits.
    Cost: on a hit only, a partner's recomputation and one small all_gather."""

    def __init__(self, driver: Any) -> None:  # the StepDriver
        self.driver = driver
        self._waiting: dict[int, dict[int, _Observed]] = {}  # id(screen) -> step -> its plan, verdict not read
        self._next_step: dict[int, bool] = {}  # id(screen) -> reads one step later (decided at its first step)

    def reads_next_step(self, screen: Any) -> bool:
        """Whether ``screen``'s verdict on a step is read at the next step (decided once, alike on every rank)."""
        if id(screen) not in self._next_step:
            read = screen.config.read
            if read == "auto":
                skip = any(r.config.on_failure == "skip_step" for r in self.driver.replays)
                read = "same_step" if skip else "next_step"
            self._next_step[id(screen)] = read == "next_step"
        return self._next_step[id(screen)]

    def before_update(self, step: Any, skipped: bool) -> bool:
        """Each screen's verdict due now (this step's or the previous step's). True: drop this step's update."""
        drop = False
        for screen in self.driver.screens:
            recording = self.recording()
            seen = _Observed(skipped, any(r.armed for r in recording))
            if not self.reads_next_step(screen):
                drop = self._judge(screen.suspects(step.index), step, seen, recording, same_step=True) or drop
                continue
            drop = self.resolve(step, screen, before=step.index) or drop
            self._waiting.setdefault(id(screen), {})[step.index] = seen
        return drop

    def resolve(self, step: Any, screen: Any = None, before: int | None = None) -> bool:
        """Read the verdicts still waiting (of steps before ``before``; of every screen when ``screen`` is None).
        True: the replicas were healed or rolled back (the coming update is stale)."""
        drop = False
        for s in [screen] if screen is not None else self.driver.screens:
            waiting = self._waiting.get(id(s), {})
            for index in sorted(waiting):
                if before is None or index < before:
                    drop = self._judge(s.suspects(index), step, waiting.pop(index), self.recording(),
                                       same_step=False) or drop  # fmt: skip
        return drop

    def discard(self) -> None:
        """Forget the verdicts waiting (an exception left the loop; the screens forget their rows)."""
        self._waiting.clear()

    def recording(self) -> list[Any]:
        """The replays keeping every step's micro-batches for a confirmation."""
        return [r for r in self.driver.replays if r.keep_every_step and r.active]

    def _judge(self, result: Any, step: Any, seen: _Observed, recording: list[Any], same_step: bool) -> bool:
        """Deliver one screen verdict: hits are escalated to a partner's recomputation on the weights as they are
        now (``recording``: the replays keeping the micro-batches); True to drop the coming update."""
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
