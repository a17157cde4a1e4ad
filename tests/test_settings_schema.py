"""One settings schema: each check's config dataclass declares its settings once (keyword-only,
a doc per setting, validated on construction); ``SDCSettings``, the ``accelerate-sdc config``
prompts and help, and the Lightning callbacks' signatures follow it. Adding a setting to a
config without deciding where it is offered fails here."""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_sdc import MatmulChecksumCheck, NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck
from sdc_core.checks.fingerprint import FingerprintConfig
from sdc_core.checks.gradients import NonFiniteConfig
from sdc_core.checks.matmul import MatmulChecksumConfig
from sdc_core.checks.screen import ScreenConfig
from sdc_core.driver.settings import NOT_OFFERED, SDCSettings, field_doc, settings_for
from sdc_core.replay.ring import ReplayConfig
from sdc_core.schema import settings_of
from sdc_core.sharded.update_audit import UpdateAudit

CONFIGS = (NonFiniteConfig, ReplayConfig, FingerprintConfig, MatmulChecksumConfig, UpdateAudit, ScreenConfig)
PREFIX = {NonFiniteConfig: "", ReplayConfig: "replay_", FingerprintConfig: "fingerprint_",
          UpdateAudit: "update_audit_", ScreenConfig: "screen_"}  # fmt: skip
# the public names that do not follow the prefix (kept as they were released)
UNPREFIXED = {"include_buffers", "include_optimizer_state", "max_heals"}
# where an SDCSettings default differs from its config's, and why
OWN_DEFAULTS = {"update_audit_every_n_steps": 0, "replay_allow_pickled_batches": False}  # 0: off; False: None
# every public setting name and default, as released (ACCELERATE_SDC_* variables, files, keywords)
PUBLIC = {
    "nonfinite_gradient": True, "on_failure": "raise", "overflow_patience": 3, "max_names": 5,
    "replay_every_n_steps": 100, "replay_exact": "auto", "replay_rtol": 1e-3, "replay_atol": 1e-6,
    "replay_on_failure": "raise", "replay_on_unreplayable": "raise", "replay_max_state_mb": 256.0,
    "replay_deterministic": True, "replay_allow_pickled_batches": False, "fingerprint_every_n_steps": 1,
    "include_buffers": False, "include_optimizer_state": False, "fingerprint_on_failure": "raise", "max_heals": 3,
    "fingerprint_rolling": 1, "update_audit_every_n_steps": 0, "gradient_screen": True,
    "matmul_checksum": False, "log_every_n_steps": 50,
}  # fmt: skip
# callback -> (its config, config settings it does not take, arguments of its own and the setting they equal)
CALLBACKS: dict[type, tuple[type, set[str], dict[str, str]]] = {
    NonFiniteGradientCheck: (NonFiniteConfig, set(), {"screen": "gradient_screen"}),
    RingReplayAudit: (ReplayConfig, {"allow_pickled_batches"}, {}),
    WeightFingerprintCheck: (FingerprintConfig, set(), {"update_audit_every_n_steps": "update_audit_every_n_steps"}),
    MatmulChecksumCheck: (MatmulChecksumConfig, set(), {}),
}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_configs_are_keyword_only_with_a_doc_per_setting(config: type) -> None:
    settings = settings_of(config)
    assert settings and all(f.kw_only for f in dataclasses.fields(config))
    with pytest.raises(TypeError):
        config(*[f.default for f in settings.values()])
    for name, f in settings.items():
        doc = f.metadata["doc"]
        assert doc and "\n" not in doc and not doc.endswith(".") and len(doc) <= 100, (name, doc)
    if config is not UpdateAudit:  # a check's state, not a frozen config
        assert config.__dataclass_params__.frozen
        assert all(f"{name}: " in config.__doc__ for name in settings)  # the Args section, from the same docs


def test_a_bad_value_is_refused_on_construction() -> None:
    for config, bad in ((NonFiniteConfig, {"max_names": 0}), (ReplayConfig, {"rtol": 2.0}),
                        (FingerprintConfig, {"rolling": 0}), (MatmulChecksumConfig, {"block": -1}),
                        (UpdateAudit, {"every_n_steps": 0})):  # fmt: skip
        with pytest.raises(ValueError):
            config(**bad)


def test_the_public_settings_keep_their_names_and_defaults() -> None:
    assert {f.name: f.default for f in dataclasses.fields(SDCSettings)} == PUBLIC
    assert all(field_doc(name) for name in PUBLIC)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_setting_is_a_setting_of_the_hook_set_or_declared_not_offered(config: type) -> None:
    offered = settings_for(config)
    declared = settings_of(config)
    assert set(offered) | set(NOT_OFFERED.get(config, ())) == set(declared)
    assert not set(offered) & set(NOT_OFFERED.get(config, ()))
    own = {f.name: f for f in dataclasses.fields(SDCSettings)}
    for name, setting in offered.items():
        assert setting == PREFIX[config] + name or setting in UNPREFIXED, setting
        default = OWN_DEFAULTS.get(setting, declared[name].default)
        assert own[setting].default == default, setting
        if setting not in OWN_DEFAULTS:
            assert own[setting].type == declared[name].type, setting


def test_settings_build_each_config_by_name() -> None:
    values = {"overflow_patience": 7, "replay_rtol": 0.01, "replay_allow_pickled_batches": True, "max_heals": 2,
              "fingerprint_rolling": 4, "update_audit_every_n_steps": 3, "matmul_checksum": True}  # fmt: skip
    s = SDCSettings(**values)
    assert s.nonfinite() == NonFiniteConfig(overflow_patience=7)
    assert s.replay() == ReplayConfig(rtol=0.01, allow_pickled_batches=True)
    assert SDCSettings().replay().allow_pickled_batches is None  # False: the environment decides
    assert s.fingerprint() == FingerprintConfig(max_heals=2, rolling=4)
    assert s.matmul() == MatmulChecksumConfig() and s.update_audit().every_n_steps == 3
    off = SDCSettings(nonfinite_gradient=False, replay_every_n_steps=0, fingerprint_every_n_steps=0)
    assert (off.nonfinite(), off.replay(), off.fingerprint(), off.matmul(), off.update_audit()) == (None,) * 5


@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_callback_signatures_follow_the_configs(callback: type) -> None:
    config, left_out, extra = CALLBACKS[callback]
    params = dict(list(inspect.signature(callback.__init__).parameters.items())[1:])
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())  # no **kwargs
    settings = {n: f for n, f in settings_of(config).items() if n not in left_out}
    assert set(params) == set(settings) | set(extra)
    own = {f.name: f for f in dataclasses.fields(SDCSettings)}
    for name, p in params.items():
        f = own[extra[name]] if name in extra else settings[name]
        assert p.default == f.default, name
        assert p.annotation == f.type, name  # the same type for LightningCLI
    cb = callback(**{name: p.default for name, p in params.items()})  # every argument by name
    assert cb._core.config == config()


def test_accelerate_sdc_config_help_and_prompts_are_the_docs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from accelerate_sdc.cli import main

    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    for name, default in PUBLIC.items():
        assert "".join(f"--{name} {name.upper()} {field_doc(name)} (default {default})".split()) in text

    prompts: list[str] = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("builtins.input", answer)
    monkeypatch.setattr(sys, "stdin", Tty())
    target = tmp_path / "sdc.yaml"
    assert main(["config", "--config_file", str(target)]) == 0
    assert prompts == [f"{field_doc(name)} [{default}]: " for name, default in PUBLIC.items()]
    written: dict[str, Any] = yaml.safe_load(target.read_text())
    assert written == PUBLIC
