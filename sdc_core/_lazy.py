"""Package exports imported on first use (PEP 562), so ``import sdc_core`` imports no torch until a
name is used; and ``require``, the one-line ``ImportError`` of an adapter whose framework is missing."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` importing each name of ``exports`` (module -> names) on first access."""
    home = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *home})

    return getattr_, dir_


def _advice(module: str, extra: str, package: str) -> str:
    return f"{package} needs {module}, which is not installed: pip install 'sdc-checks[{extra}]'"


def require(module: str, extra: str, package: str) -> None:
    """Raise ``ImportError`` naming the extra to install when ``module`` is not installed (imports nothing)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked import, or a module in sys.modules without a spec
        found = False
    if not found:
        raise ImportError(_advice(module, extra, package), name=module)


def missing(err: ImportError, module: str, extra: str, package: str) -> ImportError:
    """For ``err`` met importing ``module``: the one-line advice when it is missing, else ``err``."""
    if (err.name or "").split(".")[0] != module:
        return err
    return ImportError(_advice(module, extra, package), name=module)
