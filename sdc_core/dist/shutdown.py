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
``settle_threads()`` releases the GIL for a settle period, long enough for a worker already
waiting for it to take it, run or release its callback and leave. The threads of C++ libraries
are invisible to ``threading``, so the wait is a fixed period, not a count of waiting threads.

``arm()`` (the adapters call it when a check is attached to a distributed model) turns on the
exit handler registered when this module is first imported: registered early, it runs after the
``atexit`` handlers registered later (trackers, Lightning's process-group teardown, the Accelerate
hook set's), just before interpreter teardown. Cost: one settle period (0.2 s) at exit and on
a distributed run's way out of the loop; nothing during training.
"""

from __future__ import annotations

import atexit
import time

SETTLE_S = 0.2  # the GIL is released this long at exit

_armed = False


def settle_threads(settle_s: float = SETTLE_S) -> None:
    """Release the GIL for ``settle_s`` seconds (in short sleeps, so any thread waiting for the
    GIL takes it at once): a gloo worker finishing a Python callback does so before the caller
    goes on to free the process group or end the interpreter. Never raises; no collective."""
    deadline = time.monotonic() + settle_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.01))


def arm() -> None:
    """Settle the threads at interpreter exit (idempotent; every rank alike, no collective)."""
    global _armed
    _armed = True


def _at_exit() -> None:
    if _armed:
        settle_threads()


atexit.register(_at_exit)

__all__ = ["arm", "settle_threads"]
