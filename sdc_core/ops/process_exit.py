"""How a process ends on an SDC verdict (docs/incidents-and-exit-codes.md): the one line, the exit code (86) and the
marker ``sdc run`` reads (``install_exit_code``); ranks other than 0 waiting at exit, at most ``WAIT_S``, for rank 0,
which owns the trackers (``capture``, ``leave``); and a clean interpreter exit under a Python DDP communication hook
(``arm``, ``settle_threads``): gloo runs the hook on a worker thread that aborts the process if teardown starts first,
so the GIL is released for 0.2 s before it. This module is imported first by ``sdc_core`` so that its exit handler runs
after those registered later. Below public APIs, for want of public ones: ``atexit._run_exitfuncs`` and torch's
``_get_default_store``. Cost: nothing during training; one store round trip at a verdict's exit."""

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
    """Print ``text`` on stderr, with ``[rank<r>]: `` in front under a launcher (unless torch's
    excepthook, which swaps stderr for a buffer, adds it)."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}]: " if rank and not isinstance(sys.stderr, io.StringIO) else ""
    sys.stderr.write(f"{prefix}{text}\n")  # one write: under PIPE_BUF, lines of several ranks never interleave
    sys.stderr.flush()


def one_line_when_uncaught(kind: type[BaseException]) -> None:
    """Print an uncaught ``kind`` as one line, not a traceback per rank (idempotent)."""
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
    """``SDC_EXIT_CODE`` of ``environ`` (default: ours): 0-255 (0 turns it off); 86 when unset or empty."""
    raw = (os.environ if environ is None else environ).get(EXIT_CODE_ENV, "").strip() or str(DEFAULT_EXIT_CODE)
    if not raw.isdigit() or not 0 <= int(raw) <= 255:
        raise ValueError(f"{EXIT_CODE_ENV} must be an integer in 0..255, got {raw!r}")
    return int(raw)


def install_exit_code() -> None:
    """Make an uncaught ``SDCError`` print one line (``SDC_TRACEBACK=1``: the traceback), leave its
    marker and end the process through ``exit_cleanly(exit_code() or 1)`` (idempotent). Other
    exceptions are left alone. After a verdict's restart inside ``sdc run``, ends the process at once."""
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
    """Put the real stderr back, writing out what torch's excepthook buffered in its place (it
    prints the buffer only once our hook returns, which it never does)."""
    captured, real = sys.stderr, sys.__stderr__
    if isinstance(captured, io.StringIO) and real is not None:
        sys.stderr = real
        with contextlib.suppress(Exception):
            rank = os.environ.get("RANK")
            text = captured.getvalue()
            real.write("".join(f"[rank{rank}]: {line}" if rank else line for line in text.splitlines(True)))


def exit_cleanly(code: int) -> None:
    """End the process with ``code`` after joining non-daemon threads, running the ``atexit``
    handlers, ``leave()`` and flushing, skipping interpreter teardown (where a gloo worker can abort
    the process). A script may end with ``exit_cleanly(main())``."""
    with contextlib.suppress(Exception):  # never let the exit path fail; join what a normal exit joins first
        for thread in threading.enumerate():
            if thread not in (threading.current_thread(), threading.main_thread()) and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()  # the trackers close their runs
    leave()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def mark_verdict(error: SDCError, also: str | Path | None = None) -> None:
    """Write the verdict's marker atomically to ``$SDC_VERDICT_DIR/<host>-<pid>-<ns>.json`` (when
    set) and to ``also`` (when given), once per error; a failed write only warns."""
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
    """A fresh file name for ``mark_verdict(also=...)``, made by the process that spawns workers."""
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
    """End this process with the SDC exit code when torchrun restarted its worker group after an SDC
    verdict of an earlier attempt of the same run (markers in ``$SDC_VERDICT_DIR``: inside ``sdc run``
    only): training again on the host just named would repeat the fault."""
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
    """Keep the default group's store and this rank for ``leave()``, on a verdict. Never raises."""
    global _captured
    if _captured is not None or "torch.distributed" not in sys.modules:
        return
    with contextlib.suppress(Exception):  # an exit path must not fail
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _captured = (dist.distributed_c10d._get_default_store(), dist.get_rank())


def leave(wait_s: float = WAIT_S) -> bool:
    """After the ``atexit`` handlers: rank 0 says it is done; every other rank waits for that, at
    most ``wait_s`` seconds. False when the wait ran out or the store failed. Never raises."""
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
    """Release the GIL for ``settle_s`` seconds in short sleeps, so a gloo worker finishes its Python
    callback before the process group is freed or the interpreter ends. No collective."""
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
# A worker group restarted after an SDC verdict stops here, at `import sdc_core`: before it trains again.
refuse_restart_after_verdict()

__all__ = ["DEFAULT_EXIT_CODE", "EXIT_CODE_ENV", "KEY", "VERDICT_DIR_ENV", "WAIT_S", "arm", "capture", "exit_cleanly",
           "exit_code", "install_exit_code", "leave", "mark_verdict", "one_line_when_uncaught", "print_line",
           "read_verdicts", "refuse_restart_after_verdict", "settle_threads", "spawn_marker", "take_marker"]
