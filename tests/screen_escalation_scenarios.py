"""The every-step screen at the defaults of ``sdc_core.SDCHooks``, end to end: run with torchrun, 3 ranks.

The heterogeneous transformer classifier of ``screen_scenarios`` (short and long sequences,
imbalanced labels, dropout, AdamW, a warm-up) trains in a plain DDP loop with the hook set at its
defaults (the replay audits one step in 100: steps 0 and 100 only). Scenarios:

* ``fault``: the top exponent bit of one element of rank 1's local weight gradient at step 30
  (a step the replay does not audit): the screen flags it, the partner's recomputation confirms
  it on the weights after step 30's update (the verdict is read one step later, ``read="auto"``),
  and every rank raises ``ReplayMismatchError`` naming rank 1 at step 30, during step 31.
* ``spike``: rank 2's batch of step 30 is a genuine spike (its pooled features scaled 10^4, so the
  gradient is huge on any rank that computes it): flagged, reproduced by the partner, cleared;
  training goes on to the end without a verdict.
* ``skip``: the ``fault`` with ``replay_on_failure="skip_step"`` (``auto`` then reads the verdict
  before the step's update): every rank drops step 30 and training goes on; the replicas stay
  equal (the final comparison passes).
* ``logit``: the top exponent bit of one logit of rank 1's head flipped from step 30 on (a wrong
  activation that mostly moves the loss; it blows up only on steps whose logit lies below 2 in
  magnitude): named on rank 1 (by the non-finite check when its gradients overflow; where they stay
  finite, its loss stands out, which on the weights after the update confirms nothing, and the
  replay's audit of the step after names it).
* ``lightning``: the ``fault`` in a ``Trainer(strategy="ddp")`` fit with the three callbacks at
  their default arguments: the same verdict, from the callbacks' one driver.
* ``last``: the fault at the last step, named by the end of training.
* ``fault_sgd``: the ``fault`` under SGD (lr 0.05, momentum 0.9): the update spreads the 2^128 gradient to every
  replica's weights, so the partner's recomputation on them cannot witness it; the next step every rank's gradients
  are non-finite, and the non-finite verdict names rank 1 as the suspect of the screen's unconfirmed hit.
* ``hard``: no fault; an MLP trained by SGD (lr 0.1, momentum 0.9) with the loss computed in the loop, and at
  random steps one rank's batch made hard (inputs x5-x50, random labels, or both). The update such a batch drives can
  fit it, so the partner's recomputation on the weights after it comes back into the band (it named the healthy rank
  at step 15 before 2026-12-07): no verdict; the hits stay unconfirmed and the replay audits the step after.
* ``fault_same``, ``spike_same``, ``lightning_same``: the screen's verdict read before the
  step's own update (``ScreenConfig(read="same_step")``): the fault named in step 30 before its
  update, the spike cleared, and under Lightning.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import parse, run_each
from screen_scenarios import WARMUP, Classifier, batch
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_core import Fault, FaultInjector, SDCError, SDCHooks

STEPS, AT = 44, 30


class Spiky(Classifier):
    """The classifier whose pooled features are scaled by ``scale`` before the head: a genuine,
    reproducible spike (the head's gradient and the loss grow with it on any rank)."""

    scale = 1.0

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.enc(self.embed(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled * self.scale), labels)


def same_step(screen: Any) -> None:
    """Read ``screen``'s verdicts before the step's own update (``auto``'s choice with ``skip_step``)."""
    screen.config = dataclasses.replace(screen.config, read="same_step")


def train(out: Path, name: str, faults: list[Fault], spike: bool = False, read_same: bool = False,
          sgd: bool = False, **settings: Any) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    rank = dist.get_rank()
    net = Spiky()
    ddp = DDP(net)
    params = ddp.parameters()
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if sgd else torch.optim.AdamW(params, lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    hooks = SDCHooks(run_dir=out / name, **settings).attach(ddp, opt)
    if read_same:
        same_step(hooks.screen)
    injector = FaultInjector(faults)
    injector.install(net, rank)
    result: dict[str, Any] = {"steps": 0}
    try:
        for step in range(STEPS):
            injector.set_step(step)
            net.scale = 1e4 if spike and rank == 2 and step == AT else 1.0
            tokens, labels = batch(0, rank, step)
            ddp(tokens, labels).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            result["steps"] = step + 1
        hooks.finish()
    except SDCError as err:
        result["error"] = err.to_dict()
    finally:
        injector.remove()
    result["replay"] = hooks.replay.stats.state_dict() if hooks.replay is not None else None
    result["screen"] = hooks.screen.stats.state_dict() if hooks.screen is not None else None
    result["digest"] = float(sum(p.detach().double().sum() for p in net.parameters()))
    hooks.detach()
    return result


def lightning(out: Path, name: str = "lightning", read_same: bool = False) -> dict[str, Any]:
    """The fault under Lightning, the SDC callbacks at their defaults."""
    import lightning.pytorch as L
    from scenario_runner import cpu_ddp_trainer
    from torch.utils.data import DataLoader

    from lightning_sdc import FaultInjector as InjectorCallback
    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Classifier()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(*batch)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    rank = dist.get_rank()
    loader = DataLoader(list(range(STEPS)), batch_size=1, collate_fn=lambda idx: batch(0, rank, idx[0]))
    checks = [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()]
    if read_same:
        same_step(checks[0]._screen)
    faults = [Fault(kind="gradient_bit_flip", rank=1, step=AT, target="model.enc.linear2.weight", index=11, bit=30)]
    trainer = cpu_ddp_trainer(max_steps=STEPS, use_distributed_sampler=False, default_root_dir=str(out / name),
                              callbacks=[*checks, InjectorCallback(faults)])  # fmt: skip
    result: dict[str, Any] = {}
    try:
        trainer.fit(Lit(), loader)
    except SDCError as err:
        result["error"] = err.to_dict()
    result["steps"] = trainer.global_step
    result["replay"] = checks[1]._core.stats.state_dict()
    result["screen"] = checks[0]._screen.stats.state_dict() if checks[0]._screen is not None else None
    return result


def hard(out: Path, steps: int = 24) -> dict[str, Any]:
    """SGD on a small MLP, the loss computed in the loop, one rank's batch made hard at a quarter of the steps."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    nn = torch.nn
    net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
                        nn.Linear(128, 10))
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    hooks = SDCHooks(run_dir=out / "hard").attach(ddp, opt)
    mine, shared = torch.Generator().manual_seed(100 + rank), torch.Generator().manual_seed(5)
    w = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    result: dict[str, Any] = {}
    try:
        for _ in range(steps):
            x = torch.randn(32, 32, generator=mine)
            y = (x @ w).argmax(1)
            if int(torch.randint(0, world * 4, (1,), generator=shared)) == rank:  # this rank's batch is hard
                how = int(torch.randint(0, 3, (1,), generator=mine))
                x = x * float(torch.empty(1).uniform_(5, 50, generator=mine)) if how != 1 else x
                y = torch.randint(0, 10, (32,), generator=mine) if how != 0 else y
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        hooks.finish()
    except SDCError as err:
        result["error"] = err.to_dict()
    result["replay"] = hooks.replay.stats.state_dict() if hooks.replay is not None else None
    result["screen"] = hooks.screen.stats.state_dict() if hooks.screen is not None else None
    hooks.detach()
    return result


def fault(step: int = AT) -> list[Fault]:
    return [Fault(kind="gradient_bit_flip", rank=1, step=step, target="enc.linear2.weight", index=11, bit=30)]


def main() -> None:
    args = parse("fault,spike,skip,lightning,logit,fault_same,last,hard,fault_sgd")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    scenarios = {
        "fault": lambda: train(args.out, "fault", fault()),
        "fault_sgd": lambda: train(args.out, "fault_sgd", fault(), sgd=True),
        "spike": lambda: train(args.out, "spike", [], spike=True),
        "hard": lambda: hard(args.out),
        "skip": lambda: train(args.out, "skip", fault(), replay_on_failure="skip_step"),
        "lightning": lambda: lightning(args.out),
        "last": lambda: train(args.out, "last", fault(STEPS - 1)),
        "fault_same": lambda: train(args.out, "fault_same", fault(), read_same=True),
        "spike_same": lambda: train(args.out, "spike_same", [], spike=True, read_same=True),
        "lightning_same": lambda: lightning(args.out, "lightning_same", read_same=True),
        "logit": lambda: train(args.out, "logit", [Fault(kind="module_output", rank=1, step=AT, target="head",
                                                         index=3, bit=30)]),
    }
    try:
        run_each(args.only, lambda name: scenarios[name](), args.out, int(os.environ["RANK"]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
