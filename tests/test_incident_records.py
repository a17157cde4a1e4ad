"""``sdc_core.load_incidents``: the incidents rank 0 wrote, as typed read-only records with the
file format's ``schema_version`` (0 for files written before it existed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import sdc_core
from sdc_core.errors import FingerprintMismatchError


def test_written_incidents_read_back_as_typed_records(tmp_path: Path) -> None:
    from sdc_core.dist.topology import Topology
    from sdc_core.ops.incidents import SCHEMA_VERSION, write_incident

    err = FingerprintMismatchError(step=7, rank=0, suspects=(0,), hosts={0: "node-a"})
    path = write_incident(tmp_path / "run", err, Topology.gather(), {"every_n_steps": 1}, "raise")
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION == 1
    (incident,) = sdc_core.load_incidents([tmp_path / "run"])
    assert isinstance(incident, sdc_core.Incident)
    assert (incident.check, incident.step, incident.rank, incident.policy) == ("weight_fingerprint", 7, 0, "raise")
    assert incident.schema_version == 1 and incident.file == str(path)
    assert incident.hosts == {0: Topology.gather().ranks[0].host}
    assert incident.message == str(err)
    with pytest.raises(dataclasses.FrozenInstanceError):
        incident.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        incident.suspects[0]["host"] = "elsewhere"  # type: ignore[index]


def test_an_incident_from_before_the_schema_version_reads_as_version_0(tmp_path: Path) -> None:
    old = {"check": "ring_replay", "step": 4, "rank": None, "time": 1.7e9, "policy": "raise",
           "suspects": {"1": {"host": "b"}, "2": {"host": "c"}}, "exclude_hosts": ["b", "c"]}  # fmt: skip
    folder = tmp_path / "sdc" / "incidents"
    folder.mkdir(parents=True)
    (folder / "1-ring_replay-step4.json").write_text(json.dumps(old))
    (folder / "2-broken.json").write_text("{not json")
    skipped: list[str] = []
    (incident,) = sdc_core.load_incidents([tmp_path], skipped=skipped)
    assert incident.schema_version == 0 and incident.rank is None and incident.hosts == {1: "b", 2: "c"}
    assert incident.exclude_hosts == ("b", "c")
    assert len(skipped) == 1 and "2-broken.json" in skipped[0]
