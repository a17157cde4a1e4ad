"""What the replay costs on a clean audited step and on a disagreement it confirms as noise: CPU DDP.

Run under ``torchrun --nproc-per-node N python -m benchmarks.replay_confirm --out FILE``. Three
configurations of the DDP benchmarks' model train step by step in turn in one process group
(A B C, C B A, ...): ``none`` (no checks), ``audited`` (``SDCHooks`` with the replay on every
step, on a step that replays bit for bit) and ``noisy`` (the same, with one element of the
first layer's output off by 1e-7 relative on about one owner forward in four, outside the
replay: each such audit disagrees, is confirmed by the re-runs and explained as noise; the
tolerance the run would then move to is put back to bit equality after each step, so that every
noisy audit is confirmed again). The median step shows a clean audited step; the noisy
configuration's confirmed steps against its other steps show what one confirmation costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import Model, summary
from sdc_core.driver.hooks import SDCHooks

BATCH = 128
CONFIGS = ("none", "audited", "noisy")


class Run:
    def __init__(self, config: str, width: int) -> None:
        torch.manual_seed(0)
        self.net = Model(width)
        self.model = DistributedDataParallel(self.net)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sdc = SDCHooks(replay_every_n_steps=1) if config != "none" else None
        if self.sdc is not None:
            self.sdc.attach(self.model, self.opt)
        if config == "noisy":
            noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

            def jitter(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor | None:
                if self.sdc is not None and self.sdc.replay is not None and self.sdc.replay.replaying:
                    return None  # the replays are exact: only the owner's forward is noisy
                if torch.rand((), generator=noise) >= 0.25:
                    return None
                bump = torch.zeros_like(out)
                bump.view(-1)[0] = out.detach().view(-1)[0] * 1e-7
                return out + bump

            self.net.net[0].register_forward_hook(jitter)
        self.steps: list[tuple[float, float]] = []  # (seconds, confirmations so far)
        self.noisy = config == "noisy"

    def confirmations(self) -> float:
        if self.sdc is None or self.sdc.replay is None:
            return 0.0
        return float((self.sdc.replay.stats.extra or {}).get("confirmations", 0.0))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.model(x, y).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps.append((time.perf_counter() - t0, self.confirmations()))
        if self.sdc is not None and self.sdc.replay is not None and self.noisy:
            self.sdc.replay.calibration.measured = 0.0  # benchmark only: confirm every noisy audit, not just the first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    runs = {c: Run(c, args.width) for c in CONFIGS}
    g = torch.Generator().manual_seed(dist.get_rank())
    for i in range(args.skip + args.steps):
        x = torch.randn(BATCH, 64, generator=g)
        for c in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:
            runs[c].step(x, x[:, :1])
    for run in runs.values():
        if run.sdc is not None:
            run.sdc.finish()
    if dist.get_rank() == 0:
        kept = {c: run.steps[args.skip :] for c, run in runs.items()}
        wall = {c: [s for s, _ in steps] for c, steps in kept.items()}
        before = runs["noisy"].steps[args.skip - 1][1] if args.skip else 0.0
        marks = [before] + [n for _, n in kept["noisy"]]
        confirmed = [s for (s, _), a, b in zip(kept["noisy"], marks, marks[1:], strict=False) if b > a]
        clean = [s for (s, _), a, b in zip(kept["noisy"], marks, marks[1:], strict=False) if b == a]
        base = statistics.median(wall["none"])
        result = {
            "world_size": dist.get_world_size(),
            "params": sum(p.numel() for p in Model(args.width).parameters()),
            "steps": args.steps,
            "step_seconds": {c: summary(w) for c, w in wall.items()},
            "overhead": {c: statistics.median(w) / base - 1 for c, w in wall.items()},
            "noisy_steps_confirmed": len(confirmed),
            "confirmed_step_seconds": summary(confirmed) if confirmed else None,
            "unconfirmed_step_seconds": summary(clean) if clean else None,
            "confirmation_cost_vs_clean_audited_step": (
                statistics.median(confirmed) / statistics.median(clean) - 1 if confirmed and clean else None
            ),
            "noisy_verdicts": runs["noisy"].sdc.replay.stats.failures if runs["noisy"].sdc else None,
        }
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "step_seconds"}, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
