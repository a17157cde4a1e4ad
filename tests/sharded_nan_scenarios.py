"""FSDP2 on 3 real gloo ranks (plain torch, torchrun) where a NaN forms inside the reduction and
lands on ONE rank's reduced shard (a user reduce-scatter that poisons rank 1's output at element
0, where the in-band flag is read): every rank must reach the same verdict, none may enter the
names gather alone. Each scenario writes, per rank, what it raised and when."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import main_for
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from sdc_core.errors import SDCError
from sdc_core.ops import process_exit
from sdc_core.sharded.checks import ShardedNonFinite

POISONED_RANK, POISONED_STEP = 1, 1


class NanOnOneShard(DefaultReduceScatter):
    """The default reduce-scatter; then, once, element 0 of rank 1's reduced shard becomes NaN (what
    overflowing partial sums or a fault on the wire would leave on that rank only)."""

    armed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        work = super().__call__(*args, **kwargs)
        if NanOnOneShard.armed and dist.get_rank() == POISONED_RANK:
            kwargs.get("output_tensor", args[0] if args else None).view(-1)[0] = float("nan")
            NanOnOneShard.armed = False
        return work


def run(now: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
        layer.set_custom_reduce_scatter(NanOnOneShard())
    fully_shard(model, mesh=mesh)
    check = ShardedNonFinite()
    check.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    t0 = time.monotonic()
    try:
        for step in range(4):
            NanOnOneShard.armed = step == POISONED_STEP
            model(x).square().sum().backward()
            check.verdict(step, list(model.named_parameters()), now=now)
            opt.step()
            opt.zero_grad()
        check.resolve()
    except SDCError as err:
        return {"error": type(err).__name__, "step": err.step, "rank": err.rank, "details": err.details,
                "seconds": time.monotonic() - t0, "in_band": check.in_band}  # fmt: skip
    return {"error": None, "seconds": time.monotonic() - t0, "in_band": check.in_band}


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "60"))))
    process_exit.arm()  # as every adapter does on attach: no gloo thread may still need Python at exit (an abort)
    try:
        main_for({"now": lambda out: run(True), "deferred": lambda out: run(False)})
    finally:
        dist.destroy_process_group()
