"""Reading files that may be hostile and writing files that must not be half written (torch only).

``load_torch`` reads with ``weights_only=True`` (``trust_pickle=True`` unpickles, warning each time). ``atomic_write``
writes beside the destination and renames into place, only onto a regular file or nothing (``check_output``).
``UnreadableError`` and ``OutputError`` name the file; both are ``ValueError``."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from sdc_core.schema import env_flag

TRUST_PICKLE_ENV = "SDC_TRUST_PICKLE"


class UnreadableError(ValueError):
    """An input file or folder cannot be read (missing, not the expected format, or damaged)."""


class OutputError(ValueError):
    """An output cannot be written where asked (a folder, a missing parent folder, no permission)."""


def trust_pickle_from_env() -> bool:
    return env_flag(TRUST_PICKLE_ENV)


def load_torch(path: str | Path, trust_pickle: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load`` of ``path`` that cannot run code unless ``trust_pickle`` (loudly) allows it;
    ``UnreadableError`` naming the file (and how to opt in, where that would help) otherwise."""
    import torch

    path = Path(path)
    if trust_pickle:
        warnings.warn(f"loading {path} with full unpickling (trusted): a file from elsewhere can run code this way",
                      UserWarning, stacklevel=2)  # fmt: skip
    try:
        return torch.load(path, map_location=map_location, weights_only=not trust_pickle)
    except RecursionError:
        raise UnreadableError(f"{path} is not a readable torch checkpoint: it nests too deeply") from None
    except Exception as err:
        text = str(err)
        first = next((line.strip().rstrip(".") for line in text.splitlines() if "nsupported" in line), "")
        if not trust_pickle and "Weights only load failed" in text and "GLOBAL" in first.upper():
            raise UnreadableError(
                f"{path} holds objects other than tensors and plain values, which could run code when read"
                f"{' (' + first + ')' if first else ''}; if you wrote it yourself, opt in to full unpickling: "
                f"--trust-pickle (sdc commands), {TRUST_PICKLE_ENV}=1 (rollback)"
            ) from None
        if isinstance(err, IsADirectoryError | FileNotFoundError | PermissionError):
            raise UnreadableError(f"cannot read {path}: {err.strerror or err}") from None
        why = first or (text.splitlines()[0] if text else "")
        raise UnreadableError(f"{path} is not a readable torch checkpoint: {type(err).__name__}: {why}") from None


_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def check_output(path: str | Path) -> Path:
    """The file ``atomic_write`` would replace for ``path`` (a symbolic link's target); ``OutputError``
    when it is anything but a regular file or nothing, or its folder is missing. A few ``stat`` calls."""
    path = target = Path(path)
    mode = None  # nothing there (a dangling link's target included)
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            target = Path(os.path.realpath(path))
            if stat.S_ISLNK(os.lstat(target).st_mode):
                raise OutputError(f"cannot write {path}: it is a symbolic link that does not resolve (a loop)")
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        pass
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    if mode is not None and not stat.S_ISREG(mode):
        shown = f"{path} (a link to {target})" if target != path else str(path)
        if stat.S_ISDIR(mode):
            raise OutputError(f"{shown} is a folder; give a file name")
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise OutputError(f"cannot write {shown}: it is {kind}, and outputs are only written to regular files "
                          "(replaced atomically); give a file path")  # fmt: skip
    if not target.parent.is_dir():
        raise OutputError(f"cannot write {path}: folder {target.parent} does not exist; create it first")
    return target


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """This process's umask, from ``/proc/self/status`` where Linux shows it, else set and restored under a lock."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def output_mode(target: str | Path, folder: bool = False) -> int:
    """The mode an ordinary write leaves on ``target``: its own, else ``0o666``/``0o777`` less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode) & 0o777
    except OSError:
        return (0o777 if folder else 0o666) & ~current_umask()


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write`` on a temporary file beside ``path`` (removed when it fails), then rename it onto
    ``check_output(path)``; a reader sees the old file or the new one, a hard link is never written
    through, and a replaced file keeps its mode. Returns ``path``."""
    path = Path(path)
    target = check_output(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), output_mode(target))  # mkstemp made it 0o600
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def create_unique(folder: str | Path, stem: str, suffix: str, text: str) -> Path:
    """Write ``text`` atomically to a new file ``<folder>/<stem><suffix>`` (``<stem>-2<suffix>``, ...
    when taken), never replacing one: two writers in the same instant get two files."""
    folder = Path(folder)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=".tmp")
    except OSError as err:
        raise OutputError(f"cannot write in {folder}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp made it 0o600
            os.fsync(f.fileno())
        for n in range(1, 10_000):
            path = folder / (f"{stem}{suffix}" if n == 1 else f"{stem}-{n}{suffix}")
            try:
                os.link(tmp, path)  # fails when the name is taken: no overwrite, no race
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links: exclusive create, then write
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "wb") as f:
                    f.write(text.encode())
            return path
        raise OutputError(f"no free file name for {stem}{suffix} in {folder}")
    finally:
        Path(tmp).unlink(missing_ok=True)
