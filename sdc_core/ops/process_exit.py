"""How a process ends on an SDC verdict, in one place: the one line, the exit code, the launcher's
marker, the order in which ranks leave, and a clean interpreter exit under torch.distributed.

* **The verdict's exit** (``install_exit_code``): an uncaught ``SDCError`` prints one line per
  process (``errors.verdict_line``; ``SDC_TRACEBACK=1``: the traceback), leaves a marker for the
  launcher (``mark_verdict``), runs what a normal exit runs (threads joined, ``atexit`` handlers)
  and exits with a distinct code (86, ``SDC_EXIT_CODE``). Launchers turn any failed worker into exit
  code 1, so ``sdc run`` / ``accelerate-sdc launch`` (``sdc_core.ops.launch``) read the markers in
  ``$SDC_VERDICT_DIR`` and exit 86; a worker group torchrun restarts after a verdict ends at once
  (``refuse_restart_after_verdict``).
* **Exit order** (``capture``, ``leave``): launchers stop the whole worker group as soon as one
  worker fails, and rank 0 owns the trackers, so on a verdict the other ranks wait for rank 0 at
  exit through the process group's key-value store (across nodes too), at most ``WAIT_S`` seconds.
* **A clean interpreter exit** (``arm``, ``settle_threads``): with a Python DDP communication hook
  (the user's: torch's ``allreduce_hook``, compression, PowerSGD) gloo runs a Python callback on a
  worker thread that takes the GIL again after the bucket is reduced; if the main thread starts
  interpreter teardown first, CPython ends that thread with ``pthread_exit`` and the process aborts
  ("terminate called without an active exception") or hangs. The remedy: release the GIL for a
  settle period (0.2 s) before teardown. ``arm()`` (called when a check is attached to a distributed
  model) turns on the exit handler registered when ``sdc_core`` is first imported, so it runs after
  the ``atexit`` handlers registered later (trackers, Lightning's and Accelerate's teardown).
* **One line for an uncaught configuration error** (``one_line_when_uncaught``): every rank raises
  it alike, and eight tracebacks hide the one line that matters.

Two calls reach below public APIs, for want of public ones: ``atexit._run_exitfuncs`` (the only way
to run the ``atexit`` handlers before choosing the exit code) and torch's ``_get_default_store``
(the store the process group was built on). Cost: nothing during training; at a verdict's exit one
store round trip per rank and one settle period.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from sdc_core.errors import TRACEBACK_ENV, SDCError, verdict_line

EXIT_CODE_ENV = "SDC_EXIT_CODE"
DEFAULT_EXIT_CODE = 86
VERDICT_DIR_ENV = "SDC_VERDICT_DIR"
KEY = "sdc/verdict_exit/rank0_done"  # rank 0's "my exit handlers ran", in the process group's store
WAIT_S = 15.0  # the longest a rank waits at exit for rank 0 to close its trackers
SETTLE_S = 0.2  # the GIL is released this long at exit

_captured: tuple[Any, int] | None = None  # (the default group's store, this process's global rank)
_armed = False


def print_line(text: str) -> None:
    """Print ``text`` on stderr, with ``[rank<r>]: `` in front under a launcher, unless torch's own
    excepthook (``init_process_group`` installs it around ours; it swaps stderr for a buffer) adds it."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}]: " if rank and not isinstance(sys.stderr, io.StringIO) else ""
    sys.stderr.write(f"{prefix}{text}\n")  # one write: under PIPE_BUF, lines of several ranks never interleave
    sys.stderr.flush()


def one_line_when_uncaught(kind: type[BaseException]) -> None:
    """Install the one-line hook for ``kind`` (idempotent while it is the current ``sys.excepthook``);
    the settings call it with ``SDCConfigError`` before raising one."""
    if getattr(sys.excepthook, "_sdc_one_line", None) is kind:
        return
    previous = sys.excepthook

    def hook(raised: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, kind):
            previous(raised, value, tb)
            return
        print_line(f"{raised.__name__}: {value}")

    hook._sdc_one_line = kind  # type: ignore[attr-defined]
    sys.excepthook = hook


