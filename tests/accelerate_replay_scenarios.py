"""The ring replay audit with Accelerate on losses outside the model and stateful modules.

``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 3 tests/accelerate_replay_scenarios.py
--out DIR --only a,b`` runs the named scenarios with one ``Accelerator`` and writes
``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import fresh, parse, run_each

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector
from sdc_core.checks.digest import combine, tensor_digests
from sdc_core.errors import ReplayUnavailableError


class Classifier(nn.Module):
    """Returns logits (no loss): the loss is computed outside the model, from labels."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 3)
        self.calls = 0  # a Python counter the forward bumps
        self.level = torch.zeros(())  # a tensor attribute the forward changes in place
        self.memory: Memory | None = None  # an opaque object: only the explicit hook carries it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.level += 1.0
        scale = 1.0 + 0.01 * self.level + (self.memory.step() if self.memory is not None else 0.0)
        return self.head(self.drop(torch.relu(self.stem(x)))) * scale


class Memory:
    def __init__(self) -> None:
        self.level = torch.zeros(())

    def step(self) -> torch.Tensor:
        self.level += 0.125
        return self.level.clone()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(17)
    x = torch.randn(384, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def train(acc: Accelerator, style: str, audit: bool = True, steps: int = 5, faults: list[Fault] = ()) -> dict:
    fresh(acc, 5)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings: dict = {"replay_every_n_steps": 1 if audit else 0, "fingerprint_every_n_steps": 1}
    if style == "hook":
        model.memory = memory = Memory()
        settings["replay_state"] = lambda: memory.level.clone()
        settings["load_replay_state"] = lambda level: setattr(memory, "level", level.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sdc = SDCHooks(acc, **settings)
        model, opt, data = acc.prepare(model, opt, loader())
        sdc.attach(model, opt)
    injector = FaultInjector(list(faults))
    injector.install(acc.unwrap_model(model), acc.process_index)

    def plain(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    def z_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = m(x)
        return F.cross_entropy(logits, y) + 0.01 * torch.logsumexp(logits, -1).pow(2).mean()

    def by_world(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y) * acc.num_processes  # like the HF Trainer's default

    fns = {"outside": plain, "z_loss": z_loss, "by_world": by_world, "hook": z_loss}
    compute = sdc.replayable(fns[style]) if style in fns else None
    if style == "forward":  # recorded by the forward hooks; the loss is a function of the outputs
        sdc.loss_fn = lambda logits, *_a: logits.logsumexp(-1).mean()
    error = None
    try:
        for x, y in data:
            injector.set_step(sdc.step)
            with acc.accumulate(model):
                if compute is not None:
                    loss = compute(model, x, y)
                elif style == "forward":
                    loss = model(x).logsumexp(-1).mean()
                elif style == "bare":  # computed from the outputs, nothing told: replayed by their gradients
                    loss = F.cross_entropy(model(x), y) * acc.num_processes
                else:  # closure over y: the replay does not see the labels
                    sdc.loss_fn = lambda logits, *_a, y=y: F.cross_entropy(logits, y)
                    loss = F.cross_entropy(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if sdc.step >= steps:
                break
        sdc.finish()
    except SDCError as err:
        error = err.to_dict()
    except ReplayUnavailableError as err:
        error = {"type": type(err).__name__, "message": str(err)}
    module = acc.unwrap_model(model)
    return {
        "error": error,
        "step": sdc.step,
        "weights": int(combine(tensor_digests([*module.parameters(), *module.buffers()]))),
        "calls": module.calls,
        "level": float(module.level),
        "memory": float(module.memory.level) if module.memory is not None else None,
        "state": sdc.state_dict(),
    }


STYLES = ("outside", "z_loss", "by_world", "forward", "hook", "bare")
SCENARIOS = {
    **{f"{s}_on": lambda acc, s=s: train(acc, s) for s in STYLES},
    **{f"{s}_off": lambda acc, s=s: train(acc, s, audit=False) for s in STYLES},
    "closure": lambda acc: train(acc, "closure"),
    "outside_fault": lambda acc: train(
        acc, "outside", faults=[Fault("module_output", rank=1, step=2, target="head", factor=1.2)]
    ),
}


def main() -> None:
    args = parse(",".join(SCENARIOS))
    acc = Accelerator(gradient_accumulation_steps=2, project_dir=str(args.out))  # incidents go there
    # gc after each: free that scenario's DDP model now (one collected at interpreter exit can abort gloo)
    run_each(args.only, lambda name: SCENARIOS[name](acc), args.out, acc.process_index, after_each=gc.collect)
    acc.end_training()


if __name__ == "__main__":
    main()
