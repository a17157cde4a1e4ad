"""The SDC checks on a plain FSDP2 model (``fully_shard``) under torchrun, no framework.

    torchrun --nproc-per-node 4 examples/fsdp2_torchrun_demo.py                   # pure FSDP, a NaN on rank 1
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun_demo.py --fault at_rest   # a bit flipped at rest on rank 1
    torchrun --nproc-per-node 6 examples/fsdp2_torchrun_demo.py --hsdp 3 --fault weights  # HSDP 3 x 2
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun_demo.py --tp 2 --fault at_rest  # FSDP 2 x tensor parallel 2
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun_demo.py --fault none      # clean: nothing fires

What a training loop calls (all of it on every rank):

* ``nonfinite.attach(model)`` once: taps every FSDP parameter group's reduce-scatter (local grads);
* ``nonfinite.verdict(step, model.named_parameters())`` after backward, before ``optimizer.step()``
  (with ``on_failure="raise"`` its all-reduce is read at the next call, or by ``nonfinite.resolve()``);
* ``fingerprint.before_use()`` before each forward, ``fingerprint.start(step, model, [optimizer])``
  after each update; ``nonfinite.resolve()`` and ``fingerprint.finish()`` after the loop.

Exit status 0 when the faulty rank was named (or, with ``--fault none``, when nothing fired).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from sdc_core import SDCError, flip_bit
from sdc_core.dist.topology import Topology
from sdc_core.sharded.checks import ShardedFingerprint, ShardedNonFinite, local


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=["nan", "at_rest", "weights", "none"], default="nan")
    parser.add_argument("--faulty-rank", type=int, default=1)
    parser.add_argument("--hsdp", type=int, default=0, help="replicate size of an HSDP mesh (0: pure FSDP)")
    parser.add_argument("--tp", type=int, default=0, help="tensor parallel size (0: none)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # FSDP2 does not broadcast initial weights: every rank builds the same model
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    if args.tp:  # tensor parallel inside each data-parallel row, FSDP across the rows
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        shape = (args.hsdp, world // args.hsdp) if args.hsdp else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if args.hsdp else ("shard",))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    topo = Topology.gather()
    nonfinite, fingerprint = ShardedNonFinite(topology=topo), ShardedFingerprint(topology=topo)
    nonfinite.attach(model)
    data_rank = rank // args.tp if args.tp else rank  # tensor-parallel ranks share their batch
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(data_rank))
    y = x.sum(1, keepdim=True).sin()
    try:
        for step in range(args.steps):
            fingerprint.before_use()
            loss = nn.functional.mse_loss(model(x), y)
            if args.fault == "nan" and step == 5 and rank == args.faulty_rank:
                loss = loss * float("nan")
            loss.backward()
            nonfinite.verdict(step, model.named_parameters())
            optimizer.step()
            optimizer.zero_grad()
            if args.fault == "weights" and step == 4 and rank == args.faulty_rank:
                flip_bit(local(model[2].weight), 3, 22)  # a faulty update on one replica
            fingerprint.start(step, model, [optimizer])
            if args.fault == "at_rest" and step == 4 and rank == args.faulty_rank:
                flip_bit(local(model[2].weight), 3, 22)  # after the digest, before the next forward
        nonfinite.resolve()
        fingerprint.finish()
    except SDCError as err:
        if rank == 0:
            print(f"DETECTED on every rank: {err}", flush=True)
        ok = err.rank == args.faulty_rank and args.fault != "none"
        dist.destroy_process_group()
        return 0 if ok else 1
    if rank == 0:
        print(f"no SDC verdict in {args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0 if args.fault == "none" else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
