"""The every-step screen on FSDP2 (``fully_shard``) at the hook set's defaults: run with torchrun, 3 ranks.

A small MLP, each layer and the root ``fully_shard`` (three FSDP parameter groups), trains in a
plain loop with ``SDCHooks()`` at its defaults (the replay audits one step in 100: step 0 only).
Scenarios:

* ``fault``: on rank 1 at step ``AT`` (not audited) the largest element of the gradient flowing back
  into the second layer's output (before its ReLU) is multiplied by 2^30 (a wrong backward, transient: once): the screen
  flags rank 1, its partner's recomputation (during step ``AT + 1``: the verdict is read one step
  later) stays in band, every rank raises ``ReplayMismatchError`` naming rank 1 at step ``AT``.
* ``clean``: the same run without a fault: no verdict, no confirmed hit.
* ``spike``: rank 2's batch of step ``AT`` is a genuine spike (the hidden features before the head
  scaled by 10^4 on any rank that computes that batch): flagged, nobody named; training goes on to
  the end without a verdict.
* ``lightning``: the ``fault`` under Lightning's ``ModelParallelStrategy`` with the three callbacks
  at their default arguments: the same verdict; ``lightning_clean``: no fault, no verdict.
* ``fault_same``, ``spike_same``: read before the step's own update (``read="same_step"``): the
  fault named in step ``AT``, the spike reproduced by the partner on the same weights and cleared.
* ``fault_outside``: the ``fault`` with the loss computed in the loop from the model's output (no ``loss_fn``): the
  partner recomputes through the gradient the loss sent into the output; the same verdict. ``spike_outside``: the
  ``spike`` so: the partner's outputs give the owner's projection, nobody is named.
* ``fault_accumulate``, ``clean_accumulate``: two micro-batches a step, the first with gradient sync off (as
  Accelerate's ``accumulate`` does on FSDP2), the fault in that first one: the same verdict; clean: none.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import parse, run_each
from torch import nn

from sdc_core import SDCError, SDCHooks
from sdc_core.sharded.checks import local

STEPS, AT = 16, 12
FAULT = {"armed": False}  # the next forward's backward multiplies one gradient element by 2^30


class Net(nn.Module):
    """Two hidden layers and a head; ``FAULT`` (set by the loop) corrupts one backward once."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        self.scale = 1.0  # a genuine spike: the features before the head scaled on the spiky batch (the
        # replay's state capture carries it to the partner: the batch really gives such gradients)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        z = self.l1(torch.relu(self.l0(x)))
        if FAULT["armed"]:  # a module-level flag, not state of the model: the partner's re-run does not see it
            FAULT["armed"] = False  # transient: this rank's own re-run of its owner's batch computes right
            z.register_hook(_wrong)
        h = torch.relu(z)
        out = self.head(h * self.scale).squeeze(-1)
        return out if y is None else nn.functional.mse_loss(out, y)  # no labels: the loop computes the loss


def _wrong(g: torch.Tensor) -> torch.Tensor:
    """The gradient with its largest element multiplied by 2^30 (one exponent bit's worth)."""
    g = g.clone()
    flat = g.view(-1)
    i = int(flat.abs().argmax())
    flat[i] = flat[i] * 2.0**30
    return g


def batch(rank: int, step: int, spike: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    if spike:
        x = x.abs() + 1.0  # the spiky batch: positive features, so the scaled ones do not vanish in the ReLU
    return x, torch.randn(8, generator=g)


def train(out: Path, name: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net.l0, net.l1, net.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accumulate = name.endswith("_accumulate")
        hooks = SDCHooks(run_dir=out / name, accumulation_steps=2 if accumulate else 1).attach(net, opt)
    if name.endswith("_same"):  # the verdict read before the step's own update (``auto`` with ``skip_step``)
        hooks.screen.config = dataclasses.replace(hooks.screen.config, read="same_step")
    result: dict[str, Any] = {"steps": 0, "groups": hooks.screen.names if hooks.screen is not None else None}
    try:
        for step in range(STEPS):
            spiky = name.startswith("spike") and rank == 2 and step == AT
            net.scale = 1e4 if spiky else 1.0
            FAULT["armed"] = name.startswith("fault") and rank == 1 and step == AT
            x, y = batch(rank, step, spiky)
            if accumulate:  # the first half with gradient sync off: its gradients are summed into the second's
                net.set_requires_gradient_sync(False)
                (net(x[:4], y[:4]) / 2).backward()
                net.set_requires_gradient_sync(True)
                x, y = x[4:], y[4:]
            loss = nn.functional.mse_loss(net(x), y) if name.endswith("_outside") else net(x, y)
            (loss / (2 if accumulate else 1)).backward()
            opt.step()
            opt.zero_grad()
            result["steps"] = step + 1
        hooks.finish()
    except SDCError as err:
        result["error"] = err.to_dict()
    result["replay"] = hooks.replay.stats.state_dict() if hooks.replay is not None else None
    result["screen"] = hooks.screen.stats.state_dict() if hooks.screen is not None else None
    result["nonfinite"] = hooks.nonfinite.stats.state_dict() if hooks.nonfinite is not None else None
    result["shards"] = [local(p).detach().double().sum().item() for p in net.parameters()]
    hooks.detach()
    return result


def lightning(out: Path, name: str) -> dict[str, Any]:
    """``fault`` (or ``lightning_clean``: none) under Lightning's ``ModelParallelStrategy``, the
    three callbacks at their default arguments."""
    from datetime import timedelta

    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from scenario_runner import cpu_ddp_trainer
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net.l0, self.net.l1, self.net.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, b: Any, batch_idx: int) -> torch.Tensor:
            FAULT["armed"] = name == "lightning" and self.global_rank == 1 and self.trainer.global_step == AT
            return self.net(*b)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(list(range(STEPS)), batch_size=1, collate_fn=lambda idx: batch(rank, idx[0], False))
    checks = [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()]
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timedelta(seconds=90))
    trainer = cpu_ddp_trainer(devices=world, strategy=strategy, max_steps=STEPS, use_distributed_sampler=False,
                              default_root_dir=str(out / name), callbacks=checks)  # fmt: skip
    result: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Lit(), loader)
    except SDCError as err:
        result["error"] = err.to_dict()
    result["steps"] = trainer.global_step
    result["replay"] = checks[1]._core.stats.state_dict()
    result["screen"] = checks[0]._screen.stats.state_dict() if checks[0]._screening else None
    return result


def main() -> None:
    args = parse("fault,clean,spike,lightning,lightning_clean,fault_same,spike_same,fault_accumulate,clean_accumulate,"
                 "fault_outside,spike_outside")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)

    def run(name: str) -> dict[str, Any]:
        return lightning(args.out, name) if name.startswith("lightning") else train(args.out, name)

    try:
        run_each(args.only, run, args.out, int(os.environ["RANK"]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
