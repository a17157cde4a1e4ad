"""The witness rule: replicas read from DTensor placements and device meshes (no real training)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import worker_env
from torch.distributed.tensor import Partial, Replicate, Shard

from sdc_core.sharded.replicas import Witnesses, replicate_ranks

HSDP = torch.arange(6).reshape(3, 2)  # (replicate, shard): ranks 0, 2, 4 hold the same shard


def test_replicate_ranks_follow_the_replicate_dimensions() -> None:
    assert replicate_ranks(HSDP, (1, 1), (Replicate(), Shard(0))) == (1, 3, 5)
    assert replicate_ranks(HSDP, (2, 0), (Replicate(), Shard(0))) == (0, 2, 4)
    assert replicate_ranks(HSDP, (2, 0), (Shard(0), Shard(1))) == (4,)  # pure sharding: no replica
    assert replicate_ranks(HSDP, (2, 0), (Replicate(), Replicate())) == (0, 1, 2, 3, 4, 5)
    assert replicate_ranks(HSDP, (2, 0), (Shard(0), Replicate())) == (4, 5)  # TP-replicated, FSDP-sharded
    assert replicate_ranks(HSDP, (2, 0), (Partial(), Shard(0))) == ()  # pending reduction: not comparable
    assert replicate_ranks(torch.arange(4), (2,), (Shard(0),)) == (2,)
    assert Witnesses((0, 1, 2)).kind == ("world",)


_FAKE = r"""
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from sdc_core.sharded.replicas import plan_groups, witnesses
out = {}
for rank in range(6):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=6)
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard"))
    tp = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    hsdp = DTensor.from_local(torch.ones(4), mesh, [Replicate(), Shard(0)], run_check=False)
    flat = init_device_mesh("cpu", (6,), mesh_dim_names=("fsdp",))
    fsdp = DTensor.from_local(torch.ones(4), flat, [Shard(0)], run_check=False)
    sub = DTensor.from_local(torch.ones(4), mesh["shard"], [Shard(0)], run_check=False)
    norm = DTensor.from_local(torch.ones(4), tp, [Shard(0), Replicate()], run_check=False)
    named = [("hsdp", hsdp), ("fsdp", fsdp), ("norm", norm), ("plain", torch.ones(2)), ("hsdp2", hsdp)]
    groups = plan_groups(named, 6)
    out[rank] = {
        "hsdp": list(witnesses(hsdp, 6).ranks), "fsdp": list(witnesses(fsdp, 6).ranks),
        "sub": list(witnesses(sub, 6).ranks),
        "norm": list(witnesses(norm, 6).ranks), "plain": list(witnesses(torch.ones(1), 6).ranks),
        "groups": [[list(g.ranks), g.names] for g in groups],
    }
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_witnesses_of_dtensors_on_hsdp_fsdp_and_tp_meshes() -> None:
    proc = subprocess.run([sys.executable, "-c", _FAKE], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    assert out[0]["hsdp"] == [0, 2, 4] and out[3]["hsdp"] == [1, 3, 5]
    assert out[3]["fsdp"] == [3]  # pure FSDP: no replica
    assert out[3]["sub"] == [1, 3, 5]  # on a sub-mesh: the root mesh's other dimensions hold replicas
    assert out[4]["norm"] == [3, 4, 5]  # replicated over the TP ranks of its data-parallel row
    assert out[5]["plain"] == list(range(6))  # a plain tensor: replicated over the whole world (DDP)
    # one group per replica set, unreplicated first, in an order identical on every rank
    assert out[2]["groups"][0] == [[2], ["fsdp"]]
    assert sorted(out[2]["groups"][1:]) == [[[0, 1, 2], ["norm"]], [[0, 1, 2, 3, 4, 5], ["plain"]],
                                            [[0, 2, 4], ["hsdp", "hsdp2"]]]  # fmt: skip
    assert [[len(r), n] for r, n in out[2]["groups"]] == [[len(r), n] for r, n in out[5]["groups"]]


def test_lightning_refuses_fsdp1_and_deepspeed_naming_what_is_supported(tmp_path) -> None:
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck
    from lightning_sdc._common import require_supported_strategy

    t = L.Trainer(accelerator="cpu", devices=1, default_root_dir=tmp_path, logger=False)
    for strategy in (FSDPStrategy(), object.__new__(DeepSpeedStrategy)):  # neither can be built on CPU here
        t._accelerator_connector.strategy = strategy
        for check in (NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck):
            with pytest.raises(ValueError, match=f"ModelParallelStrategy.*got {type(strategy).__name__}.*FSDP1"):
                require_supported_strategy(t, check.__name__)
    t._accelerator_connector.strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    require_supported_strategy(t, "WeightFingerprintCheck")  # accepted


def test_update_audit_hands_back_its_optimizer_hook_for_removal() -> None:
    """The hook set removes every hook at detach: the update audit's post-step hook included (it would fire
    on every later update, and twice after a second attach)."""
    from sdc_core.sharded.update_audit import UpdateAudit

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = optimizer._optimizer_step_post_hooks  # torch's own table: the only way to see a registered hook
    before = len(hooks)
    handle = UpdateAudit(every_n_steps=1).attach(optimizer, model)
    assert len(hooks) == before + 1
    handle.remove()
    assert len(hooks) == before
