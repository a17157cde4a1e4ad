"""After detection: incident reports, hosts to exclude, and a process exit code for SDC verdicts.

* ``write_incident`` (rank 0, on every verdict: raised, skipped or warned) writes one JSON file to
  ``<run dir>/sdc/incidents/``: the exception's fields, the check's configuration, the step and
  time, and for each suspect rank its host, node rank, local rank, device, device UUID (where the
  device has one) and library versions, gathered once at start-up.
  Each is written atomically under a name of its own: two incidents in the same millisecond are
  two files.
* ``load_incidents`` reads them back, skipping (and naming) files that are not incidents;
  ``summarise`` and ``exclude_hosts`` are ``sdc report`` and ``sdc exclude-list``.
* ``install_exit_code`` makes an uncaught ``SDCError`` end the process with a distinct exit code
  (default 86, ``SDC_EXIT_CODE`` to change, 0 to keep Python's own 1), so torchrun elastic, Slurm
  requeue scripts and Kubernetes job controllers can tell an SDC verdict from a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdc_core.errors import SDCError
from sdc_core.safeio import UnreadableError, create_unique
from sdc_core.topology import Topology

EXIT_CODE_ENV = "SDC_EXIT_CODE"
DEFAULT_EXIT_CODE = 86


def exit_code() -> int:
    """The exit code for SDC verdicts: ``SDC_EXIT_CODE`` (0-255; 0 turns it off) or 86 (also
    when the variable is set but empty, as ``VAR=`` in a job script leaves it)."""
    raw = os.environ.get(EXIT_CODE_ENV, "").strip() or str(DEFAULT_EXIT_CODE)
    if not raw.isdigit() or not 0 <= int(raw) <= 255:
        raise ValueError(f"{EXIT_CODE_ENV} must be an integer in 0..255, got {raw!r}")
    return int(raw)


def install_exit_code() -> None:
    """Make an uncaught ``SDCError`` exit the process with ``exit_code()`` (idempotent).

    The previous ``sys.excepthook`` still prints the traceback first; other exceptions are left
    alone.
    """
    if getattr(sys.excepthook, "_sdc", False):
        return
    code = exit_code()
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        if isinstance(value, SDCError) and code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    hook._sdc = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def write_incident(run_dir: str | Path, error: SDCError, topology: Topology, config: Any, policy: str) -> Path:
    """Write the incident of ``error`` under ``<run_dir>/sdc/incidents/`` (call on rank 0): a new
    file, written atomically, never replacing another incident."""
    folder = Path(run_dir) / "sdc" / "incidents"
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    facts = {r: dataclasses.asdict(topology.ranks[r]) for r in error.suspects if r < topology.world_size}
    for f in facts.values():
        f["versions"] = dict(f["versions"])
    incident = {
        "time": now,
        "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "policy": policy,
        "check": error.check,
        "step": error.step,
        "rank": error.rank,
        "error": error.to_dict(),
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config or {}),
        "world_size": topology.world_size,
        "suspects": {str(r): f for r, f in facts.items()},
        "exclude_hosts": [topology.ranks[error.rank].host] if error.rank is not None else [],
    }
    text = json.dumps(incident, indent=1, default=str)
    return create_unique(folder, f"{int(now * 1000)}-{error.check}-step{error.step}", ".json", text)


def load_incidents(paths: Iterable[str | Path], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every incident under the given run directories (``<dir>/**/sdc/incidents/*.json`` and
    ``<dir>/*.json``) or incident files, in a checked shape.

    A path that does not exist raises ``UnreadableError``. A file that cannot be read, is not
    JSON, or is not an incident is skipped and the rest still read: ``"<file>: <why>"`` is
    appended to ``skipped`` when given, else issued as a warning. (A ``*.json`` beside the run
    folders that is valid JSON but no incident, such as a results file, is passed over quietly.)"""
    found: list[dict[str, Any]] = []

    def skip(f: Path, why: str) -> None:
        if skipped is None:
            warnings.warn(f"skipped {f}: {why}", UserWarning, stacklevel=3)
        else:
            skipped.append(f"{f}: {why}")

    for p in map(Path, paths):
        if not p.exists():
            raise UnreadableError(f"{p} does not exist; give a run folder or an incident file")
        if p.is_file():
            files = [(p, True)]
        else:
            try:
                files = [(f, True) for f in sorted(p.rglob("sdc/incidents/*.json"))]
                files += [(f, False) for f in sorted(p.glob("*.json"))]
            except OSError as err:
                raise UnreadableError(f"cannot read folder {p}: {err.strerror or err}") from None
        for f, expected in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
                skip(f, f"not a readable JSON file ({type(err).__name__}: {err})")
                continue
            incident, why = _checked(data)
            if incident is not None:
                incident["_file"] = str(f)
                found.append(incident)
            elif expected or (isinstance(data, dict) and "check" in data):
                skip(f, f"not an SDC incident ({why})")
    return found


