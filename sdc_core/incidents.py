"""After detection: incident reports, hosts to exclude, and a process exit code for SDC verdicts.

* ``write_incident`` (rank 0, on every verdict: raised, skipped or warned) writes one JSON file to
  ``<run dir>/sdc/incidents/``: the exception's fields, the check's configuration, the step and
  time, and for each suspect rank its host, node rank, local rank, device, device UUID (where the
  device has one) and library versions, gathered once at start-up.
* ``summarise`` and ``exclude_hosts`` read incidents back (``sdc report``, ``sdc exclude-list``).
* ``install_exit_code`` makes an uncaught ``SDCError`` end the process with a distinct exit code
  (default 86, ``SDC_EXIT_CODE`` to change, 0 to keep Python's own 1), so torchrun elastic, Slurm
  requeue scripts and Kubernetes job controllers can tell an SDC verdict from a crash.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdc_core.errors import SDCError
from sdc_core.topology import Topology

EXIT_CODE_ENV = "SDC_EXIT_CODE"
DEFAULT_EXIT_CODE = 86


def exit_code() -> int:
    """The exit code for SDC verdicts: ``SDC_EXIT_CODE`` (0-255; 0 turns it off) or 86."""
    raw = os.environ.get(EXIT_CODE_ENV, str(DEFAULT_EXIT_CODE))
    if not raw.strip().isdigit() or not 0 <= int(raw) <= 255:
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
    """Write the incident of ``error`` under ``<run_dir>/sdc/incidents/`` (call on rank 0)."""
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
    path = folder / f"{int(now * 1000)}-{error.check}-step{error.step}.json"
    path.write_text(json.dumps(incident, indent=1))
    return path


def load_incidents(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every incident JSON under the given run directories (or incident files)."""
    found: list[dict[str, Any]] = []
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(p.rglob("sdc/incidents/*.json")) + sorted(p.glob("*.json"))
        for f in files:
            try:
                data = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"{f} is not a readable incident file: {err}") from None
            if isinstance(data, dict) and "check" in data and "suspects" in data:
                data["_file"] = str(f)
                found.append(data)
    return found


def summarise(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host and device: incidents, checks, first and last seen (named faulty rank, else suspects)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for inc in incidents:
        named = [str(inc["rank"])] if inc.get("rank") is not None else list(inc["suspects"])
        for r in named:
            f = inc["suspects"].get(r)
            if f is None:
                continue
            key = (f["host"], f.get("device_uuid") or f.get("device", "?"))
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
    """Hosts of ranks a verdict named as faulty (suspects that were not localized are not listed)."""
    return sorted({h for inc in incidents for h in inc.get("exclude_hosts", [])})


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
