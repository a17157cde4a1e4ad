"""SDC settings for Accelerate users: defaults < settings file < ``ACCELERATE_SDC_*`` < keywords.

* The settings file is ``sdc_config.yaml`` in accelerate's config directory (beside
  ``default_config.yaml``; ``$HF_HOME/accelerate`` by default), written by
  ``accelerate-sdc config``; ``ACCELERATE_SDC_CONFIG_FILE`` names another file.
* Every setting ``name`` can be overridden by the environment variable
  ``ACCELERATE_SDC_<NAME>`` (inherited by every process ``accelerate launch`` starts).
* Keyword arguments of ``SDCHooks`` override both.

One rule for every source (file, environment, keywords, ``accelerate-sdc config`` options): a
bool is ``true``/``false`` or ``1``/``0`` (as a bool, a number or a string, any case; not
``yes``/``on``), an integer is a whole number or a string of one, a number a finite number or a
string of one, a policy a string. An unknown name anywhere (a file key, an ``ACCELERATE_SDC_*``
variable, a keyword) is an error suggesting the closest known name; so is a bad value, also of a
check that is turned off. ``SDCConfigError`` names the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from sdc_core.fingerprint import FingerprintConfig
from sdc_core.gradients import NonFiniteConfig
from sdc_core.replay import ReplayConfig
from sdc_core.sharded_update import UpdateAudit, update_audit

ENV_PREFIX = "ACCELERATE_SDC_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG_FILE"
FILE_NAME = "sdc_config.yaml"


class SDCConfigError(ValueError):
    """A setting has a bad value; the message names the key and its source."""


@dataclass(frozen=True)
class SDCSettings:
    """All settings of ``SDCHooks`` (names mirror the Lightning callbacks' arguments).

    ``replay_every_n_steps`` and ``fingerprint_every_n_steps`` of 0 turn that check off;
    ``nonfinite_gradient=False`` turns the gradient check off. ``update_audit_every_n_steps``
    (default 0, off) applies to FSDP2 models only (``WeightFingerprintCheck``'s argument of the
    same name); a DDP run ignores it.
    """

    nonfinite_gradient: bool = True
    on_failure: str = "raise"
    overflow_patience: int = 3
    max_names: int = 5
    replay_every_n_steps: int = 100
    replay_exact: bool | str = "auto"
    replay_rtol: float = 1e-3
    replay_atol: float = 1e-6
    replay_on_failure: str = "raise"
    replay_on_unreplayable: str = "raise"
    replay_max_state_mb: float = 256.0
    fingerprint_every_n_steps: int = 1
    include_buffers: bool = False
    include_optimizer_state: bool = False
    fingerprint_on_failure: str = "raise"
    max_heals: int = 3
    update_audit_every_n_steps: int = 0
    log_every_n_steps: int = 50

    def nonfinite(self) -> NonFiniteConfig | None:
        if not self.nonfinite_gradient:
            return None
        return NonFiniteConfig(self.on_failure, self.overflow_patience, self.max_names)

    def replay(self) -> ReplayConfig | None:
        if self.replay_every_n_steps == 0:
            return None
        return ReplayConfig(
            self.replay_every_n_steps, self.replay_exact, self.replay_rtol, self.replay_atol, self.replay_on_failure,
            self.replay_on_unreplayable, self.replay_max_state_mb,
        )  # fmt: skip

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

    def update_audit(self) -> UpdateAudit | None:
        """FSDP2 without replicas: a partner recomputes each rank's optimizer update every n-th step."""
        return update_audit(self.update_audit_every_n_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TYPES = {f.name: type(f.default) for f in fields(SDCSettings)}
_INT = re.compile(r"[+-]?\d+")


class _Loader(yaml.SafeLoader):
    """YAML whose booleans are ``true``/``false`` only (``yes``/``on`` stay strings and are then
    rejected, as they are from the environment)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"


def _coerce(key: str, value: Any, source: str) -> Any:
    """``value`` as the type of setting ``key``, by the same rule whatever the source."""
    if key not in _TYPES:
        raise SDCConfigError(f"unknown SDC setting {key!r} in {source}{_suggest(key, list(_TYPES))}")
    kind = _TYPES[key]
    text = value.strip().lower() if isinstance(value, str) else None
    try:
        if key == "replay_exact":  # True, False or "auto"
            if isinstance(value, bool) or text == "auto":
                return value if isinstance(value, bool) else "auto"
            if (isinstance(value, int) and value in (0, 1)) or text in ("0", "1", "true", "false"):
                return text in ("1", "true") if text is not None else bool(value)
            raise ValueError("expected true, false or auto (or 1 or 0)")
        if kind is bool:
            if isinstance(value, bool):
                return value
            if (isinstance(value, int) and value in (0, 1)) or text in ("0", "1", "true", "false"):
                return text in ("1", "true") if text is not None else bool(value)
            raise ValueError("expected true or false (or 1 or 0)")
        if kind is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if text is not None and _INT.fullmatch(text):
                return int(text)
            raise ValueError("expected a whole number")
        if kind is float:
            number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
            if text is not None:
                number = float(text)
            if number is None or not math.isfinite(number):
                raise ValueError("expected a finite number")
            return float(number)
        if not isinstance(value, str):
            raise ValueError("expected a word such as raise")
        return value.strip()
    except (TypeError, ValueError) as err:
        why = "expected a finite number" if "could not convert" in str(err) else err
        raise SDCConfigError(f"bad value {value!r} for SDC setting {key!r} in {source}: {why}") from None


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
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except (OSError, yaml.YAMLError) as err:
        raise SDCConfigError(f"cannot read {source}: {err}") from None
    if not isinstance(data, dict):
        raise SDCConfigError(f"{source} must hold a mapping of SDC settings")
    if "sdc" in data:
        data = data["sdc"] or {}
        source += ", section sdc"
        if not isinstance(data, dict):
            raise SDCConfigError(f"the sdc section of {path} must be a mapping")
    return {str(k): _coerce(str(k), v, source) for k, v in data.items()}


def from_env(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Settings from ``ACCELERATE_SDC_<NAME>`` variables; any other ``ACCELERATE_SDC_*`` name
    (a typo) raises ``SDCConfigError`` with the closest known name."""
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + key.upper(): key for key in _TYPES}
    out = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_FILE_ENV:
            continue
        if name not in known:
            raise SDCConfigError(f"unknown environment variable {name}{_suggest(name, [*known, CONFIG_FILE_ENV])}")
        out[known[name]] = _coerce(known[name], env[name], f"environment variable {name}")
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
    checked = dataclasses.replace(  # a check turned off still gets its other settings checked
        settings,
        nonfinite_gradient=True,
        replay_every_n_steps=settings.replay_every_n_steps or 1,
        fingerprint_every_n_steps=settings.fingerprint_every_n_steps or 1,
    )
    sections = (
        (checked.nonfinite, {"on_failure": "on_failure", "overflow_patience": "overflow_patience",
                              "max_names": "max_names"}),
        (checked.replay, {"every_n_steps": "replay_every_n_steps", "exact": "replay_exact",
                           "rtol": "replay_rtol", "atol": "replay_atol",
                           "on_failure": "replay_on_failure", "on_unreplayable": "replay_on_unreplayable",
                           "max_state_mb": "replay_max_state_mb"}),
        (checked.fingerprint, {"every_n_steps": "fingerprint_every_n_steps", "include_buffers": "include_buffers",
                                "include_optimizer_state": "include_optimizer_state",
                                "on_failure": "fingerprint_on_failure", "max_heals": "max_heals"}),
        (checked.update_audit, {"update_audit_every_n_steps": "update_audit_every_n_steps"}),
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
            key = next((k for arg, k in keys.items() if str(err).startswith(arg)), next(iter(keys.values())))
            raise SDCConfigError(f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): {err}") from None
    if settings.log_every_n_steps < 1:
        key = "log_every_n_steps"
        raise SDCConfigError(f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): must be >= 1")
    return settings, origin
