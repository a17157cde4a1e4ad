"""The process exit code of an uncaught SDC verdict."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import worker_env

SCRIPT = """
from sdc_core.incidents import install_exit_code
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
    assert {p.name for p in scripts} == {"k8s_cordon.sh", "slurm_requeue.sh", "torchrun_elastic.sh"}
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
