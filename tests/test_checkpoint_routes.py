"""`sdc verify-checkpoint` and `sdc corrupt-checkpoint` read what every route of this project writes.

Per route (plain, torchrun demo, Accelerate, Lightning, Fabric, the Trainer): write a checkpoint
with the route as its README recipe does, verify it with `sdc`, flip a bit with `sdc`, verify the
copy again (it names the tensor); Fabric and the Trainer also load the copy, which raises. A file
whose fingerprint covers state it does not hold gets a true "does not hold" (exit 3).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

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
    # the hook set's state without before_save (as fabric.save stored it in earlier releases): counters only
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "sdc": SDCHooks().state_dict()},
               tmp_path / "counters.pt")  # fmt: skip
    assert sdc(["verify-checkpoint", str(tmp_path / "counters.pt")]) == NONE
    assert "under 'sdc' holds counters only: call hooks.before_save()" in capsys.readouterr().out


@pytest.mark.slow  # a 3-rank launch (about 10 s): the default run stays under 10 minutes on 2 cores
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


def _fabric_run(fabric: Any, tmp_path: Path) -> tuple[Any, Any, Any]:
    from lightning_sdc.fabric import SDCHooks

    net = _net()
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: the replica checks say they are inactive
        hooks = SDCHooks(fabric, run_dir=str(tmp_path)).attach(net, optimizer)
    return net, optimizer, hooks


def test_fabric_save_round_trip_and_load_verifies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """fabric.save stores the fingerprint with the counters; sdc verifies and corrupts the file;
    fabric.load verifies once everything is restored, whatever the order of the state's keys."""
    from lightning.fabric import Fabric

    from sdc_core.errors import FingerprintMismatchError

    fabric = Fabric(accelerator="cpu", devices=1)
    net, optimizer, hooks = _fabric_run(fabric, tmp_path)
    for _ in range(2):
        fabric.backward(net(torch.randn(5, 4)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    hooks.finish()
    path = tmp_path / "last.ckpt"
    fabric.save(path, {"model": net, "optimizer": optimizer, "sdc": hooks})
    changed = _round_trip(path, tmp_path / "bad.ckpt", capsys)
    assert changed[0].startswith("optimizer/state/")
    # loading: the SDC state first in the dictionary, so it is restored before the model and optimizer
    fresh, fresh_opt, fresh_hooks = _fabric_run(fabric, tmp_path)
    fabric.load(path, {"sdc": fresh_hooks, "model": fresh, "optimizer": fresh_opt})
    assert fresh_hooks.step == hooks.step == 2
    fresh, fresh_opt, fresh_hooks = _fabric_run(fabric, tmp_path)
    with pytest.raises(FingerprintMismatchError) as err:
        fabric.load(tmp_path / "bad.ckpt", {"sdc": fresh_hooks, "model": fresh, "optimizer": fresh_opt})
    assert err.value.details["checkpoint_changed_tensors"] == changed and changed[0] in str(err.value)
    # keys of the user's own: each entry is matched by the tensor names it holds
    fabric.save(tmp_path / "keys.ckpt", {"net": net, "opt": optimizer, "sdc": hooks})
    assert sdc(["verify-checkpoint", str(tmp_path / "keys.ckpt")]) == OK
    # a file whose model entry holds other names (saved elsewhere, renamed): said so
    torch.save({"net": {"w": torch.zeros(2)}, "optimizer": optimizer.state_dict(), "sdc": hooks.state_dict()},
               tmp_path / "other.ckpt")  # fmt: skip
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(tmp_path / "other.ckpt")]) == NONE
    assert "covers 'model', which the file does not hold" in capsys.readouterr().out


