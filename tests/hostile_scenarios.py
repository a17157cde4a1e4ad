"""Hostile peers under the ring replay: the same persistent fault on several ranks at once.

``torchrun --nproc-per-node 4 tests/hostile_scenarios.py --out DIR --only 1+2:module,0+2:matmul``
runs plain-PyTorch DDP loops (``sdc_core.SDCHooks``, the replay at every step) in one process
group; each rank writes ``DIR/<scenario>.rank<r>.json``. A scenario is ``<ranks>:<kind>[:warn]``:
the faulty ranks joined by ``+`` all get the same persistent fault from step 1 (``module``: one
output element of ``head`` scaled; ``body``: one of ``body.0``; ``matmul``: one element of
``head``'s weight-gradient product), and ``warn`` sets ``replay_on_unreplayable="warn"``.

``pickle:hostile`` and ``pickle:trusted``: no fault; each batch carries a ``Tag`` object, which
travels only pickled. ``hostile``: rank 1 alone allows pickling (``SDC_ALLOW_PICKLED_BATCHES=1``)
and so sends its batch pickled to a partner that refuses it; ``trusted``: every rank allows it
through ``ReplayConfig(allow_pickled_batches=True)``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import parse, run_each

from sdc_core import Fault, FaultInjector, ReplayUnavailableError, SDCError, SDCHooks
from sdc_core.dist.payload import ALLOW_PICKLE_ENV

STEPS = 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, tag: Tag | None = None) -> torch.Tensor:
        return F.mse_loss(self.head(self.body(x)), y)


class Tag:
    """An object in the batch that is not plain data: it travels only pickled."""

    def __init__(self, step: int) -> None:
        self.step = step


def faults(ranks: list[int], kind: str) -> list[Fault]:
    if kind in ("hostile", "trusted"):
        return []
    one = {
        "module": dict(kind="module_output", target="head", factor=1.5, index=3),
        "body": dict(kind="module_output", target="body.0", factor=-2.0, index=5),
        "matmul": dict(kind="matmul_output", target="head", factor=-3.0, index=3, phase="weight_grad"),
    }[kind]
    return [Fault(rank=r, step=1, **one) for r in ranks]  # type: ignore[arg-type]


def train(name: str, out: Path) -> dict[str, Any]:
    ranks, kind, *rest = name.split(":")
    faulty = [] if ranks == "pickle" else [int(r) for r in ranks.split("+")]
    rank = dist.get_rank()
    torch.manual_seed(7)
    net = MLP()
    wrapped = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    settings: dict[str, Any] = {"replay_every_n_steps": 1, "fingerprint_every_n_steps": 1}
    if "warn" in rest:
        settings["replay_on_unreplayable"] = "warn"
    run_dir = out / name.replace(":", "-").replace("+", "_")
    hooks = SDCHooks(run_dir=run_dir, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.attach(wrapped, optimizer)
    if kind == "trusted":
        hooks.replay.config = dataclasses.replace(hooks.replay.config, allow_pickled_batches=True)
    if kind == "hostile" and rank == 1:
        os.environ[ALLOW_PICKLE_ENV] = "1"
    injector = FaultInjector(faults(faulty, kind))
    injector.install(net, rank)
    g = torch.Generator().manual_seed(1000 + rank)
    error: dict[str, Any] | None = None
    caught: list[str] = []
    step = 0
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(STEPS):
                injector.set_step(step)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                wrapped(x, y, Tag(step) if ranks == "pickle" else None).backward()
                optimizer.step()
                optimizer.zero_grad()
            hooks.finish()
        caught = [str(w.message) for w in seen if "RingReplay" in str(w.message)]
    except SDCError as err:
        error = err.to_dict()
    except ReplayUnavailableError as err:
        error = {"type": type(err).__name__, "message": str(err), "rank": None, "suspects": [], "step": step}
    os.environ.pop(ALLOW_PICKLE_ENV, None)
    incidents = sorted(p.name for p in run_dir.glob("sdc/incidents/*.json"))
    hooks.detach()
    injector.remove()
    stats = hooks.replay.stats.state_dict() if hooks.replay is not None else None
    return {"error": error, "faulty": faulty, "warnings": caught, "incidents": incidents, "step": step, "stats": stats}


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    try:
        run_each(args.only, lambda name: train(name, args.out), args.out, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