def exit_code(environ: Mapping[str, str] | None = None) -> int:
    """The exit code for SDC verdicts: ``SDC_EXIT_CODE`` (0-255; 0 turns it off) or 86 (also
    when the variable is set but empty, as ``VAR=`` in a job script leaves it); read from
    ``environ`` (default: this process's environment)."""
    raw = (os.environ if environ is None else environ).get(EXIT_CODE_ENV, "").strip() or str(DEFAULT_EXIT_CODE)
    if not raw.isdigit() or not 0 <= int(raw) <= 255:
        raise ValueError(f"{EXIT_CODE_ENV} must be an integer in 0..255, got {raw!r}")
    return int(raw)


def install_exit_code() -> None:
    """Make an uncaught ``SDCError`` exit the process with ``exit_code()`` (idempotent).

    The verdict prints one line per process (``SDC_TRACEBACK=1``: the traceback), is marked for the launcher
    (``mark_verdict``), non-daemon threads are joined and the ``atexit`` handlers run (trackers close their runs),
    then the process ends with the code (``SDC_EXIT_CODE=0``: Python's own 1). Ranks other than 0 leave only once
    rank 0's handlers ran (``leave``, at most ``WAIT_S`` seconds). Other exceptions are left alone. In a worker group
    torchrun restarted after an SDC verdict (inside ``sdc run``) the first call ends the process at once with the
    code."""
    if getattr(sys.excepthook, "_sdc", False):
        return
    code = exit_code()
    refuse_restart_after_verdict(code)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, SDCError) and os.environ.get(TRACEBACK_ENV, "").strip() in ("", "0"):
            print_line(verdict_line(value))  # one line, not a traceback
        else:
            previous(kind, value, tb)
        if isinstance(value, SDCError):
            _release_stderr()
            mark_verdict(value)
            exit_cleanly(code or 1)

    hook._sdc = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _release_stderr() -> None:
    """Put the real stderr back, with what was written to the buffer in its place. When
    ``init_process_group`` ran after ``install_exit_code``, torch's excepthook calls ours with
    ``sys.stderr`` swapped for a buffer that it prints (prefixed with the rank) only once ours
    returns, which ours never does: the verdict's traceback, and whatever the ``atexit``
    handlers print, would be lost."""
    captured, real = sys.stderr, sys.__stderr__
    if isinstance(captured, io.StringIO) and real is not None:
        sys.stderr = real
        with contextlib.suppress(Exception):
            rank = os.environ.get("RANK")
            text = captured.getvalue()
            real.write("".join(f"[rank{rank}]: {line}" if rank else line for line in text.splitlines(True)))


