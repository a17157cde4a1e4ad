"""After detection (docs/incidents-and-exit-codes.md): ``write_incident`` (rank 0, on every verdict) writes one JSON
file, atomically and under a name of its own, to ``<run dir>/sdc/incidents/``; ``read_incident_dicts`` reads them back
as checked dicts (``sdc report``, ``sdc exclude-list``), and ``load_incidents`` as typed ``Incident`` records for a
user's own tooling."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from sdc_core.errors import SDCError
from sdc_core.io.safe_files import UnreadableError, create_unique

if TYPE_CHECKING:  # topology imports torch: `sdc report` and `sdc exclude-list` read incidents without it
    from sdc_core.dist.topology import Topology

SCHEMA_VERSION = 1  # of the incident JSON; files written before the field read as version 0


def write_incident(run_dir: str | Path, error: SDCError, topology: Topology, config: Any, policy: str) -> Path:
    """Write the incident of ``error`` to a new file under ``<run_dir>/sdc/incidents/`` (rank 0)."""
    folder = Path(run_dir) / "sdc" / "incidents"
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    facts = {r: dataclasses.asdict(topology.ranks[r]) | {"versions": dict(topology.ranks[r].versions)}
             for r in error.suspects if r < topology.world_size}  # fmt: skip
    incident = {
        "schema_version": SCHEMA_VERSION,
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
        "exclude_hosts": _exclude(error, topology),
    }
    text = json.dumps(incident, indent=1, default=str)
    return create_unique(folder, f"{int(now * 1000)}-{error.check}-step{error.step}", ".json", text)


def _exclude(error: SDCError, topology: Topology) -> list[str]:
    """The hosts to take out: the named rank's; when several ranks disagree, every suspect's while
    they are fewer than the ranks; else none (a common cause is likelier, or two cannot tell)."""
    if error.rank is not None:
        return [topology.ranks[error.rank].host]
    if error.details.get("several_ranks") and 0 < len(error.suspects) < topology.world_size:
        return sorted({topology.ranks[r].host for r in error.suspects if r < topology.world_size})
    return []


def read_incident_dicts(paths: Iterable[str | Path], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every incident under the given run directories (``<dir>/**/sdc/incidents/*.json`` and
    ``<dir>/*.json``) or incident files, in a checked shape, oldest file name first within a folder.

    A missing path raises ``UnreadableError``. A file that is not a readable incident is skipped:
    ``"<file>: <why>"`` is appended to ``skipped`` when given, else warned (a ``*.json`` beside the
    run folders that is no incident, such as a results file, is passed over quietly)."""
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
            except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON, a 5000-digit number
                skip(f, f"not a readable JSON file ({type(err).__name__}: {err})")
                continue
            notes: list[str] = []
            incident, why = _checked(data, notes)
            if incident is not None:
                incident["_file"] = str(f)
                found.append(incident)
                for note in notes:
                    skip(f, note)
            elif expected or (isinstance(data, dict) and "check" in data):
                skip(f, f"not an SDC incident ({why})")
    return found


def _when(data: dict[str, Any], notes: list[str]) -> str:
    """``time_iso``, else ``time`` as ISO text, else ``"?"``; a value that is no time is noted."""
    when = data.get("time_iso")
    if isinstance(when, str):
        return when
    if when is not None:
        notes.append(f"field 'time_iso' is {_short(when)}, not a text: field skipped")
    t = data.get("time")
    if t is None:
        return "?"
    try:
        if isinstance(t, bool) or not isinstance(t, int | float):
            raise TypeError
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (TypeError, ValueError, OverflowError, OSError):
        notes.append(f"field 'time' is {_short(t)}, not a time: field skipped")
        return "?"


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer too long to print
        text = f"a {type(value).__name__} too long to show"
    return text if len(text) <= 40 else text[:37] + "..."


def _facts(rank: str, facts: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """A suspect's facts with ``device`` a text (``"?"``) and ``device_uuid`` a text or None."""
    out = dict(facts)
    for key, missing in (("device", "?"), ("device_uuid", None)):
        value = facts.get(key)
        if value is None or value == "":
            out[key] = missing
        elif isinstance(value, str | int) and not isinstance(value, bool):
            out[key] = str(value)
        else:
            notes.append(f"field 'suspects.{rank}.{key}' is {_short(value)}, not a text: field skipped")
            out[key] = missing
    return out


def _checked(data: Any, notes: list[str]) -> tuple[dict[str, Any] | None, str]:
    """``data`` as an incident whose fields ``summarise`` and ``exclude_hosts`` read are of their type,
    or ``(None, why)``; a field only shown (the time) of another type is noted in ``notes``."""
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
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int | str)
                             or not re.fullmatch(r"[0-9]{1,18}", str(rank))):  # fmt: skip
        return None, f"'rank' is {_short(rank)}, not a rank or null"
    hosts = data.get("exclude_hosts", [])
    if isinstance(hosts, str):  # one host, or a comma separated list
        hosts = [h for h in re.split(r"[,\s]+", hosts) if h]
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        return None, f"'exclude_hosts' is {_short(hosts)}, not a list of host names"
    when = _when(data, notes)
    suspects = {str(r): _facts(str(r), f, notes) for r, f in suspects.items()}
    out = {**data, "suspects": suspects, "rank": None if rank is None else int(rank),
           "exclude_hosts": [h.strip() for h in hosts if h.strip()], "time_iso": when}  # fmt: skip
    return out, ""


