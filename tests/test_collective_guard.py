"""The replay's collective guard (``forbid_collectives``, issue 22 item 4) with a real gloo group.

It refuses collectives on the replaying thread only, lets a signal handler's collectives through,
and an exception or signal cutting its entry or exit short at any point never leaves collectives
refused. One process: a gloo group of one rank (its collectives really run).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdc_core.replay import guard as guard_module
from sdc_core.replay.guard import CollectiveInReplay, forbid_collectives

NAMES = [(ns, name) for ns in guard_module._NAMESPACES for name in guard_module._COLLECTIVES]


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _originals() -> dict[tuple[str, str], Any]:
    present = [(ns, n) for ns, n in NAMES if ns in sys.modules and hasattr(sys.modules[ns], n)]
    return {(ns, n): getattr(sys.modules[ns], n) for ns, n in present}


def _works() -> float:
    """A real all-reduce and broadcast through ``torch.distributed`` (raises if refused)."""
    t = torch.full((2,), 3.0)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    return float(t.sum())


def test_another_threads_collectives_pass_during_a_replay(group: None) -> None:
    before = _originals()
    seen: dict[str, Any] = {}
    inside = threading.Event()

    def other() -> None:
        inside.wait(10)
        try:
            seen["sum"] = _works()
        except Exception as err:  # what the test reports
            seen["error"] = repr(err)

    worker = threading.Thread(target=other)
    worker.start()
    with forbid_collectives():
        inside.set()
        worker.join(30)
        with pytest.raises(CollectiveInReplay, match=r"torch\.distributed\.all_reduce"):
            dist.all_reduce(torch.zeros(1))  # the replaying thread's own collective is still refused
    assert seen == {"sum": 6.0}, seen
    assert _originals() == before and _works() == 6.0


def test_a_signal_handlers_collective_passes_during_a_replay(group: None) -> None:
    got: list[float] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(_works()))  # like Lightning's SIGTERM handler
    try:
        with forbid_collectives():
            signal.raise_signal(signal.SIGUSR1)  # the handler runs here, inside the replay
            with pytest.raises(CollectiveInReplay):
                dist.broadcast(torch.zeros(1), src=0)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == [6.0]


class _Interrupt(BaseException):
    """What a signal handler raises (KeyboardInterrupt, SystemExit)."""


def test_an_interrupted_entry_or_exit_never_leaves_collectives_refused(group: None) -> None:
    """An exception at every line the guard runs (entering, installing, leaving, uninstalling),
    as a signal handler's raises between two lines: afterwards collectives work, and once a later
    guard ends every collective is the original again."""
    before = _originals()
    here = guard_module.__file__

    def run(cut: int) -> bool:
        """One guarded replay with an exception at the ``cut``-th line of the guard's code; False
        when the guard runs fewer lines."""
        count = [0]

        def tracer(frame: Any, event: str, _arg: Any) -> Any:
            if frame.f_code.co_filename != here:
                return None
            if event == "line":
                count[0] += 1
                if count[0] == cut:
                    raise _Interrupt(f"line {frame.f_lineno} of {frame.f_code.co_name}")
            return tracer

        sys.settrace(tracer)
        try:
            with forbid_collectives():
                dist.all_reduce(torch.zeros(1))
        except (_Interrupt, CollectiveInReplay):
            pass
        finally:
            sys.settrace(None)
        return count[0] >= cut

    cut, failures = 1, {}
    while run(cut):
        try:
            _works()
        except CollectiveInReplay as err:
            failures[cut] = repr(err)
        cut += 1
    assert cut > 10, "the tracer saw too few lines of the guard"
    assert not failures, f"collectives refused after {len(failures)} interrupted guards, e.g. {sorted(failures)[:3]}"
    with forbid_collectives():
        pass
    assert _originals() == before


def test_a_real_signal_during_entry_and_exit(group: None) -> None:
    """Real signals, from another thread, whose handler raises when it interrupts the guard's own
    code (entering, installing, leaving, uninstalling), over many guarded replays."""
    before = _originals()
    here, cut_short, fired = guard_module.__file__, [0], [0]

    def handler(_signum: int, frame: Any) -> None:
        fired[0] += 1
        if frame is not None and frame.f_code.co_filename == here:
            cut_short[0] += 1
            raise _Interrupt

    old = signal.signal(signal.SIGUSR2, handler)
    stop = threading.Event()

    def pester() -> None:
        while not stop.is_set():
            os.kill(os.getpid(), signal.SIGUSR2)
            stop.wait(0.0001)

    thread = threading.Thread(target=pester)
    thread.start()
    try:
        for _ in range(3000):
            try:
                with forbid_collectives():
                    pass
            except _Interrupt:
                _works()  # right after a cut-short guard
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGUSR2, old)
    assert cut_short[0] > 0, f"no signal landed in the guard's code ({fired[0]} signals)"
    with forbid_collectives():
        pass
    assert _originals() == before and _works() == 6.0