def _checked(data: Any) -> tuple[dict[str, Any] | None, str]:
    """``data`` as an incident with the fields ``summarise``/``exclude_hosts`` read, each of the
    right type, or ``(None, why)``."""
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    if not isinstance(data.get("check"), str):
        return None, "no 'check' name"
    suspects = data.get("suspects")
    if not isinstance(suspects, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("host"), str) for v in suspects.values()
    ):
        return None, "'suspects' is not a mapping of rank to facts with a 'host'"
    rank = data.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int | str) or not str(rank).isdigit()):
        return None, f"'rank' is {rank!r}, not a rank or null"
    hosts = data.get("exclude_hosts", [])
    if isinstance(hosts, str):  # one host, or a comma separated list
        hosts = [h for h in re.split(r"[,\s]+", hosts) if h]
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        return None, f"'exclude_hosts' is {hosts!r}, not a list of host names"
    when = data.get("time_iso")
    if not isinstance(when, str):
        t = data.get("time")
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if isinstance(t, int | float) else "?"
    suspects = {str(r): {**f, "device": str(f.get("device", "?")), "device_uuid": f.get("device_uuid") or None}
                for r, f in suspects.items()}  # fmt: skip
    out = {**data, "suspects": suspects, "rank": None if rank is None else int(rank),
           "exclude_hosts": [h.strip() for h in hosts if h.strip()], "time_iso": when}  # fmt: skip
    return out, ""


def summarise(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host and device: incidents, checks, first and last seen (named faulty rank, else suspects)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for inc in incidents:
        named = [str(inc["rank"])] if inc.get("rank") is not None else list(inc["suspects"])
        for r in named:
            f = inc["suspects"].get(r)
            if f is None:
                continue
            key = (f["host"], str(f.get("device_uuid") or f.get("device", "?")))
            row = rows.setdefault(key, {"host": key[0], "device": key[1], "incidents": 0, "named": 0, "checks": set(),
                                        "first_seen": inc["time_iso"], "last_seen": inc["time_iso"]})  # fmt: skip
            row["incidents"] += 1
            row["named"] += inc.get("rank") is not None
            row["checks"].add(inc["check"])
            row["first_seen"] = min(row["first_seen"], inc["time_iso"])
            row["last_seen"] = max(row["last_seen"], inc["time_iso"])
    out = sorted(rows.values(), key=lambda r: (-r["named"], -r["incidents"], r["host"]))
    for r in out:
        r["checks"] = sorted(r["checks"])
    return out


def exclude_hosts(incidents: list[dict[str, Any]]) -> list[str]:
    """Hosts of ranks a verdict named as faulty (suspects that were not localized are not listed);
    a string ``exclude_hosts`` is one host name (or a comma separated list), never its letters."""
    out: set[str] = set()
    for inc in incidents:
        hosts = inc.get("exclude_hosts", [])
        if isinstance(hosts, str):
            hosts = re.split(r"[,\s]+", hosts)
        out.update(h.strip() for h in hosts if isinstance(h, str) and h.strip())
    return sorted(out)


def record_verdict(check: Any, run_dir: str | Path, is_main: bool, policy: str) -> Path | None:
    """Write the incident of ``check.last_error`` (once) on the main process; what adapters call
    after a verdict, whether it raised, skipped the step or warned."""
    error = getattr(check, "last_error", None)
    if error is None:
        return None
    check.last_error = None
    if not is_main:
        return None
    topology = check.topology or Topology.gather()
    return write_incident(run_dir, error, topology, check.config, policy)
