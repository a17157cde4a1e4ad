"""Fire drill for Lightning Fabric users: 3 CPU ranks, the SDC checks on, one rank made faulty.

    python examples/fabric_ddp_demo.py                         # Fabric starts 3 CPU ranks itself
    python examples/fabric_ddp_demo.py --fault weights --faulty-rank 2
    python examples/fabric_ddp_demo.py --fault none            # a clean run: nothing fires
    (or under torchrun: torchrun --nproc-per-node 3 examples/fabric_ddp_demo.py)

The loop accumulates 2 micro-batches per optimizer step with ``fabric.no_backward_sync`` and
divides the loss before ``fabric.backward``: ``hooks.replayable`` tells the replay audit exactly
that. Incidents go to ``runs/fabric_demo/sdc/incidents/``, the ``sdc/*`` metrics to a CSV file
(``runs/fabric_demo/csv/version_0/metrics.csv``, Fabric's ``CSVLogger``); the counters travel in
``fabric.save``.
Exit status 0 when the faulty rank was named (or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import sys

import torch
from lightning.fabric import Fabric, seed_everything
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdc import SDCError
from lightning_sdc.fabric import SDCHooks
from sdc_core import Fault, FaultInjector

ACCUMULATE = 2
FAULTS = {
    "compute": lambda r: Fault("module_output", rank=r, step=5, target="head", factor=1.2),
    "weights": lambda r: Fault("weight_bit_flip", rank=r, step=7, target="body.weight", index=123, bit=22),
    "nan": lambda r: Fault("nonfinite_gradient", rank=r, step=9, target="body.weight"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=[*FAULTS, "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    tracker = CSVLogger("runs/fabric_demo", name="csv", version=0)  # the sdc/* metrics, through fabric.log_dict
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=3, loggers=tracker)
    fabric.launch()
    seed_everything(0, verbose=False)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    named = nn.ModuleDict({"body": model[0], "head": model[3]})  # names for the drill's targets
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    hooks = SDCHooks(fabric, run_dir="runs/fabric_demo", replay_every_n_steps=5)
    hooks.attach(model, optimizer)
    step_loss = hooks.replayable(lambda m, x, y: nn.functional.mse_loss(m(x), y) / ACCUMULATE)

    injector = FaultInjector([FAULTS[args.fault](args.faulty_rank)] if args.fault != "none" else [])
    injector.install(named, fabric.global_rank)
    inner = optimizer.optimizer
    inner.register_step_post_hook(lambda *_: injector.after_step(injector.step, named, [inner]))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=16))
    try:
        for i, (xb, yb) in enumerate(loader):
            injector.set_step(hooks.step)
            accumulating = (i + 1) % ACCUMULATE != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(step_loss(model, xb, yb))
            if not accumulating:
                optimizer.step()
                optimizer.zero_grad()
                if hooks.step >= args.steps:
                    break
        hooks.finish()
    except SDCError as err:
        if fabric.is_global_zero:
            print(f"\nDETECTED on every rank: {err}\n  check={err.check} step={err.step} rank={err.rank} "
                  f"suspects={err.suspects} hosts={err.hosts}\n"
                  f"  incident: {getattr(err, 'incident', 'runs/fabric_demo/sdc/incidents')}; sdc/* metrics: "
                  f"{tracker.log_dir}/metrics.csv\n  next: sdc report runs/fabric_demo", flush=True)  # fmt: skip
        return 0 if err.rank == args.faulty_rank and args.fault != "none" else 1
    fabric.save("runs/fabric_demo/last.ckpt", {"model": model, "optimizer": optimizer, "sdc": hooks})
    if fabric.is_global_zero:
        print(f"\nNo SDC detected in {hooks.step} steps.", flush=True)
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
