"""How much host work the checks add per step, counted rather than timed: the Python calls made
inside ``sdc_core`` per training step (cProfile), for the plain hook set at its defaults
(``SDCHooks()``), plain DDP on 2 gloo ranks, an MLP of 20 and of 200 parameter tensors.
``--route lightning`` counts the three SDC callbacks at their defaults under ``Trainer(strategy="ddp")``
and ``--route accelerate`` the Accelerate hook set, each with its adapter's calls added.

    python -m benchmarks.calls --out FILE.json [--route plain] [--tensors 20 200] [--steps 8]

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
ROUTES = {  # the packages whose calls count on each route
    "plain": ("sdc_core",), "lightning": ("sdc_core", "lightning_sdc"), "accelerate": ("sdc_core", "accelerate_sdc"),
}
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


def sdc_calls(stats: pstats.Stats, top: int = 12, packages: tuple[str, ...] = ("sdc_core",)
              ) -> tuple[int, list[tuple[str, int]]]:  # fmt: skip
    """All calls made to functions defined under ``packages`` and the ``top`` functions by calls."""
    per_function: dict[str, int] = {}
    prefixes = tuple(str(ROOT / p) + os.sep for p in packages)
    for (filename, line, name), (_, calls, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
        if os.path.abspath(filename).startswith(prefixes):
            key = f"{os.path.relpath(filename, ROOT)}:{line}({name})"
            per_function[key] = per_function.get(key, 0) + calls
    ranked = sorted(per_function.items(), key=lambda kv: (-kv[1], kv[0]))
    return sum(per_function.values()), ranked[:top]


def _rank(rank: int, port: int, tensors: int, steps: int, out: str, route: str = "plain") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_SDC_CONFIG_FILE=os.devnull,
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    profile = cProfile.Profile()
    if route == "lightning":
        _lightning(tensors, steps, profile)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        try:
            _loop(route, tensors, steps, rank, profile)
        finally:
            dist.destroy_process_group()
    stats = pstats.Stats(profile)
    total, top = sdc_calls(stats, packages=ROUTES[route])
    adapter = sdc_calls(stats, packages=ROUTES[route][1:])[0] if route != "plain" else 0
    if rank == 0:
        Path(out).write_text(json.dumps({"calls_per_step": total / steps, "adapter": adapter / steps, "top": top}))


def _loop(route: str, tensors: int, steps: int, rank: int, profile: cProfile.Profile) -> None:
    """A plain loop over DDP with the plain hook set, or over ``accelerator.prepare`` with Accelerate's."""
    model: nn.Module = Stack(tensors)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as run_dir:
        if route == "accelerate":
            from accelerate import Accelerator

            from accelerate_sdc import SDCHooks as AccelerateHooks

            accelerator = Accelerator(cpu=True, project_dir=run_dir)
            model, optimizer = accelerator.prepare(model, optimizer)
            hooks: Any = AccelerateHooks(accelerator).attach(model, optimizer)
            backward = accelerator.backward
        else:
            from sdc_core.driver.hooks import SDCHooks

            model = nn.parallel.DistributedDataParallel(model)
            hooks = SDCHooks(run_dir=run_dir)
            hooks.attach(model, optimizer)
            backward = torch.Tensor.backward
        g = torch.Generator().manual_seed(100 + rank)
        for step in range(WARMUP + steps):
            x = torch.randn(8, WIDTH, generator=g)
            if step == WARMUP:
                profile.enable()
            backward(model(x, x))
            optimizer.step()
            optimizer.zero_grad()
        profile.disable()
        hooks.finish()


def _lightning(tensors: int, steps: int, profile: cProfile.Profile) -> None:
    """``Trainer(strategy="ddp")`` with the three SDC callbacks at their defaults; the ranks are this
    benchmark's processes (Lightning reads them from the environment)."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Stack(tensors)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0], batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Profiled(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == WARMUP:
                profile.enable()

        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            profile.disable()

    data = DataLoader(TensorDataset(torch.randn(8 * WORLD * (WARMUP + steps), WIDTH)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=WARMUP + steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck(), Profiled()])
    trainer.fit(Module(), data)
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count(tensors: int, steps: int, route: str = "plain") -> dict[str, Any]:
    """Rank 0's calls per step under the route's packages (and the top functions) in a real 2-rank gloo run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "calls.json")
        mp.start_processes(_rank, args=(_free_port(), tensors, steps, out, route), nprocs=WORLD, start_method="spawn")
        return json.loads(Path(out).read_text())


def run(sizes: tuple[int, int] = (20, 200), steps: int = 8, route: str = "plain") -> dict[str, Any]:
    """The counts for both sizes, their ratio and whether the targets hold."""
    small, large = (count(n, steps, route) for n in sizes)
    ratio = large["calls_per_step"] / small["calls_per_step"]
    return {
        "route": route,
        "packages": list(ROUTES[route]),
        "world_size": WORLD,
        "steps_profiled": steps,
        "tensors": list(sizes),
        "calls_per_step": [small["calls_per_step"], large["calls_per_step"]],
        "adapter_calls_per_step": [small["adapter"], large["adapter"]],  # of the counts, the adapter's own
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
    parser.add_argument("--route", choices=sorted(ROUTES), default="plain",
                        help="plain: the hook set over DDP; lightning: the three callbacks; accelerate: its hook set")
    args = parser.parse_args(argv)
    result = run(tuple(args.tensors), args.steps, args.route)
    args.out.write_text(json.dumps(result, indent=1))
    small, large = result["calls_per_step"]
    print(f"{' + '.join(ROUTES[args.route])} calls per step: {small:.0f} at {args.tensors[0]} tensors, {large:.0f} at "
          f"{args.tensors[1]}; ratio {result['ratio']:.2f} (targets: <= 1.25, <= 400)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
