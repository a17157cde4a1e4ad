"""``sdc run -- <launch command>``: the job's exit code tells an SDC verdict from a crash.

torchrun, ``accelerate launch`` and most launchers turn any failed worker into their own exit code 1. ``sdc run`` starts
the command with ``SDC_VERDICT_DIR`` naming a fresh private folder, where every process that raises an SDC verdict
(uncaught, or through the adapters) leaves a marker. Then:

* exit 0 stays 0 (the job finished, or handled the verdict itself);
* a failure with a marker exits ``SDC_EXIT_CODE`` (default 86; 0 keeps the command's code);
* any other failure keeps the command's own code (a command killed by a signal: 128 + its number).

SIGTERM, SIGHUP, SIGUSR1, SIGUSR2 (and SIGINT/SIGQUIT not from the terminal, which sends them to the command itself) are
forwarded. Under ``torchrun --max-restarts N`` a worker group restarted after an SDC verdict ends at once with the SDC
code instead of training again on the host just named. Multi-node: run ``sdc run`` on every node."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

USAGE = "usage: sdc run [--] COMMAND [ARG ...]   (e.g. sdc run -- torchrun --nproc-per-node 8 train.py)"
_FORWARDED = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGQUIT")
_FROM_TERMINAL = ("SIGINT", "SIGQUIT")


def job_exit_code(returncode: int, verdicts: Sequence[dict[str, Any]], sdc_code: int | None = None) -> int:
    """The exit code for the job: see the module docstring."""
    from sdc_core.ops.process_exit import exit_code

    code = exit_code() if sdc_code is None else sdc_code
    if returncode == 0:
        return 0
    if verdicts and code:
        return code
    return 128 - returncode if returncode < 0 else returncode


def summary(returncode: int, verdicts: Sequence[dict[str, Any]], job_code: int) -> str | None:
    """The line ``sdc run`` ends with (None when the job succeeded without a verdict)."""
    if verdicts:
        message = str((verdicts[0].get("error") or {}).get("message") or "an SDC verdict")
        places = [str(v["incident"]) for v in verdicts if v.get("incident")]
        incident = next((p for p in places if p.endswith(".json")), places[0] if places else None)
        where = f" Incident: {incident}." if incident else ""
        if returncode == 0:
            return f"sdc run: the job finished (exit 0); it handled an SDC verdict itself: {message}{where}"
        return f"sdc run: the job ended on an SDC verdict (exit {job_code}): {message}{where}"
    if returncode != 0:
        return (f"sdc run: the job failed (exit {job_code}) for a reason other than an SDC verdict: no process "
                "raised one (see the job's own error above)")  # fmt: skip
    return None


def _in_foreground() -> bool:
    """Whether this process group is a terminal's foreground group (the terminal then sends
    SIGINT/SIGQUIT to the command as well, so forwarding them would deliver them twice)."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return os.tcgetpgrp(stream.fileno()) == os.getpgrp()
    return False


def run_command(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` with a fresh ``SDC_VERDICT_DIR`` and return the job's exit code (``sdc run``)."""
    from sdc_core.ops.process_exit import (  # here: `sdc run --help` stays quick
        VERDICT_DIR_ENV,
        exit_code,
        read_verdicts,
    )

    env = dict(os.environ if env is None else env)
    sdc_code = exit_code(env)  # the command's setting; a bad one is named before anything starts
    folder = tempfile.mkdtemp(prefix="sdc-verdict-")
    env[VERDICT_DIR_ENV] = folder
    try:
        child = subprocess.Popen(list(cmd), env=env)
        previous: dict[int, Any] = {}

        def forward(signum: int, _frame: Any) -> None:
            if child.poll() is None:
                child.send_signal(signum)

        def already_delivered(signum: int, _frame: Any) -> None:
            """The terminal sent it to the command too: wait for the command to act on it."""

        foreground = _in_foreground()
        for name in _FORWARDED:
            sig = getattr(signal, name, None)
            if sig is not None:
                terminal = foreground and name in _FROM_TERMINAL
                previous[sig] = signal.signal(sig, already_delivered if terminal else forward)
        try:
            returncode = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        verdicts = read_verdicts(folder)
        code = job_exit_code(returncode, verdicts, sdc_code)
        line = summary(returncode, verdicts, code)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
        return code
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``sdc run [--] COMMAND ...``: run the command; exit 86 on an SDC verdict, else its own code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""), file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    try:
        return run_command(args)
    except ValueError as err:  # a bad SDC_EXIT_CODE
        print(f"sdc run: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"sdc run: cannot start {args[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126


if __name__ == "__main__":
    sys.exit(main())
