"""Lightning DDP on 3 CPU ranks: steady-state time per step with and without the checks, the
audited step against a normal one, and the bytes and collectives the checks add per rank.

Run under ``torchrun --nproc-per-node N python -m benchmarks.ddp_lightning --out FILE``. The
configurations alternate in one process group (start-up excluded, paid once). Traffic is
counted by wrapping the ``torch.distributed`` calls made in Python: the checks' (DDP's own
gradient all-reduce runs in C++ and is not counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import WorkTimer, alternate, audited_split, step_table
from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

BATCH = 128
COUNTED = ("all_reduce", "all_gather", "all_gather_object", "isend", "irecv", "broadcast", "barrier")


class Traffic:
    """Counts calls and payload bytes of ``torch.distributed`` collectives made in Python."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes_sent = 0
        for name in COUNTED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            tensor = args[1] if name == "all_gather" else (args[0] if args else None)
            if isinstance(tensor, torch.Tensor) and name != "irecv":
                self.bytes_sent += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def snapshot(self) -> tuple[int, int]:
        return sum(self.calls.values()), self.bytes_sent


class Probe(L.Callback):
    """Per-step wall time, check traffic and the time spent in the checks' own code (wall and the
    thread's CPU): every hook of the SDC callbacks, the gradient tap's consumers, writers and
    finishers (inside backward) and the replay's capture where ``training_step`` starts."""

    def __init__(self, traffic: Traffic, checks: list[L.Callback]) -> None:
        self.traffic = traffic
        self.steps: list[dict[str, float]] = []
        self.work = WorkTimer()
        self.checks = checks
        for check in checks:
            for name in dir(check):
                if name.startswith("on_") and callable(getattr(check, name)):
                    setattr(check, name, self.work.wrap(getattr(check, name)))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        taps = [getattr(trainer.strategy.model, "_sdc_gradient_tap", None)]  # DDP: one per model
        taps += [tap for cb in trainer.callbacks for tap in getattr(getattr(cb, "_core", None), "taps", [])]  # FSDP2
        self.work.wrap_taps(taps)
        for check in self.checks:  # the replay's capture where training_step starts (its wrapper calls begin)
            core = getattr(check, "_core", None)
            if hasattr(core, "begin"):
                core.begin = self.work.wrap(core.begin)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.t0, self.cpu0, self.main0 = time.perf_counter(), time.process_time(), time.thread_time()
        self.c0, self.b0 = self.traffic.snapshot()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        calls, sent = self.traffic.snapshot()
        cpu = time.process_time() - self.cpu0  # this process, every thread: less sensitive to scheduling
        main = time.thread_time() - self.main0  # the training thread alone (the rest: gloo's threads, mostly)
        # work: the checks' own seconds since the last step's end (this step's hooks, all of them)
        self.steps.append({"seconds": time.perf_counter() - self.t0, "cpu_seconds": cpu, "main_cpu_seconds": main,
                           "calls": calls - self.c0,
                           "bytes": sent - self.b0, "work_seconds": self.work.take(),
                           "work_cpu_seconds": self.work.take_thread()})  # fmt: skip