def exit_cleanly(code: int) -> None:
    """End the process with ``code`` after what a normal interpreter exit runs first (non-daemon threads joined, the
    ``atexit`` handlers, stdout and stderr flushed), skipping interpreter teardown, where a gloo worker running a
    Python communication hook can abort the process. A script may end with ``exit_cleanly(main())``."""
    with contextlib.suppress(Exception):  # never let the exit path fail
        _join_threads()  # what a normal exit does first
    atexit._run_exitfuncs()  # the trackers close their runs (module docstring: no public way)
    leave()  # after a verdict: rank 0 (the trackers' owner) leaves first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _join_threads() -> None:
    """Join the non-daemon threads, as the interpreter does before its ``atexit`` handlers."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def mark_verdict(error: SDCError, also: str | Path | None = None) -> None:
    """Leave a marker of a raised verdict for whoever started the job (best effort, never raises).

    Writes ``<$SDC_VERDICT_DIR>/<host>-<pid>-<ns>.json`` when ``SDC_VERDICT_DIR`` is set (``sdc run``
    and ``accelerate-sdc launch`` set it), and ``also`` when given (the ``ddp_spawn`` parent reads
    it). Once per error object; a few hundred bytes, atomic (written aside, then renamed).
    """
    if getattr(error, "_sdc_marked", False):
        return
    error._sdc_marked = True  # type: ignore[attr-defined]
    from sdc_core.dist.topology import node_name

    capture()  # the process group may be gone by the time the verdict ends the process
    record = {
        "host": node_name(),
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "restart": _restart_count(),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "error": error.to_dict(),
        "incident": getattr(error, "incident", None) or getattr(error, "incident_dir", None),
    }
    targets = [Path(also)] if also is not None else []
    folder = os.environ.get(VERDICT_DIR_ENV)
    if folder and Path(folder).is_dir():  # absent on the other nodes of a job started on one node
        targets.append(Path(folder) / f"{node_name()}-{os.getpid()}-{time.time_ns()}.json")
    for target in targets:
        try:
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, target)
        except OSError as err:
            warnings.warn(f"SDC verdict marker not written to {target}: {err}", RuntimeWarning, stacklevel=2)


def spawn_marker() -> str:
    """A fresh file name for ``mark_verdict(also=...)``: made in the process that spawns the
    workers and carried to them, where a worker leaves its verdict for that process."""
    return str(Path(tempfile.gettempdir()) / f"sdc-verdict-{uuid.uuid4().hex}.json")


def take_marker(path: str | Path) -> SDCError | None:
    """The verdict ``mark_verdict`` left at ``path`` (the file is removed), or None without a readable one."""
    marker = Path(path)
    if not marker.is_file():
        return None
    try:
        return SDCError.from_dict(json.loads(marker.read_text())["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        marker.unlink(missing_ok=True)


def read_verdicts(folder: str | Path) -> list[dict[str, Any]]:
    """The markers ``mark_verdict`` left in ``folder`` (unreadable ones are skipped)."""
    found = []
    for f in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            found.append(data)
    return found


def _restart_count() -> int:
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.strip().isdigit() else 0


def refuse_restart_after_verdict(code: int | None = None) -> None:
    """End this process with the SDC exit code if torchrun restarted its worker group after an SDC
    verdict of an earlier attempt of the same run (seen through ``$SDC_VERDICT_DIR``, so only
    inside ``sdc run``): training again on the host a check just named would repeat the fault.
    ``--max-restarts`` then still covers crashes, and ``sdc run`` exits with the SDC code."""
    folder, restart = os.environ.get(VERDICT_DIR_ENV), _restart_count()
    if not folder or restart == 0 or not Path(folder).is_dir():
        return
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    for marker in read_verdicts(folder):
        if marker.get("run_id") == run_id and isinstance(marker.get("restart"), int) and marker["restart"] < restart:
            message = marker["error"].get("message", "an SDC verdict")
            print(f"sdc: not restarting after an SDC verdict of attempt {marker['restart']}: {message}",
                  file=sys.stderr, flush=True)  # fmt: skip
            raise SystemExit(code if code is not None else (exit_code() or 1))


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
# A torchrun worker group restarted after an SDC verdict (inside `sdc run`) stops here, at `import
# sdc_core`: before it joins a process group or trains on the host just named.
refuse_restart_after_verdict()


atexit.register(_at_exit)
# A torchrun worker group restarted after an SDC verdict (inside `sdc run`) stops here, at `import
# sdc_core`: before it joins a process group or trains on the host just named.
refuse_restart_after_verdict()

__all__ = ["DEFAULT_EXIT_CODE", "EXIT_CODE_ENV", "KEY", "VERDICT_DIR_ENV", "WAIT_S", "arm", "capture", "exit_cleanly",
           "exit_code", "install_exit_code", "leave", "mark_verdict", "one_line_when_uncaught", "print_line",
           "read_verdicts", "refuse_restart_after_verdict", "settle_threads", "spawn_marker", "take_marker"]
