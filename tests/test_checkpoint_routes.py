"""`sdc verify-checkpoint` and `sdc corrupt-checkpoint` read what every route of this project writes.

Per route: write a checkpoint with the route as its README recipe does, verify it with `sdc`, flip a
bit with `sdc`, verify the copy again. Routes that store no fingerprint (Fabric, the Trainer) get
a true "none stored" (exit 3) naming the route, and their files still take `corrupt-checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT, torchrun
from torch import nn

from sdc_core.cli import main as sdc

OK, CHANGED, NONE, UNREADABLE = 0, 1, 3, 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _round_trip(src: Path, out: Path, capsys: pytest.CaptureFixture, target: str = "optimizer") -> list[str]:
    """verify (clean), corrupt one entry of ``target``, verify the copy: returns the changed names."""
    assert sdc(["verify-checkpoint", str(src)]) == OK, capsys.readouterr()
    assert "clean" in capsys.readouterr().out
    before = _digest(src)
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(out), "--target", target, "--bit-class", "mantissa"]) == OK
    assert _digest(src) == before  # the input is untouched
    flipped = json.loads(Path(f"{out}.flips.json").read_text())["flips"]
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(out), "--json"]) == CHANGED
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "corrupted" and len(result["changed"]) == len(flipped) == 1
    return result["changed"]


def _digest(path: Path) -> str:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.is_file())).hexdigest()


def test_plain_recipe_under_sdc_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The README's plain recipe: {"model", "optimizer", "sdc": hooks.state_dict()} (one process)."""
    from sdc_core import SDCHooks

    net = _net()
    optimizer = torch.optim.AdamW(net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: the replica checks say they are inactive
        hooks = SDCHooks(run_dir=str(tmp_path))
        hooks.attach(net, optimizer)
    for _ in range(3):
        net(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    hooks.before_save()
    path = tmp_path / "last.pt"
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "sdc": hooks.state_dict()}, path)
    hooks.finish()
    changed = _round_trip(path, tmp_path / "bad.pt", capsys)
    assert changed[0].startswith("optimizer/state/")
    # a DDP-wrapped model's state dict ('module.' names) is matched too
    wrapped = {"model": {f"module.{k}": v for k, v in net.state_dict().items()}, "optimizer": optimizer.state_dict(),
               "sdc": hooks.state_dict()}  # fmt: skip
    torch.save(wrapped, tmp_path / "wrapped.pt")
    assert sdc(["verify-checkpoint", str(tmp_path / "wrapped.pt")]) == OK
    # the state the fingerprint covers, missing from the file: said so, not "written without the check"
    torch.save({"model": net.state_dict(), "sdc": hooks.state_dict()}, tmp_path / "no_optimizer.pt")
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(tmp_path / "no_optimizer.pt")]) == NONE
    out = capsys.readouterr().out
    assert "covers 'optimizer', which the file does not hold" in out and "without" not in out


def test_torchrun_demo_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """examples/torchrun_demo.py (3 DDP ranks under torchrun) saves model, optimizer and SDC state."""
    torchrun(ROOT / "examples" / "torchrun_demo.py", None, None, 3, "--fault", "none", "--steps", "3", timeout=300,
             cwd=tmp_path)  # fmt: skip
    path = tmp_path / "runs" / "torchrun_demo" / "last.pt"
    assert set(torch.load(path, weights_only=True)) == {"model", "optimizer", "sdc"}
    assert _round_trip(path, tmp_path / "bad.pt", capsys, target="weights")[0].startswith("model/")


def test_accelerate_save_state_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from accelerate import Accelerator

    from accelerate_sdc import SDCHooks

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    net = _net()
    net, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = SDCHooks(accelerator).attach(net, optimizer)
    for _ in range(3):
        accelerator.backward(net(torch.randn(5, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    hooks.finish()
    assert (tmp_path / "state" / "sdc_state.json").is_file()
    changed = _round_trip(tmp_path / "state", tmp_path / "bad", capsys, target="weights")
    assert changed[0].startswith("model/")


def test_lightning_model_checkpoint_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import lightning.pytorch as L
    from ddp_scenarios import Net, loader
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sdc import WeightFingerprintCheck

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[WeightFingerprintCheck(), ModelCheckpoint(dirpath=tmp_path / "ckpts")])  # fmt: skip
    trainer.fit(Net(optimizer="adam"), loader())
    (path,) = (tmp_path / "ckpts").glob("*.ckpt")
    assert _round_trip(path, tmp_path / "bad.ckpt", capsys)[0].startswith("optimizer_states/")


def test_fabric_file_says_it_holds_counters_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning.fabric import Fabric

    from lightning_sdc.fabric import SDCHooks

    fabric = Fabric(accelerator="cpu", devices=1)
    net = _net()
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = SDCHooks(fabric, run_dir=str(tmp_path)).attach(net, optimizer)
    fabric.backward(net(torch.randn(5, 4)).pow(2).mean())
    optimizer.step()
    hooks.finish()
    path = tmp_path / "last.ckpt"
    fabric.save(path, {"model": net, "optimizer": optimizer, "sdc": hooks})
    assert sdc(["verify-checkpoint", str(path)]) == NONE
    out = capsys.readouterr().out
    assert "under 'sdc' holds counters only" in out and "Fabric" in out
    assert sdc(["corrupt-checkpoint", str(path), "-o", str(tmp_path / "bad.ckpt"), "--target", "optimizer"]) == OK
    assert sdc(["verify-checkpoint", str(tmp_path / "bad.ckpt")]) == NONE


def test_trainer_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Trainer checkpoint (its pickled training_args.bin is left unread): read, altered, and
    truthfully reported as holding no fingerprint."""
    from transformers import Trainer, TrainingArguments

    from accelerate_sdc.transformers import SDCTrainerCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.cross_entropy(self.net(x), labels)}

    data = [{"x": torch.randn(4), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, save_steps=2,
                             per_device_train_batch_size=4, disable_tqdm=True)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=Model(), args=args, train_dataset=data, callbacks=[SDCTrainerCallback()]).train()
    folder = tmp_path / "checkpoint-2"
    assert (folder / "training_args.bin").is_file()
    assert sdc(["verify-checkpoint", str(folder)]) == NONE
    assert "Hugging Face Trainer checkpoint" in capsys.readouterr().out
    out = tmp_path / "bad"
    assert sdc(["corrupt-checkpoint", str(folder), "-o", str(out), "--target", "weights"]) == OK
    flips = json.loads(Path(f"{out}.flips.json").read_text())["flips"]
    assert flips[0]["tensor"].startswith("model.safetensors/")
    assert (out / "training_args.bin").read_bytes() == (folder / "training_args.bin").read_bytes()
    assert sdc(["verify-checkpoint", str(out)]) == NONE


def test_dcp_folder_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": _net().state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    assert sdc(["verify-checkpoint", str(tmp_path / "dcp")]) == UNREADABLE
    err = capsys.readouterr().err
    assert "torch.distributed.checkpoint (DCP) folder" in err and len(err.strip().splitlines()) == 1
