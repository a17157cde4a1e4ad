"""A check's settings, declared once: the fields of its config dataclass made by ``setting(default, doc, more)``;
``SDCSettings`` and ``accelerate-sdc config`` take their defaults and docs from them, ``documented`` writes them into
the class docstring. No torch: every config module imports this one."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def setting(default: Any, doc: str, more: str = "") -> Any:
    """A config field that is a setting: ``default``, a one-line ``doc`` and optional details."""
    return dataclasses.field(default=default, metadata={"doc": doc, "more": more})


def settings_of(config: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of ``config`` that are settings (those with a doc), in declaration order."""
    return {f.name: f for f in dataclasses.fields(config) if "doc" in f.metadata}


def describe(f: dataclasses.Field[Any]) -> str:
    doc, more = f.metadata["doc"], f.metadata.get("more", "")
    return f"{doc}. {more}" if more else f"{doc}."


def documented(cls: T, settings: dict[str, dataclasses.Field[Any]] | None = None) -> T:
    """Append an ``Args:`` section of ``cls``'s settings' docs (or of ``settings``) to ``cls.__doc__``."""
    lines = [
        textwrap.fill(f"{name}: {describe(f)}", width=96, initial_indent=" " * 8, subsequent_indent=" " * 12)
        for name, f in (settings_of(cls) if settings is None else settings).items()]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + "\n".join(lines) + "\n"
    return cls


def env_flag(name: str) -> bool:
    """The environment flag ``name`` by the settings' rule for booleans: ``1``/``true`` on; unset,
    empty, ``0``/``false`` off (any case, spaces ignored); ``ValueError`` naming it for anything else."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false"):
        return False
    if raw in ("1", "true"):
        return True
    raise ValueError(f"{name} must be 1, true, 0 or false, got {raw!r}")
