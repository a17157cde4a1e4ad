"""The run's closing line (docs/incidents-and-exit-codes.md, "At the end of a run"): what the checks checked and whether
they found anything, logged once by rank 0 (logger ``sdc_checks``, INFO) and sent to the trackers; ``SDC_RUN_SUMMARY=0``
turns it off. Cost: once per run, no collective."""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from sdc_core.ops.trackers import log_summary
from sdc_core.schema import env_flag

LOGGER_NAME = "sdc_checks"
SUMMARY_ENV = "SDC_RUN_SUMMARY"
_SUMMARISED: weakref.WeakSet[Any] = weakref.WeakSet()  # the seams whose run was summarised (once each)


def run_summary(steps: int, checks: Iterable[Any], run_dir: str | None = None) -> str:
    """The closing line: each check (its ``stats``) with the times it ran, then "no SDC found" or the verdicts."""
    parts, verdicts = [], {}
    for check in checks:
        stats = check.stats
        unit = " audits" if stats.check == "ring_replay" else ""
        parts.append(f"{stats.check} ({stats.runs}{unit}{_observed(check)})")
        if stats.failures:
            verdicts[stats.check] = stats.failures
    line = f"sdc-checks: {steps} steps checked by {', '.join(parts) or 'no check'}"
    if not verdicts:
        return line + "; no SDC found"
    total = sum(verdicts.values())
    where = f": sdc report {run_dir}" if run_dir else ""
    listed = ", ".join(f"{name} {n}" for name, n in sorted(verdicts.items()))
    return f"{line}; {total} SDC verdict{'s' if total != 1 else ''} ({listed}){where}"


def _observed(check: Any) -> str:
    """What a check saw that is no verdict: the screen's hits, the replay's unexplained differences."""
    extra = check.stats.extra or {}
    if hits := int(extra.get("hits", 0)):  # the screen's
        return f"; {hits} hit{'s' if hits != 1 else ''}"
    n = int(extra.get("unexplained_differences", 0))
    if not n:
        return ""
    last = f", rank {int(extra['last_unexplained_rank'])} at step {int(extra['last_unexplained_step'])}"
    return f"; {n} unexplained difference{'s' if n != 1 else ''}{last if 'last_unexplained_rank' in extra else ''}"


def _wanted() -> bool:
    if not os.environ.get(SUMMARY_ENV, "").strip():
        return True
    try:
        return env_flag(SUMMARY_ENV)
    except ValueError as err:  # at the end of a run: said, not raised
        warnings.warn(f"{err}; the run summary is logged", UserWarning, stacklevel=3)
        return True


def log_run_summary(steps: int, checks: Iterable[Any], seam: Any) -> str | None:
    """Log ``run_summary`` once per ``seam`` on the main process, unless ``SDC_RUN_SUMMARY=0``, and
    return it. Every rank calls it: ``seam.run_dir`` may be collective, and is asked on every rank alike."""
    if seam in _SUMMARISED:
        return None
    _SUMMARISED.add(seam)
    checks = [c for c in checks if getattr(c, "stats", None) is not None]
    run_dir = seam.run_dir if any(c.stats.failures for c in checks) else None
    if not seam.is_main or not _wanted():
        return None
    line = run_summary(steps, checks, run_dir)
    logger = logging.getLogger(LOGGER_NAME)
    if not logging.getLogger().handlers and not logger.handlers:  # nothing configured: show it on stderr
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    logger.info(line)
    log_summary(seam.tracker_targets(), line, steps)
    return line


__all__ = ["LOGGER_NAME", "SUMMARY_ENV", "log_run_summary", "run_summary"]
