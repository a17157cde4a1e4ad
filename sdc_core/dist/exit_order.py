"""Exit order on an SDC verdict: the process that owns the trackers leaves last.

torchrun and ``accelerate launch`` stop the whole worker group (SIGTERM, then SIGKILL) as soon as
one worker exits with a failure. Every rank raises the verdict in the same step, but global rank
0, the process that owns the trackers (MLflow, W&B, TensorBoard through the Trainer, Accelerate
or Lightning), has more to do on the way out (the incident, the final metrics, its ``atexit``
handlers that end the tracker's run), so the other ranks used to exit first and rank 0 was
killed before its runs were closed: an MLflow run stayed RUNNING.

So, on a verdict that leaves the script (``incidents.install_exit_code``): ``capture()`` keeps
the default process group's key-value store when the verdict is marked (the group may be
destroyed before the exit), and at the exit, after this process's ``atexit`` handlers ran,
``leave()`` has rank 0 set a key and every other rank wait for it, at most ``WAIT_S`` seconds.
The store is the one the process group was built on (torchrun's agent store, or the
``MASTER_ADDR`` store), so the order holds across nodes. Cost: one store round trip per rank
at a verdict's exit; a rank whose rank 0 never gets there (it caught the verdict, or died)
waits ``WAIT_S`` at most; a store that is gone ends the wait at once. Never raises.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

WAIT_S = 15.0  # the longest a rank waits at exit for rank 0 to close its trackers
KEY = "sdc/verdict_exit/rank0_done"

_captured: tuple[Any, int] | None = None  # (the default group's store, this process's global rank)


def capture() -> None:
    """Keep the default process group's store and this process's rank for ``leave()`` (call on
    a verdict, while the group is alive; once per process). Nothing without a group of 2 or more.
    Holds a reference to the store until the process ends. Never raises; no communication."""
    global _captured
    if _captured is not None or "torch.distributed" not in sys.modules:
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _captured = (dist.distributed_c10d._get_default_store(), dist.get_rank())
    except Exception:  # an exit path must not fail
        return


def leave(wait_s: float = WAIT_S) -> bool:
    """Call after this process's ``atexit`` handlers ran, just before it ends: rank 0 says its
    handlers (the trackers' end-of-run) are done; every other rank waits for that, at most
    ``wait_s`` seconds. Returns True when the order was kept (nothing to do counts), False when
    the wait ran out or the store failed. Never raises."""
    if _captured is None:
        return True
    store, rank = _captured
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        if rank == 0:
            store.set(KEY, b"1")
        else:
            store.wait([KEY], timedelta(seconds=wait_s))
    except Exception:  # the wait ran out, or the store's host is gone (rank 0 has left)
        return False
    return True


__all__ = ["KEY", "WAIT_S", "capture", "leave"]
