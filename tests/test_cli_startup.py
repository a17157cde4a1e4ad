"""`sdc --help`, every subcommand's --help and `accelerate-sdc --help` answer at once (no torch, no
framework imported; the settings' help from a table generated from the schema), and
`scripts/setup.sh` (which `scripts/demo.sh` and `scripts/test.sh` call) installs only when needed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, worker_env

from sdc_core import cli

PROBE = """
import json, sys, time, contextlib, io
start = time.perf_counter()
import sdc_core.cli as cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = cli.main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "lightning", "accelerate", "transformers") if m in sys.modules)
print(json.dumps({"code": code, "seconds": time.perf_counter() - start, "heavy": heavy}))
"""


def test_help_of_every_command_imports_nothing_heavy() -> None:
    for argv in (["--help"], *([name, "--help"] for name in cli.COMMANDS)):
        proc = subprocess.run([sys.executable, "-c", PROBE, *argv], env=worker_env(), capture_output=True, text=True,
                              timeout=60, cwd=ROOT)  # fmt: skip
        result = json.loads(proc.stdout)
        assert result["code"] == 0, (argv, proc.stderr)
        assert result["heavy"] == [], argv  # torch alone takes seconds to import
        assert result["seconds"] < 1.0, (argv, result)


def test_bit_classes_match_the_checkpoint_module() -> None:
    from sdc_core.faults.checkpoint import BIT_CLASSES

    assert cli.BIT_CLASSES == BIT_CLASSES


def test_lazy_packages_export_every_name() -> None:
    import lightning_sdc
    import sdc_core

    for package in (sdc_core, lightning_sdc):
        assert all(getattr(package, name) is not None for name in package.__all__)
        assert set(package.__all__) <= set(dir(package))


def test_setup_installs_only_when_needed() -> None:
    subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=worker_env(), check=True, timeout=600,
                   capture_output=True)  # fmt: skip  # installs if pyproject.toml changed since the last one
    start = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "installing" not in proc.stderr  # nothing changed: pip is not run
    assert time.perf_counter() - start < 5
    assert (ROOT / ".venv" / ".sdc-installed").is_file()


# Runs an installed console script as it is (its own file, as `accelerate-sdc --help` would), then
# reports what it imported: the `sys.modules` of that process, not a wall time.
CONSOLE = """
import json, runpy, sys
script, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = script
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    code = exit.code
heavy = sorted(m for m in ("torch", "lightning", "accelerate", "transformers") if m in sys.modules)
print("\\nIMPORTED " + json.dumps({"code": code, "heavy": heavy}))
"""


def _console(command: str, *argv: str) -> tuple[str, dict[str, Any]]:
    script = Path(sys.executable).with_name(command)  # what `pip install -e .` put beside the interpreter
    assert script.is_file(), f"{script}: the console command is not installed (bash scripts/setup.sh)"
    proc = subprocess.run([sys.executable, "-c", CONSOLE, str(script), *argv], env=worker_env(), capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    out, _, report = proc.stdout.rpartition("\nIMPORTED ")
    assert report, proc.stderr
    return out, json.loads(report)


def test_the_settings_help_table_is_the_schema() -> None:
    from sdc_core.driver import settings
    table = ROOT / "sdc_core" / "driver" / "settings_help.py"
    assert table.read_text() == settings.help_table_source(), (
        "sdc_core/driver/settings_help.py differs from SDCSettings; regenerate it: .venv/bin/python -c "
        "\"import pathlib, sdc_core.driver.settings as s; "
        "pathlib.Path('sdc_core/driver/settings_help.py').write_text(s.help_table_source())\""
    )


def test_console_help_is_complete_and_imports_no_torch() -> None:
    from dataclasses import fields

    from sdc_core.driver.settings import SDCSettings, field_doc

    out, got = _console("accelerate-sdc", "--help")
    assert got == {"code": 0, "heavy": []}, got
    assert "accelerate-sdc config" in out and "accelerate-sdc launch" in out and "{config,launch}" in out
    out, got = _console("accelerate-sdc", "config", "--help")
    assert got == {"code": 0, "heavy": []}, got
    text = "".join(out.split())  # argparse wraps lines, also at hyphens
    for f in fields(SDCSettings):  # every setting, with the schema's doc and default
        assert "".join(f"--{f.name} {f.name.upper()} {field_doc(f.name)} (default {f.default})".split()) in text
    out, got = _console("sdc", "--help")
    assert got == {"code": 0, "heavy": []}, got
    assert all(name in out for name in cli.COMMANDS), out


def test_report_and_exclude_list_read_incidents_without_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a job script runs after a verdict (`sdc report`, `sdc exclude-list`, `sdc run`'s last
    line) reads incidents without importing torch (about 2 s each on 2 cores)."""
    from sdc_core.dist.topology import RankFacts, Topology
    from sdc_core.errors import FingerprintMismatchError
    from sdc_core.ops.incidents import write_incident

    error = FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={1: "node-b"}, details={"world_size": 3})
    topology = Topology(ranks=tuple(RankFacts(r, ("node-a", "node-b", "node-c")[r], node_rank=r, local_rank=0)
                                    for r in range(3)), rank=0)  # fmt: skip
    write_incident(tmp_path / "run", error, topology, None, "raise")
    for argv in (["report", str(tmp_path)], ["exclude-list", str(tmp_path)]):
        proc = subprocess.run([sys.executable, "-c", PROBE, *argv], env=worker_env(), capture_output=True, text=True,
                              timeout=60, cwd=ROOT)  # fmt: skip
        result = json.loads(proc.stdout)
        assert result["code"] == 0 and result["heavy"] == [], (argv, result, proc.stderr)
    assert cli.main(["exclude-list", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "node-b"  # the incident was read
