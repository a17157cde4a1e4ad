"""Non-finite check scenarios without a synchronous collective: run under ``torchrun`` (3 ranks).

``torchrun --nproc-per-node 3 tests/nonfinite_scenarios.py --out DIR --only a,b`` runs the named
scenarios in one process group, each a real ``Trainer(strategy="ddp")`` fit (``ddp_scenarios.fit``),
and writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_scenarios import fit, loader
from scenario_runner import main_for

from lightning_sdc import Fault, FaultInjector, NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "isend", "irecv")


class SyncProbe(L.Callback):
    """Counts, per training batch, the host reads (``Tensor.item``, ``tolist``, ``bool``, ...) and
    the ``torch.distributed`` calls made INSIDE the non-finite check: ``now`` inside the verdict of
    the current step and the tap's consumers and writers (the per-parameter gradient hooks), ``late``
    inside the read of the previous step's pending verdict."""

    def __init__(self) -> None:
        self.where = threading.local()
        self.counts: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        self._saved: dict[tuple[Any, str], Any] = {}

    def _count(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        self._saved[(owner, name)] = original

        def counted(*args: Any, **kwargs: Any) -> Any:
            where = getattr(self.where, "name", None)
            if where is not None:
                key = f"{kind}_{where}"
                self.counts[key] = self.counts.get(key, 0) + 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def _enter(self, fn: Any, name: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(self.where, "name", None)
            self.where.name = name
            try:
                return fn(*args, **kwargs)
            finally:
                self.where.name = outer

        return wrapped

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (check,) = [cb for cb in trainer.callbacks if isinstance(cb, NonFiniteGradientCheck)]
        core = check._core
        core.verdict = self._enter(core.verdict, "now")
        core.resolve = self._enter(core.resolve, "late")
        tap = core.tap
        tap.consumers[:] = [self._enter(f, "now") for f in tap.consumers]
        tap.writers[:] = [self._enter(f, "now") for f in tap.writers]
        for name in HOST_READS:
            self._count(torch.Tensor, name, "reads")
        for name in COLLECTIVES:
            self._count(dist, name, "collectives")

    def on_train_batch_start(self, *args: Any) -> None:
        self.counts = {}

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps.append(dict(self.counts))

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        for (owner, name), original in self._saved.items():
            setattr(owner, name, original)
        self._saved.clear()


def probed(o: Path, name: str, on_failure: str) -> dict[str, Any]:
    probe = SyncProbe()
    result = fit(o, name, [NonFiniteGradientCheck(on_failure=on_failure), probe], steps=6)
    return result | {"probe": probe.steps}


class DivergingNet(L.LightningModule):
    """An MLP without normalisation whose inputs (x 8) and SGD learning rate (0.8) diverge it; rank 1 computes its
    outputs through a 2^78 larger intermediate (the same values and gradients, a range 2^78 narrower), so its values
    overflow first, alone, the SDC signature (the plain route's ``mlp:diverging`` does it with larger inputs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)  # made before ``fit`` seeds: the same weights whatever ran before in the process
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(64, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.head(self.body(x * 8))
        if self.global_rank == 1:
            out = (out * 2.0**78) / 2.0**78
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.8)


def wide_loader(n: int = 384) -> DataLoader:
    g = torch.Generator().manual_seed(1000)
    return DataLoader(TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)), batch_size=8)


def nan(rank: int, step: int, target: str = "body.weight") -> FaultInjector:
    return FaultInjector([Fault("nonfinite_gradient", rank=rank, step=step, target=target, index=5)])


SCENARIOS: dict[str, Any] = {
    # clean steps: no collective and no host read in the check with "raise"; one read with "skip_step"
    "probe_raise": lambda o: probed(o, "probe_raise", "raise"),
    "probe_skip": lambda o: probed(o, "probe_skip", "skip_step"),
    # clipping after the all-reduce turns every gradient NaN; the names come from the local flags
    "clip_nan": lambda o: fit(
        o, "clip_nan", [NonFiniteGradientCheck(), nan(2, 3)], gradient_clip_val=0.5,
        strategy_kwargs={"bucket_cap_mb": 0.001},  # several buckets
    ),
    # a NaN in the last step: the verdict read at the end of training
    "nan_last_step": lambda o: fit(o, "nan_last_step", [NonFiniteGradientCheck(), nan(1, 7, "head.weight")]),
    # a checkpoint is never written after a step whose verdict is unread
    "nan_checkpoint": lambda o: fit(
        o, "nan_checkpoint",
        [ModelCheckpoint(dirpath=o / "ckpts" / "nan_checkpoint", every_n_train_steps=1, save_top_k=-1),
         NonFiniteGradientCheck(), nan(0, 2)],
    ),
    # warn: read one step later, training goes on, the incident names the step and the rank
    "nan_warn": lambda o: fit(o, "nan_warn", [NonFiniteGradientCheck(on_failure="warn"), nan(1, 5)]),
    # the README's defaults, a NaN in one sample: rank 1's at step 3 (Lightning's DistributedSampler shuffles, seed 7)
    "nan_sample": lambda o: fit(o, "nan_sample", [NonFiniteGradientCheck(), RingReplayAudit(every_n_steps=100)],
                                train=loader(nan_at=38)),
    # a diverging run whose values overflow on rank 1 first, alone: no rank named (the screen saw the median loss grow)
    "diverging": lambda o: fit(o, "diverging", [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()],
                               model=DivergingNet(), steps=24,
                               train=wide_loader()),
}  # fmt: skip


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
