"""Trainings for the Slurm end-to-end tests (tests/test_slurm.py): what ``train.py`` is in the
after-detection routes. Both resume from the newest checkpoint in ``RUN_DIR/ckpt`` (every one was
written only after the replicas were compared, and its fingerprint is checked again on load) and
inject a weight bit flip on the rank that runs on the Slurm node ``--fault-node`` (that node's
"faulty hardware": a requeued job without it trains clean).

``python tests/slurm_scenarios.py torchrun --run-dir DIR [--fault-node n2]``
    Plain PyTorch DDP with ``sdc_core.SDCHooks``, one process per torchrun worker.
``python tests/slurm_scenarios.py lightning --run-dir DIR [--fault-node n2]``
    ``Trainer(num_nodes=3, devices=1)`` under ``srun``: Lightning's own ``SLURMEnvironment``.

Rank 0 writes ``DIR/final.pt`` (the final weights) and, for every attempt,
``DIR/attempt<SLURM_RESTART_COUNT>.json`` (nodes and the checkpoint it resumed from).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_core import Fault
from sdc_core.dist.topology import node_name

STEPS, CKPT_EVERY, FAULT_STEP = 10, 3, 7  # checkpoints after steps 3, 6 and 9; the flip after step 7


def save(obj: Any, path: Path) -> None:
    """``torch.save`` written aside, then renamed: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def attempt(run_dir: Path, resumed_from: Path | None, start_step: int) -> None:
    """Rank 0's record of this attempt of the job."""
    write_json(run_dir / f"attempt{os.environ.get('SLURM_RESTART_COUNT', '0')}.json", {
        "nodes": os.environ.get("SLURM_JOB_NODELIST"), "node": node_name(),
        "resumed_from": str(resumed_from) if resumed_from else None, "start_step": start_step,
    })  # fmt: skip


def newest(folder: Path, pattern: str) -> Path | None:
    """The checkpoint of the highest step in ``folder`` (names end in ``step<N>.<ext>``)."""
    found = sorted(folder.glob(pattern), key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    return found[-1] if found else None


def fault_here(args: argparse.Namespace, rank: int, target: str = "head.weight") -> list[Fault]:
    """The fault of this node's "hardware": a weight bit flip on its rank, after ``FAULT_STEP``."""
    hit = args.fault_node is not None and node_name() == args.fault_node
    return [Fault("weight_bit_flip", rank=rank, step=FAULT_STEP, target=target, index=3, bit=27)] if hit else []


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step`` (a function of both: a resumed run sees the same data)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] - x[:, 1:2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(torch.relu(self.body(x))), y)


def torchrun(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdc_core import FaultInjector, SDCHooks

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hooks = SDCHooks(run_dir=args.run_dir, replay_every_n_steps=0, fingerprint_every_n_steps=1)
    hooks.attach(model, opt)
    ckpt = [newest(args.run_dir / "ckpt", "step*.pt")]
    dist.broadcast_object_list(ckpt)  # every rank loads the file rank 0 chose
    if ckpt[0] is not None:
        state = torch.load(ckpt[0], weights_only=True)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        hooks.load_state_dict(state["sdc"])  # verifies the loaded tensors against the saved fingerprint
    if rank == 0:
        attempt(args.run_dir, ckpt[0], hooks.step)
    injector = FaultInjector(fault_here(args, rank))
    injector.install(net, rank)
    while hooks.step < STEPS:
        step = hooks.step
        injector.set_step(step)
        model(*batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        injector.after_step(step, net, [opt])
        if hooks.step % CKPT_EVERY == 0:
            hooks.before_save()  # the replicas compared before anything is written
            if rank == 0:
                save({"model": net.state_dict(), "optimizer": opt.state_dict(), "sdc": hooks.state_dict()},
                     args.run_dir / "ckpt" / f"step{hooks.step}.pt")  # fmt: skip
    hooks.finish()
    if rank == 0:
        save(net.state_dict(), args.run_dir / "final.pt")
    dist.barrier()
    dist.destroy_process_group()


def lightning(args: argparse.Namespace) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    from lightning_sdc import FaultInjector, NonFiniteGradientCheck, WeightFingerprintCheck
    from sdc_core.io.checkpoints import newest_verified

    class Steps(Dataset):
        """Batch ``i`` of this rank is ``batch(i, rank)`` (no sampler: each rank its own data)."""

        def __len__(self) -> int:
            return STEPS

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return batch(i, int(os.environ.get("SLURM_PROCID", "0")))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return self.net(*b)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    ckpt_dir = args.run_dir / "ckpt"
    # every rank reads the same files (nothing writes them before fit): the same answer everywhere
    resume = newest_verified([ckpt_dir], max_step=STEPS)
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=3, devices=1, max_steps=STEPS, use_distributed_sampler=False,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
        logger=CSVLogger(args.run_dir, name="logs", version=0),
        callbacks=[NonFiniteGradientCheck(), WeightFingerprintCheck(every_n_steps=1),
                   FaultInjector(fault_here(args, int(os.environ.get("SLURM_PROCID", "0")), "net.head.weight")),
                   ModelCheckpoint(dirpath=ckpt_dir, filename="step{step}", auto_insert_metric_name=False,
                                   every_n_train_steps=CKPT_EVERY, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    if trainer.global_rank == 0:
        attempt(args.run_dir, resume, int(torch.load(resume, weights_only=True)["global_step"]) if resume else 0)
    trainer.fit(module, DataLoader(Steps(), batch_size=None, batch_sampler=None), ckpt_path=resume)
    if trainer.global_rank == 0:
        save(module.net.state_dict(), args.run_dir / "final.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["torchrun", "lightning"])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--fault-node", default=None, help="the Slurm node whose rank gets the fault")
    args = parser.parse_args()
    (torchrun if args.mode == "torchrun" else lightning)(args)


if __name__ == "__main__":
    main()
