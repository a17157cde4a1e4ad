"""The three SDC checks in a plain PyTorch loop under torchrun: ``sdc_core.SDCHooks``, no framework.

    torchrun --nproc-per-node 3 examples/torchrun_demo.py                       # DDP, a wrong multiply on rank 1
    torchrun --nproc-per-node 3 examples/torchrun_demo.py --fault nan           # a NaN in rank 1's gradients
    torchrun --nproc-per-node 3 examples/torchrun_demo.py --fault weights       # a bit flip in rank 1's weights
    torchrun --nproc-per-node 4 examples/torchrun_demo.py --fsdp                # fully_shard (FSDP2), wrong multiply
    torchrun --nproc-per-node 3 examples/torchrun_demo.py --fault none          # clean: nothing fires

On GPUs each rank uses ``cuda:<LOCAL_RANK>`` and NCCL; without one, gloo on CPU. The loop is an
ordinary torchrun loop; the hook set adds three lines (create, ``attach``, ``finish``) and one
before a checkpoint (``before_save``). A verdict raises an ``SDCError`` on every rank at the same
step, writes an incident under ``runs/torchrun_demo/sdc/incidents`` and (through ``sdc run``) exits 86.
Exit status 0 when the faulty rank was named (or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_core import Fault, FaultInjector, SDCError, SDCHooks


class CsvTracker:
    """A minimal tracker: one row per logged step, one column per metric (``sdc/...``)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({"step": step, **metrics})
        names = sorted({k for row in self.rows for k in row} - {"step"})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        columns = ["step", *names]
        lines = [",".join(columns)] + [",".join(str(row.get(k, "")) for k in columns) for row in self.rows]
        self.path.write_text("\n".join(lines) + "\n")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 128)
        self.head = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.body(x)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["compute", "nan", "weights", "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fsdp", action="store_true", help="fully_shard the model instead of DDP")
    args = parser.parse_args()
    if args.fsdp and args.fault in ("nan", "weights"):
        parser.error("with --fsdp this demo simulates --fault compute or none (tests/plain_scenarios.py has the rest)")
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights everywhere (fully_shard does not broadcast them)
    net = Net().to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        model: nn.Module = fully_shard(net)
    else:
        model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    tracker = CsvTracker(Path("runs/torchrun_demo/metrics.csv")) if rank == 0 else None  # one writer: rank 0
    hooks = SDCHooks(replay_every_n_steps=4, run_dir="runs/torchrun_demo",
                     log=lambda metrics, step: tracker.log(metrics, step) if tracker else None)  # fmt: skip
    hooks.attach(model, optimizer)

    step_of_fault = 4  # an audited step (the replay runs every 4th step)
    fault = {
        "compute": Fault("module_output", rank=args.faulty_rank, step=step_of_fault, target="head", factor=1.5),
        "nan": Fault("nonfinite_gradient", rank=args.faulty_rank, step=step_of_fault - 1, target="body.weight"),
        "weights": Fault("weight_bit_flip", rank=args.faulty_rank, step=step_of_fault - 2, target="head.weight",
                         bit=27),
    }.get(args.fault)
    injector = FaultInjector([fault] if fault else [])
    injector.install(net, rank)
    # a weight fault strikes inside the update (as a faulty optimizer step would), so the comparison
    # after that update sees it: verdicts name the step of Fault(step=...)
    optimizer.register_step_post_hook(lambda *_: injector.after_step(injector.step, net, [optimizer]))
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    try:
        for step in range(args.steps):
            injector.set_step(step)
            x, y = torch.randn(16, 32, generator=g).to(device), torch.randint(0, 8, (16,), generator=g).to(device)
            loss = F.cross_entropy(model(x), y)  # computed in the loop: the replay needs nothing more
            loss.backward()
            optimizer.step()  # the checks run around the real update
            optimizer.zero_grad()
        hooks.before_save()  # compare the replicas before writing a checkpoint
        if not args.fsdp and rank == 0:
            Path("runs/torchrun_demo").mkdir(parents=True, exist_ok=True)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "sdc": hooks.state_dict()}
            torch.save(state, "runs/torchrun_demo/last.pt")  # sdc verify-checkpoint runs/torchrun_demo/last.pt
        hooks.finish()
    except SDCError as err:
        if rank == 0:
            print(f"DETECTED on every rank: {err}")
            print(f"  incident: {getattr(err, 'incident', 'runs/torchrun_demo/sdc/incidents')}; "
                  f"sdc/* metrics: {tracker.path if tracker else '-'}\n  next: sdc report runs/torchrun_demo")
        named = err.rank == args.faulty_rank
        dist.destroy_process_group()
        return 0 if named and args.fault != "none" else 1
    if rank == 0:
        print("no SDC detected")
    dist.destroy_process_group()
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    raise SystemExit(main())
