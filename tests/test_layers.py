"""Imports go one way (docs/architecture.md): the core names no framework and no adapter, only
fault injection, the CLI and the campaign import fault injection, adapters do not import each
other, and no module of a package imports itself back at module level.

Every module of ``sdc_core``, ``lightning_sdc`` and ``accelerate_sdc`` is parsed with ``ast``:
imports at module level and inside functions (a lazy import is still a dependency) count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("sdc_core", "lightning_sdc", "accelerate_sdc")
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")
# The core's layers, bottom up (docs/architecture.md): a module imports only from its own subpackage, from
# a layer below it, and from the leaves. Fault injection and the CLI are the top: nothing else imports them.
LEAVES = {"sdc_core.errors", "sdc_core.stats", "sdc_core.schema", "sdc_core._lazy"}
LAYERS = ("dist", "checks", "io", "ops", "replay", "sharded", "driver", "faults", "cli")
# who may import fault injection: itself, the CLI (sdc corrupt-checkpoint) and the adapters (the
# Lightning FaultInjector callback, the campaign)
MAY_INJECT = ("sdc_core.faults", "sdc_core.cli")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(source: str, module: str, known: set[str], is_package: bool = False) -> list[tuple[str, bool, int]]:
    """``(imported module, at module level, line)`` for every import in ``source``; ``from p
    import x`` is ``p.x`` when that is a module in ``known``, else ``p``."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                found.extend((a.name, top, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for a in child.names:
                    name = f"{base}.{a.name}"
                    found.append((name if name in known else base, top, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), True)
    return found


def graph() -> dict[str, list[tuple[str, bool, int]]]:
    mods = modules()
    return {m: imports(path.read_text(), m, set(mods), path.stem == "__init__") for m, path in mods.items()}


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_core_imports_no_framework_and_no_adapter() -> None:
    wrong = [f"{m}:{line} imports {dep}" for m, deps in graph().items() if top(m) == "sdc_core"
             for dep, _, line in deps if top(dep) in (*FRAMEWORKS, "lightning_sdc", "accelerate_sdc")]  # fmt: skip
    assert wrong == []


def injects(name: str) -> bool:
    return name == "sdc_core.faults" or name.startswith("sdc_core.faults.")


def test_only_fault_injection_the_cli_and_the_adapters_import_fault_injection() -> None:
    wrong = [f"{m}:{line} imports {dep}" for m, deps in graph().items()
             if top(m) == "sdc_core" and not any(m == a or m.startswith(a + ".") for a in MAY_INJECT)
             for dep, _, line in deps if injects(dep)]  # fmt: skip
    assert wrong == []


def layer(module: str) -> int | None:
    """The index of ``module``'s layer in ``LAYERS``; -1 for a leaf, None for the package itself."""
    if module in LEAVES:
        return -1
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else None


def test_every_core_module_is_in_a_layer() -> None:
    assert [m for m in modules() if top(m) == "sdc_core" and m != "sdc_core" and m not in LEAVES
            and m.split(".")[1] not in LAYERS] == []  # fmt: skip


def test_the_core_imports_only_down_its_layers() -> None:
    g = graph()
    wrong = [f"{m}:{line} imports {dep}" for m, deps in g.items() if top(m) == "sdc_core" and layer(m) is not None
             for dep, _, line in deps if dep in g and top(dep) == "sdc_core" and dep != "sdc_core"
             and not (layer(dep) < layer(m) or (layer(dep) == layer(m) and layer(m) >= 0))]  # fmt: skip
    assert wrong == []


def test_the_layer_check_fails_on_an_upward_import() -> None:
    assert layer("sdc_core.checks.gradients") < layer("sdc_core.replay.ring") < layer("sdc_core.driver.hooks")
    assert layer("sdc_core.errors") == -1 and layer("sdc_core") is None
    assert layer("sdc_core.driver.step") < layer("sdc_core.faults.inject")


def test_adapters_do_not_import_each_other() -> None:
    other = {"lightning_sdc": "accelerate_sdc", "accelerate_sdc": "lightning_sdc"}
    wrong = [f"{m}:{line} imports {dep}" for m, deps in graph().items() if top(m) in other
             for dep, _, line in deps if top(dep) == other[top(m)]]  # fmt: skip
    assert wrong == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of ``edges`` found by a depth-first search (each reported once per entry point)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node)
    return found


def test_no_import_cycle_at_module_level() -> None:
    g = graph()
    edges = {m: {dep for dep, at_top, _ in deps if at_top and dep in g and dep != m} for m, deps in g.items()}
    assert cycles(edges) == []


def test_the_checks_see_lazy_imports_and_cycles() -> None:
    source = "import torch\n\ndef f():\n    from sdc_core.faults import inject\n    import lightning.pytorch\n"
    known = {"sdc_core.faults.inject"}
    assert imports(source, "sdc_core.driver.hooks", known) == [
        ("torch", True, 1), ("sdc_core.faults.inject", False, 4), ("lightning.pytorch", False, 5)]  # fmt: skip
    assert imports("from . import step\nfrom .x import y\n", "sdc_core.driver.hooks", {"sdc_core.driver.step"}) == [
        ("sdc_core.driver.step", True, 1), ("sdc_core.driver.x", True, 2)]  # fmt: skip
    assert imports("from . import step\n", "sdc_core.driver", {"sdc_core.driver.step"}, is_package=True) == [
        ("sdc_core.driver.step", True, 1)]  # fmt: skip
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_seen(package: str) -> None:
    assert any(m == package for m in modules()) and sum(top(m) == package for m in modules()) > 3


# Issue 29's measures of size (docs/architecture.md): a file, a class and a function each fit on a few screens.
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 600, 300, 80


def oversized(source: str, where: str) -> list[str]:
    """What in ``source`` exceeds the limits: the file's lines, each class's and each function's
    (from its ``class``/``def`` line to its last, decorators aside)."""
    found = [f"{where}: {n} lines" for n in [len(source.splitlines())] if n > MAX_FILE]
    for node in ast.walk(ast.parse(source)):
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > limit:
                found.append(f"{where}:{node.lineno} {node.name}: {n} lines")
    return found


def test_no_file_class_or_function_is_over_its_size() -> None:
    found = [f for m, path in modules().items() for f in oversized(path.read_text(), m)]
    assert found == [], "split by responsibility: " + "; ".join(found)


def test_the_size_check_sees_each_kind() -> None:
    body = "    x = 1\n" * MAX_FUNCTION
    assert oversized(f"def f():\n{body}", "m") == [f"m:1 f: {MAX_FUNCTION + 1} lines"]
    assert oversized(f"def f():\n{body[10:]}", "m") == []
    method = "    def g(self):\n" + "        x = 1\n" * 60 + "\n"
    big = "class C:\n" + method * 5
    assert [f.split(" C:")[0] for f in oversized(big, "m")] == ["m:1"]
    assert oversized("x = 1\n" * (MAX_FILE + 1), "m") == [f"m: {MAX_FILE + 1} lines"]
