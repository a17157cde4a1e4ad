"""What the every-step gradient screen costs: plain DDP on CPU ranks, the hook set at its defaults
(``SDCHooks()``: the screen on) against the same without the screen (``gradient_screen=False``),
interleaved STEP BY STEP in one process group.

Run under ``torchrun --nproc-per-node N python -m benchmarks.screen_cost --out FILE``. The model,
batch and optimizer are ``benchmarks.ddp_steps``' (the Lightning benchmark's MLP, AdamW), or with
``--model encoder`` a 12-layer ``nn.TransformerEncoder`` (123 modules, dropout: what keeping a
step costs grows with the modules its state capture walks); each
configuration trains its own copy (same seed, same batches) in its own
``DistributedDataParallel``, one step of each in turn (A B C, C B A, ...). The screen's own work is
timed in the same steps, where the hook set's driver calls it: the magnitude read at the end of
backward (``_group_magnitudes``), ``observe`` and ``suspects`` (read before the update, as the
driver reads it), as a share of rank 0's step without the screen; what the replay records while it
keeps a step it does not audit (``record``, inside the forward hooks below) is reported apart.
The weight comparison's calls (``start``, ``resolve``, the non-finite verdict it carries) are
timed in both configurations, and so are the hook set's forward hooks (with the screen they keep
every step for a possible confirmation: the RNG states, the module state, what the forward runs
under): what turning the screen on costs (``screen_marginal_*``) is its own work, plus what the
comparison and the forward hooks cost with it, less what they cost without it. The weights'
digests inside the comparison (about 2.4 ms a step, the same work in both) are left out of both
(``digest_cpu_ms_per_step`` reports them): their run-to-run noise is larger than the difference
measured. The A/B columns carry what a timer misses (caches, threads).
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import Model, WorkTimer, summary
from sdc_core.checks import fingerprint
from sdc_core.driver.hooks import SDCHooks

BATCH = 128
ENCODER_BATCH = 16
CONFIGS = ("none", "no_screen", "defaults")


class ThreadTimer(WorkTimer):
    """``WorkTimer`` whose thread CPU time (``thread_seconds``: what the screen's code itself costs,
    without the time the thread waits for a core on an oversubscribed machine, 3 ranks and their
    communication threads on 2 cores) is also split by wrapped callable's name (``parts``)."""

    def __init__(self) -> None:
        super().__init__()
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
                self.parts[name] += time.thread_time() - c0

        return counted


# the thread CPU time spent in the weight comparison's digests (``grouped_digests``, as the fingerprint calls it),
# in every configuration alike: taken out of the comparison's time
DIGESTS = WorkTimer()
fingerprint.grouped_digests = DIGESTS.wrap(fingerprint.grouped_digests)  # type: ignore[assignment]


class Encoder(nn.Module):
    """A 12-layer ``nn.TransformerEncoder`` (d 128, 4 heads, dropout 0.1) on ``(batch, 32, 128)``
    inputs; returns the MSE of its mean-pooled output's first feature against ``y``."""

    def __init__(self, width: int = 128, layers: int = 12) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True)
        self.net = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).mean(1)[:, :1], y)


def make_model(kind: str, width: int) -> nn.Module:
    return Encoder() if kind == "encoder" else Model(width)


