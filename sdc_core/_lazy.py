"""Package exports imported on first use (PEP 562): ``import sdc_core`` or ``lightning_sdc`` stays
cheap (no torch, no Lightning) until a name is used, so ``sdc --help`` answers at once."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name in ``exports`` (module -> names) is
    imported from its module on first access and kept in ``namespace`` (the package's globals)."""
    home = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *home})

    return getattr_, dir_
