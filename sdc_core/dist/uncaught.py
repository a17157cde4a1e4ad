"""One line, not a traceback, for an uncaught error that every rank raises alike.

In a launched job every rank raises the same configuration error, and eight tracebacks hide the
one line that matters. ``one_line_when_uncaught(kind)`` makes an uncaught ``kind`` print
``<Kind>: <message>`` on stderr (with ``[rank<r>]: `` in front under a launcher) and the process
exit 1, as after any uncaught exception; other exceptions go to the previous ``sys.excepthook``.
(An uncaught ``SDCError`` verdict has its own hook: ``sdc_core.ops.incidents.install_exit_code``.)
No communication; the standard library only.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any


def print_line(text: str) -> None:
    """Print ``text`` on stderr, with ``[rank<r>]: `` in front under a launcher, unless torch's own
    excepthook (``init_process_group`` installs it around ours; it swaps stderr for a buffer) adds it."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}]: " if rank and not isinstance(sys.stderr, io.StringIO) else ""
    print(prefix + text, file=sys.stderr, flush=True)


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


__all__ = ["one_line_when_uncaught", "print_line"]
