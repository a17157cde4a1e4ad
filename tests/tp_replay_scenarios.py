"""Ring replay scenarios on FSDP2 + tensor parallel (Lightning ``ModelParallelStrategy``): run under torchrun.

``torchrun --nproc-per-node 4 tests/tp_replay_scenarios.py --out DIR --only a,b`` runs the named
scenarios in one process group (data parallel = world / 2, tensor parallel = 2); each rank writes
``DIR/<scenario>.rank<r>.json``. Rank ``r`` has data-parallel index ``r // 2`` and tensor-parallel
coordinate ``r % 2`` (Lightning's mesh is ``(data_parallel, tensor_parallel)``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenario_runner import main_for
from sharded_scenarios import ShardedNet, fit

from lightning_sdc import Fault, FaultInjector, RingReplayAudit

TP = 2


class TPNet(ShardedNet):
    """``ShardedNet`` (8 -> 32 -> 32 -> 1, dropout after the first layer) with ``layers.0``
    column-parallel and ``layers.1`` row-parallel over the tensor-parallel mesh (an all-reduce in
    the forward), ``layers.2`` replicated over it; every layer and the root sharded with
    ``fully_shard`` over the data-parallel mesh."""

    def configure_model(self) -> None:
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.layers, tp, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        for layer in self.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(self, mesh=dp)


def fit_tp(out: Path, name: str, callbacks: list[Any], steps: int = 8, **trainer_kwargs: Any) -> dict[str, Any]:
    return fit(out, name, callbacks, steps, make=TPNet, tensor_parallel=TP, **trainer_kwargs)


def fault(mode: str, target: str = "layers.2", factor: float = 1.2, **kw: Any) -> list[Any]:
    return [
        FaultInjector([Fault("module_output", rank=1, step=2, target=target, factor=factor, mode=mode)]),
        RingReplayAudit(every_n_steps=2, **kw),
    ]


SCENARIOS: dict[str, Any] = {
    # clean: dropout and gradient accumulation, the audit on every step; bit-identical with it off
    "tp_off": lambda o: fit_tp(o, "tp_off", [], accumulate_grad_batches=2),
    "tp_on": lambda o: fit_tp(o, "tp_on", [RingReplayAudit(every_n_steps=1, exact=True)], accumulate_grad_batches=2),
    # a persistent fault in rank 1's last (TP-replicated) layer from step 2: with two data-parallel groups
    # no referee exists; ranks 1 and 3 (coordinate 1 of each group) disagree both ways
    "tp_fault": lambda o: fit_tp(o, "tp_fault", fault("persistent")),
    # 3 x 2 (6 ranks): only rank 1's first forward of each step is wrong: one pair disagrees, group 2 referees
    "tp_referee": lambda o: fit_tp(o, "tp_referee", fault("intermittent")),
    # 3 x 2: a persistent fault in rank 1's column-parallel output (sign flipped: a ReLU cannot hide it),
    # before the row-parallel all-reduce: it reaches rank 0 (its tensor-parallel peer) too, so the group is named
    "tp_group": lambda o: fit_tp(o, "tp_group", fault("persistent", target="layers.0", factor=-2.0)),
}


def main() -> None:
    main_for(SCENARIOS)


if __name__ == "__main__":
    main()
