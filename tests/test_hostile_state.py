"""Loading the hook set's state never unpickles code, on every route that loads it (issue: a hostile
``custom_checkpoint_0.pkl`` in an Accelerate ``save_state`` folder ran code once SDCHooks was attached)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch
from conftest import ROOT, worker_env


class _Planted:
    """Unpickling this touches a marker file: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_accelerate_load_state_reads_json_and_never_unpickles_a_planted_file(tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    code = f"""
import sys, json, warnings, pickle, torch
sys.path.insert(0, {str(ROOT)!r})
warnings.simplefilter("ignore")
from pathlib import Path
from accelerate import Accelerator
from accelerate_sdc import SDCHooks

def run(load):
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = SDCHooks(acc, replay_every_n_steps=0)
    model, opt = acc.prepare(model, opt)
    hooks.attach(model, opt)
    if load:
        acc.load_state({str(ckpt)!r})
        return hooks.step
    for _ in range(3):
        acc.backward(model(torch.randn(2, 4)).sum()); opt.step(); opt.zero_grad()
    acc.save_state({str(ckpt)!r})
    return sorted(p.name for p in Path({str(ckpt)!r}).iterdir())

files = run(False)
print(json.dumps(files))
planted = sys.argv[1]
with open(Path({str(ckpt)!r}) / "custom_checkpoint_0.pkl", "wb") as f:
    f.write(bytes.fromhex(planted))
try:
    print(run(True))
except RuntimeError as err:
    print("refused:", str(err).splitlines()[0])
Path({str(ckpt)!r}, "custom_checkpoint_0.pkl").unlink()
print(run(True))
"""
    planted = pickle.dumps({"step": _Planted(marker)}).hex()
    proc = subprocess.run([sys.executable, "-c", code, planted], env=worker_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    files, refused, step = proc.stdout.strip().splitlines()[-3:]
    assert "sdc_state.json" in files and "custom_checkpoint" not in files  # the counters travel as JSON
    # Accelerate refuses a custom_checkpoint file no registered object claims, without reading it
    assert refused.startswith("refused: Number of custom checkpoints"), refused
    assert not marker.exists(), "load_state ran code from the planted pickle"
    assert step == "3"  # restored from the JSON once the planted file is gone


def test_core_hook_state_loads_with_weights_only(tmp_path: Path) -> None:
    """What ``SDCHooks.state_dict()`` returns (Fabric's ``fabric.save``, a plain ``torch.save``, the
    Trainer's JSON) is plain data: ``torch.load(weights_only=True)`` takes it, no code is needed."""
    from sdc_core import SDCHooks

    hooks = SDCHooks()
    hooks.step, hooks._updates = 5, 5
    torch.save({"sdc": hooks.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)["sdc"]
    fresh = SDCHooks()
    fresh.load_state_dict(state)
    assert fresh.step == 5
