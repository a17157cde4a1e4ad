"""The ring replay audit under FSDP2 + tensor parallel (Lightning ModelParallelStrategy, CPU gloo):
the ring runs over the data-parallel groups, each tensor-parallel group replaying another group's
batches together. One ``torchrun`` launch of ``tests/tp_replay_scenarios.py`` per topology: 2 x 2
(4 ranks) and 3 x 2 (6 ranks, a referee group). Rank ``r``: data-parallel index ``r // 2``,
tensor-parallel coordinate ``r % 2``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sharded import launch, results, same_error

SCENARIOS = Path(__file__).with_name("tp_replay_scenarios.py")


@pytest.fixture(scope="module")
def tp2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("tp2x2"), ["tp_off", "tp_on", "tp_fault"], 4, script=SCENARIOS)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_tp_2x2_clean_audit_every_step_is_exact_and_bit_identical(tp2x2: Path) -> None:
    """Dropout, gradient accumulation, the audit on all 8 steps: exact replays, nothing raised,
    every rank's shards bit for bit as with the audit off."""
    on, off = results(tp2x2, "tp_on", 4), results(tp2x2, "tp_off", 4)
    assert all(r["error"] is None and r["global_step"] == 8 for r in on + off)
    assert [r["weights"] for r in on] == [r["weights"] for r in off]
    assert len({r["weights"] for r in on}) == 4  # FSDP x TP: four different shards
    assert on[0]["groups"] == [[0, 1], [2, 3]]  # the tensor-parallel groups, read from the mesh
    replay = on[0]["states"]["RingReplayAudit"]
    assert replay["runs"] == 8 and replay["failures"] == 0 and replay["max_diff"] == 0.0


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_tp_2x2_persistent_fault_is_caught_on_every_rank_with_its_pair_as_suspects(tp2x2: Path) -> None:
    """Two data-parallel groups: no referee group exists, so the faulty rank 1 and rank 3 (the same
    tensor-parallel coordinate in the other group) are both suspects; ranks 0 and 2 agree."""
    err = same_error(tp2x2, "tp_fault", 4, "ReplayMismatchError")
    assert err["step"] == 2 and err["rank"] is None and err["suspects"] == [1, 3]
    details = err["details"]
    assert sorted(map(tuple, details["mismatching_pairs"])) == [(1, 3), (3, 1)]
    assert details["partners"] == [2, 3, 0, 1]  # coordinate t of group 1 replays coordinate t of group 0
    assert details["rulings"] == {"1->3": "no referee", "3->1": "no referee"}
    assert details["tensor_parallel_groups"] == [[0, 1], [2, 3]]
    assert "two data-parallel groups" in err["message"]


@pytest.fixture(scope="module")
def tp3x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("tp3x2"), ["tp_referee"], 6, script=SCENARIOS)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_tp_3x2_referee_group_names_exactly_the_faulty_rank(tp3x2: Path) -> None:
    """Only rank 1's first forward of each step is wrong: one pair disagrees (1 -> 3); group 2
    (ranks 4 and 5) replays group 0's batch together and rank 5 rules for the replayer."""
    err = same_error(tp3x2, "tp_referee", 6, "ReplayMismatchError")
    assert err["rank"] == 1 and err["suspects"] == [1] and err["step"] == 2
    details = err["details"]
    assert details["mismatching_pairs"] == [[1, 3]] and details["referees"] == {"1->3": 5}
    assert details["rulings"] == {"1->3": "referee agrees with the replayer: the owner is faulty"}
    assert details["classification"] == "transient"  # its re-run, with its peer rank 0 alongside, is right


@pytest.fixture(scope="module")
def tp3x2_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("tp3x2_group"), ["tp_group"], 6, script=SCENARIOS)


@pytest.mark.slow  # a second 6-rank launch
def test_tp_3x2_fault_before_a_tp_collective_names_the_tensor_parallel_group(tp3x2_group: Path) -> None:
    """A wrong column-parallel output on rank 1 enters the row-parallel all-reduce: rank 0 computes
    wrong too. The replay names the group (both suspects), not one of its ranks."""
    err = same_error(tp3x2_group, "tp_group", 6, "ReplayMismatchError")
    assert err["rank"] is None and err["suspects"] == [0, 1]
    assert "the suspects are one tensor-parallel group" in err["message"]


