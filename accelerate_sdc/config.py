"""SDC settings for Accelerate users: defaults < settings file < ``ACCELERATE_SDC_*`` < keywords.

* The settings file is ``sdc_config.yaml`` in accelerate's config directory (beside
  ``default_config.yaml``; ``$HF_HOME/accelerate`` by default), written by
  ``accelerate-sdc config``; ``ACCELERATE_SDC_CONFIG_FILE`` names another file.
* Every setting ``name`` can be overridden by the environment variable
  ``ACCELERATE_SDC_<NAME>`` (inherited by every process ``accelerate launch`` starts).
* Keyword arguments of ``SDCHooks`` override both.

A bad value anywhere raises ``SDCConfigError`` naming the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from sdc_core.fingerprint import FingerprintConfig
from sdc_core.gradients import NonFiniteConfig
from sdc_core.replay import ReplayConfig

ENV_PREFIX = "ACCELERATE_SDC_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"
FILE_NAME = "sdc_config.yaml"


class SDCConfigError(ValueError):
    """A setting has a bad value; the message names the key and its source."""


@dataclass(frozen=True)
class SDCSettings:
    """All settings of ``SDCHooks`` (names mirror the Lightning callbacks' arguments).

    ``replay_every_n_steps`` and ``fingerprint_every_n_steps`` of 0 turn that check off;
    ``nonfinite_gradient=False`` turns the gradient check off.
    """

    nonfinite_gradient: bool = True
    on_failure: str = "raise"
    overflow_patience: int = 3
    max_names: int = 5
    replay_every_n_steps: int = 100
    replay_exact: bool = False
    replay_rtol: float = 1e-3
    replay_atol: float = 1e-6
    replay_on_failure: str = "raise"
    fingerprint_every_n_steps: int = 1
    include_buffers: bool = False
    include_optimizer_state: bool = False
    fingerprint_on_failure: str = "raise"
    max_heals: int = 3
    log_every_n_steps: int = 50

    def nonfinite(self) -> NonFiniteConfig | None:
        if not self.nonfinite_gradient:
            return None
        return NonFiniteConfig(self.on_failure, self.overflow_patience, self.max_names)

    def replay(self) -> ReplayConfig | None:
        if self.replay_every_n_steps == 0:
            return None
        return ReplayConfig(
            self.replay_every_n_steps, self.replay_exact, self.replay_rtol, self.replay_atol, self.replay_on_failure
        )

    def fingerprint(self) -> FingerprintConfig | None:
        if self.fingerprint_every_n_steps == 0:
            return None
        return FingerprintConfig(
            self.fingerprint_every_n_steps,
            self.include_buffers,
            self.include_optimizer_state,
            self.fingerprint_on_failure,
            self.max_heals,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TYPES = {f.name: type(f.default) for f in fields(SDCSettings)}


def _coerce(key: str, value: Any, source: str) -> Any:
    """``value`` as the type of setting ``key``; strings (environment) are parsed."""
    if key not in _TYPES:
        raise SDCConfigError(f"unknown SDC setting {key!r} in {source}; known: {', '.join(_TYPES)}")
    kind = _TYPES[key]
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        return str(value)
    except (TypeError, ValueError) as err:
        raise SDCConfigError(f"bad value {value!r} for SDC setting {key!r} in {source}: {err}") from None


def default_file() -> Path:
    """Where ``accelerate-sdc config`` writes and ``SDCHooks`` reads the settings."""
    if os.environ.get(CONFIG_FILE_ENV):
        return Path(os.environ[CONFIG_FILE_ENV])
    from accelerate.commands.config.config_args import default_yaml_config_file

    return Path(default_yaml_config_file).with_name(FILE_NAME)


def read_file(path: Path) -> dict[str, Any]:
    """Settings from a YAML file: its top level, or its ``sdc:`` section (an accelerate config)."""
    source = f"config file {path}"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise SDCConfigError(f"cannot read {source}: {err}") from None
    if not isinstance(data, dict):
        raise SDCConfigError(f"{source} must hold a mapping of SDC settings")
    if "sdc" in data:
        data = data["sdc"] or {}
        source += ", section sdc"
        if not isinstance(data, dict):
            raise SDCConfigError(f"the sdc section of {path} must be a mapping")
    return {k: _coerce(k, v, source) for k, v in data.items()}


def from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    out = {}
    for key in _TYPES:
        name = ENV_PREFIX + key.upper()
        if name in env:
            out[key] = _coerce(key, env[name], f"environment variable {name}")
    return out


def resolve(**kwargs: Any) -> tuple[SDCSettings, dict[str, str]]:
    """Merge defaults, the settings file, the environment and ``kwargs``.

    Returns the settings and, for each key that was set, where its value came from.
    """
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    path = default_file()
    layers = []
    if path.exists():  # os.devnull reads as an empty file: no settings
        layers.append((read_file(path), f"config file {path}"))
    elif os.environ.get(CONFIG_FILE_ENV):
        raise SDCConfigError(f"{CONFIG_FILE_ENV} names {path}, which does not exist")
    layers.append((from_env(), "environment"))
    layers.append(({k: _coerce(k, v, "keyword arguments") for k, v in kwargs.items()}, "keyword arguments"))
    for layer, source in layers:
        for k, v in layer.items():
            values[k] = v
            origin[k] = f"environment variable {ENV_PREFIX}{k.upper()}" if source == "environment" else source
    settings = SDCSettings(**values)
    sections = (
        (settings.nonfinite, {"on_failure": "on_failure", "overflow_patience": "overflow_patience",
                              "max_names": "max_names"}),
        (settings.replay, {"every_n_steps": "replay_every_n_steps", "exact": "replay_exact",
                           "rtol": "replay_rtol", "atol": "replay_atol",
                           "on_failure": "replay_on_failure"}),
        (settings.fingerprint, {"every_n_steps": "fingerprint_every_n_steps", "include_buffers": "include_buffers",
                                "include_optimizer_state": "include_optimizer_state",
                                "on_failure": "fingerprint_on_failure", "max_heals": "max_heals"}),
    )  # fmt: skip
    for key in ("on_failure", "replay_on_failure", "fingerprint_on_failure"):
        if getattr(settings, key) == "rollback":
            raise SDCConfigError(
                f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): 'rollback' is a Lightning "
                "policy (it reloads ModelCheckpoint files); with Accelerate use load_state yourself"
            )
    for build, keys in sections:
        try:
            build()
        except ValueError as err:
            key = next(k for arg, k in keys.items() if str(err).startswith(arg))
            raise SDCConfigError(f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): {err}") from None
    if settings.log_every_n_steps < 1:
        key = "log_every_n_steps"
        raise SDCConfigError(f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): must be >= 1")
    return settings, origin
