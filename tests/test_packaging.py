"""The package as an index would get it: the wheel and the sdist built with setuptools' own PEP 517
hooks from a copy of the tree, then read back (metadata, ``py.typed``, what the sdist leaves out)."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

_SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                               ".ruff_cache", "lightning_logs", "sdc")  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = tmp_path_factory.mktemp("src") / "tree"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    out = tmp_path_factory.mktemp("dist")
    code = (
        "import sys; from setuptools import build_meta as b\n"
        f"w = b.build_wheel({str(out)!r}); s = b.build_sdist({str(out)!r}); print('BUILT', w, s)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel, sdist = next(line for line in proc.stdout.splitlines() if line.startswith("BUILT ")).split()[1:]
    return out / wheel, out / sdist


def test_the_wheel_carries_py_typed_and_the_metadata(built: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(built[0]) as wheel:
        names = set(wheel.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_string(wheel.read(meta_name).decode())
    for package in ("sdc_core", "lightning_sdc", "accelerate_sdc"):
        assert f"{package}/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["License-Expression"] == "Apache-2.0"
    assert "torch>=2.6" in meta.get_all("Requires-Dist")
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3" in classifiers
    assert meta["Author"] or meta["Author-email"]


def test_the_sdist_leaves_the_test_suite_out_and_ships_the_license(built: tuple[Path, Path]) -> None:
    with tarfile.open(built[1]) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert "LICENSE" in names and "README.md" in names
    assert any(n.startswith("docs/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)


def test_the_license_is_the_apache_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "END OF TERMS AND CONDITIONS" in text


def test_the_readme_has_no_relative_link_an_index_page_would_break() -> None:
    """A package index shows the README without the repository around it: pages are named by path."""
    import re

    links = re.findall(r"\[[^\]]+\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert [t for t in links if not re.match(r"[a-z]+://", t)] == []
