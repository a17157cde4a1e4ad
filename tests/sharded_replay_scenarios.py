"""Ring replay scenarios on FSDP2 (Lightning ``ModelParallelStrategy``): run under torchrun.

``torchrun --nproc-per-node 4 tests/sharded_replay_scenarios.py --out DIR --only a,b`` runs the
named scenarios in one process group; each rank writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
import torchmetrics
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenario_runner import main_for
from sharded_scenarios import ShardedNet, fit

from lightning_sdc import Fault, FaultInjector, NonFiniteGradientCheck, ReplayUnavailableError, RingReplayAudit
from sdc_core.checks.digest import combine, tensor_digests
from sdc_core.sharded.checks import local


class Opaque:
    """State the generic capture cannot see: an object (not a tensor or a plain value)."""

    def __init__(self) -> None:
        self.level = 0.0


class StatefulSharded(ShardedNet):
    """``ShardedNet`` whose step reads and changes state besides its batch: a Python counter, a
    torchmetrics metric, an EMA buffer (updated in place), hidden state carried in ``self``, a
    frozen sharded teacher layer updated in place, Python and NumPy RNG; ``opaque=True`` adds an
    object the capture cannot see (the step is then not replayable)."""

    def __init__(self, opaque: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.teacher = nn.Linear(32, 1)  # EMA of layers.2, a frozen parameter sharded by fully_shard
        self.teacher.requires_grad_(False)
        self.register_buffer("ema", torch.zeros(32))  # EMA of the features, updated in place
        self.hidden: torch.Tensor | None = None  # carried from step to step
        self.calls = 0
        self.seen = torchmetrics.SumMetric()
        self.opaque = Opaque() if opaque else None

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        mesh = (init_device_mesh("cpu", (self.hsdp, world // self.hsdp), mesh_dim_names=("replicate", "shard"))
                if self.hsdp else self.device_mesh["data_parallel"])  # fmt: skip
        fully_shard(self.teacher, mesh=mesh)
        super().configure_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.layers[1](self.drop(torch.relu(self.layers[0](x)))))
        if self.hidden is not None:
            h = h + 0.1 * self.hidden
        self.hidden = h.detach().mean(0)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            for t, s in zip(self.teacher.parameters(), self.layers[2].parameters(), strict=True):
                local(t).mul_(0.5).add_(local(s).detach(), alpha=0.5)
        self.calls += 1
        self.seen.update(torch.full((x.shape[0],), 1.0))
        out = self.layers[2](h)
        loss = nn.functional.mse_loss(out.float(), y) * (1.0 + 0.01 * self.calls)
        loss = loss + 0.1 * (h * self.ema).mean() + 0.1 * nn.functional.mse_loss(out, self.teacher(h))
        loss = loss * (1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand()))
        if self.opaque is not None:
            self.opaque.level += 0.25
            loss = loss * (1.0 + self.opaque.level)
        return loss


def stateful(out: Path, name: str, audit: bool, opaque: bool = False, hsdp: int = 0, **kw: Any) -> dict[str, Any]:
    random.seed(3)
    np.random.seed(3)
    model = StatefulSharded(opaque=opaque, hsdp=hsdp)
    callbacks = [RingReplayAudit(every_n_steps=2, **({"exact": True} | kw))] if audit else []
    try:
        result = fit(out, name, callbacks, model=model, accumulate_grad_batches=2)
    except ReplayUnavailableError as err:  # not an SDCError: the step cannot be replayed faithfully
        return {"error": {"type": type(err).__name__, "message": str(err)}}
    everything = [local(t).detach() for t in (*model.parameters(), *model.buffers())]
    return result | {
        "everything": int(combine(tensor_digests(everything))),  # trained and frozen shards, buffers
        "calls": model.calls,
        "seen": float(model.seen.compute()),
        "hidden": int(combine(tensor_digests([model.hidden]))) if model.hidden is not None else None,
        "rng": [random.random(), float(np.random.rand()), float(torch.rand(()))],
    }


class DataDependentFault(L.Callback):
    """A persistent, data-dependent defect on ``rank``: from ``step`` on, every forward of
    ``layers.0`` on the batch that rank trained at ``step`` (replays included) comes out wrong, as
    a bad lane only some values reach would; other batches compute right. Its own batch is wrong,
    its replay of its partner's is right: one pair disagrees and a referee must settle it."""

    def __init__(self, rank: int = 2, step: int = 2) -> None:
        self.rank, self.step, self.batch = rank, step, None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if self.batch is not None and torch.equal(args[0], self.batch):
                output = output.clone()
                output.view(-1)[0] *= 1.2
            return output

        if trainer.global_rank == self.rank:
            pl_module.layers[0].register_forward_hook(hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.batch = batch[0].clone()


def quiet(out: Path, name: str, model: ShardedNet) -> dict[str, Any]:
    """``NonFiniteGradientCheck`` alone (its screen on, as at the defaults); counts the all-reduces
    the SDC code issues: the check's (one per step), the screen's (one at attach: the ranks agree
    on the row's width; its rows travel in an all_gather) and any other (the start-up gather of
    the ranks' facts agrees on its outcome with one)."""
    calls = {"sdc": 0, "screen": 0, "other": 0}
    original = torch.distributed.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "sdc_core.checks.screen":
            calls["screen"] += 1
        elif caller == "sdc_core.sharded.checks":
            calls["sdc"] += 1
        elif caller.startswith("sdc_core"):
            calls["other"] += 1
        return original(*args, **kwargs)

    check = NonFiniteGradientCheck()
    torch.distributed.all_reduce = counting
    try:
        result = fit(out, name, [check], model=model)
    finally:
        torch.distributed.all_reduce = original
    return result | {"sdc_all_reduces": calls["sdc"], "screen_all_reduces": calls["screen"],
                     "other_all_reduces": calls["other"],
                     "in_band": check._core.in_band}


def fault(mode: str, **kw: Any) -> list[Any]:
    return [
        FaultInjector([Fault("module_output", rank=2, step=2, target="layers.2", factor=1.2, mode=mode)]),
        RingReplayAudit(every_n_steps=2, **kw),
    ]


SCENARIOS: dict[str, Any] = {
    "stateful_off": lambda o: stateful(o, "stateful_off", audit=False),
    "stateful_on": lambda o: stateful(o, "stateful_on", audit=True),
    "opaque": lambda o: stateful(o, "opaque", audit=True, opaque=True, exact="auto"),
    # a fault in the first forward of each step from step 2 on rank 2 (the replays compute right):
    # one pair disagrees, a referee settles it
    "referee": lambda o: fit(o, "referee", fault("intermittent")),
    "referee_skip": lambda o: fit(o, "referee_skip", fault("intermittent", on_failure="skip_step")),
    # the non-finite check without a collective of its own: clean (bit-identical to "off" of
    # sharded_scenarios.py is tested there) and NaN on one rank, bf16 parameters
    "quiet_clean": lambda o: quiet(o, "quiet_clean", ShardedNet(bf16=True)),
    "quiet_nan": lambda o: quiet(o, "quiet_nan", ShardedNet(bf16=True, nan_at=([1], 3))),
    # HSDP 3 x 2 (6 ranks): a clean stateful run with accumulation, and a referee naming rank 3
    "hsdp_stateful": lambda o: stateful(o, "hsdp_stateful", audit=True, hsdp=3),
    "hsdp_referee": lambda o: fit(o, "hsdp_referee", [
        FaultInjector([Fault("module_output", rank=3, step=2, target="layers.2", factor=1.2, mode="intermittent")]),
        RingReplayAudit(every_n_steps=2)], model=ShardedNet(hsdp=3)),
    # a persistent fault seen by one pair only: the referee names the rank, skip_step does not hide it
    "data_fault": lambda o: fit(o, "data_fault", [DataDependentFault(), RingReplayAudit(every_n_steps=2,
                                                                                       on_failure="skip_step")]),
}


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
