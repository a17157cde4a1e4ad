"""Collectives refused inside a replay: a replay runs on one rank only, so a collective in it would leave the ranks in
different collectives.

Contract: inside ``forbid_collectives()`` the ``torch.distributed`` collectives, as looked up at call time, raise
``CollectiveInReplay`` on the thread that entered it, before they reach the transport; other threads' collectives and
those of a Python signal handler interrupting the replay go through. An entry or exit cut short never leaves collectives
refused. Cost: a wrapped collective outside a guard pays one thread-local look-up. Limits: functions imported by name
before the replay and functional collectives are not refused."""

from __future__ import annotations

import functools
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class CollectiveInReplay(RuntimeError):
    """A ``torch.distributed`` collective was called inside a replay (refused before transport)."""


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "all_gather_coalesced", "send_object_list", "recv_object_list",
)  # fmt: skip
_NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.nn.functional",
               "torch.distributed.nn")  # fmt: skip


class _Guard:
    """One replay's refusal of collectives, on the thread that entered it (``forbid_collectives``)."""

    __slots__ = ("__weakref__", "active", "entry")

    def __init__(self) -> None:
        self.active = False
        self.entry = 0  # id() of the frame that entered the guard: the signal-handler search stops there

    def __enter__(self) -> None:
        self.entry = id(sys._getframe(1))
        stack = _LOCAL.guards
        stack[:] = [g for g in stack if (t := g()) is not None and t.active]  # guards cut short are gone
        stack.append(weakref.ref(self))
        _install(self)
        self.active = True  # from here on (one attribute store) this thread's collectives are refused

    def __exit__(self, *_exc: object) -> None:
        self.active = False
        _LOCAL.guards[:] = [g for g in _LOCAL.guards if (t := g()) is not None and t is not self and t.active]
        _uninstall()


class _Local(threading.local):
    def __init__(self) -> None:
        self.guards: list[weakref.ref[_Guard]] = []  # this thread's (weak: an interrupted exit dies with the guard)


_GUARD_CODES = frozenset((_Guard.__enter__.__code__, _Guard.__exit__.__code__))
_LOCAL = _Local()
_LOCK = threading.RLock()  # re-entrant: a signal handler on the locking thread may enter a guard too
_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}  # (namespace, name) -> the function wrapped


def _refuses(frame: Any) -> bool:
    """Whether the collective called from ``frame`` is the replay's: a live guard of this thread entered on the
    stack, no signal handler in between. A guard whose entering frame has returned is dropped here."""
    codes: set[Any] | None = None
    for ref in reversed(_LOCAL.guards):
        guard = ref()
        if guard is None or not guard.active:
            continue
        f = frame
        while f is not None and id(f) != guard.entry:
            codes = _handler_codes() if codes is None else codes
            if f.f_code in codes:
                return False
            f = f.f_back
        if f is not None and not _cut_short(guard):
            return True
        guard.active = False
    return False


def _cut_short(guard: _Guard) -> bool:
    """Whether an exception being handled now (or one it replaced) left ``guard``'s own entry or exit."""
    err: BaseException | None = sys.exc_info()[1]
    seen = 0
    while err is not None and seen < 16:
        tb = err.__traceback__
        while tb is not None:
            if tb.tb_frame.f_locals.get("self") is guard and tb.tb_frame.f_code in _GUARD_CODES:
                return True
            tb = tb.tb_next
        err, seen = err.__context__, seen + 1
    return False


def _handler_codes() -> set[Any]:
    """The code objects of the Python signal handlers installed now."""
    codes = set()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        while isinstance(handler, functools.partial):
            handler = handler.func
        if not callable(handler):  # SIG_DFL, SIG_IGN, None
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        code = code or getattr(type(handler).__call__, "__code__", None)  # a callable object (Lightning's)
        if code is not None:
            codes.add(code)
    return codes


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _LOCAL.guards and _refuses(sys._getframe(1)):
            raise CollectiveInReplay(f"torch.distributed.{name} was called inside the replayed training step")
        return original(*args, **kwargs)

    collective._sdc_wrapped = original  # type: ignore[attr-defined]
    return collective


def _install(guard: _Guard) -> None:
    """Wrap every collective (idempotent; an interrupted install leaves pass-through wrappers)."""
    with _LOCK:
        _ALL.add(guard)
        for ns in _NAMESPACES:
            mod = sys.modules.get(ns)
            for name in _COLLECTIVES if mod is not None else ():
                fn = getattr(mod, name, None)
                if callable(fn) and not hasattr(fn, "_sdc_wrapped"):
                    _ORIGINALS[(ns, name)] = fn
                    setattr(mod, name, _wrap(name, fn))


def _uninstall() -> None:
    """Put the originals back once no thread has a live guard."""
    with _LOCK:
        if any(g.active for g in list(_ALL)):
            return
        for (ns, name), fn in list(_ORIGINALS.items()):
            mod = sys.modules.get(ns)
            if mod is not None and hasattr(getattr(mod, name, None), "_sdc_wrapped"):
                setattr(mod, name, fn)


_ALL: weakref.WeakSet[_Guard] = weakref.WeakSet()


def forbid_collectives() -> AbstractContextManager[None]:
    """Inside, the collectives raise ``CollectiveInReplay`` on THIS thread; other threads' and signal handlers'
    (Lightning's SIGTERM handler broadcasts) go through: refusing them on one rank would make the ranks diverge."""
    return _Guard()
