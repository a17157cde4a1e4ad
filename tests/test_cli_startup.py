"""`sdc --help` and every subcommand's --help answer at once (no torch, no framework imported), and
`scripts/setup.sh` (which `scripts/demo.sh` and `scripts/test.sh` call) installs only when needed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

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
    from sdc_core.checkpoint_faults import BIT_CLASSES

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
