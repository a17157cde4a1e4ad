"""Timing helpers: interleaved repetitions, medians and spreads, device sync."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device,
                warmup: int = 1) -> dict[str, list[float]]:  # fmt: skip
    """Seconds per call of each function, measured in alternating rounds (A B C A B C ...) so
    that drifts of a shared, noisy machine hit every candidate alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def summary(samples: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of a list of timings."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def round_overheads(per_round: dict[str, list[float]], base: str = "none") -> dict[str, list[float]]:
    """Per round, each configuration's median step time relative to ``base`` in the same round,
    minus one: the spread of the overhead estimate itself (rounds alternate the configurations)."""
    return {c: [m / b - 1 for m, b in zip(medians, per_round[base], strict=True)] for c, medians in per_round.items()}


def cpu_over_ranks(cpu_seconds: list[float]) -> float:
    """This rank's median CPU time per step, summed over the ranks of the default process group
    (one small all-reduce, outside the timed steps; every rank calls it)."""
    total = torch.tensor([statistics.median(cpu_seconds)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)
