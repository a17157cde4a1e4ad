"""Plain PyTorch DDP on CPU ranks: the checks at their defaults (``SDCHooks()``) against none,
the configurations interleaved STEP BY STEP in one process group.

Run under ``torchrun --nproc-per-node N python -m benchmarks.ddp_steps --out FILE``. Every
configuration trains its own copy of the Lightning benchmark's model (same seed, same batches,
AdamW) wrapped in its own ``DistributedDataParallel``; one step of each runs in turn (A B C D A B
C D ...), so the drifts of a shared, oversubscribed machine hit every configuration alike, far
finer than alternating whole runs. A step is timed from the forward to ``zero_grad``: wall time,
and CPU time of this process (every thread), summed over the ranks. "Checks' own work" is the
time rank 0 spends in ``SDCHooks``' optimizer-step logic (the real update excluded) and in the
gradient tap inside backward. The replay audit keeps its default cadence (every 100 steps), so
the means include its audited steps and the medians show a clean step.
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

from benchmarks.common import DDP_SETTINGS, Model, WorkTimer, summary
from sdc_core.driver.hooks import SDCHooks

BATCH = 128
# the defaults with the verdict read from the reduced gradients; the defaults without the every-step screen
SETTINGS = DDP_SETTINGS | {"defaults_no_screen": {"gradient_screen": False}}


class Run:
    """One configuration: a model copy, its optimizer, its ``SDCHooks`` (or none) and its timings."""

    def __init__(self, config: str, width: int) -> None:
        torch.manual_seed(0)
        self.model = DistributedDataParallel(Model(width))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.work = WorkTimer()
        settings = SETTINGS[config]
        self.sdc = SDCHooks(**settings) if settings is not None else None
        if self.sdc is not None:
            self.sdc.attach(self.model, self.opt)
            inner = self.work.wrap(self.sdc._step)
            self.sdc._step = lambda optimizer, original, *a, **k: inner(optimizer, self.work.exclude(original), *a, **k)  # type: ignore[method-assign]
            self.work.wrap_taps([getattr(self.model, "_sdc_gradient_tap", None)])
        self.steps: list[dict[str, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        self.model(x, y).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps.append({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                           "work_seconds": self.work.take()})  # fmt: skip


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps per configuration, not timed")
    parser.add_argument("--block", type=int, default=25, help="steps per block of the per-block spread")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--configs", default=",".join(SETTINGS))
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    configs = args.configs.split(",")
    runs = {c: Run(c, args.width) for c in configs}
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(args.skip + args.steps):
        x = torch.randn(BATCH, 64, generator=g)
        order = configs if i % 2 == 0 else configs[::-1]  # A B C D, D C B A: no configuration always first
        for c in order:
            runs[c].step(x, x[:, :1])
    for run in runs.values():
        if run.sdc is not None:
            run.sdc.finish()
    kept = {c: run.steps[args.skip :] for c, run in runs.items()}
    wall = {c: [s["seconds"] for s in steps] for c, steps in kept.items()}
    cpu_median = {c: _sum_over_ranks(statistics.median(s["cpu_seconds"] for s in steps)) for c, steps in kept.items()}
    cpu_mean = {c: _sum_over_ranks(statistics.fmean(s["cpu_seconds"] for s in steps)) for c, steps in kept.items()}
    if dist.get_rank() == 0:
        base = statistics.median(wall["none"]) if "none" in wall else None
        blocks = range(0, args.steps, args.block)
        result: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "params": sum(p.numel() for p in Model(args.width).parameters()),
            "batch": BATCH,
            "steps": args.steps,
            "step_seconds": {c: summary(w) for c, w in wall.items()},
            "mean_step_seconds": {c: statistics.fmean(w) for c, w in wall.items()},
            "cpu_seconds_median_over_ranks": cpu_median,
            "cpu_seconds_mean_over_ranks": cpu_mean,
            "work_share": {c: sum(s["work_seconds"] for s in st) / sum(wall[c]) for c, st in kept.items()},
        }  # fmt: skip
        if base is not None:
            result["overhead"] = {c: statistics.median(w) / base - 1 for c, w in wall.items()}
            result["mean_overhead"] = {
                c: statistics.fmean(w) / statistics.fmean(wall["none"]) - 1 for c, w in wall.items()
            }
            result["cpu_overhead"] = {c: cpu_median[c] / cpu_median["none"] - 1 for c in wall}
            result["cpu_mean_overhead"] = {c: cpu_mean[c] / cpu_mean["none"] - 1 for c in wall}
            result["overhead_by_block"] = {
                c: [statistics.median(w[b : b + args.block]) / statistics.median(wall["none"][b : b + args.block]) - 1
                    for b in blocks] for c, w in wall.items()
            }  # fmt: skip
            result["step_ratio_median"] = {  # each step against the none step next to it
                c: statistics.median(a / b for a, b in zip(w, wall["none"], strict=True)) - 1 for c, w in wall.items()
            }
        args.out.write_text(json.dumps(result, indent=1))
        for c in configs:
            over = f"{100 * result['overhead'][c]:+.1f}%" if base is not None else ""
            print(f"{c:12} {1000 * result['step_seconds'][c]['median']:8.1f} ms {over}  "
                  f"work {100 * result['work_share'][c]:.2f}%", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
