"""Zero-code enable for Lightning through the ``lightning.pytorch.callbacks_factory`` entry point.

The entry point is read from ``pyproject.toml`` and published through a ``*.dist-info`` folder on
``PYTHONPATH`` (what ``pip install`` writes), so the Trainers below discover it exactly as they
would in an installed environment; the shared environment is left alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, results, torchrun, worker_env

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

SCRIPT = Path(__file__).with_name("zero_code_scenarios.py")


def publish_entry_points(folder: Path) -> Path:
    """A minimal ``sdc_checks`` distribution with the project's entry points, under ``folder``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = folder / f"sdc_checks-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sdc-checks\nVersion: {project['version']}\n")
    lines = []
    for group, points in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{name} = {target}" for name, target in points.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return folder


@pytest.fixture(scope="module")
def zero(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    env = worker_env()
    env["PYTHONPATH"] = str(publish_entry_points(out / "site")) + ":" + env["PYTHONPATH"]
    env["SDC_CHECKS"] = "1"
    torchrun(SCRIPT, out, "auto,mixed,off,bad", 3, timeout=600, env=env)
    return out


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_sdc_checks_env_adds_the_three_checks_to_a_script_that_mentions_none(zero: Path) -> None:
    for r in results(zero, "auto", 3):
        added = ["NonFiniteGradientCheck", "RingReplayAudit", "WeightFingerprintCheck"]
        assert r["callbacks"] == ["SDCAutoEnable", *added]
        assert r["error"]["type"] == "FingerprintMismatchError" and r["error"]["rank"] == 2  # the model's own flip
        assert r["runs"]["NonFiniteGradientCheck"] >= 4 and r["runs"]["RingReplayAudit"] == 1  # step 0 audited


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_user_checks_are_kept_and_sdc_metrics_are_monitorable(zero: Path) -> None:
    for r in results(zero, "mixed", 3):
        assert r["error"] is None
        assert sorted(r["callbacks"]) == ["NonFiniteGradientCheck", "RingReplayAudit", "SDCAutoEnable",
                                          "WeightFingerprintCheck"]  # fmt: skip
        assert r["runs"]["RingReplayAudit"] == 6  # the user's every_n_steps=1, not the default 100
        assert "sdc/ring_replay/runs" in r["monitorable"] and "sdc/weight_fingerprint/failures" in r["monitorable"]
        assert r["best_score"] == 6.0  # ModelCheckpoint(monitor="sdc/ring_replay/runs", mode="max")


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_unset_adds_nothing_and_a_bad_value_is_named(zero: Path) -> None:
    for r in results(zero, "off", 3):
        assert r["error"] is None and r["callbacks"] == []
    message = results(zero, "bad", 3)[0]["message"]
    assert "SDC_CHECKS='replay'" in message and "ring_replay" in message


@pytest.mark.slow
def test_standalone_pytorch_lightning_refuses_rather_than_train_unguarded(tmp_path: Path) -> None:
    env = worker_env() | {"SDC_CHECKS": "1"}
    env["PYTHONPATH"] = str(publish_entry_points(tmp_path / "site")) + ":" + env["PYTHONPATH"]
    code = "import pytorch_lightning as pl; pl.Trainer(logger=False, accelerator='cpu')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not the standalone `pytorch_lightning` Trainer" in proc.stderr
