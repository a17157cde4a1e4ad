"""``load_incidents``: the incidents of one or more runs as typed records, for a user's own tooling
(a dashboard, a node-health service). ``sdc report`` and ``sdc exclude-list`` read the same files.

```python
from sdc_core import load_incidents

for incident in load_incidents(["runs/my_job"]):
    print(incident.time_iso, incident.check, incident.step, incident.rank, incident.hosts, incident.exclude_hosts)
```
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sdc_core.ops.incidents import read_incident_dicts


@dataclass(frozen=True)
class Incident:
    """One SDC verdict as rank 0 recorded it (``<run dir>/sdc/incidents/*.json``).

    Args:
        file: the incident's file.
        schema_version: the file's format version (0: written before the field existed).
        check: the check that reached the verdict (``"ring_replay"``, ``"weight_fingerprint"``, ...).
        step: the optimizer step of the verdict, or None.
        rank: the rank named faulty, or None when the evidence could not single one out.
        suspects: each suspect rank's facts (host, node rank, local rank, device, device UUID,
            library versions), read-only.
        exclude_hosts: the hosts the verdict says to take out of service.
        time_iso: when it was recorded (UTC, ISO 8601).
        policy: what was done (``"raise"``, ``"warn"``, ``"skip_step"``, ``"heal"``, ``"rollback"``).
        message: the verdict's one-line text.
        record: the whole JSON record, read-only.
    """

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
        """Each suspect rank's host."""
        return {r: str(f["host"]) for r, f in self.suspects.items()}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_incidents(paths: Iterable[str | Path], skipped: list[str] | None = None) -> list[Incident]:
    """Every incident under the given run directories (``<dir>/**/sdc/incidents/*.json`` and
    ``<dir>/*.json``) or incident files, oldest file name first within a folder.

    A path that does not exist raises ``UnreadableError``. A file that cannot be read or is not an
    incident is skipped: ``"<file>: <why>"`` is appended to ``skipped`` when given, else issued as a
    warning. Reads JSON only (nothing in a file can run code)."""
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


__all__ = ["Incident", "load_incidents"]
