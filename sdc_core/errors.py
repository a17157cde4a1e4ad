"""Typed exceptions raised by the SDC checks: every rank raises the same one, with the same fields,
in the same step (the verdict is computed from data all ranks exchanged)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

_FIELDS = ("check", "step", "rank", "suspects", "hosts", "details", "reason")  # what to_dict and pickling carry


class SDCError(RuntimeError):
    """A silent-data-corruption check failed.

    Attributes:
        check: ``"nonfinite_gradient"``, ``"ring_replay"`` (also a confirmed screen hit:
            ``details["source"] == "gradient_screen"``), ``"weight_fingerprint"`` or ``"matmul_checksum"``.
        step: the global optimizer step the evidence belongs to.
        rank: the faulty global rank, or ``None`` when it cannot be localized.
        suspects: sorted tuple of the ranks that may be faulty.
        hosts: ``{rank: hostname}`` for every suspect.
        details: JSON-ready evidence (tensor names, values, the pattern seen, node ranks)."""

    check: str = "sdc"

    def __init__(
        self,
        *,
        step: int,
        rank: int | None,
        suspects: Iterable[int],
        hosts: Mapping[int, str] | None = None,
        details: Mapping[str, Any] | None = None,
        reason: str = "",
        check: str | None = None,
    ) -> None:
        if check is not None:
            self.check = check
        self.step = int(step)
        self.rank = None if rank is None else int(rank)
        self.suspects = tuple(sorted(int(r) for r in suspects))
        self.hosts = {int(r): str(h) for r, h in (hosts or {}).items()}
        self.details = dict(details or {})
        self.reason = reason
        super().__init__(self._message())

    def _message(self) -> str:
        nodes = self.details.get("node_ranks", {})

        def where(r: int) -> str:
            host = self.hosts.get(r, "?")
            node = nodes.get(r, nodes.get(str(r)))
            return f"rank {r} (host {host}" + (f", node {node})" if node is not None else ")")

        if self.rank is not None:
            who = f"{where(self.rank)} is faulty"
            action = f"take host {self.hosts.get(self.rank, '?')} out of service"
        elif self.suspects:
            who = "cannot localize; suspects: " + ", ".join(where(r) for r in self.suspects)
            action = self._unlocalized_action()
        else:
            who = "no rank could be named"
            action = ("lower the learning rate, resume from the last checkpoint"  # a diverging run: not a device
                      if self.details.get("pattern") == "diverging" else "inspect the details")
        reason = f": {self.reason}" if self.reason else ""
        return f"SDC check '{self.check}' failed at step {self.step}: {who}{reason}; {action}."

    def _unlocalized_action(self) -> str:
        """What to do when no rank could be named, by what more replicas would change."""
        world = self.details.get("world_size")
        if world == 1:
            return (
                "a single process has no replica to compare with, so this may be the model, the data or the "
                "numerics rather than the device; run with 2 or more replicas to tell them apart")
        if self.details.get("pattern") == "after_screen_hit":  # a fault, or a batch that diverged the run
            return "resume from the last checkpoint: a batch that diverges the run does so again, a transient fault not"
        if world == 2:
            return "run with 3 or more replicas to localize, or test these hosts"
        if self.details.get("several_ranks"):  # same-device re-runs held: devices disagree, not a common cause
            return "several ranks disagree and no single rank explains it: test every suspect host"
        if isinstance(world, int) and len(self.suspects) >= world:
            return "every replica is a suspect: look for a common cause (learning rate, data, numerics) first"
        return "no majority named one rank: test these hosts"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: every key a string, every value a plain type."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        return _jsonable({"type": type(self).__name__, **fields, "message": str(self)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SDCError:
        """Rebuild an error from ``to_dict()`` output; ``ValueError`` for anything else (it may come from a file)."""
        known = (SDCError, NonFiniteGradientError, ReplayMismatchError, FingerprintMismatchError, ChecksumMismatchError)
        types = {t.__name__: t for t in known}
        try:
            kind = types[data["type"]]
            return kind(  # the constructor makes every field of its type, or raises
                step=data["step"],
                rank=data["rank"],
                suspects=data["suspects"],
                hosts=dict(data.get("hosts") or {}),
                details=data.get("details"),
                reason=str(data.get("reason") or ""),
                check=str(data.get("check") or kind.check),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not an SDC error record: {err!r}") from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), {name: getattr(self, name) for name in _FIELDS}))


def _rebuild(cls: type[SDCError], kwargs: dict[str, Any]) -> SDCError:
    return cls(**kwargs)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | str) or value is None or (isinstance(value, float) and abs(value) < float("inf")):
        return value  # a finite float; NaN and infinities as their repr
    return repr(value)


TRACEBACK_ENV = "SDC_TRACEBACK"  # set to 1: an uncaught verdict prints its full traceback too


def verdict_line(error: SDCError) -> str:
    """The one line an uncaught verdict prints on each rank: its type, message and incident (the file
    on the rank that wrote it, the folder elsewhere)."""
    where = getattr(error, "incident", None) or getattr(error, "incident_dir", None)
    incident = f" Incident: {where}." if where else ""
    return f"{type(error).__name__}: {error}{incident} ({TRACEBACK_ENV}=1 shows the traceback)"


class NonFiniteGradientError(SDCError):
    """Local (pre-all-reduce) gradients of one or more ranks contained NaN or Inf."""

    check = "nonfinite_gradient"


class ReplayMismatchError(SDCError):
    """A partner's replay of a rank's micro-batches disagreed with the rank's own result."""

    check = "ring_replay"


