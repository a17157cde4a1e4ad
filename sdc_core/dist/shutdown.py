"""A clean process exit under torch.distributed: no communication thread meets a dying interpreter.

The failure this prevents ("terminate called without an active exception", SIGABRT at exit, and
its twin, a hang at exit). A DDP communication hook written in Python (every Python hook of torch
itself: ``allreduce_hook``, the fp16/bf16 compression hooks, PowerSGD; the SDC checks register
none since they read gradients in per-parameter hooks, but they register the user's)
must return a future with a Python value, made by ``Future.then(python_callback)``. Gloo runs that
callback on one of its worker threads, and the same thread releases it afterwards, which takes the
GIL again (``torch::jit::PythonFunctionGuard``), after DDP has already been told the bucket is
reduced. When that thread is descheduled long enough (2 cores, 3 ranks), the main thread can
finish the script and start interpreter teardown first; CPython then ends any other thread that
asks for the GIL with ``pthread_exit``, whose forced unwind through the C++ destructor calls
``std::terminate``. Backtrace of the aborting thread (gloo worker, torch 2.13, Python 3.11)::

    take_gil -> PyThread_exit_thread -> pthread_exit -> _Unwind_ForcedUnwind -> std::terminate
    <- pybind11::gil_scoped_acquire <- PythonFunctionGuard disposal <- Future::markCompleted
    <- ProcessGroupGloo::runLoop            (main thread: Py_FinalizeEx -> gc_collect_main)

If instead the main thread holds the GIL in C++ while it waits for that worker (destroying the last
reference to a ``ProcessGroupGloo`` joins its workers; DDP's reducer drops it with the GIL held),
the process hangs. The callbacks cannot be avoided (a Python hook whose future has no Python value
is refused by DDP), so the remedy is to let the workers finish with Python first:
``settle_threads()`` releases the GIL until no thread outside Python's own is inside or waiting for
a Python section. A C++ thread holds a Python thread state exactly while it is inside or waits to
enter such a section (pybind11 creates it on entry and deletes it on exit), so the count of thread
states that belong to no ``threading`` thread is the measure.

``arm()`` (the adapters call it when a check is attached to a distributed model) turns on the
exit handler registered when this module is first imported: registered early, it runs after the
``atexit`` handlers registered later (trackers, Lightning's process-group teardown, the Accelerate
hook set's), just before interpreter teardown. Cost: one settle period (0.1 s) at exit, and a
few microseconds per poll; nothing during training.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import time

SETTLE_S = 0.1  # the thread-state count must stay unchanged this long
TIMEOUT_S = 5.0  # never delay an exit longer than this (threads that keep entering Python)

_armed = False


def _python_api() -> ctypes.PyDLL | None:
    """CPython's C API through ctypes, with the three thread-state calls typed (None elsewhere)."""
    try:
        api = ctypes.pythonapi
        api.PyInterpreterState_Get.restype = ctypes.c_void_p
        api.PyInterpreterState_Get.argtypes = []
        api.PyInterpreterState_ThreadHead.restype = ctypes.c_void_p
        api.PyInterpreterState_ThreadHead.argtypes = [ctypes.c_void_p]
        api.PyThreadState_Next.restype = ctypes.c_void_p
        api.PyThreadState_Next.argtypes = [ctypes.c_void_p]
    except (AttributeError, OSError):
        return None
    return api


_API = _python_api()


def foreign_thread_states() -> int | None:
    """How many threads the ``threading`` module does not know (C++ threads: gloo workers,
    autograd, data loaders' native threads) are inside or waiting for a section that holds the
    GIL, read from the interpreter's list of thread states; None where it cannot be read (not
    CPython). Call with the GIL held (any Python code does)."""
    if _API is None:
        return None
    states, state = 0, _API.PyInterpreterState_ThreadHead(_API.PyInterpreterState_Get())
    while state:
        states += 1
        state = _API.PyThreadState_Next(state)
    known = sum(1 for t in threading.enumerate() if not isinstance(t, threading._DummyThread))  # type: ignore[attr-defined]
    return max(states - known, 0)


def settle_threads(settle_s: float = SETTLE_S, timeout_s: float = TIMEOUT_S, poll_s: float = 0.001) -> bool:
    """Release the GIL until no foreign thread is inside or waiting for a Python section, i.e.
    until the count of ``foreign_thread_states()`` has stayed the same for ``settle_s`` (zero, or
    threads that keep a thread state for good), at most ``timeout_s``. Returns True when it
    settled. Each poll sleeps ``poll_s`` without the GIL, so a waiting thread takes it at once;
    without the C API it only sleeps ``settle_s``. Never raises; no collective."""
    try:
        if foreign_thread_states() is None:
            time.sleep(settle_s)
            return True
        start = last_change = time.monotonic()
        count = foreign_thread_states()
        while True:
            time.sleep(poll_s)
            now, seen = time.monotonic(), foreign_thread_states()
            if seen != count:
                count, last_change = seen, now
            elif now - last_change >= settle_s:
                return True
            if now - start >= timeout_s:
                return False
    except Exception:  # an exit path must not fail
        return False


def arm() -> None:
    """Settle the threads at interpreter exit (idempotent; every rank alike, no collective)."""
    global _armed
    _armed = True


def _at_exit() -> None:
    if _armed:
        settle_threads()


atexit.register(_at_exit)

__all__ = ["arm", "foreign_thread_states", "settle_threads"]
