"""Timing helpers: interleaved repetitions, medians and spreads, device sync."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


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


class WorkTimer:
    """Seconds spent inside wrapped callables on this process (outermost calls only, so nested
    wrapped calls count once). What a check's own code costs per step, measured in the same steps
    as the wall time: unlike an A/B difference of two noisy runs, it does not drift with the
    machine; it misses indirect costs (caches, scheduling), which the A/B columns carry."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.thread_seconds = 0.0  # the calling thread's CPU time inside: no waits, no time waiting for a core
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.thread_seconds += time.thread_time() - c0
                self._depth -= 1

        return timed

    def wrap_taps(self, taps: list[Any]) -> None:
        """Count the work of every consumer, writer and finisher of these gradient taps (the DDP
        tap's, inside backward; the FSDP2 taps', inside the reduce-scatter); ``None`` entries are skipped."""
        for tap in taps:
            wanted = getattr(tap, "wanted_when", {})  # kept for the wrapper: else the tap reads per parameter always
            for name in ("consumers", "writers", "finishers", "output_consumers", "replay_consumers"):
                hooks = getattr(tap, name, None)
                if hooks is not None:
                    wrapped = [self.wrap(f) for f in hooks]
                    for f, w in zip(hooks, wrapped, strict=True):
                        if f in wanted:
                            wanted[w] = wanted.pop(f)
                    hooks[:] = wrapped

    def exclude(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` wrapped so that its time is not counted when a wrapped caller calls it (the real
        optimizer step inside a check's step wrapper)."""

        def untimed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._depth:
                    self.seconds -= time.perf_counter() - t0

        return untimed

    def take(self) -> float:
        """The seconds counted since the last ``take``."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def take_thread(self) -> float:
        """The thread CPU seconds counted since the last ``take_thread``."""
        seconds, self.thread_seconds = self.thread_seconds, 0.0
        return seconds


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


def alternate(fit: Callable[[str], list[dict[str, float]]], configs: list[str], rounds: int,
              skip: int) -> dict[str, Any]:  # fmt: skip
    """Run ``fit(config)`` for every configuration, ``rounds`` times in alternation, the order rotated each round
    (A B C, B C A, C A B: drifts of a shared machine and the place in a round hit every configuration alike; a
    configuration ``control`` with nothing in it measures the run's own resolution against ``none``), dropping the
    first ``skip`` steps of each fit. Every rank calls it. Returns the kept steps per configuration (``runs``), each
    round's median wall time (``per_round``) and each round's CPU time per step summed over the
    ranks (``cpu_round``); ``fit`` returns per-step ``seconds`` and ``cpu_seconds``."""
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    per_round: dict[str, list[float]] = {c: [] for c in configs}
    cpu_round: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(rounds):
        for config in configs[r % len(configs):] + configs[: r % len(configs)]:
            kept = fit(config)[skip:]
            runs[config] += kept
            per_round[config].append(summary([s["seconds"] for s in kept])["median"])
            cpu_round[config].append(cpu_over_ranks([s["cpu_seconds"] for s in kept]))
    return {"runs": runs, "per_round": per_round, "cpu_round": cpu_round}


def step_table(runs: dict[str, list[dict[str, float]]], per_round: dict[str, list[float]],
               cpu_round: dict[str, list[float]]) -> dict[str, Any]:  # fmt: skip
    """The step-time part of a benchmark's JSON: summaries, overheads against ``none`` and their
    per-round spread, wall and CPU."""
    base = summary([s["seconds"] for s in runs["none"]])["median"]
    out: dict[str, Any] = {
        "step_seconds": {c: summary([s["seconds"] for s in steps]) for c, steps in runs.items()},
        "overhead": {c: summary([s["seconds"] for s in steps])["median"] / base - 1 for c, steps in runs.items()},
        "overhead_by_round": round_overheads(per_round),
        "cpu_seconds_by_round": cpu_round,
        "cpu_overhead_by_round": round_overheads(cpu_round),
    }
    if all("work_seconds" in s for steps in runs.values() for s in steps):  # this rank's steps
        out["work_share"] = {
            c: sum(s["work_seconds"] for s in steps) / sum(s["seconds"] for s in steps) for c, steps in runs.items()
        }
    if all("work_cpu_seconds" in s for steps in runs.values() for s in steps):  # the checks' CPU / the process's
        out["work_cpu_share"] = {
            c: sum(s["work_cpu_seconds"] for s in steps) / sum(s["cpu_seconds"] for s in steps)
            for c, steps in runs.items()
        }
    if all("main_cpu_seconds" in s and "work_cpu_seconds" in s for steps in runs.values() for s in steps):
        out.update(thread_cpu(runs))
    if "defaults" in runs:
        out["defaults_overhead"] = out["overhead"]["defaults"]
    return out


def thread_cpu(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """This rank's CPU per step split into the training thread and the others (gloo's communication threads,
    mostly), and the checks' share of the process's CPU counting the other threads' CPU they add over ``none``
    (their collectives are processed there: ``work_cpu_share`` misses it). Means: CPU time adds up."""
    mean = statistics.fmean
    split = {c: {"main_ms": 1e3 * mean(s["main_cpu_seconds"] for s in steps),
                 "other_ms": 1e3 * mean(s["cpu_seconds"] - s["main_cpu_seconds"] for s in steps)}
             for c, steps in runs.items()}  # fmt: skip
    base = split["none"]["other_ms"]
    share = {c: (1e3 * mean(s["work_cpu_seconds"] for s in steps) + split[c]["other_ms"] - base)
             / (1e3 * mean(s["cpu_seconds"] for s in steps)) for c, steps in runs.items()}  # fmt: skip
    return {"thread_cpu_per_step": split, "checks_cpu_share_with_threads": share}


def audited_split(steps: list[dict[str, float]], steps_per_fit: int, skip: int,
                  every: int) -> tuple[list[dict[str, float]], list[dict[str, float]], float]:  # fmt: skip
    """The kept steps of fits run back to back (the first ``skip`` of each dropped) split into the
    audited ones (step index a multiple of ``every``) and the others, and the ratio of their
    median wall times."""
    kept = steps_per_fit - skip
    audited: list[dict[str, float]] = []
    normal: list[dict[str, float]] = []
    for i, step in enumerate(steps):
        (audited if (skip + i % kept) % every == 0 else normal).append(step)
    ratio = summary([s["seconds"] for s in audited])["median"] / summary([s["seconds"] for s in normal])["median"]
    return audited, normal, ratio


class Model(nn.Module):
    """The Lightning benchmark's MLP (4.3M parameters in 6 tensors at width 2048); returns its loss
    (what the replay audit looks for)."""

    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


# the SDCHooks settings of the DDP benchmarks' configurations (None: no hook set)
DDP_SETTINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "nonfinite": {"replay_every_n_steps": 0, "fingerprint_every_n_steps": 0},
    "fingerprint": {"nonfinite_gradient": False, "replay_every_n_steps": 0},
    "defaults": {},
}
