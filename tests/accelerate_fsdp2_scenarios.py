"""``SDCHooks.attach`` on an FSDP2 model under ``accelerate launch`` (4 gloo CPU ranks).

On CPU Accelerate ignores its FSDP plugin (it wraps in DDP), so the model is given the shape the
FSDP2 plugin (``fsdp_version=2``) produces on GPUs by hand: ``fully_shard`` of each layer and the
root, in place, the optimizer and loader prepared by the ``Accelerator``. Each rank writes
``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import parse, run_each

from accelerate_sdc import SDCError, SDCHooks
from sdc_core import Fault, FaultInjector, flip_bit
from sdc_core.checks.digest import combine, tensor_digests
from sdc_core.sharded.checks import ShardedFingerprint, ShardedNonFinite, local


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(torch.relu(self.body(x))), y)


class StatefulRegressor(Regressor):
    """Its forward reads and changes state besides its inputs: a counter and an EMA buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_buffer("ema", torch.zeros(32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        self.calls += 1
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return nn.functional.mse_loss(self.head(h + self.ema), y) * (1.0 + 0.01 * self.calls)


def run(accelerator: Accelerator, name: str, nan: tuple[int, int] | None = None,
        flip: tuple[int, int] | None = None, steps: int = 8, fault: Fault | None = None,
        update_flip: tuple[int, int] | None = None, model_cls: type = Regressor,
        **settings: Any) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = model_cls()
    mesh = init_device_mesh("cpu", (accelerator.num_processes,))
    fully_shard(model.body, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=8)
    optimizer, loader = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    rank = accelerator.process_index
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if update_flip:  # a wrong update: a step post-hook registered before the audit's own

            def wrong(opt: Any, *_: Any) -> None:
                if (rank, sdc.step) == update_flip:
                    flip_bit(local(model.body.weight), 0, 22)

            optimizer.optimizer.register_step_post_hook(wrong)
        sdc = SDCHooks(accelerator, **({"replay_every_n_steps": 2, "replay_exact": True,
                                        "fingerprint_every_n_steps": 1} | settings))  # fmt: skip
        sdc.attach(model, optimizer)
    injector = FaultInjector([fault] if fault else [])
    injector.install(model, rank)
    error = None
    try:
        for step, (xb, yb) in enumerate(loader):
            if step == steps:
                break
            injector.set_step(step)
            loss = model(xb, yb)
            if nan and (rank, step) == nan:
                loss = loss * float("nan")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if flip and (rank, step) == flip:
                flip_bit(local(model.body.weight), 5, 22)  # after the digest, before the next forward
        sdc.finish()
    except SDCError as err:
        error = err.to_dict()
    return {
        "error": error,
        "cores": [type(c).__name__ for c in (sdc.nonfinite, sdc.replay, sdc.fingerprint)],
        "warnings": [str(w.message) for w in caught],
        "runs": {k: v for k, v in sdc.metrics().items() if k.endswith("/runs")},
        "update_audit": sdc.update_audit.stats.state_dict() if getattr(sdc, "update_audit", None) else None,
        "calls": getattr(model, "calls", None),
        "weights": int(combine(tensor_digests([local(t).detach() for t in (*model.parameters(), *model.buffers())]))),
        "sharded": isinstance(sdc.nonfinite, ShardedNonFinite) and isinstance(sdc.fingerprint, ShardedFingerprint),
    }


SCENARIOS = {
    "clean": lambda a: run(a, "clean"),
    "nan": lambda a: run(a, "nan", nan=(2, 3)),
    "at_rest": lambda a: run(a, "at_rest", flip=(1, 4)),
    "compute": lambda a: run(a, "compute", fault=Fault("module_output", rank=3, step=2, target="head", factor=1.2)),
    # the FSDP2 update audit as an SDCHooks setting; a stateful forward replays with its state
    "update_fault": lambda a: run(a, "update_fault", update_flip=(1, 4), fingerprint_every_n_steps=0,
                                  replay_every_n_steps=0, update_audit_every_n_steps=2),
    "stateful_off": lambda a: run(a, "stateful_off", model_cls=StatefulRegressor, replay_every_n_steps=0,
                                  update_audit_every_n_steps=1),
    "stateful_on": lambda a: run(a, "stateful_on", model_cls=StatefulRegressor, update_audit_every_n_steps=1),
}


def main() -> None:
    args = parse(",".join(SCENARIOS))
    accelerator = Accelerator()
    run_each(args.only, lambda name: SCENARIOS[name](accelerator), args.out, accelerator.process_index)


if __name__ == "__main__":
    main()
