"""``settle_groups`` on 4 real gloo ranks over a 2 x 2 mesh: replica groups every member reports
alike are kept (confirmed by small all-reduces), and a group whose members disagree is dropped by
its members, also when every group disagrees (every rank then agrees that it disagrees: that
must not pass for agreement)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import torchrun

SCRIPT = '''
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from sdc_core.sharded.replicas import ReplicaGroup, Witnesses, settle_groups

dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
mesh = init_device_mesh("cpu", (2, 2))
mates = tuple(sorted(int(r) for r in mesh.mesh[:, rank % 2].tolist()))  # this rank's replicas on dim 0
results = {}
for case in ("agree", "all_disagree", "one_disagrees"):
    ranks = mates
    if case == "all_disagree" or (case == "one_disagrees" and rank == 3):
        ranks = tuple(sorted((rank, (rank + 1) % 4)))  # real ranks, but a plan no group mate shares
    group = ReplicaGroup(Witnesses(ranks, mesh, (0,)), ["w"], [torch.zeros(2)])
    settled = settle_groups([group], 4)
    results[case] = [len(g.ranks) for g in settled]
json.dump(results, open(os.path.join(out, f"rank{rank}.json"), "w"))
dist.destroy_process_group()
'''


def test_replica_groups_are_kept_when_their_members_agree_and_dropped_alike_when_any_disagrees(tmp_path: Path) -> None:
    script = tmp_path / "settle.py"
    script.write_text(SCRIPT)
    torchrun(script, None, None, 4, str(tmp_path), timeout=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["agree"] == [2]  # kept: a group of the rank and its replica
        assert r["all_disagree"] == [1]  # dropped: the tensor joins the rank's unreplicated group
    # rank 3 disagrees with its mate, rank 1: their group is dropped, the other group {0, 2} is kept
    assert [r["one_disagrees"] for r in results] == [[2], [1], [2], [1]]