class Model(L.LightningModule):
    def __init__(self, width: int = 2048) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LM(L.LightningModule):
    """A small causal transformer LM (4 layers, d 128, 4 heads, dropout 0.1, 256 tokens, 64 a
    sequence): ``--model lm``, the route issue 48 measured."""

    vocab, width, length = 256, 128, 64

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.vocab, self.width)
        layer = nn.TransformerEncoderLayer(self.width, 4, 4 * self.width, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(self.width, self.vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        mask = nn.Transformer.generate_square_subsequent_mask(self.length - 1)
        h = self.body(self.emb(x[:, :-1]), mask=mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, self.vocab), x[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data_for(model: str, batch: int, steps: int) -> tuple[L.LightningModule, DataLoader]:
    """The model and one epoch of batches (every rank its share) for ``--model``."""
    g = torch.Generator().manual_seed(0)
    n = batch * (steps + 2) * dist.get_world_size()
    if model == "lm":
        tokens = torch.randint(0, LM.vocab, (n, LM.length), generator=g)
        return LM(), DataLoader(TensorDataset(tokens), batch_size=batch)
    x = torch.randn(n, 64, generator=g)
    return Model(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=batch)


def read_in_step(check: NonFiniteGradientCheck) -> NonFiniteGradientCheck:
    """``check`` with its screen's verdict read before the step's own update, the host waiting for
    the rows (``ScreenConfig(read="same_step")``: what a ``skip_step`` replay gets)."""
    check._screen.config = dataclasses.replace(check._screen.config, read="same_step")  # type: ignore[union-attr]
    return check


def fit(config: str, steps: int, traffic: Traffic, replay_every: int, batch: int = BATCH,
        model: str = "mlp") -> list[dict[str, float]]:  # fmt: skip
    callbacks: list[Any] = {
        "none": [],
        "control": [],  # no checks either: its overhead against none is what this run can resolve
        "nonfinite": [NonFiniteGradientCheck()],
        "fingerprint": [WeightFingerprintCheck()],
        "defaults": [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()],
        "no_screen": [NonFiniteGradientCheck(screen=False), RingReplayAudit(), WeightFingerprintCheck()],
        "audit_often": [NonFiniteGradientCheck(), RingReplayAudit(replay_every), WeightFingerprintCheck()],
        "replay_only": [RingReplayAudit()],
        "cheap_two": [NonFiniteGradientCheck(), WeightFingerprintCheck()],
        "screen_in_step": [read_in_step(NonFiniteGradientCheck()), RingReplayAudit(), WeightFingerprintCheck()],
        "fingerprint_every_10": [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck(every_n_steps=10)],
    }[config]  # fmt: skip
    probe = Probe(traffic, callbacks)
    L.seed_everything(0, verbose=False)
    module, data = data_for(model, batch, steps)
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu", devices=local, num_nodes=world // local,
        strategy=DDPStrategy(timeout=timedelta(seconds=120)), max_steps=steps, callbacks=[*callbacks, probe],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return probe.steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replay-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per rank and step")
    parser.add_argument("--configs", default="none,nonfinite,fingerprint,defaults,audit_often")
    parser.add_argument("--model", choices=["mlp", "lm"], default="mlp", help="lm: a small transformer LM")
    parser.add_argument("--skip", type=int, default=5, help="first steps of each fit left out (warm-up); the "
                        "screen recalibrates its band every step for its first 32, so 40 measures the steady state")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    traffic = Traffic()
    skip = args.skip
    configs = args.configs.split(",")
    rounds = alternate(lambda c: fit(c, args.steps, traffic, args.replay_every, args.batch, args.model), configs,
                       args.rounds, skip)  # fmt: skip
    if dist.get_rank() != 0:
        return
    runs = rounds["runs"]
    result: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "model": args.model,
        "params": sum(p.numel() for p in (LM() if args.model == "lm" else Model()).parameters()),
        # the checks' collectives made in Python per step (median over the kept steps): counted, not timed
        "collectives_per_step": {c: sorted(s["calls"] for s in steps)[len(steps) // 2] for c, steps in runs.items()},
        **step_table(runs, rounds["per_round"], rounds["cpu_round"]),
        "replay_every": args.replay_every,
        "batch": args.batch,
        "skipped_steps": skip,
    }
    if "audit_often" in runs:
        audited, normal, result["audited_step_vs_normal"] = audited_split(
            runs["audit_often"], args.steps, skip, args.replay_every
        )
        result["clean_step_traffic"] = {"calls": normal[0]["calls"], "bytes_sent": normal[0]["bytes"]}
        result["audited_step_traffic"] = {"calls": audited[0]["calls"], "bytes_sent": audited[0]["bytes"]}
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