def test_group_ring_partners_keep_the_tensor_parallel_coordinate() -> None:
    from sdc_core.dist.topology import group_ring_partners

    assert group_ring_partners([(0, 1), (2, 3), (4, 5)], [0] * 6) == (2, 3, 4, 5, 0, 1)
    # two nodes, groups (0, 1), (2, 3) on node 0 and (4, 5), (6, 7) on node 1: every hop crosses nodes
    partners = group_ring_partners([(0, 1), (2, 3), (4, 5), (6, 7)], [0, 0, 0, 0, 1, 1, 1, 1])
    assert all((r < 4) != (partners[r] < 4) and r % 2 == partners[r] % 2 for r in range(8))
    with pytest.raises(ValueError, match="cover"):
        group_ring_partners([(0, 1), (2,)], [0, 0, 0])


def test_referee_jobs_give_a_whole_third_group_every_coordinate_of_the_disputed_group_pair() -> None:
    from sdc_core.dist.topology import RankFacts, Topology
    from sdc_core.replay.attribution import referee_jobs
    from sdc_core.replay.ring import RingReplay

    topo = Topology(tuple(RankFacts(r, "h", 0, r) for r in range(6)), 0)
    core = RingReplay(groups=[(0, 1), (2, 3), (4, 5)])
    referees, jobs = referee_jobs([(1, 3)], [(1, 3)], topo, core.groups)
    assert referees == {(1, 3): 5}
    assert jobs == [(0, 2, 4), (1, 3, 5)]  # rank 4 replays rank 0's batch beside rank 5: their collectives pair up
    plain = RingReplay()
    assert referee_jobs([(1, 2)], [(1, 2)], topo, plain.groups) == ({(1, 2): 3}, [(1, 2, 3)])


class _Mesh:
    """Just what ``tensor_parallel_groups`` reads of a ``DeviceMesh``."""

    def __init__(self, ranks: list[list[int]] | list[int], names: tuple[str, ...]) -> None:
        import torch

        self.mesh = torch.tensor(ranks)
        self.mesh_dim_names, self.shape, self.ndim = names, tuple(self.mesh.shape), self.mesh.ndim


def _module_on(meshes: list[_Mesh], fsdp_mesh: _Mesh, monkeypatch: pytest.MonkeyPatch) -> object:
    from types import SimpleNamespace

    import torch
    from torch import nn

    import sdc_core.sharded.tap as sharded

    class FakeFSDP(nn.Module):
        def _get_fsdp_state(self) -> SimpleNamespace:
            group = SimpleNamespace(mesh_info=SimpleNamespace(mesh=fsdp_mesh))
            return SimpleNamespace(_fsdp_param_groups=[group])

    monkeypatch.setattr(sharded, "FSDPModule", FakeFSDP)
    module = FakeFSDP()
    for i, mesh in enumerate(meshes):
        p = nn.Parameter(torch.zeros(1))
        p.device_mesh = mesh  # type: ignore[attr-defined]
        module.register_parameter(f"p{i}", p)
    return module


def test_tensor_parallel_groups_are_read_from_the_mesh_in_any_dimension_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdc_core.sharded.replay import tensor_parallel_groups

    dp = _Mesh([0, 1, 2], ("dp",))
    tp_first = _Mesh([[0, 1, 2], [3, 4, 5]], ("tp", "dp"))  # rank = 3 * tp + dp
    assert tensor_parallel_groups(_module_on([tp_first], dp, monkeypatch), 6) == [(0, 3), (1, 4), (2, 5)]
    dp_first = _Mesh([[0, 1], [2, 3], [4, 5]], ("dp", "tp"))  # Lightning's layout
    assert tensor_parallel_groups(_module_on([dp_first], dp, monkeypatch), 6) == [(0, 1), (2, 3), (4, 5)]
    no_tp = _Mesh([[0], [1], [2]], ("dp", "tp"))  # tensor_parallel_size=1: no groups
    assert tensor_parallel_groups(_module_on([no_tp], dp, monkeypatch), 3) is None
    with pytest.raises(ValueError, match="hold every one of the 8 ranks"):
        tensor_parallel_groups(_module_on([dp_first], dp, monkeypatch), 8)
    other = _Mesh([[0, 2], [1, 3], [4, 5]], ("dp", "tp"))
    with pytest.raises(ValueError, match="one tensor-parallel device mesh"):
        tensor_parallel_groups(_module_on([dp_first, other], dp, monkeypatch), 6)
