"""Settings of the loop driver (``sdc_core.SDCHooks``): one validated set, from layered sources.

Precedence: defaults < settings file < environment (``<PREFIX><NAME>``) < keywords; a route's ``Sources`` says which
file and prefix it reads (the plain-PyTorch route: keywords only; the Accelerate, Fabric and Trainer seams:
``ACCELERATE_SDC_*`` and the ``accelerate-sdc config`` file).

One rule for every source: a bool is ``true``/``false`` or ``1``/``0`` (as a bool, a number or a string, any case; not
``yes``/``on``), an integer a whole number or a string of one, a number a finite number or a string of one, a policy a
string. An unknown name anywhere is an error suggesting the closest known name; so is a bad value, also of a check that
is turned off. ``SDCConfigError`` names the key and where it came from. Cost: paid once, at construction."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sdc_core.checks.fingerprint import FingerprintConfig, FingerprintFailurePolicy
from sdc_core.checks.gradients import NonFiniteConfig, NonFiniteFailurePolicy
from sdc_core.checks.matmul import MatmulChecksumConfig
from sdc_core.checks.screen import ScreenConfig
from sdc_core.ops.process_exit import one_line_when_uncaught
from sdc_core.replay.ring import ReplayConfig, ReplayExact, ReplayFailurePolicy, UnreplayablePolicy
from sdc_core.schema import settings_of
from sdc_core.sharded.update_audit import UpdateAudit, update_audit


class SDCConfigError(ValueError):
    """A setting has a bad value; the message names the key and its source."""


def _from(config: type, name: str, *, default: Any = dataclasses.MISSING, doc: str = "", more: str = "") -> Any:
    """An ``SDCSettings`` field that IS setting ``name`` of ``config``, with its default and doc unless given."""
    f = settings_of(config)[name]
    return dataclasses.field(
        default=f.default if default is dataclasses.MISSING else default,
        metadata={**f.metadata, "doc": doc or f.metadata["doc"], "more": more or f.metadata.get("more", ""),
                  "config": config, "field": name},
    )  # fmt: skip


def _own(default: Any, doc: str) -> Any:
    """An ``SDCSettings`` field of its own (a check's switch, the tracker cadence)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


# the config fields the hook set does not offer as settings (their defaults apply); tests/test_settings_schema.py
# fails when a config gains a setting that is neither here nor a field of SDCSettings
NOT_OFFERED: dict[type, tuple[str, ...]] = {
    MatmulChecksumConfig: tuple(settings_of(MatmulChecksumConfig)),  # the switch matmul_checksum only
    ScreenConfig: tuple(settings_of(ScreenConfig)),  # the switch gradient_screen only: the band calibrates itself
}


@dataclass(frozen=True)
class SDCSettings:
    """All settings of the hook set (names mirror the Lightning callbacks' arguments; a check's field is its config's).

    A cadence of 0, or ``nonfinite_gradient=False``, turns that check off. ``replay_allow_pickled_batches=False``
    refuses a partner's micro-batch that needs unpickling unless the launcher sets ``SDC_ALLOW_PICKLED_BATCHES=1`` on
    every rank (the receiver decides)."""

    nonfinite_gradient: bool = _own(True, "check local gradients for NaN/Inf before the all-reduce")
    on_failure: NonFiniteFailurePolicy = _from(NonFiniteConfig, "on_failure")
    overflow_patience: int = _from(NonFiniteConfig, "overflow_patience")
    max_names: int = _from(NonFiniteConfig, "max_names")
    replay_every_n_steps: int = _from(
        ReplayConfig, "every_n_steps", doc="ring replay audit cadence in optimizer steps (0: off)")
    replay_exact: ReplayExact = _from(ReplayConfig, "exact")
    replay_rtol: float = _from(ReplayConfig, "rtol")
    replay_atol: float = _from(ReplayConfig, "atol")
    replay_on_failure: ReplayFailurePolicy = _from(ReplayConfig, "on_failure")
    replay_on_unreplayable: UnreplayablePolicy = _from(ReplayConfig, "on_unreplayable")
    replay_max_state_mb: float = _from(ReplayConfig, "max_state_mb")
    replay_deterministic: bool = _from(ReplayConfig, "deterministic")
    replay_allow_pickled_batches: bool = _from(ReplayConfig, "allow_pickled_batches", default=False)  # False: None
    fingerprint_every_n_steps: int = _from(
        FingerprintConfig, "every_n_steps", doc="weight fingerprint cadence in optimizer steps (0: off)")
    include_buffers: bool = _from(FingerprintConfig, "include_buffers")
    include_optimizer_state: bool = _from(FingerprintConfig, "include_optimizer_state")
    fingerprint_on_failure: FingerprintFailurePolicy = _from(FingerprintConfig, "on_failure")
    max_heals: int = _from(FingerprintConfig, "max_heals")
    fingerprint_rolling: int = _from(FingerprintConfig, "rolling")
    update_audit_every_n_steps: int = _from(
        UpdateAudit, "every_n_steps", default=0,
        doc="FSDP2: a partner recomputes each rank's optimizer update every n steps (0: off)",
        more="Sharded models (``ModelParallelStrategy``, ``fully_shard``) only: it costs a copy and a transfer of "
        "the shard, its gradient and optimizer state, and one extra optimizer step.",
    )  # fmt: skip
    gradient_screen: bool = _own(
        True, "each step, compare the ranks' local-gradient peaks; a partner's replay confirms a hit before "
        "a rank is named",
    )  # fmt: skip
    matmul_checksum: bool = _own(False, "verify every nn.Linear product's row sums in forward and backward (opt-in)")
    log_every_n_steps: int = _own(50, "how often the counters go to the trackers")

    def _config(self, config: type, on: bool, **extra: Any) -> Any:
        """``config`` built from its settings (``extra`` over them), or None when ``on`` is false."""
        if not on:
            return None
        return config(**{name: getattr(self, setting) for name, setting in settings_for(config).items()} | extra)

    def nonfinite(self) -> NonFiniteConfig | None:
        return self._config(NonFiniteConfig, self.nonfinite_gradient)

    def replay(self) -> ReplayConfig | None:  # allow_pickled_batches=False becomes None: the environment decides
        return self._config(ReplayConfig, self.replay_every_n_steps != 0,
                            allow_pickled_batches=True if self.replay_allow_pickled_batches else None)  # fmt: skip

    def fingerprint(self) -> FingerprintConfig | None:
        return self._config(FingerprintConfig, self.fingerprint_every_n_steps != 0)

    def screen(self) -> ScreenConfig | None:
        """None when the screen or the gradient check it reads from is off; its band's tuning is not offered."""
        return ScreenConfig() if self.gradient_screen and self.nonfinite_gradient else None

    def matmul(self) -> MatmulChecksumConfig | None:
        return self._config(MatmulChecksumConfig, self.matmul_checksum)

    def update_audit(self) -> UpdateAudit | None:
        return update_audit(self.update_audit_every_n_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_doc(name: str) -> str:
    """The one-line doc of setting ``name`` (``accelerate-sdc config`` prompts and help)."""
    return next(f.metadata["doc"] for f in fields(SDCSettings) if f.name == name)


def help_table_source() -> str:
    """The text of ``sdc_core/driver/settings_help.py``, for a ``--help`` that imports no torch
    (``tests/test_cli_startup.py`` keeps the file equal to this)."""
    rows = "".join(f"    ({f.name!r}, {f.default!r},\n     {f.metadata['doc']!r}),\n" for f in fields(SDCSettings))
    return (
        '"""Generated from ``sdc_core.driver.settings.SDCSettings`` by ``help_table_source()`` (do not edit): each\n'
        "setting's ``(name, default, one-line doc)``, so ``accelerate-sdc --help`` imports no torch.\n"
        '``tests/test_cli_startup.py`` fails when this differs from the schema."""\n\n'
        f"SETTINGS: tuple[tuple[str, object, str], ...] = (\n{rows})\n")


def settings_for(config: type) -> dict[str, str]:
    """``config``'s field names and the ``SDCSettings`` names that set them, in field order."""
    return {f.metadata["field"]: f.name for f in fields(SDCSettings) if f.metadata.get("config") is config}


_TYPES = {f.name: type(f.default) for f in fields(SDCSettings)}
_INT = re.compile(r"[+-]?\d+")


def suggest(name: str, known: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, else the list of known names."""
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=1, cutoff=0.5)
    if close:
        match = next(k for k in known if k.lower() == close[0])
        return f" (did you mean {match!r}?)"
    return f"; known: {', '.join(known)}"


class UnknownArgumentError(SDCConfigError, TypeError):
    """A keyword no setting or argument has (a ``TypeError`` too, as Python's own for a bad keyword)."""


def checked_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a constructor so an unknown keyword raises ``UnknownArgumentError`` naming the class, the keyword and the
    closest known one; the signature stays visible (LightningCLI reads it)."""
    params = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return init
    names = [n for n, p in list(params.items())[1:] if p.kind is not inspect.Parameter.POSITIONAL_ONLY]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = next((k for k in kwargs if k not in names), None)
        if unknown is not None:
            one_line_when_uncaught(SDCConfigError)
            raise UnknownArgumentError(
                f"unknown argument {unknown!r} of {type(self).__name__} (value {kwargs[unknown]!r})"
                f"{suggest(unknown, names)}; its arguments: {', '.join(names)}")
        init(self, *args, **kwargs)

    checked._sdc_checked = True  # type: ignore[attr-defined]
    return checked


def coerce(key: str, value: Any, source: str) -> Any:
    """``value`` as the type of setting ``key``, by the same rule whatever the source."""
    if key not in _TYPES:
        raise SDCConfigError(f"unknown SDC setting {key!r} in {source}{suggest(key, list(_TYPES))}")
    kind = _TYPES[key]
    text = value.strip().lower() if isinstance(value, str) else None
    try:
        if kind is bool or key == "replay_exact":  # replay_exact: True, False or "auto"
            if isinstance(value, bool) or (key == "replay_exact" and text == "auto"):
                return value if isinstance(value, bool) else "auto"
            if (isinstance(value, int) and value in (0, 1)) or text in ("0", "1", "true", "false"):
                return text in ("1", "true") if text is not None else bool(value)
            words = "true, false or auto" if key == "replay_exact" else "true or false"
            raise ValueError(f"expected {words} (or 1 or 0)")
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


def read_file(path: Path) -> dict[str, Any]:
    """Settings from a YAML file: its top level, or its ``sdc:`` section (an accelerate config). Booleans are
    ``true``/``false`` only (``yes``/``on`` stay strings and are then rejected)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    _Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    source = f"config file {path}"
    try:
        data = yaml.load(Path(path).read_text(), Loader=_Loader) or {}
    except (OSError, yaml.YAMLError) as err:
        raise SDCConfigError(f"cannot read {source}: {err}") from None
    if not isinstance(data, dict):
        raise SDCConfigError(f"{source} must hold a mapping of SDC settings")
    if "sdc" in data:
        data = data["sdc"] or {}
        source += ", section sdc"
        if not isinstance(data, dict):
            raise SDCConfigError(f"the sdc section of {path} must be a mapping")
    return {str(k): coerce(str(k), v, source) for k, v in data.items()}


@dataclass(frozen=True)
class Sources:
    """Where a route reads settings besides keywords: ``<env_prefix><NAME>`` variables, the file named by
    ``<env_prefix>CONFIG_FILE``, else ``default_file()`` when it exists. ``env_prefix=None``: keywords only."""

    env_prefix: str | None = None
    default_file: Callable[[], Path | None] | None = None

    @property
    def file_env(self) -> str:
        return (self.env_prefix or "") + "CONFIG_FILE"

    def file(self) -> Path | None:
        if self.env_prefix is None:
            return None
        if os.environ.get(self.file_env):
            return Path(os.environ[self.file_env])
        return self.default_file() if self.default_file is not None else None

    def from_env(self) -> dict[str, Any]:
        """Settings from ``<env_prefix><NAME>`` variables; any other name with the prefix (in any case) raises
        ``SDCConfigError`` with the closest known name."""
        if self.env_prefix is None:
            return {}
        known = {self.env_prefix + key.upper(): key for key in _TYPES}
        out = {}
        for name in sorted(os.environ):
            if not name.upper().startswith(self.env_prefix) or name == self.file_env:
                continue
            if name not in known:
                raise SDCConfigError(f"unknown environment variable {name}{suggest(name, [*known, self.file_env])}")
            out[known[name]] = coerce(known[name], os.environ[name], f"environment variable {name}")
        return out


PLAIN = Sources()  # keywords only

POLICIES = {  # the failure policies the hook set offers, per setting ('rollback' is the Lightning callbacks' only)
    "on_failure": ("raise", "skip_step", "warn"),
    "replay_on_failure": ("raise", "skip_step"),
    "fingerprint_on_failure": ("raise", "heal"),
}


def _either(words: tuple[str, ...]) -> str:
    quoted = [repr(w) for w in words]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def resolve(sources: Sources = PLAIN, **kwargs: Any) -> tuple[SDCSettings, dict[str, str]]:
    """Merge defaults, the settings file, the environment and ``kwargs``, and validate every value. Returns the
    settings and, for each key that was set, where its value came from. ``SDCConfigError`` names the key and its
    source; left uncaught, it ends the process with that one line."""
    try:
        return _resolve(sources, **kwargs)
    except SDCConfigError:
        one_line_when_uncaught(SDCConfigError)
        raise


def _resolve(sources: Sources, **kwargs: Any) -> tuple[SDCSettings, dict[str, str]]:
    path = sources.file()
    layers = []  # (key, value, where it came from), later sources last
    if path is not None and path.exists():  # os.devnull reads as an empty file: no settings
        layers += [(k, v, f"config file {path}") for k, v in read_file(path).items()]
    elif sources.env_prefix is not None and os.environ.get(sources.file_env):
        raise SDCConfigError(f"{sources.file_env} names {path}, which does not exist")
    layers += [(k, v, f"environment variable {sources.env_prefix}{k.upper()}") for k, v in sources.from_env().items()]
    layers += [(k, coerce(k, v, "keyword arguments"), "keyword arguments") for k, v in kwargs.items()]
    origin = {k: source for k, _, source in layers}
    settings = SDCSettings(**{k: v for k, v, _ in layers})
    checked = dataclasses.replace(  # a check turned off still gets its other settings checked
        settings,
        nonfinite_gradient=True,
        replay_every_n_steps=settings.replay_every_n_steps or 1,
        fingerprint_every_n_steps=settings.fingerprint_every_n_steps or 1,
    )
    sections = (  # each config's settings, by field name (the first names the setting of an unplaced error)
        (checked.nonfinite, settings_for(NonFiniteConfig)),
        (checked.replay, settings_for(ReplayConfig)),
        (checked.fingerprint, settings_for(FingerprintConfig)),
        (checked.update_audit, settings_for(UpdateAudit)),
    )

    def bad(key: str, why: object) -> SDCConfigError:
        return SDCConfigError(f"bad value for SDC setting {key!r} ({origin.get(key, 'default')}): {why}")

    for key, allowed in POLICIES.items():
        value = getattr(settings, key)
        if value == "rollback":
            raise bad(key, "'rollback' is a policy of the Lightning callbacks (it reloads ModelCheckpoint files), not "
                      f"of the hook set; use one of {_either(allowed)}, catch the SDCError and load a checkpoint "
                      "yourself (Accelerate: load_state)")  # fmt: skip
        if value not in allowed:
            raise bad(key, f"must be {_either(allowed)}, got {value!r}")
    for key in ("replay_every_n_steps", "fingerprint_every_n_steps"):
        if getattr(settings, key) < 0:
            raise bad(key, f"must be a whole number >= 0 (0 turns the check off), got {getattr(settings, key)!r}")
    for build, keys in sections:
        try:
            build()
        except ValueError as err:
            key = next((k for arg, k in keys.items() if str(err).startswith(arg)), next(iter(keys.values())))
            raise bad(key, err) from None
    if settings.log_every_n_steps < 1:
        raise bad("log_every_n_steps", "must be >= 1")
    return settings, origin
