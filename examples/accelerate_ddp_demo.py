"""Fire drill for Accelerate users: 3 CPU ranks, the SDC checks on, one rank made faulty.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 examples/accelerate_ddp_demo.py
    ... examples/accelerate_ddp_demo.py --fault weights --faulty-rank 2
    ... examples/accelerate_ddp_demo.py --fault none          # a clean run: nothing fires

The checks' settings come from `accelerate-sdc config`, ``ACCELERATE_SDC_*`` variables or the
keywords below. Every rank catches the same ``SDCError``; the main process prints it. Exit status 0
when the faulty rank was named (or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector

FAULTS = {
    "compute": lambda r: Fault("module_output", rank=r, step=5, target="head", factor=1.2),
    "weights": lambda r: Fault("weight_bit_flip", rank=r, step=7, target="body.weight", index=123, bit=22),
    "nan": lambda r: Fault("nonfinite_gradient", rank=r, step=9, target="body.weight"),
}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss, a scalar (the replay audit recomputes it from the same inputs)."""
        pred = self.head(nn.functional.dropout(torch.relu(self.body(x)), 0.1, self.training))
        return nn.functional.mse_loss(pred, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=[*FAULTS, "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    set_seed(0)
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # pip install tensorboard for the tracker
    # incidents: runs/accelerate_demo/sdc/incidents/; sdc/* metrics: TensorBoard files under runs/accelerate_demo/demo
    accelerator = Accelerator(log_with="tensorboard" if tensorboard else None, project_dir="runs/accelerate_demo")
    accelerator.init_trackers("demo")  # without it, log_with logs nothing
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16)
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sdc = SDCHooks(accelerator, replay_every_n_steps=5, fingerprint_every_n_steps=1).attach(model, optimizer)
    injector = FaultInjector([FAULTS[args.fault](args.faulty_rank)] if args.fault != "none" else [])
    injector.install(accelerator.unwrap_model(model), accelerator.process_index)
    optimizer.optimizer.register_step_post_hook(
        lambda *_: injector.after_step(injector.step, accelerator.unwrap_model(model), [optimizer.optimizer])
    )
    try:
        return run(args, accelerator, model, optimizer, loader, sdc, injector)
    finally:
        accelerator.end_training()  # ends the process group while Python is whole, on every path out


def run(args: argparse.Namespace, accelerator: Accelerator, model: nn.Module, optimizer: Any, loader: DataLoader,
        sdc: SDCHooks, injector: FaultInjector) -> int:  # fmt: skip
    try:
        for xb, yb in loader:
            injector.set_step(sdc.step)
            loss = model(xb, yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if sdc.step >= args.steps:
                break
        sdc.finish()
    except SDCError as err:
        if accelerator.is_main_process:
            print(f"\nDETECTED on every rank: {err}\n  check={err.check} step={err.step} rank={err.rank} "
                  f"suspects={err.suspects} hosts={err.hosts}\n"
                  f"  incident: {getattr(err, 'incident', 'runs/accelerate_demo/sdc/incidents')}; sdc/* metrics: "
                  "TensorBoard, runs/accelerate_demo/demo\n  next: sdc report runs/accelerate_demo",
                  flush=True)  # fmt: skip
        return 0 if err.rank == args.faulty_rank and args.fault != "none" else 1
    if accelerator.is_main_process:
        print(f"\nNo SDC detected in {sdc.step} steps.", flush=True)
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
