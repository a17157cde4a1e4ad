"""Dependencies by extra: the core needs torch alone; an adapter imported without its framework
raises one ``ImportError`` line naming the extra to install, and ``import sdc_core`` still works.

Each case runs in a fresh interpreter whose framework import is blocked by a meta-path finder
(what an environment without the package sees: ``ModuleNotFoundError`` for it and its submodules)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, worker_env

BLOCKER = """
import sys

BLOCKED = set(sys.argv[1].split(","))


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Absent())
"""

PROBE = BLOCKER + """
import importlib, json

out = {}
for module in sys.argv[2:]:
    try:
        importlib.import_module(module)
        out[module] = None
    except ImportError as err:
        out[module] = f"{type(err).__name__}: {err}"
import sdc_core
from sdc_core.driver.hooks import SDCHooks  # the plain-PyTorch driver needs no framework

out["core"] = [sdc_core.SDCHooks is SDCHooks, sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)]
print(json.dumps(out))
"""


def probe(blocked: str, *modules: str) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", PROBE, blocked, *modules], env=worker_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("blocked", "modules", "extra"), [
    ("lightning", ("lightning_sdc", "lightning_sdc.fabric", "lightning_sdc.callbacks"), "lightning"),
    ("accelerate", ("accelerate_sdc.hooks", "accelerate_sdc.transformers"), "accelerate"),
    ("transformers", ("accelerate_sdc.transformers",), "transformers"),
])  # fmt: skip
def test_an_adapter_without_its_framework_names_the_extra(blocked: str, modules: tuple[str, ...], extra: str) -> None:
    got = probe(blocked, *modules)
    for module in modules:
        message = got[module]
        assert isinstance(message, str) and "\n" not in message, (module, message)
        assert message.startswith("ImportError: ") and f"needs {blocked}, which is not installed" in message
        assert message.endswith(f"pip install 'sdc-checks[{extra}]'"), message
    assert got["core"] == [True, []]  # the core imported, and nothing of the blocked framework was loaded


def test_the_other_adapters_import_without_a_framework_they_do_not_use() -> None:
    got = probe("transformers,lightning", "accelerate_sdc", "accelerate_sdc.hooks")  # the package exports lazily
    assert got["accelerate_sdc"] is None and got["accelerate_sdc.hooks"] is None and got["core"] == [True, []]
    got = probe("accelerate,transformers", "lightning_sdc")
    assert got["lightning_sdc"] is None


def test_sdc_campaign_without_lightning_says_which_extra() -> None:
    code = BLOCKER + "from sdc_core.cli import main\nsys.exit(main(sys.argv[2:]))\n"
    proc = subprocess.run([sys.executable, "-c", code, "lightning", "campaign", "--help"], env=worker_env(),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("sdc campaign: error: lightning_sdc needs lightning, which is not installed: "
                                   "pip install 'sdc-checks[lightning]'")  # fmt: skip


def _blocked_cli(blocked: str, *args: str) -> subprocess.CompletedProcess:
    code = BLOCKER + "from accelerate_sdc.cli import main\nsys.exit(main(sys.argv[2:]))\n"
    return subprocess.run([sys.executable, "-c", code, blocked, *args], env=worker_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip


def test_accelerate_sdc_answers_help_without_accelerate_and_names_the_extra_for_its_commands() -> None:
    helped = _blocked_cli("accelerate", "--help")
    assert helped.returncode == 0 and "Traceback" not in helped.stderr, helped.stderr
    assert helped.stdout.startswith("usage: accelerate-sdc")
    for command in ("config", "launch"):
        proc = _blocked_cli("accelerate", command, "--default")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip() == (f"accelerate-sdc {command}: error: accelerate-sdc {command} needs accelerate, "
                                       "which is not installed: pip install 'sdc-checks[accelerate]'")  # fmt: skip
    code = BLOCKER + "from accelerate_sdc import SDCHooks\n"  # the package imports; its hook set names the extra
    proc = subprocess.run([sys.executable, "-c", code, "accelerate"], env=worker_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ImportError: accelerate_sdc needs accelerate, which is not installed: pip install 'sdc-checks[accelerate]'")
