"""``CounterLog``: the checks' counters as tracker points, one per step and metric.

A point is never written twice for one step with different values: a periodic point is only noted
(``due``) and written once the next step's verdicts are in (``write_due``), or by a forced write
(``now``: at the end, or when a verdict leaves the loop), which also flushes the trackers. The
points go through the framework's ``log`` (``Framework.log``); no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdc_core.driver.framework import Framework


class CounterLog:
    """The tracker points of ``checks()``' counters, written through ``fw``."""

    def __init__(self, fw: Framework, checks: Callable[[], list[Any]]) -> None:
        self._fw = fw
        self._checks = checks
        self._due: int | None = None  # step of the periodic point not written yet
        self._written: int | None = None  # the last step written

    def metrics(self) -> dict[str, float]:
        """Every check's counters, by metric name."""
        out: dict[str, float] = {}
        for check in self._checks():
            out.update(check.stats.metrics())
        return out

    def due(self, step: int) -> None:
        """A periodic point at ``step``: written by ``write_due`` or ``now``, whichever comes first."""
        self._due = step

    def write_due(self) -> None:
        """Write the pending periodic point (its step's verdicts are in), unless its step was written."""
        if self._due is not None:
            step, self._due = self._due, None
            if self._written != step:
                self._write(step)

    def now(self, step: int) -> None:
        """Write the point of ``step`` now (unless written already) and flush the trackers."""
        self._due = None
        if self._written != step:
            self._write(step)
        self._fw.flush()

    def _write(self, step: int) -> None:
        self._fw.log(self.metrics(), step)
        self._written = step


__all__ = ["CounterLog"]
