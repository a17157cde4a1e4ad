"""The process exit code of an uncaught SDC verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import worker_env

SCRIPT = """
from sdc_core.ops.process_exit import install_exit_code
from sdc_core import FingerprintMismatchError
install_exit_code()
if {sdc}:
    raise FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={{1: "node-b"}})
raise KeyError("an ordinary crash")
"""


@pytest.mark.parametrize(("env", "sdc", "code"), [({}, True, 86), ({"SDC_EXIT_CODE": "42"}, True, 42),
                                                  ({"SDC_EXIT_CODE": "0"}, True, 1), ({}, False, 1)])  # fmt: skip
def test_uncaught_sdc_error_exits_with_its_own_code(env: dict, sdc: bool, code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(sdc=sdc)], env=worker_env() | env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert ("node-b" in proc.stderr) == sdc  # the traceback is still printed


def test_bad_exit_code_setting_is_named() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(sdc=True)], env=worker_env() | {"SDC_EXIT_CODE": "x"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "SDC_EXIT_CODE must be an integer" in proc.stderr


def test_scheduler_scripts_are_valid_shell() -> None:
    from pathlib import Path

    from conftest import ROOT

    scripts = sorted((ROOT / "examples" / "after_detection").glob("*.sh"))
    names = {"k8s_cordon.sh", "slurm_lightning.sh", "slurm_requeue.sh", "torchrun_elastic.sh"}
    assert {p.name for p in scripts} == names
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
        assert "sdc exclude-list" in Path(script).read_text()


def _incident(host: str, **extra: object) -> dict:
    return {"check": "replay", "step": 3, "rank": 0, "suspects": {"0": {"host": host, "device": "cpu"}},
            "exclude_hosts": [host], **extra}  # fmt: skip


@pytest.mark.parametrize("command", ["report", "exclude-list"])
def test_a_bad_field_is_skipped_with_a_warning_and_the_rest_reported(tmp_path, capsys, command: str) -> None:
    """One incident with "time": 1e300 made both commands exit 70 and report nothing."""
    import json

    from sdc_core.cli import main as sdc

    folder = tmp_path / "run" / "sdc" / "incidents"
    folder.mkdir(parents=True)
    (folder / "good.json").write_text(json.dumps(_incident("node-a", time=1.0e9)))
    (folder / "far.json").write_text(json.dumps(_incident("node-b", time=1e300)))
    (folder / "nan.json").write_text(json.dumps(_incident("node-c", time=float("nan"))))
    (folder / "inf.json").write_text(
        '{"check": "replay", "time": 1e999, "rank": 0, "exclude_hosts": ["node-d"], '
        '"suspects": {"0": {"host": "node-d", "device": ["x"], "device_uuid": {"a": 1}}}}'
    )
    (folder / "list_time.json").write_text(json.dumps(_incident("node-e", time=[1], time_iso=5)))
    (folder / "big.json").write_text(json.dumps(_incident("node-f", time=10**400, rank="9" * 30)))
    (folder / "digits.json").write_text('{"check": "replay", "time": ' + "9" * 5000 + ', "suspects": {}}')
    (folder / "unicode_rank.json").write_text(json.dumps(_incident("node-g", rank="\u00b2")))
    assert sdc([command, str(tmp_path / "run"), *(["--json"] if command == "report" else [])]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert all(line.startswith(f"sdc {command}: warning: skipped ") for line in lines)
    for name, field in (("far", "'time'"), ("nan", "'time'"), ("inf", "'time'"), ("inf", "device'"),
                        ("inf", "device_uuid'"), ("list_time", "'time_iso'"), ("list_time", "'time'"),
                        ("big", "'rank'"), ("digits", "JSON"), ("unicode_rank", "'rank'")):  # fmt: skip
        assert any(f"{name}.json" in line and field in line for line in lines), (name, field, lines)
    if command == "report":
        rows = {r["host"]: r for r in json.loads(out)}
        assert set(rows) == {"node-a", "node-b", "node-c", "node-d", "node-e"}
        assert rows["node-a"]["first_seen"] == "2001-09-09T01:46:40Z" and rows["node-b"]["first_seen"] == "?"
        assert rows["node-d"]["device"] == "?"
    else:
        assert out.strip() == "node-a,node-b,node-c,node-d,node-e"
    assert sdc([command, str(tmp_path / "run"), "--strict"]) == 4  # a skipped field counts as skipped


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLURMD_NODENAME": "n3", "NODE_NAME": "k8s-node"}, "n3"),  # Slurm first
    ({"NODE_NAME": "k8s-node"}, "k8s-node"),  # Kubernetes' downward API
    ({"SLURMD_NODENAME": " ", "NODE_NAME": ""}, None),  # blank: the host name
    ({}, None),
])  # fmt: skip
def test_node_name_is_the_schedulers_name_for_the_node(monkeypatch, capsys, tmp_path, env: dict,
                                                      expected: str | None) -> None:  # fmt: skip
    """Incidents, verdict markers, exclude lists and `sdc node-name` name the node the scheduler
    knows: several Slurm nodes on one host share its host name."""
    import json
    import socket

    from sdc_core.cli import main as sdc
    from sdc_core.dist.topology import Topology, node_name
    from sdc_core.errors import FingerprintMismatchError
    from sdc_core.ops.process_exit import mark_verdict

    for name in ("SLURMD_NODENAME", "NODE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    want = expected or socket.gethostname()
    assert node_name() == want
    assert Topology.gather().ranks[0].host == want  # the facts incidents and verdict messages use
    assert sdc(["node-name"]) == 0 and capsys.readouterr().out == f"{want}\n"
    folder = tmp_path
    monkeypatch.setenv("SDC_VERDICT_DIR", str(folder))
    mark_verdict(FingerprintMismatchError(step=1, rank=0, suspects=(0,), hosts={0: want}))
    (marker,) = folder.glob("*.json")
    assert marker.name.startswith(f"{want}-") and json.loads(marker.read_text())["host"] == want


def test_exclude_reason_names_check_step_and_node(tmp_path, capsys) -> None:
    """`sdc exclude-list --format reason`: the line a drained node keeps as its reason."""
    import json

    from sdc_core.cli import main as sdc

    folder = tmp_path / "run" / "sdc" / "incidents"
    folder.mkdir(parents=True)
    for i, (check, step, host) in enumerate([("weight_fingerprint", 8, "n2"), ("ring_replay", 12, "n4"),
                                             ("weight_fingerprint", 8, "n2"), ("replay", None, "n;1 rm")]):  # fmt: skip
        (folder / f"{i}.json").write_text(json.dumps(_incident(host, check=check, step=step,
                                                               time_iso=f"2026-01-0{i + 1}T00:00:00Z")))  # fmt: skip
    (folder / "unlocalized.json").write_text(json.dumps(_incident("n9", exclude_hosts=[], check="nonfinite")))
    assert sdc(["exclude-list", str(tmp_path / "run"), "--format", "reason"]) == 0
    assert capsys.readouterr().out == (
        "SDC weight_fingerprint at step 8 on n2; ring_replay at step 12 on n4; replay on n?1?rm\n"
    )
    assert sdc(["exclude-list", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == "n2,n4,n;1 rm\n"
    empty = tmp_path / "none"
    empty.mkdir()
    assert sdc(["exclude-list", str(empty), "--format", "reason"]) == 0 and capsys.readouterr().out == ""


def test_incident_excludes_the_suspects_of_a_verdict_that_several_ranks_disagree(tmp_path) -> None:
    """A confirmed replay verdict that no single rank explains: every suspect's host is excluded
    while they are fewer than the ranks; none when every rank is a suspect; the named rank's alone
    when one is named."""
    import json

    from sdc_core.dist.topology import RankFacts, Topology
    from sdc_core.errors import ReplayMismatchError
    from sdc_core.ops.incidents import write_incident

    topo = Topology(ranks=tuple(RankFacts(rank=r, host=f"n{r}", node_rank=r, local_rank=0) for r in range(4)), rank=0)

    def excluded(rank: int | None, suspects: tuple[int, ...], **details: object) -> list[str]:
        err = ReplayMismatchError(step=3, rank=rank, suspects=suspects, hosts=topo.hosts(suspects),
                                  details={"world_size": 4, **details}, reason="test")  # fmt: skip
        path = write_incident(tmp_path / f"run{rank}{suspects}", err, topo, {}, "raise")
        return json.loads(path.read_text())["exclude_hosts"]

    assert excluded(None, (1, 2), several_ranks=True) == ["n1", "n2"]
    assert excluded(None, (0, 1, 2, 3), several_ranks=True) == []
    assert excluded(None, (1, 2)) == []  # not localized for another reason (e.g. no referee)
    assert excluded(2, (2,)) == ["n2"]
