"""The core runs with torch alone: NumPy hidden from every rank (``import numpy`` fails there), the
plain torchrun demo still reaches its verdict, and the peer-payload codec still round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, torchrun, worker_env

_HIDE_NUMPY = "import sys\nsys.modules['numpy'] = None  # import numpy raises ImportError\n"


def _env_without_numpy(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "no_numpy"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDE_NUMPY)
    env = worker_env()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return env


def test_payload_codec_round_trips_without_numpy(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "assert sys.modules.get('numpy') is None\n"
        "from sdc_core.dist.payload import decode, encode\n"
        "obj = {'a': torch.arange(6.0).reshape(2, 3), 'b': [1, 'x', b'\\x00\\xff'], 'c': (2.5, None)}\n"
        "back = decode(encode(obj))\n"
        "assert torch.equal(back['a'], obj['a']) and back['b'] == obj['b'] and back['c'] == obj['c']\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env_without_numpy(tmp_path), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_plain_demo_names_the_faulty_rank_without_numpy(tmp_path: Path) -> None:
    proc = torchrun(ROOT / "examples" / "torchrun_demo.py", None, None, 3, "--fault", "compute", "--faulty-rank", "1",
                    timeout=300, cwd=tmp_path, env=_env_without_numpy(tmp_path))  # fmt: skip
    assert "DETECTED on every rank: SDC check" in proc.stdout
    assert "rank 1 (host" in proc.stdout
