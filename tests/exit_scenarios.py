"""The gloo abort at exit, reproduced on demand (issue 11 item 7). Run as two plain processes:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/exit_scenarios.py {armed,control}

Rank 0 chains a Python callback on an asynchronous gloo all-reduce (what every Python DDP
communication hook does) and holds the GIL until the gloo worker that completed it is waiting for
the GIL, then ends the script. ``control``: the worker meets interpreter teardown and the process
aborts ("terminate called without an active exception", SIGABRT) in most runs (in the others the
GIL was handed over before teardown began). ``armed``: ``sdc_core.dist.process_exit.arm()`` lets the worker
finish first and the process exits 0.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_core.ops import process_exit


class _ReleasesTheGilInTeardown:
    """Left in a reference cycle with the collector off: collected by interpreter teardown's own
    collection, where it releases the GIL, as torch's destructors do (a process group is
    destroyed without the GIL)."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0.05)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if sys.argv[1] == "armed":
        process_exit.arm()
    t = torch.ones(4)
    if rank == 1:
        time.sleep(0.2)
        dist.all_reduce(t)  # completes rank 0's asynchronous all-reduce
        time.sleep(1.0)
        return
    gc.disable()  # nothing collected (no GIL released) before teardown
    future = dist.all_reduce(t, async_op=True).get_future()
    future.then(lambda f: f.value()[0] * 2)
    sys.setswitchinterval(1000.0)  # keep the GIL: the gloo worker must wait for it
    deadline = time.monotonic() + 60
    while not future.done() and time.monotonic() < deadline:
        pass
    held = time.monotonic() + 0.5  # the worker that completed it now waits for the GIL to run the callback
    while time.monotonic() < held:
        pass
    # not flushed: writing would release the GIL now (stdout is flushed in teardown, which then does)
    print(f"waiting at exit: {int(future.done())}")
    _ReleasesTheGilInTeardown()


if __name__ == "__main__":
    main()