def make_batch(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch: ``(x, y)``."""
    if kind == "encoder":
        x = torch.randn(ENCODER_BATCH, 32, 128, generator=g)
        return x, x[:, 0, :1]
    x = torch.randn(BATCH, 64, generator=g)
    return x, x[:, :1]


class Run:
    """One configuration: a model copy, its optimizer, its hook set (or none), its timings."""

    def __init__(self, config: str, width: int, kind: str = "mlp") -> None:
        torch.manual_seed(0)
        self.model = DistributedDataParallel(make_model(kind, width))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sdc = None if config == "none" else SDCHooks(gradient_screen=config == "defaults")
        self.work = ThreadTimer()  # the screen's own work
        self.shared = ThreadTimer()  # the weight comparison and the verdict it carries: with the screen, in its row
        self.hooks = ThreadTimer()  # the hook set's forward hooks (with the screen: keeping every step)
        self.keep = ThreadTimer()  # of which the replay's record of a kept step (reported apart)
        if self.sdc is not None:
            self.sdc.attach(self.model, self.opt)
            for module in self.model.modules():  # the hooks the hook set registered: timed as the forward calls them
                for hooks in (module._forward_pre_hooks, module._forward_hooks):
                    for key, hook in list(hooks.items()):
                        hooks[key] = self.hooks.wrap(hook)
            fp, nf = self.sdc.fingerprint, self.sdc.nonfinite
            fp.start, fp.resolve = self.shared.wrap(fp.start), self.shared.wrap(fp.resolve)  # type: ignore[method-assign]
            nf.resolve = self.shared.wrap(nf.resolve)  # type: ignore[method-assign]
        self.screen = self.sdc.screen if self.sdc is not None else None
        if self.screen is not None:  # the driver calls these by attribute: the wrappers are what it calls
            nonfinite, replay = self.sdc.nonfinite, self.sdc.replay  # type: ignore[union-attr]
            nonfinite._group_magnitudes = self.work.wrap(nonfinite._group_magnitudes)  # type: ignore[method-assign]
            self.screen.observe = self.work.wrap(self.screen.observe)  # type: ignore[method-assign]
            self.screen.suspects = self.work.wrap(self.screen.suspects)  # type: ignore[method-assign]
            record, kept = replay.record, self.keep.wrap(replay.record)

            def record_kept(*args: Any, **kwargs: Any) -> Any:  # timed only while keeping for the screen
                return (kept if replay.keeping else record)(*args, **kwargs)

            replay.record = record_kept  # type: ignore[method-assign]
        self.steps: list[dict[str, float]] = []
        self.i = 0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        t0, c0, w0, s0 = time.perf_counter(), time.thread_time(), self.work.thread_seconds, self.shared.thread_seconds
        d0, h0, k0 = DIGESTS.thread_seconds, self.hooks.thread_seconds, self.keep.thread_seconds
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.i += 1
        self.steps.append({"seconds": time.perf_counter() - t0, "work_seconds": self.work.take(),
                           "cpu_seconds": time.thread_time() - c0,
                           "work_cpu_seconds": self.work.thread_seconds - w0,
                           "hooks_cpu_seconds": self.hooks.thread_seconds - h0,
                           "keep_cpu_seconds": self.keep.thread_seconds - k0,
                           "digest_cpu_seconds": (d := DIGESTS.thread_seconds - d0),
                           "shared_cpu_seconds": self.shared.thread_seconds - s0 - d})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps per configuration, not timed")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--model", choices=("mlp", "encoder"), default="mlp")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    runs = {c: Run(c, args.width, args.model) for c in CONFIGS}
    g = torch.Generator().manual_seed(dist.get_rank())
    screened = runs["defaults"]
    for i in range(args.skip + args.steps):
        if i == args.skip:
            parts_after_skip = dict(screened.work.parts)
        x, y = make_batch(args.model, g)
        for c in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:
            runs[c].step(x, y)
    parts = {k: v - parts_after_skip.get(k, 0.0) for k, v in screened.work.parts.items()}
    stats = screened.screen.stats.metrics() if screened.screen is not None else {}
    for run in runs.values():
        if run.sdc is not None:
            run.sdc.finish()
    kept = {c: run.steps[args.skip :] for c, run in runs.items()}
    wall = {c: [s["seconds"] for s in steps] for c, steps in kept.items()}
    if dist.get_rank() == 0:
        own = sum(s["work_seconds"] for s in kept["defaults"])
        own_cpu = sum(s["work_cpu_seconds"] for s in kept["defaults"])
        main_cpu = sum(s["cpu_seconds"] for s in kept["no_screen"])
        shared = {c: sum(s["shared_cpu_seconds"] for s in kept[c]) for c in ("no_screen", "defaults")}
        hooks = {c: sum(s["hooks_cpu_seconds"] for s in kept[c]) for c in ("no_screen", "defaults")}
        marginal = own_cpu + shared["defaults"] - shared["no_screen"] + hooks["defaults"] - hooks["no_screen"]
        base = sum(wall["no_screen"])
        pairs = zip(wall["defaults"], wall["no_screen"], strict=True)
        result: dict[str, Any] = {
            "world_size": dist.get_world_size(),
            "model": args.model,
            "modules": len(list(make_model(args.model, args.width).modules())),
            "params": sum(p.numel() for p in make_model(args.model, args.width).parameters()),
            "batch": ENCODER_BATCH if args.model == "encoder" else BATCH,
            "steps": args.steps,
            "step_seconds": {c: summary(w) for c, w in wall.items()},
            "screen_own_work_share_of_no_screen_step": own / base,
            "screen_own_work_ms_per_step": 1000 * own / len(wall["no_screen"]),
            "screen_own_cpu_ms_per_step": 1000 * own_cpu / len(wall["no_screen"]),
            "screen_own_cpu_ms_per_step_by_call": {k: 1000 * v / len(wall["no_screen"]) for k, v in parts.items()},
            "screen_own_cpu_share_of_no_screen_step_wall": own_cpu / base,
            "screen_own_cpu_share_of_no_screen_main_thread_cpu": own_cpu / main_cpu,
            # the weight comparison's calls (start, resolve, the non-finite verdict it carries) in each configuration,
            # less its digests: with the screen its values ride the screen's all_gather instead of an all-reduce
            "comparison_cpu_ms_per_step": {c: 1000 * v / len(wall["no_screen"]) for c, v in shared.items()},
            # the forward hooks in each configuration (with the screen: keeping every step), and the replay's
            # record of a kept step within them
            "forward_hooks_cpu_ms_per_step": {c: 1000 * v / len(wall["no_screen"]) for c, v in hooks.items()},
            "keep_record_cpu_ms_per_step": 1000 * sum(s["keep_cpu_seconds"] for s in kept["defaults"])
            / len(wall["no_screen"]),
            "digest_cpu_ms_per_step": {c: 1000 * sum(s["digest_cpu_seconds"] for s in kept[c]) / len(wall[c])
                                       for c in ("no_screen", "defaults")},
            "screen_marginal_cpu_ms_per_step": 1000 * marginal / len(wall["no_screen"]),
            "screen_marginal_cpu_share_of_no_screen_step_wall": marginal / base,
            "defaults_vs_no_screen_median": statistics.median(wall["defaults"])
            / statistics.median(wall["no_screen"]) - 1,
            "defaults_vs_no_screen_step_pairs": statistics.median(a / b for a, b in pairs) - 1,
            "no_screen_vs_none_median": statistics.median(wall["no_screen"]) / statistics.median(wall["none"]) - 1,
            "screen_metrics": stats,
        }  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
