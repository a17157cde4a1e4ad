"""``accelerate-sdc config`` never writes into accelerate's own config file, even one that does not
exist yet (a plain ``accelerate launch`` would then reject the SDC keys), and still writes its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, worker_env


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = worker_env()
    env["HOME"] = str(home)
    env.pop("HF_HOME", None)
    env.pop("ACCELERATE_SDC_CONFIG_FILE", None)
    return subprocess.run([sys.executable, "-m", "accelerate_sdc.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)  # fmt: skip


def test_config_refuses_accelerates_own_file_even_before_it_exists(tmp_path: Path) -> None:
    folder = tmp_path / ".cache" / "huggingface" / "accelerate"
    for name in ("default_config.yaml",):  # what `accelerate config` writes and `accelerate launch` reads
        proc = _cli(tmp_path, "config", "--default", "--config_file", str(folder / name))
        assert proc.returncode == 2, proc.stderr
        assert "is accelerate's own config file" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not (folder / name).exists()
    proc = _cli(tmp_path, "config", "--default")  # the default goes beside it, in a file of its own
    assert proc.returncode == 0, proc.stderr
    assert (folder / "sdc_config.yaml").is_file() and not (folder / "default_config.yaml").exists()
