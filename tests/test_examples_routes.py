"""The Trainer, Fabric and zero-code examples run and name the simulated faulty rank (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, torchrun, worker_env
from test_examples import _assert_whole_story, _tensorboard_tags
from test_zero_code import publish_entry_points

pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_hf_trainer_demo_names_the_faulty_rank(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = worker_env() | {"ACCELERATE_SDC_CONFIG_FILE": os.devnull}
    proc = torchrun(ROOT / "examples" / "hf_trainer_demo.py", None, None, 3, "--fault", "weights", "--faulty-rank", "2",
                    timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert "SDC check 'weight_fingerprint' failed at step 4: rank 2" in proc.stdout
    assert len(list((tmp_path / "runs" / "hf_trainer_demo" / "sdc" / "incidents").glob("*.json"))) == 1
    _assert_whole_story(proc.stdout, tmp_path, "hf_trainer_demo")
    tags = _tensorboard_tags(tmp_path / "runs" / "hf_trainer_demo" / "runs")  # the Trainer adds its "train/"
    assert "train/sdc/weight_fingerprint/failures" in tags, sorted(tags)


def test_fabric_demo_names_the_faulty_rank(tmp_path: Path) -> None:
    env = worker_env() | {"ACCELERATE_SDC_CONFIG_FILE": os.devnull}
    proc = run([sys.executable, str(ROOT / "examples" / "fabric_ddp_demo.py"), "--fault", "compute"], tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "SDC check 'ring_replay' failed at step 5: rank 1" in proc.stdout
    assert len(list((tmp_path / "runs" / "fabric_demo" / "sdc" / "incidents").glob("*.json"))) == 1
    _assert_whole_story(proc.stdout, tmp_path, "fabric_demo")
    header = (tmp_path / "runs" / "fabric_demo" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "sdc/ring_replay/failures" in header


def test_zero_code_demo_is_guarded_only_with_sdc_checks(tmp_path: Path) -> None:
    env = worker_env()
    env["PYTHONPATH"] = str(publish_entry_points(tmp_path / "site")) + ":" + env["PYTHONPATH"]
    script = str(ROOT / "examples" / "lightning_zero_code_demo.py")
    proc = run([sys.executable, script, "--flip-rank", "2"], tmp_path, env | {"SDC_CHECKS": "1"})
    assert proc.returncode == 86, proc.stdout[-2000:] + proc.stderr[-4000:]  # the SDC exit code
    assert "SDC check 'weight_fingerprint' failed at step 3: rank 2" in proc.stdout + proc.stderr
    # the whole story with no code: Lightning's default logger holds the sdc/* metrics, the one-line
    # verdict says where the incident is
    (incident,) = (tmp_path / "runs" / "zero_code_demo").rglob("sdc/incidents/*.json")
    assert incident.name in proc.stdout + proc.stderr
    assert "sdc/weight_fingerprint/failures" in _tensorboard_tags(tmp_path / "runs" / "zero_code_demo")
    proc = run([sys.executable, script], tmp_path, env | {"SDC_CHECKS": "0"})
    assert proc.returncode == 0 and "SDC callbacks: none" in proc.stdout, proc.stderr[-3000:]
