"""End to end on GPUs: Accelerate's FSDP2 plugin (``fsdp_version=2``) with ``SDCHooks``.

    accelerate launch --num_processes 4 benchmarks/fsdp2_accelerate_e2e.py --fault compute
    bash benchmarks/gpu_fsdp2.sh        # every fault, then a clean run (needs 2+ CUDA devices)

On CPU Accelerate ignores its FSDP plugin (see tests/accelerate_fsdp2_scenarios.py for the CPU
test, which builds the same model shape by hand). Exit status 0 when the faulty rank was named
(or, with ``--fault none``, when nothing fired); rank 0 prints the verdict.
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector, flip_bit
from sdc_core.sharded.checks import is_sharded, local


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.gelu(self.up(h)))


class Net(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).float(), y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=["nan", "at_rest", "compute", "none"], default="compute")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])  # fmt: skip
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    set_seed(0)  # FSDP2 shards what each rank built: every rank builds the same model
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert is_sharded(model), f"not an FSDP2 model: {type(model).__name__} ({accelerator.distributed_type})"
    sdc = SDCHooks(accelerator, replay_every_n_steps=3, fingerprint_every_n_steps=1).attach(model, optimizer)
    rank = accelerator.process_index
    fault = Fault("module_output", rank=args.faulty_rank, step=3, target="head", factor=1.2)
    injector = FaultInjector([fault] if args.fault == "compute" else [])
    injector.install(model, rank)
    try:
        for step, (xb, yb) in enumerate(loader):
            if step == args.steps:
                break
            injector.set_step(step)
            loss = model(xb, yb)
            if args.fault == "nan" and (rank, step) == (args.faulty_rank, 5):
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if args.fault == "at_rest" and (rank, step) == (args.faulty_rank, 6):
                flip_bit(local(model.blocks[1].up.weight), 7, 22)
        sdc.finish()
    except SDCError as err:
        if accelerator.is_main_process:
            print(f"DETECTED on every rank: {err}", flush=True)
        return 0 if err.rank == args.faulty_rank and args.fault != "none" else 1
    if accelerator.is_main_process:
        print(f"no SDC verdict in {args.steps} steps", flush=True)
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    sys.exit(main())
