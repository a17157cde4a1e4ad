"""``update_audit_every_n_steps`` (the FSDP2 update audit) as an Accelerate setting: keyword,
``ACCELERATE_SDC_*`` variable, settings file and ``accelerate-sdc config``, validated alike. The
Accelerate FSDP2 run that uses it is ``test_sharded.py::test_accelerate_attach_on_an_fsdp2_model``
(slow)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from accelerate_sdc.config import SDCConfigError, resolve
from lightning_sdc import WeightFingerprintCheck
from sdc_core.sharded.update_audit import UpdateAudit


def test_update_audit_setting_from_every_source(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    settings, _ = resolve()
    assert settings.update_audit_every_n_steps == 0 and settings.update_audit() is None  # off by default
    settings, origin = resolve(update_audit_every_n_steps="3")
    audit = settings.update_audit()
    assert isinstance(audit, UpdateAudit) and audit.every_n_steps == 3
    assert origin["update_audit_every_n_steps"] == "keyword arguments"
    monkeypatch.setenv("ACCELERATE_SDC_UPDATE_AUDIT_EVERY_N_STEPS", "5")
    settings, origin = resolve()
    assert settings.update_audit_every_n_steps == 5
    assert origin["update_audit_every_n_steps"] == "environment variable ACCELERATE_SDC_UPDATE_AUDIT_EVERY_N_STEPS"
    monkeypatch.delenv("ACCELERATE_SDC_UPDATE_AUDIT_EVERY_N_STEPS")
    (tmp_path / "s.yaml").write_text("update_audit_every_n_steps: 7\n")
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", str(tmp_path / "s.yaml"))
    assert resolve()[0].update_audit_every_n_steps == 7


@pytest.mark.parametrize("value", [-1, "-2", "two", 1.5, True])
def test_bad_update_audit_values_name_the_setting(monkeypatch: Any, value: Any) -> None:
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    with pytest.raises(SDCConfigError, match="update_audit_every_n_steps"):
        resolve(update_audit_every_n_steps=value)
    with pytest.raises(ValueError, match="update_audit_every_n_steps"):  # Lightning: the same rule
        WeightFingerprintCheck(update_audit_every_n_steps=value)


def test_accelerate_sdc_config_writes_the_update_audit_setting(tmp_path: Path, monkeypatch: Any) -> None:
    from accelerate_sdc.cli import main

    monkeypatch.delenv("ACCELERATE_SDC_CONFIG_FILE", raising=False)
    path = tmp_path / "sdc_config.yaml"
    assert main(["config", "--config_file", str(path), "--update_audit_every_n_steps", "10"]) == 0
    assert yaml.safe_load(path.read_text())["update_audit_every_n_steps"] == 10
    assert main(["config", "--config_file", str(path), "--update_audit_every_n_steps", "-3"]) == 2
    assert yaml.safe_load(path.read_text())["update_audit_every_n_steps"] == 10  # a bad value writes nothing
