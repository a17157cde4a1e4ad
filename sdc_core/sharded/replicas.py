"""The witness rule of the sharded checks: the ranks that hold the same bytes of a tensor are its replicas, read from a
DTensor's placements and device mesh (a plain tensor is replicated over the whole world). ``plan_groups`` partitions
tensors by their replicas, in an order identical on every rank; ``settle_groups`` confirms the groups with their members
and gives each a process group."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sdc_core.dist.topology import all_gather_objects, collective_device

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - old torch: nothing here is sharded
    DTensor = Replicate = None  # type: ignore[assignment,misc]


def replicate_ranks(mesh_ranks: torch.Tensor, coordinate: Sequence[int], placements: Sequence[Any]) -> tuple[int, ...]:
    """The global ranks of ``mesh_ranks`` sharing ``coordinate`` on every dimension not ``Replicate``;
    ``()`` when a placement is ``Partial`` (the bytes are no one's yet)."""
    if any(getattr(p, "is_partial", lambda: False)() for p in placements):
        return ()
    index = tuple(slice(None) if p.is_replicate() else int(c) for p, c in zip(placements, coordinate, strict=True))
    return tuple(sorted(int(r) for r in mesh_ranks[index].flatten().tolist()))


@dataclass(frozen=True)
class Witnesses:
    """Where a tensor's replicas are: ``ranks`` (sorted, this rank included) and the mesh
    dimensions that replicate it (``dims``; ``None`` for a plain tensor: the whole world)."""

    ranks: tuple[int, ...]
    mesh: Any = None
    dims: tuple[int, ...] | None = None

    @property
    def kind(self) -> tuple:
        """Identical on every rank for the same tensor (SPMD): orders the collectives."""
        return ("world",) if self.mesh is None else ("mesh", tuple(self.mesh.shape), self.dims)


def witnesses(t: torch.Tensor, world_size: int) -> Witnesses:
    """The replicas of ``t``; a DTensor on a sub-mesh is read on its root mesh, other dimensions ``Replicate``
    (``settle_groups`` keeps such a group only if every member reports it)."""
    if DTensor is None or not isinstance(t, DTensor):
        return Witnesses(tuple(range(world_size)))
    mesh, placements = t.device_mesh, list(t.placements)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is not mesh and names and root_names and all(n in root_names for n in names):
        widened: list[Any] = [Replicate()] * root.ndim
        for name, p in zip(names, placements, strict=True):
            widened[root_names.index(name)] = p
        mesh, placements = root, widened
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return Witnesses(())
    ranks = replicate_ranks(mesh.mesh, coordinate, placements)
    dims = tuple(i for i, p in enumerate(placements) if p.is_replicate())
    return Witnesses(ranks, mesh, dims)


@dataclass
class ReplicaGroup:
    """Tensors with the same replicas, and the process group they are compared in."""

    witnesses: Witnesses
    names: list[str]
    tensors: list[torch.Tensor]
    group: Any = None  # ProcessGroup, or None for the default (world) group

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.witnesses.ranks


def plan_groups(named: Sequence[tuple[str, torch.Tensor]], world_size: int) -> list[ReplicaGroup]:
    """Partition ``named`` tensors by their replicas, in an order identical on every rank: groups of one rank
    first, ``Partial`` tensors left out."""
    groups: dict[tuple, ReplicaGroup] = {}
    for name, t in named:
        w = witnesses(t, world_size)
        if not w.ranks:
            continue
        key = (True, w.kind, w.ranks) if len(w.ranks) > 1 else (False, ("solo",), w.ranks)
        group = groups.setdefault(key, ReplicaGroup(w, [], []))
        group.names.append(name)
        group.tensors.append(t)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], repr(k[1])))]


def _digest(value: Any) -> int:
    """A 56-bit digest of ``repr(value)`` (fits an int64 and its negation)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "big")


def _agree_by_digest(groups: list[ReplicaGroup], world_size: int) -> bool:
    """Whether every rank holds the same kinds of replica groups (each over the world or one mesh dimension) and
    every member reports the same ranks and names: an all-reduce over the world of the plan's shape, one within
    each group, one over the world of the answer (every rank returns the same)."""
    replicated = [g for g in groups if len(g.ranks) > 1]
    simple = all(len(g.ranks) == world_size or (g.witnesses.dims is not None and len(g.witnesses.dims) == 1)
                 for g in replicated)  # fmt: skip
    device = collective_device(None)
    shape = _digest([(g.witnesses.kind, g.names) for g in replicated]) if simple else -1

    def same(value: int, group: Any = None) -> bool:
        t = torch.tensor([value, -value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t[0]) == -int(t[1]) == value

    if not same(shape) or shape < 0:
        return False
    agreed = all([same(_digest((g.ranks, g.names)), g.witnesses.mesh.get_group(g.witnesses.dims[0]))
                  for g in replicated if len(g.ranks) < world_size])  # fmt: skip  # a list: every group's, no short cut
    unanimous = same(int(agreed))  # every rank alike, also when every rank's groups disagreed
    return unanimous and agreed  # False on every rank when some group disagreed


def settle_groups(groups: list[ReplicaGroup], world_size: int) -> list[ReplicaGroup]:
    """Confirm each replica group with its members (kept only when every member reports the same ranks and
    names; else its tensors count as unreplicated) and give it a process group. A collective: every rank."""
    if world_size > 1 and _agree_by_digest(groups, world_size):
        for g in groups:
            if len(g.ranks) > 1:
                g.group = None if len(g.ranks) == world_size else g.witnesses.mesh.get_group(g.witnesses.dims[0])
        solo = [g for g in groups if len(g.ranks) == 1]
        return solo + [g for g in groups if len(g.ranks) > 1]
    mine = {g.ranks: g.names for g in groups if len(g.ranks) > 1}
    gathered = all_gather_objects(mine) if world_size > 1 else [mine]
    rank = dist.get_rank() if world_size > 1 else 0
    kept: list[ReplicaGroup] = []
    solo = ReplicaGroup(Witnesses((rank,)), [], [])
    for g in groups:
        if len(g.ranks) == 1 or not all(gathered[q].get(g.ranks) == g.names for q in g.ranks):
            solo.names += g.names
            solo.tensors += g.tensors
        else:
            kept.append(g)
    needed = set()
    for g in kept:
        w = g.witnesses
        if len(w.ranks) == world_size:
            g.group = None
        elif w.dims is not None and len(w.dims) == 1:
            g.group = w.mesh.get_group(w.dims[0])
        else:
            needed.add(w.ranks)
    everyone = all_gather_objects(sorted(needed)) if world_size > 1 else [sorted(needed)]
    union = sorted({tuple(r) for theirs in everyone for r in theirs})
    made = {ranks: dist.new_group(list(ranks)) for ranks in union}
    for g in kept:
        if g.witnesses.ranks in made:
            g.group = made[g.witnesses.ranks]
    return ([solo] if solo.names else []) + kept


__all__ = ["ReplicaGroup", "Witnesses", "plan_groups", "replicate_ranks", "settle_groups", "witnesses"]
