"""One way of handling a bad setting on every surface (Lightning callbacks, the hook set, the
`accelerate-sdc config` flags): the name, the bad value, the accepted ones, "did you mean" for a
misspelling (the hook set's own suggestion), and one line instead of a traceback when uncaught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import worker_env

from lightning_sdc import MatmulChecksumCheck, NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck
from sdc_core.driver.settings import SDCConfigError, UnknownArgumentError, suggest

TYPOS = [
    (RingReplayAudit, "every_n_step", "every_n_steps"),
    (WeightFingerprintCheck, "include_buffer", "include_buffers"),
    (NonFiniteGradientCheck, "on_failur", "on_failure"),
    (MatmulChecksumCheck, "on_failures", "on_failure"),
]


@pytest.mark.parametrize(("cls", "typo", "meant"), TYPOS)
def test_a_misspelled_callback_keyword_names_the_closest_argument(cls: type, typo: str, meant: str) -> None:
    with pytest.raises(UnknownArgumentError) as info:
        cls(**{typo: 5})
    assert isinstance(info.value, TypeError) and isinstance(info.value, SDCConfigError)  # Python's own kind too
    text = str(info.value)
    assert f"unknown argument {typo!r} of {cls.__name__} (value 5)" in text and f"(did you mean {meant!r}?)" in text


def test_a_bad_callback_value_names_the_argument_the_value_and_the_accepted_ones() -> None:
    with pytest.raises(SDCConfigError, match=r"RingReplayAudit: on_failure must be .*'skip_step'.*got 'explode'"):
        RingReplayAudit(on_failure="explode")
    with pytest.raises(SDCConfigError, match=r"WeightFingerprintCheck: every_n_steps .* got -1"):
        WeightFingerprintCheck(every_n_steps=-1)


def test_the_hook_set_and_the_callbacks_suggest_alike() -> None:
    from sdc_core import SDCHooks

    with pytest.raises(SDCConfigError) as hooks:
        SDCHooks(replay_every_n_step=3)
    assert suggest("replay_every_n_step", ["replay_every_n_steps"]) in str(hooks.value)


def test_uncaught_configuration_errors_are_one_line(tmp_path: Path) -> None:
    codes = ("from lightning_sdc import RingReplayAudit; RingReplayAudit(every_n_step=5)",
             "from lightning_sdc import RingReplayAudit; RingReplayAudit(on_failure='explode')")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code], env=worker_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for code in codes]  # fmt: skip  # side by side
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        assert lines[0].startswith(("UnknownArgumentError: unknown argument 'every_n_step'",
                                    "SDCConfigError: RingReplayAudit: on_failure"))  # fmt: skip


def test_accelerate_sdc_config_suggests_the_setting(tmp_path: Path) -> None:
    target = tmp_path / "sdc.yaml"
    cmd = [sys.executable, "-m", "accelerate_sdc.cli", "config", "--config_file", str(target)]
    proc = subprocess.run([*cmd, "--replay_every_n_step", "3"], env=worker_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and not target.exists()
    assert proc.stderr.strip().splitlines() == [
        "accelerate-sdc config: error: unknown option '--replay_every_n_step' (did you mean '--replay_every_n_steps'?) "
        "(see accelerate-sdc config --help)"
    ]
    proc = subprocess.run([*cmd, "--replay_on_failure", "explode"], env=worker_env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2 and not target.exists()
    line = proc.stderr.strip()
    assert "'replay_on_failure'" in line and "'explode'" in line and "'skip_step'" in line and "\n" not in line
