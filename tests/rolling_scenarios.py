"""Rolling weight fingerprints through the plain-PyTorch hook set (``sdc_core.SDCHooks``), 3 CPU ranks.

``torchrun --nproc-per-node 3 tests/rolling_scenarios.py --out DIR --only clean,flip,flip_every,flip_end``
trains the MLP of ``plain_scenarios`` for its ``STEPS`` (6) steps under DDP with the fingerprint on at every
step and ``fingerprint_rolling=3`` (the replay off, so only the fingerprint can see a weight
fault). Its six tensors fall into three slices (``rolling_slices``, by bytes): 0 ``body.0.weight``,
1 the biases and ``head.weight``, 2 ``body.3.weight``; comparison c takes slice c % 3.

* ``clean``: nothing injected;
* ``flip``: a bit of ``body.0.weight`` (slice 0) flips on rank 1 right after update 0, whose
  comparison took slice 0 already: the next comparisons take slices 1 and 2, the one after update
  3 takes slice 0 again and sees it (3 comparisons later: the bound, ``rolling``);
* ``flip_every``: the same flip with ``fingerprint_rolling=1``: seen after update 1;
* ``flip_end``: the flip after the last update (5, whose comparison took slice 2): no rolling
  comparison is left, and ``finish`` compares every tensor.

Each rank writes ``DIR/<scenario>.rank<r>.json``: the error raised (``SDCError.to_dict()``) and
the fingerprint check's counters.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plain_scenarios import STEPS, batches, build
from scenario_runner import parse, run_each

from sdc_core import Fault, FaultInjector, SDCError, SDCHooks

FLIP = {"flip": 0, "flip_every": 0, "flip_end": STEPS - 1}  # scenario: the update after which rank 1's bit flips


def train(name: str, out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(7)
    net = build("mlp", torch.device("cpu"))
    wrapped = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    rolling = 1 if name == "flip_every" else 3
    hooks = SDCHooks(run_dir=out / name, replay_every_n_steps=0, fingerprint_every_n_steps=1,
                     fingerprint_rolling=rolling)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.attach(wrapped, optimizer)
    faults = (
        [Fault("weight_bit_flip", rank=1, step=FLIP[name], target="body.0.weight", index=5, bit=20)]
        if name in FLIP
        else []
    )
    injector = FaultInjector(faults)
    injector.install(net, rank)
    error = None
    try:
        for step, (x, y) in enumerate(batches("mlp", torch.device("cpu"), rank)):
            injector.set_step(step)
            wrapped(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
            injector.after_step(step, net, [optimizer])
        hooks.finish()
    except SDCError as err:
        error = err.to_dict()
    result = {"error": error, "stats": hooks.state_dict()["checks"]["weight_fingerprint"], "fired": injector.fired}
    hooks.detach()
    injector.remove()
    return result


def main() -> None:
    args = parse("clean,flip,flip_every,flip_end")
    dist.init_process_group("gloo")
    try:
        run_each(args.only, lambda name: train(name, args.out), args.out, int(os.environ["RANK"]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