class FingerprintMismatchError(SDCError):
    """The replicas' weight fingerprints differ after an optimizer step."""

    check = "weight_fingerprint"


class ChecksumMismatchError(SDCError):
    """A matrix product disagreed with its checksum beyond the rounding bound on one rank.

    Besides the common fields: ``module`` (e.g. ``"encoder.layers.0.linear1"``), ``phase``
    (``"forward"`` or ``"backward"``) and ``host`` (the faulty rank's); ``details["product"]``
    (``"output"``, ``"input_gradient"``, ``"weight_gradient"``) and ``details["violations"]``."""

    check = "matmul_checksum"

    def __init__(self, *, module: str | None = None, phase: str | None = None, **kwargs: Any) -> None:
        given = {"module": module, "phase": phase}
        details = dict(kwargs.pop("details", None) or {}) | {k: v for k, v in given.items() if v is not None}
        super().__init__(details=details, **kwargs)

    @property
    def module(self) -> str | None:
        return self.details.get("module")

    @property
    def phase(self) -> str | None:
        return self.details.get("phase")

    @property
    def host(self) -> str | None:
        return None if self.rank is None else self.hosts.get(self.rank)


class ReplayUnavailableError(RuntimeError):
    """The ring replay audit could not run (a transfer failed on some rank); raised on every rank alike.
    Not evidence of SDC, so not an ``SDCError``: usually the step has a side effect or an input that does not travel."""


def as_sdc_error(exception: BaseException, error: SDCError) -> BaseException:
    """Make ``exception`` (a launcher's re-raise of a worker's error as text, as under ``ddp_spawn``)
    also an instance of ``type(error)`` carrying its fields, in place: ``except SDCError`` and the
    launcher's own ``except`` both work, its attributes stay. Pickles as ``type(error)``."""
    if isinstance(exception, SDCError):
        return exception
    kind = type(error)
    both = type(kind.__name__, (kind, type(exception)), {  # named as the SDC error it is
        "__module__": kind.__module__,
        "__qualname__": kind.__qualname__,
        "__reduce__": lambda self: (_rebuild, (kind, dict(error.__reduce__()[1][1]))),
    })  # fmt: skip
    exception.__class__ = both
    for name, value in vars(error).items():
        setattr(exception, name, value)
    exception.args = error.args
    return exception

