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
