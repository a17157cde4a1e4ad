"""The check contract: the phases of an optimizer step, and what the step driver asks of a check.

``sdc_core.driver.step.StepDriver`` runs every check through the same phases (each seam translates its framework's
events; what each phase is for: ``StepCheck``'s methods, docs/architecture.md). Earlier steps' verdicts are read first:
an earlier fault is never reported as a later one's symptom. A check without a built-in ``Role`` is a ``StepCheck``
(``SDCHooks.add_check``). Every rank calls the same phases in the same order; a check runs the same collectives on every
rank, on its error paths too. Cost: a method call per check and phase."""

from __future__ import annotations

from enum import Enum
from typing import Any, ClassVar, Protocol, runtime_checkable

from sdc_core.stats import CheckStats


class Role(Enum):
    """A built-in role whose verdicts the driver relates to the others', or ``STEP_CHECK``."""

    NONFINITE = "nonfinite"  # local gradients checked for NaN/Inf (DDP or sharded)
    SCREEN = "screen"  # the every-step comparison of the ranks' gradient magnitudes
    REPLAY = "replay"  # a partner recomputes a rank's micro-batch (DDP or sharded)
    FINGERPRINT = "fingerprint"  # the replicas' weights compared after the update (DDP or sharded)
    UPDATE_AUDIT = "update_audit"  # a partner recomputes a shard's optimizer update (FSDP2)
    MATMUL = "matmul"  # every nn.Linear product's row sums verified in forward and backward
    STEP_CHECK = "step_check"  # any other check: a ``StepCheck``


@runtime_checkable
class Check(Protocol):
    """What every check has: its role, its counters, and ``discard``: drop what is in flight without
    a collective when training stops on an error (the other ranks may be gone)."""

    role: ClassVar[Role]
    stats: CheckStats

    def discard(self) -> Any: ...


class StepCheck:
    """Base class of a check the driver runs through the phases (defaults do nothing). Each method gets
    the ``StepContext`` and may raise an ``SDCError``, delivered as the check's verdict under ``policy``."""

    role: ClassVar[Role] = Role.STEP_CHECK
    policy: ClassVar[str] = "raise"  # how a verdict is recorded in its incident

    def __init__(self, name: str, config: Any = None, topology: Any = None) -> None:
        self.stats = CheckStats(name)  # its counters: ``sdc/<name>/...`` in the trackers
        self.config = config  # its settings (written into an incident), or None
        self.topology = topology  # the ranks' hosts (``Topology``), for an incident; None: gathered then
        self.last_error: Any = None  # the last verdict (an ``SDCError``), set by the delivery

    def after_backward(self, step: Any) -> None:
        """The step's gradients are reduced: read earlier steps' pending verdicts, start this step's."""

    def before_update(self, step: Any) -> bool:
        """This step's verdict before its update; True drops the update on every rank."""
        return False

    def after_update(self, step: Any, updated: bool) -> None:
        """After the update (``updated``: the weights changed): start a comparison read later."""

    def before_save(self, step: Any) -> None:
        """Before a checkpoint is written: read every pending verdict now."""

    def at_end(self, step: Any) -> None:
        """After the loop: read every pending verdict now (defaults to ``before_save``)."""
        self.before_save(step)

    def discard(self) -> None:
        """Training stops on an error: drop what is in flight, with no collective."""


def require_check(check: Any) -> Any:
    """``check`` when it meets the contract (``Check``: a role, stats, ``discard``), else a one-line ``TypeError``."""
    if not isinstance(check, Check):
        raise TypeError(f"not a check ({type(check).__name__}): subclass sdc_core.checks.contract.StepCheck")
    return check


def check_settings(config: Any, ints: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` unless each setting in ``ints`` is an integer >= 1 and each in ``flags`` True or False."""
    for name in ints:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name in flags:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")


def role_of(check: Any) -> Role:
    """The role ``check`` declares (``Role.STEP_CHECK`` for one that declares none)."""
    return getattr(check, "role", Role.STEP_CHECK)


__all__ = ["Check", "Role", "StepCheck", "require_check", "role_of"]
