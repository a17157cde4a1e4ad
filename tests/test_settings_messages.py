"""Settings errors say what is valid where they are raised, and a bad setting in a launched job
reads as one line per rank, not a traceback per rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import torchrun_cmd, worker_env

from sdc_core.driver.settings import SDCConfigError, resolve


@pytest.mark.parametrize("key", ["replay_every_n_steps", "fingerprint_every_n_steps"])
def test_a_negative_cadence_says_zero_is_valid(key: str) -> None:
    with pytest.raises(SDCConfigError) as info:
        resolve(**{key: -1})
    message = str(info.value)
    assert f"SDC setting {key!r} (keyword arguments): must be a whole number >= 0 (0 turns the check off)" in message
    assert message.endswith("got -1") and ">= 1" not in message
    assert getattr(resolve(**{key: 0})[0], key) == 0  # what the message offers is accepted


@pytest.mark.parametrize(
    ("key", "allowed"),
    [
        ("on_failure", "'raise', 'skip_step' or 'warn'"),
        ("replay_on_failure", "'raise' or 'skip_step'"),
        ("fingerprint_on_failure", "'raise' or 'heal'"),
    ],
)
def test_a_bad_policy_lists_only_what_the_hook_set_accepts(key: str, allowed: str) -> None:
    with pytest.raises(SDCConfigError) as info:
        resolve(**{key: "bogus"})
    assert str(info.value).endswith(f"must be {allowed}, got 'bogus'")
    assert "rollback" not in str(info.value)
    with pytest.raises(SDCConfigError) as info:
        resolve(**{key: "rollback"})  # refused, with what to do instead
    assert "policy of the Lightning callbacks" in str(info.value) and f"use one of {allowed}" in str(info.value)


BAD_ENV_SCRIPT = """
from accelerate import Accelerator
from accelerate_sdc import SDCHooks
acc = Accelerator(cpu=True)
SDCHooks(acc)
"""
LINE = (
    "SDCConfigError: bad value 'abc' for SDC setting 'replay_every_n_steps' in environment variable "
    "ACCELERATE_SDC_REPLAY_EVERY_N_STEPS: expected a whole number"
)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_bad_environment_value_in_a_launched_script_is_one_line_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(BAD_ENV_SCRIPT)
    env = worker_env() | {"ACCELERATE_SDC_CONFIG_FILE": "/dev/null", "ACCELERATE_SDC_REPLAY_EVERY_N_STEPS": "abc"}
    proc = subprocess.run(torchrun_cmd(script, None, None, 3), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    # each rank that got to print says its one line (the launcher may stop the others first, and two ranks'
    # writes may share a line of the combined stderr: both seen under load)
    ranks = re.findall(r"\[rank(\d)\]: " + re.escape(LINE), proc.stderr)
    assert ranks and len(ranks) == len(set(ranks)) and set(ranks) <= {"0", "1", "2"}, proc.stderr[-3000:]
    assert proc.stderr.count(LINE) == len(ranks)  # no other copy of the message (a traceback's last line)
    assert str(script) not in proc.stderr.replace(f"{script} FAILED", "")  # no worker traceback through it
    assert "settings.py" not in proc.stderr


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_other_exceptions_keep_their_traceback() -> None:
    code = (
        "from sdc_core.driver.settings import SDCConfigError, resolve\n"
        "try:\n    resolve(replay_rtol=5)\nexcept SDCConfigError:\n    pass\n"
        "raise KeyError('not a setting')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert "KeyError: 'not a setting'" in proc.stderr
