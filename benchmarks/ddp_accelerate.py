"""Accelerate DDP on CPU ranks: steady-state time per optimizer step with and without ``SDCHooks``.

Run under ``torchrun --nproc-per-node N python -m benchmarks.ddp_accelerate --out FILE`` (an
``Accelerator(cpu=True)`` under torchrun gives gloo ranks, MULTI_CPU). The same model and batch as
the Lightning benchmark; the configurations alternate in one process group (start-up paid once),
each a fresh model, optimizer and ``SDCHooks`` in a hand-written loop. A step is timed from the
forward to ``zero_grad`` (data loading excluded), the first ``skip`` steps of each run dropped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from accelerate_sdc import SDCHooks
from benchmarks.common import DDP_SETTINGS, Model, WorkTimer, alternate, audited_split, step_table

BATCH = 128
SETTINGS: dict[str, dict[str, Any] | None] = DDP_SETTINGS | {"audit_often": {"replay_every_n_steps": 10}}


def run(acc: Accelerator, config: str, steps: int, replay_every: int) -> list[dict[str, float]]:
    """Wall and CPU seconds (this process, every thread) of each optimizer step of one training run."""
    set_seed(0)
    for registry in (acc._custom_objects, acc._models, acc._optimizers, acc._dataloaders, acc._schedulers):
        registry.clear()  # one model, optimizer and SDCHooks per run in this shared Accelerator
    acc._save_model_state_pre_hook.clear()
    settings = {"replay_every_n_steps": replay_every} if config == "audit_often" else SETTINGS[config]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * (steps + 2) * acc.num_processes, 64, generator=g)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sdc = SDCHooks(acc, **settings) if settings is not None else None
    model, opt, data = acc.prepare(model, opt, DataLoader(TensorDataset(x, x[:, :1]), batch_size=BATCH))
    work = WorkTimer()
    if sdc is not None:
        sdc.attach(model, opt)
        # the checks' own work: SDCHooks' optimizer-step logic without the real update inside it,
        # and the gradient tap's consumers and writers (inside backward)
        inner = work.wrap(sdc._step)
        sdc._step = lambda optimizer, original, *a, **k: inner(optimizer, work.exclude(original), *a, **k)  # type: ignore[method-assign]
        work.wrap_taps([getattr(model, "_sdc_gradient_tap", None)])
    timed: list[dict[str, float]] = []
    for xb, yb in data:
        t0, c0 = time.perf_counter(), time.process_time()
        acc.backward(model(xb, yb))
        opt.step()
        opt.zero_grad()
        timed.append({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                      "work_seconds": work.take()})  # fmt: skip
        if len(timed) == steps:
            break
    if sdc is not None:
        sdc.finish()
    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replay-every", type=int, default=10)
    parser.add_argument("--configs", default=",".join(SETTINGS))
    args = parser.parse_args()
    acc = Accelerator(cpu=True)
    skip = 5  # warm-up steps excluded
    rounds = alternate(lambda c: run(acc, c, args.steps, args.replay_every), args.configs.split(","), args.rounds, skip)
    if acc.process_index == 0:
        runs = rounds["runs"]
        result: dict[str, Any] = {
            "world_size": acc.num_processes,
            "params": sum(p.numel() for p in Model().parameters()),
            **step_table(runs, rounds["per_round"], rounds["cpu_round"]),
            "replay_every": args.replay_every,
        }
        if "audit_often" in runs:
            _, _, result["audited_step_vs_normal"] = audited_split(
                runs["audit_often"], args.steps, skip, args.replay_every
            )
        args.out.write_text(json.dumps(result, indent=1))
    acc.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
