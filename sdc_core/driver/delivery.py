"""``Delivery``: what happens to one check's verdict, whatever the seam.

A verdict is returned (skipped, warned, healed: its incident recorded with the policy applied),
raised (recorded as ``"raise"``, marked for the launcher, re-raised; recorded once even when it
passes through an outer delivery) or, with ``on_failure="rollback"``, handed to the seam's
rollback (recorded as ``"rollback"``; ``ROLLED_BACK`` is returned). Each recorded verdict also
goes to the seam's report (its counters to the trackers). The seam is the driver's
(``sdc_core.driver.step.Seam``: ``run_dir``, ``is_main``, ``report``, ``mark``, ``rollback``). No
communication beyond what the seam's rollback does (every rank together).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdc_core.checks.contract import Role, role_of
from sdc_core.errors import SDCError
from sdc_core.ops.incidents import record_verdict


class RolledBack:
    """What ``deliver`` returns when the seam rolled back instead of raising."""

    def __repr__(self) -> str:
        return "ROLLED_BACK"


ROLLED_BACK = RolledBack()


class Delivery:
    """The delivery of verdicts through ``seam``; ``rolled_back``: the verdict of the last rollback,
    with what was done."""

    def __init__(self, seam: Any) -> None:
        self.seam = seam
        self._recorded: BaseException | None = None  # the last verdict whose incident was written
        self.rolled_back: SDCError | None = None

    def deliver(self, check: Any, run: Callable[[], Any], policy: str | None = None) -> Any:
        """Run one check's call and deliver its verdict: returned (recorded with ``policy``, default
        the check's ``on_failure``), raised, or rolled back by the seam (returns ``ROLLED_BACK``)."""
        policy = policy or _policy(check)
        try:
            out = run()
        except SDCError as err:
            if err is self._recorded:  # raised through an outer call: recorded once
                self.seam.mark(err)
                raise
            if check.last_error is None:
                check.last_error = err
            if _policy(check) == "rollback":
                try:
                    check.last_error = self.seam.rollback(err, _rollback_bound(check, err))
                except SDCError as failed:
                    check.last_error = failed
                    self._raise(check, failed)
                check.stats.bump("rollbacks")
                self.rolled_back = check.last_error
                self._record(check, "rollback")
                return ROLLED_BACK
            self._raise(check, err)
        self._record(check, policy)
        return out

    def _raise(self, check: Any, err: SDCError) -> None:
        self._recorded = err
        self._record(check, "raise")
        self.seam.mark(err)
        raise err

    def _record(self, check: Any, policy: str) -> None:
        """The incident of ``check``'s last verdict (main process; a failed write only warns)."""
        error = check.last_error
        if error is None:
            return
        path = record_verdict(check, self.seam.run_dir, self.seam.is_main, policy)
        self.seam.report(check, policy)
        if self.seam.is_main:
            self.seam.report_incident(error, path)


def _policy(check: Any) -> str:
    config = getattr(check, "config", None)
    return getattr(config, "on_failure", "raise") if config is not None else "raise"


def _rollback_bound(check: Any, error: SDCError) -> int:
    """The newest step a rollback may return to: for a weight fault, the step after the last
    comparison that found the replicas equal; for a compute fault, the faulty step."""
    if role_of(check) is Role.FINGERPRINT:
        return check.stats.last_verified_step + 1
    return error.step


__all__ = ["ROLLED_BACK", "Delivery", "RolledBack"]
