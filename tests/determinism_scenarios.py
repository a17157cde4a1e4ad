"""The ring replay audit on a step with a nondeterministic kernel: run under ``torchrun``.

``torchrun --nproc-per-node 3 tests/determinism_scenarios.py --out DIR --only a,b`` runs real
``Trainer(strategy="ddp")`` fits on CPU whose model holds ``NoisyKernel``: a stand-in for a GPU
kernel with atomics. With torch's deterministic algorithms off it adds noise drawn from a generator
seeded by ``os.urandom`` (different on every call, rank and run), on about half of its calls
(intermittent); with them on it is exact (``capable``) or, like flash attention backward under
``warn_only=True``, stays noisy and raises under ``warn_only=False`` (``incapable``). Each rank
writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import cpu_ddp_trainer, parse, run_each

from lightning_sdc import Fault, FaultInjector, ReplayUnavailableError, RingReplayAudit, SDCError
from sdc_core.replay.ring import ReplayConfig, RingReplay

NOISE = 2e-6  # relative size of the kernel's noise (bf16 GPU atomics differ by ~1e-4, fp32 ones by ~1e-6)


class NoisyKernel(nn.Module):
    """Identity, plus intermittent noise where torch's deterministic switch does not reach it."""

    def __init__(self, capable: bool) -> None:
        super().__init__()
        self.capable = capable
        self.noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.noisy_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            if self.capable:
                return x
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(
                    "NoisyKernel does not have a deterministic implementation, but you set "
                    "'torch.use_deterministic_algorithms(True)'"
                )
        if torch.rand((), generator=self.noise) < 0.5:
            return x
        self.noisy_calls += 1
        return x + NOISE * x.detach().abs().mean() * torch.randn(x.shape, generator=self.noise)


class Net(L.LightningModule):
    def __init__(self, capable: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), NoisyKernel(capable), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Attention(L.LightningModule):
    """Dropout and multi-head attention, trained under ``precision="bf16-mixed"`` on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x.view(x.shape[0], 2, 4).repeat(1, 1, 2))
        h, _ = self.attn(h, h, h, need_weights=False)
        return nn.functional.mse_loss(self.head(self.drop(h)).mean(1).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(256, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - 0.5 * x[:, 1:2]), batch_size=8, shuffle=False)


def fit(capable: bool, deterministic: bool, steps: int, faults: list[Fault] = (), precision: str = "32-true",  # type: ignore[assignment]
        model: L.LightningModule | None = None, **kw: Any) -> dict[str, Any]:  # fmt: skip
    L.seed_everything(11, workers=True, verbose=False)
    model = model or Net(capable)
    audit = RingReplayAudit(every_n_steps=1)
    audit._core = RingReplay(ReplayConfig(every_n_steps=1, deterministic=deterministic, **kw))
    callbacks: list[Any] = [audit] + ([FaultInjector(list(faults))] if faults else [])
    trainer = cpu_ddp_trainer(max_steps=steps, precision=precision, callbacks=callbacks, default_root_dir=OUT[0])
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, loader())
        except SDCError as err:
            error = err.to_dict()
        except ReplayUnavailableError as err:
            error = {"type": type(err).__name__, "message": str(err)}
    core = audit._core
    return {
        "error": error,
        "global_step": trainer.global_step,
        "stats": core.stats.state_dict(),
        "mode": core.mode,
        "noisy_calls": model.body[1].noisy_calls if isinstance(model, Net) else None,
        "deterministic_after": torch.are_deterministic_algorithms_enabled(),
    }


OUT: list[Path] = [Path(".")]
SCENARIOS: dict[str, Any] = {
    # (a) deterministic kernels: the noisy kernel is exact inside the audit's window, bit for bit
    "det_clean": lambda: fit(True, True, 6),
    # (b) the user's opt-out: noise on every audit, no verdict
    "off_clean": lambda: fit(True, False, 16),
    # torch has no deterministic kernel for it: warn_only mode, noise tolerated, no verdict
    "fallback_clean": lambda: fit(False, True, 12),
    # without determinism bit equality cannot hold: refused as unreplayable, never an SDC verdict
    "off_exact": lambda: fit(True, False, 4, exact=True),
    # (c) a real fault is named in every mode
    "det_fault": lambda: fit(True, True, 6, [Fault("module_output", rank=1, step=3, target="body.0")]),
    "off_fault": lambda: fit(True, False, 8, [Fault("module_output", rank=2, step=5, target="body.0")]),
    "fallback_fault": lambda: fit(False, True, 6, [Fault("module_output", rank=0, step=2, target="body.3")]),
    # bf16-mixed on CPU: the replay's backward runs outside autocast, as Lightning's own does
    "bf16_attention": lambda: fit(True, True, 4, precision="bf16-mixed", model=Attention(), exact=True),
}


def main() -> None:
    args = parse(",".join(SCENARIOS))
    OUT[0] = args.out
    run_each(args.only, lambda name: SCENARIOS[name](), args.out, int(os.environ["RANK"]))


if __name__ == "__main__":
    main()
