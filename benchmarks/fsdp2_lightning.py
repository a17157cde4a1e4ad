"""Lightning FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) on 4 CPU ranks: steady-state time
per step with and without the checks, audited steps against normal ones, and the bytes and
collectives the checks add per rank.

Run under ``torchrun --nproc-per-node 4 python -m benchmarks.fsdp2_lightning --out FILE``. The
configurations alternate in one process group (start-up paid once). FSDP's own all-gathers and
reduce-scatters are not counted (the traffic wrapper sees ``all_reduce``, ``all_gather``, the
point-to-point calls and the object collectives: the checks' calls).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import alternate, audited_split, step_table
from benchmarks.ddp_lightning import BATCH, Probe, Traffic
from benchmarks.ddp_lightning import Model as DDPModel
from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck


class Model(DDPModel):
    """The DDP benchmark's model, each ``Linear`` and the root ``fully_shard``-ed over the data-parallel mesh."""

    def __init__(self, width: int = 2048) -> None:
        torch.manual_seed(0)  # FSDP2 does not broadcast initial weights: every rank builds the same
        super().__init__(width)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def fit(config: str, steps: int, traffic: Traffic, every: int) -> list[dict[str, float]]:
    callbacks: list[Any] = {
        "none": [],
        "nonfinite": [NonFiniteGradientCheck()],
        "fingerprint": [WeightFingerprintCheck()],
        "defaults": [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()],
        "audit_often": [NonFiniteGradientCheck(), RingReplayAudit(every), WeightFingerprintCheck()],
        "update_often": [WeightFingerprintCheck(update_audit_every_n_steps=every)],
    }[config]  # fmt: skip
    probe = Probe(traffic, callbacks)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * (steps + 2) * dist.get_world_size(), 64, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=BATCH)
    world = int(os.environ["WORLD_SIZE"])
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timedelta(seconds=120))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, callbacks=[*callbacks, probe],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Model(), data)
    return probe.steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--every", type=int, default=10, help="cadence of the audited configurations")
    parser.add_argument("--configs", default="none,nonfinite,fingerprint,defaults,audit_often,update_often")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    traffic = Traffic()
    skip = 5
    rounds = alternate(lambda c: fit(c, args.steps, traffic, args.every), args.configs.split(","), args.rounds, skip)
    if dist.get_rank() != 0:
        return
    runs = rounds["runs"]
    result: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "params": sum(p.numel() for p in Model().parameters()),
        **step_table(runs, rounds["per_round"], rounds["cpu_round"]),
        "every": args.every,
        "replay_every": args.every,
        "steps": args.steps,
    }
    for config in ("audit_often", "update_often"):
        if config not in runs:
            continue
        audited, normal, result[f"{config}_step_vs_normal"] = audited_split(runs[config], args.steps, skip, args.every)
        result[f"{config}_traffic"] = {"clean": [normal[0]["calls"], normal[0]["bytes"]],
                                       "audited": [audited[0]["calls"], audited[0]["bytes"]]}  # fmt: skip
    if "audit_often_step_vs_normal" in result:
        result["audited_step_vs_normal"] = result["audit_often_step_vs_normal"]
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