def summarise(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host and device: incidents, checks, first and last seen (named faulty rank, else suspects)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for inc in incidents:
        named = [str(inc["rank"])] if inc.get("rank") is not None else list(inc["suspects"])
        for f in (inc["suspects"][r] for r in named if inc["suspects"].get(r) is not None):
            key = (f["host"], str(f.get("device_uuid") or f.get("device", "?")))
            row = rows.setdefault(key, {"host": key[0], "device": key[1], "incidents": 0, "named": 0, "checks": set(),
                                        "first_seen": inc["time_iso"], "last_seen": inc["time_iso"]})  # fmt: skip
            row["incidents"] += 1
            row["named"] += inc.get("rank") is not None
            row["checks"].add(inc["check"])
            row["first_seen"] = min(row["first_seen"], inc["time_iso"])
            row["last_seen"] = max(row["last_seen"], inc["time_iso"])
    ordered = sorted(rows.values(), key=lambda r: (-r["named"], -r["incidents"], r["host"]))
    return [r | {"checks": sorted(r["checks"])} for r in ordered]


def exclude_hosts(incidents: list[dict[str, Any]]) -> list[str]:
    """The hosts the incidents (as ``read_incident_dicts`` checked them: lists of names) say to exclude."""
    return sorted({host for inc in incidents for host in inc["exclude_hosts"]})


def exclude_reason(incidents: list[dict[str, Any]]) -> str:
    """Why ``exclude_hosts`` lists its hosts, as a scheduler's node reason: ``SDC weight_fingerprint at
    step 8 on n2``, one entry per check, step and host, oldest first; empty when none."""
    entries: list[str] = []
    for inc in sorted(incidents, key=lambda i: str(i.get("time_iso") or "")):
        check = re.sub(r"[^A-Za-z0-9_.-]", "?", str(inc.get("check")))[:40]
        step = inc.get("step")
        where = f" at step {step}" if isinstance(step, int) and not isinstance(step, bool) else ""
        entries += [f"{check}{where} on {re.sub(r'[^A-Za-z0-9_.-]', '?', h)[:64]}" for h in exclude_hosts([inc])]
    return "SDC " + "; ".join(dict.fromkeys(entries)) if entries else ""


def record_verdict(check: Any, run_dir: str | Path | None, is_main: bool, policy: str) -> Path | None:
    """Write the incident of ``check.last_error`` (once) on the main process and return its file.
    Never raises and runs no collective: a failed write only warns, so the verdict still reaches every rank."""
    error = getattr(check, "last_error", None)
    if error is None:
        return None
    check.last_error = None
    where = Path(run_dir or ".") / "sdc" / "incidents"
    error.incident_dir = str(where)  # type: ignore[attr-defined]
    if not is_main:
        return None
    try:
        topology = check.topology or _local_topology(error)
        path = write_incident(run_dir or ".", error, topology, check.config, policy)
        error.incident = str(path)  # type: ignore[attr-defined]
        return path
    except Exception as err:  # the report must never cost the verdict
        error.incident = f"none (not written to {where}: {type(err).__name__})"  # type: ignore[attr-defined]
        warnings.warn(f"SDC incident of {error.check} at step {error.step} not written to {where}: "
                      f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)  # fmt: skip
        return None


def _local_topology(error: SDCError) -> Topology:
    """What is known without a collective: the hosts the error names (facts unknown elsewhere)."""
    from sdc_core.dist.topology import RankFacts, Topology

    world = error.details.get("world_size")
    world = world if isinstance(world, int) else max([*error.suspects, error.rank or 0]) + 1
    facts = [RankFacts(r, error.hosts.get(r, "?"), node_rank=-1, local_rank=-1, device="?") for r in range(world)]
    return Topology(ranks=tuple(facts), rank=0)


@dataclasses.dataclass(frozen=True)
class Incident:
    """One SDC verdict as rank 0 recorded it (``<run dir>/sdc/incidents/*.json``); the mappings are
    read-only. ``schema_version`` 0: written before the field; ``rank`` None: none singled out;
    ``time_iso`` in UTC; ``policy``: what was done; ``record``: the whole JSON record."""

    file: str
    schema_version: int
    check: str
    step: int | None
    rank: int | None
    suspects: Mapping[int, Mapping[str, Any]]
    exclude_hosts: tuple[str, ...]
    time_iso: str
    policy: str | None
    message: str
    record: Mapping[str, Any]

    @property
    def hosts(self) -> dict[int, str]:
        return {r: str(f["host"]) for r, f in self.suspects.items()}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_incidents(paths: Iterable[str | Path], skipped: list[str] | None = None) -> list[Incident]:
    """``read_incident_dicts`` as ``Incident`` records (JSON only: nothing in a file can run code)."""
    out = []
    for data in read_incident_dicts(paths, skipped=skipped):
        error = data.get("error") if isinstance(data.get("error"), dict) else {}
        policy = data.get("policy")
        out.append(Incident(
            file=str(data["_file"]),
            schema_version=_int_or_none(data.get("schema_version")) or 0,
            check=data["check"],
            step=_int_or_none(data.get("step")),
            rank=data["rank"],
            suspects=MappingProxyType({int(r): MappingProxyType(dict(f)) for r, f in data["suspects"].items()}),
            exclude_hosts=tuple(data["exclude_hosts"]),
            time_iso=data["time_iso"],
            policy=policy if isinstance(policy, str) else None,
            message=str(error.get("message", "")),
            record=MappingProxyType(dict(data)),
        ))  # fmt: skip
    return out