def test_plain_load_before_attach_verifies_the_last_state_loaded() -> None:
    """``load_state_dict`` before ``attach``: the fingerprint loaded is checked against the model
    attached; counters saved without one, loaded after it, leave nothing to check."""
    from sdc_core import SDCHooks
    from sdc_core.errors import FingerprintMismatchError

    net = _net()
    optimizer = torch.optim.AdamW(net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: the replica checks say they are inactive
        hooks = SDCHooks().attach(net, optimizer)
        hooks.before_save()
        with_fingerprint, counters = hooks.state_dict(), SDCHooks().state_dict()
        assert with_fingerprint != counters

        def attach_other(*states: dict[str, Any]) -> None:
            other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # other weights than _net()'s
            fresh = SDCHooks()
            for state in states:
                fresh.load_state_dict(state)
            fresh.attach(other, torch.optim.AdamW(other.parameters()))

        with pytest.raises(FingerprintMismatchError):
            attach_other(with_fingerprint)
        attach_other(with_fingerprint, counters)  # the last state loaded holds no fingerprint: nothing to check


class _TrainerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def _trainer(tmp_path: Path, max_steps: int, **options: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    from accelerate_sdc.transformers import SDCTrainerCallback

    data = [{"x": torch.randn(4), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=max_steps, save_steps=2,
                             per_device_train_batch_size=4, disable_tqdm=True, **options)  # fmt: skip
    return Trainer(model=_TrainerModel(), args=args, train_dataset=data, callbacks=[SDCTrainerCallback()])


def test_trainer_checkpoint_round_trip_and_resume_verifies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Trainer checkpoint folder carries the fingerprint in trainer_state.json (its pickled
    training_args.bin is left unread and copied as is); resuming from an altered copy raises."""
    from sdc_core.errors import FingerprintMismatchError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, 2).train()
    folder = tmp_path / "checkpoint-2"
    assert (folder / "training_args.bin").is_file()
    changed = _round_trip(folder, tmp_path / "bad", capsys, target="weights")
    flips = json.loads(Path(f"{tmp_path / 'bad'}.flips.json").read_text())["flips"]
    assert flips[0]["tensor"].startswith("model.safetensors/") and changed[0].startswith("model/net.")
    assert (tmp_path / "bad" / "training_args.bin").read_bytes() == (folder / "training_args.bin").read_bytes()
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(tmp_path / "bad"), "--json"]) == CHANGED
    assert json.loads(capsys.readouterr().out)["where"] == "in trainer_state.json, callback SDCTrainerCallback"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path / "resumed", 3).train(resume_from_checkpoint=str(folder))  # clean: verified, goes on
        with pytest.raises(FingerprintMismatchError) as err:
            _trainer(tmp_path / "resumed_bad", 3).train(resume_from_checkpoint=str(tmp_path / "bad"))
    assert err.value.details["checkpoint_changed_tensors"] == changed and changed[0] in str(err.value)
    # a folder of an earlier release (counters only in trainer_state.json), and one without the callback
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    state = json.loads((old / "trainer_state.json").read_text())
    del state["stateful_callbacks"]["SDCTrainerCallback"]["attributes"]["sdc_state"]["sdc_fingerprint"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(old)]) == NONE
    assert "trainer_state.json holds the SDC counters only" in capsys.readouterr().out
    del state["stateful_callbacks"]["SDCTrainerCallback"]
    (old / "trainer_state.json").write_text(json.dumps(state))
    assert sdc(["verify-checkpoint", str(old)]) == NONE
    assert "written without SDCTrainerCallback" in capsys.readouterr().out
    # save_only_model: no optimizer.pt, a fingerprint of the model alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path / "only", 2, save_only_model=True).train()
    assert not (tmp_path / "only" / "checkpoint-2" / "optimizer.pt").exists()
    _round_trip(tmp_path / "only" / "checkpoint-2", tmp_path / "only_bad", capsys, target="weights")


def test_dcp_folder_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": _net().state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    assert sdc(["verify-checkpoint", str(tmp_path / "dcp")]) == UNREADABLE
    err = capsys.readouterr().err
    assert "torch.distributed.checkpoint (DCP) folder" in err and len(err.strip().splitlines()) == 1
