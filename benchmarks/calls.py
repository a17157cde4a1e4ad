"""How much host work the checks add per step, counted rather than timed: the Python calls made
inside ``sdc_core`` per training step (cProfile), for the plain hook set at its defaults
(``SDCHooks()``), plain DDP on 2 gloo ranks, an MLP of 20 and of 200 parameter tensors.

    python -m benchmarks.calls --out FILE.json [--tensors 20 200] [--steps 8]

A count is deterministic (the same code path every step; no clock in it) and machine-independent,
so it stands in for the host time that bounds a GPU step of a model up to a few hundred million
parameters. The target: host work that does not grow with the model's tensors, i.e. the count at
200 tensors at most 1.25x the count at 20, and at most 400. Each rank warms up (the first
backwards decide the gradient read's mode; the first fingerprint builds its tables; the screen's
first 32 steps recalibrate its band at each step) and then
profiles ``--steps`` steps; rank 0's count per step is reported, with the functions that make most
calls (what to look at when the ratio grows).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "sdc_core") + os.sep
WORLD = 2
WARMUP = 40  # past the screen's first 32 steps, which recalibrate its band at every step (start-up work)
WIDTH = 16


class Stack(nn.Module):
    """``tensors // 2`` small linear layers (a weight and a bias each) and an MSE loss."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        if tensors < 2 or tensors % 2:
            raise ValueError(f"tensors must be an even number >= 2, got {tensors}")
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(tensors // 2)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


def sdc_calls(stats: pstats.Stats, top: int = 12) -> tuple[int, list[tuple[str, int]]]:
    """All calls made to functions defined under ``sdc_core/`` and the ``top`` functions by calls."""
    per_function: dict[str, int] = {}
    for (filename, line, name), (_, calls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        if os.path.abspath(filename).startswith(PACKAGE):
            key = f"{os.path.relpath(filename, ROOT)}:{line}({name})"
            per_function[key] = per_function.get(key, 0) + calls
    ranked = sorted(per_function.items(), key=lambda kv: (-kv[1], kv[0]))
    return sum(per_function.values()), ranked[:top]


def _rank(rank: int, port: int, tensors: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_SDC_CONFIG_FILE=os.devnull)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from sdc_core.driver.hooks import SDCHooks

        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Stack(tensors))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with tempfile.TemporaryDirectory() as run_dir:
            hooks = SDCHooks(run_dir=run_dir)
            hooks.attach(model, optimizer)
            g = torch.Generator().manual_seed(100 + rank)
            profile = cProfile.Profile()
            for step in range(WARMUP + steps):
                x = torch.randn(8, WIDTH, generator=g)
                if step == WARMUP:
                    profile.enable()
                model(x, x).backward()
                optimizer.step()
                optimizer.zero_grad()
            profile.disable()
            hooks.finish()
        total, top = sdc_calls(pstats.Stats(profile))
        if rank == 0:
            Path(out).write_text(json.dumps({"calls_per_step": total / steps, "top": top}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count(tensors: int, steps: int) -> dict[str, Any]:
    """Rank 0's ``sdc_core`` calls per step (and the top functions) in a real 2-rank gloo run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "calls.json")
        mp.start_processes(_rank, args=(_free_port(), tensors, steps, out), nprocs=WORLD, start_method="spawn")
        return json.loads(Path(out).read_text())


def run(sizes: tuple[int, int] = (20, 200), steps: int = 8) -> dict[str, Any]:
    """The counts for both sizes, their ratio and whether the targets hold."""
    small, large = (count(n, steps) for n in sizes)
    ratio = large["calls_per_step"] / small["calls_per_step"]
    return {
        "world_size": WORLD,
        "steps_profiled": steps,
        "tensors": list(sizes),
        "calls_per_step": [small["calls_per_step"], large["calls_per_step"]],
        "ratio": ratio,
        "targets": {"ratio_at_most": 1.25, "large_at_most": 400},
        "meets_targets": ratio <= 1.25 and large["calls_per_step"] <= 400,
        "top_functions": {str(sizes[0]): small["top"], str(sizes[1]): large["top"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensors", type=int, nargs=2, default=(20, 200), metavar=("SMALL", "LARGE"))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    result = run(tuple(args.tensors), args.steps)
    args.out.write_text(json.dumps(result, indent=1))
    small, large = result["calls_per_step"]
    print(f"sdc_core calls per step: {small:.0f} at {args.tensors[0]} tensors, {large:.0f} at "
          f"{args.tensors[1]}; ratio {result['ratio']:.2f} (targets: <= 1.25, <= 400)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
