"""Rollback to the newest checkpoint verified clean, whatever the framework."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdc_core.errors import SDCError
from sdc_core.io.checkpoints import newest_verified


def roll_back(error: SDCError, max_step: int, folders: list[str], *, is_main: bool, trust_pickle: bool,
              broadcast: Callable[[Any], Any], restore: Callable[[str], Any]) -> SDCError:  # fmt: skip
    """Restore on every rank the newest checkpoint of ``folders`` verified clean at or before ``max_step``
    (chosen on the main rank, weights-only reads unless ``trust_pickle``; ``broadcast(obj)`` returns
    the main rank's ``obj`` everywhere; ``restore(path)`` returns its step). Returns ``error`` with
    ``details["action"]`` (and ``"rollback_skipped"``) set; raises it when there is none."""
    skipped: list[str] = []
    path = None
    if is_main:
        try:  # whatever happens here, every rank meets at the broadcast below
            path = newest_verified(folders, max_step, trust_pickle=trust_pickle, skipped=skipped)
        except Exception as err:
            skipped.append(f"checkpoint search failed: {type(err).__name__}: {err}")
    path, skipped = broadcast((str(path) if path else None, skipped[:20]))  # the same on every rank
    details = dict(error.details)
    if skipped:
        details["rollback_skipped"] = skipped
    if path is None:
        details["action"] = f"rollback failed: no checkpoint verified clean at or before step {max_step} in {folders}"
        if skipped:
            details["action"] += f" ({len(skipped)} passed over, e.g. {skipped[0]})"
        raise _with_details(error, details)
    step = restore(path)
    details["action"] = f"rolled back to {path} (step {step})"
    return _with_details(error, details)


def _with_details(error: SDCError, details: dict[str, Any]) -> SDCError:
    return type(error)(step=error.step, rank=error.rank, suspects=error.suspects, hosts=error.hosts,
                       details=details, reason=error.reason)  # fmt: skip


__all__ = ["roll_back"]
