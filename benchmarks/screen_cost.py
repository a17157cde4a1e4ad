"""What the every-step gradient screen costs: plain DDP on CPU ranks, the checks at their defaults
(``SDCHooks()``) with and without ``GradientScreen``, interleaved STEP BY STEP in one process group.

Run under ``torchrun --nproc-per-node N python -m benchmarks.screen_cost --out FILE``. The model,
batch and optimizer are ``benchmarks.ddp_steps``' (the Lightning benchmark's MLP, AdamW); each
configuration trains its own copy (same seed, same batches) in its own
``DistributedDataParallel``, one step of each in turn (A B C, C B A, ...). The screen's own work is
timed in the same steps: the magnitude read at the end of backward (``_group_magnitudes``),
``observe`` and ``suspects`` (read one step later, as the deferred policies do), as a share of
rank 0's step of ``defaults``; the A/B columns carry what a timer misses (caches, threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import Model, WorkTimer, summary
from sdc_core.checks.screen import GradientScreen
from sdc_core.driver.hooks import SDCHooks

BATCH = 128
CONFIGS = ("none", "defaults", "defaults_screen")


class ThreadTimer(WorkTimer):
    """``WorkTimer`` that also counts the CPU time of the calling thread inside the wrapped calls
    (``time.thread_time``): what the screen's code itself costs, without the time the thread waits
    for a core on an oversubscribed machine (3 ranks and their communication threads on 2 cores)."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_seconds = 0.0
        self.parts: dict[str, float] = {}  # CPU seconds per wrapped callable's name

    def wrap(self, fn: Any) -> Any:
        timed = super().wrap(fn)
        name = fn.__name__
        self.parts.setdefault(name, 0.0)

        def counted(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return timed(*args, **kwargs)
            finally:
                spent = time.thread_time() - c0
                self.cpu_seconds += spent
                self.parts[name] += spent

        return counted


class Run:
    """One configuration: a model copy, its optimizer, its hook set and screen (or none), its timings."""

    def __init__(self, config: str, width: int) -> None:
        torch.manual_seed(0)
        self.model = DistributedDataParallel(Model(width))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sdc = SDCHooks() if config != "none" else None
        self.screen: GradientScreen | None = None
        self.work = ThreadTimer()  # the screen's own work
        if self.sdc is not None:
            self.sdc.attach(self.model, self.opt)
        if config == "defaults_screen":
            nonfinite = self.sdc.nonfinite  # type: ignore[union-attr]
            self.screen = GradientScreen()
            self.screen.attach(nonfinite)
            nonfinite._group_magnitudes = self.work.wrap(nonfinite._group_magnitudes)  # type: ignore[method-assign]
            self.observe = self.work.wrap(self.screen.observe)
            self.suspects = self.work.wrap(self.screen.suspects)
        self.steps: list[dict[str, float]] = []
        self.parts_after_skip: dict[str, float] = {}
        self.flagged = 0
        self.i = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0, c0, w0 = time.perf_counter(), time.thread_time(), self.work.cpu_seconds
        loss = self.model(x, y)
        loss.backward()
        if self.screen is not None:
            self.observe(self.i, self.sdc.nonfinite.take_magnitudes(), loss.detach())  # type: ignore[union-attr]
        self.opt.step()
        self.opt.zero_grad()
        if self.screen is not None and self.i > 0:
            self.flagged += bool(self.suspects(self.i - 1))
        self.i += 1
        self.steps.append({"seconds": time.perf_counter() - t0, "work_seconds": self.work.take(),
                           "cpu_seconds": time.thread_time() - c0,
                           "work_cpu_seconds": self.work.cpu_seconds - w0})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps per configuration, not timed")
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    runs = {c: Run(c, args.width) for c in CONFIGS}
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(args.skip + args.steps):
        if i == args.skip:
            screen_run = runs["defaults_screen"]
            screen_run.parts_after_skip = dict(screen_run.work.parts)
        x = torch.randn(BATCH, 64, generator=g)
        for c in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:
            runs[c].step(x, x[:, :1])
    screen = runs["defaults_screen"]
    parts = {k: v - screen.parts_after_skip.get(k, 0.0) for k, v in screen.work.parts.items()}
    screen.flagged += bool(screen.screen.suspects(screen.i - 1))  # type: ignore[union-attr]
    for run in runs.values():
        if run.sdc is not None:
            run.sdc.finish()
    kept = {c: run.steps[args.skip :] for c, run in runs.items()}
    wall = {c: [s["seconds"] for s in steps] for c, steps in kept.items()}
    if dist.get_rank() == 0:
        own = sum(s["work_seconds"] for s in kept["defaults_screen"])
        own_cpu = sum(s["work_cpu_seconds"] for s in kept["defaults_screen"])
        main_cpu = sum(s["cpu_seconds"] for s in kept["defaults"])
        pairs = zip(wall["defaults_screen"], wall["defaults"], strict=True)
        result: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "params": sum(p.numel() for p in Model(args.width).parameters()),
            "batch": BATCH,
            "steps": args.steps,
            "step_seconds": {c: summary(w) for c, w in wall.items()},
            "screen_own_work_share_of_defaults_step": own / sum(wall["defaults"]),
            "screen_own_work_ms_per_step": 1000 * own / len(wall["defaults"]),
            "screen_own_cpu_ms_per_step": 1000 * own_cpu / len(wall["defaults"]),
            "screen_own_cpu_ms_per_step_by_call": {k: 1000 * v / len(wall["defaults"]) for k, v in parts.items()},
            "screen_own_cpu_share_of_defaults_step_wall": own_cpu / sum(wall["defaults"]),
            "screen_own_cpu_share_of_defaults_main_thread_cpu": own_cpu / main_cpu,
            "screen_vs_defaults_median": statistics.median(wall["defaults_screen"])
            / statistics.median(wall["defaults"]) - 1,
            "screen_vs_defaults_step_pairs": statistics.median(a / b for a, b in pairs) - 1,
            "defaults_vs_none_median": statistics.median(wall["defaults"]) / statistics.median(wall["none"]) - 1,
            "flagged_steps": screen.flagged,
        }  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
