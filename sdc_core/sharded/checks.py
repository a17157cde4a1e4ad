"""The checks on sharded models: FSDP2 (``fully_shard``), HSDP and tensor parallelism, with the witnesses of
``sdc_core.sharded.replicas``. Every verdict is reached from data every rank holds, so every rank raises the same
exception in the same step."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdc_core.checks.digest import combine, grouped_digests, home_device
from sdc_core.checks.fingerprint import FingerprintCommon, fingerprinted_tensors, vote
from sdc_core.checks.gradients import NonFiniteVerdicts
from sdc_core.checks.reductions import log2_peaks_by_group
from sdc_core.dist.topology import HostRead, Topology, all_gather_objects, collective_device, is_distributed
from sdc_core.errors import FingerprintMismatchError
from sdc_core.sharded.replicas import DTensor, ReplicaGroup, plan_groups, settle_groups
from sdc_core.sharded.tap import GradientTapComm, fsdp_taps


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's bytes of ``t``: a DTensor's local shard (no copy), else ``t`` itself."""
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def is_sharded(module: nn.Module) -> bool:
    """True when any parameter of ``module`` is a DTensor (FSDP2, HSDP, tensor parallel)."""
    return DTensor is not None and any(isinstance(p, DTensor) for p in module.parameters())


@dataclass
class _PendingVerdict:
    step: int
    count: HostRead  # nonzero: some rank's local gradients were not finite (in band or all-reduced)
    seen: list[tuple[torch.Tensor, list[str]]]
    flags: torch.Tensor | None
    scaler_active: bool


@dataclass
class ShardedNonFinite(NonFiniteVerdicts):
    """Non-finite local gradients under FSDP2 / HSDP, read inside the reduce-scatter before it mixes them: the
    same contract and adapter calls as ``NonFiniteGradient``. Cost: one ``aminmax`` per FSDP parameter group and
    micro-batch, one 4-byte all-reduce per step. In band (FSDP meshes spanning the world) the flag also rides in
    the reduce-scatter input (bit-identical while finite): a flagged step's reduced gradients carry NaN at
    element 0 of every shard of the flagged groups."""

    taps: list[GradientTapComm] = field(default_factory=list)
    _seen: list[tuple[torch.Tensor, list[str]]] = field(default_factory=list)
    _outputs: list[torch.Tensor] = field(default_factory=list)  # element 0 of each reduced shard
    _pending: _PendingVerdict | None = None
    in_band: bool = False  # the flags also travel inside the reduce-scatter (and reduced shards are read)
    _device: torch.device | None = None  # where the 4-byte flag all-reduce runs (alike on every rank)
    _group_of_tap: dict[int, int] = field(default_factory=dict)  # id(tap) -> its group
    _peaks_seen: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (lo, hi) per read, its group
    _group_index: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = field(default_factory=dict)

    def attach(self, module: nn.Module) -> None:
        """Tap every FSDP parameter group (``in_band`` when their meshes span the whole world)."""
        self.taps = fsdp_taps(module)
        self._device = collective_device(home_device(local(p) for p in module.parameters()))
        world = dist.get_world_size() if is_distributed() else 1
        self.in_band = bool(self.taps) and all(tap.mesh_size == world for tap in self.taps)
        for tap in self.taps:
            tap.consumers.append(lambda flat, names, tap=tap: self._consume(tap, flat, names))
            if self.in_band:
                tap.output_consumers.append(self._consume_output)
                tap.watch_output()

    def _consume(self, tap: GradientTapComm, flat: torch.Tensor, names: list[str]) -> None:
        """Read the local gradients; in band, element 0 of every rank's chunk minus ``z``: +0.0 (the exact
        identity for every float, -0.0 included) or NaN when they are not finite."""
        lo, hi = torch.aminmax(flat)  # NaN propagates
        mm = torch.stack([lo, hi]).double()
        self._seen.append((mm, names))
        if self.magnitude_groups:  # the screen's peak comes from the same read: max(|lo|, |hi|)
            self._peaks_seen.append((mm, self._group_of_tap.get(id(tap), 0)))
        if self.in_band and tap.group_size > 1 and flat.numel() % tap.group_size == 0:
            z = (hi - hi) + (lo - lo)  # +0.0, or NaN when lo or hi is NaN or infinite
            flat.view(tap.group_size, -1)[:, 0].sub_(z)

    @property
    def tap(self) -> SimpleNamespace | None:
        """What ``GradientScreen.attach`` reads to name its groups: the FSDP parameter groups, labelled."""
        if not self.taps:
            return None
        return SimpleNamespace(params=list(self.taps), names={id(t): group_label(t.names) for t in self.taps})

    def want_magnitudes(self, groups: int) -> int:
        """Opt in to the screen's magnitudes (``NonFiniteGradient.want_magnitudes``' contract): the taps cut into
        ``k = min(groups, taps)`` contiguous groups; two small ops per step, no host sync. Returns ``k``."""
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be an integer >= 1, got {groups!r}")
        n = len(self.taps)
        k = min(groups, n)
        self.magnitude_groups = k
        self._group_of_tap = {id(t): i * k // n for i, t in enumerate(self.taps)}
        self._group_names = {name: i * k // n for i, t in enumerate(self.taps) for name in t.names}
        self._peaks_seen, self._group_index = [], {}
        return k

    def take_magnitudes(self) -> torch.Tensor | None:
        """The magnitudes read since the last call, then forgotten (``NonFiniteGradient.take_magnitudes``' layout);
        None when nothing was read. No host synchronisation."""
        seen, self._peaks_seen = self._peaks_seen, []
        if not seen or not self.magnitude_groups:
            return None
        values = torch.cat([mm for mm, _ in seen]).abs()
        key = (tuple(g for _, g in seen), values.device)
        index = self._group_index.get(key)
        if index is None:
            index = torch.tensor([g for _, g in seen for _ in range(2)], device=values.device)
            if len(self._group_index) < 64:
                self._group_index[key] = index
        return log2_peaks_by_group([(values, index)], self.magnitude_groups)

    def _consume_output(self, reduce_output: torch.Tensor) -> None:
        self._outputs.append(reduce_output.view(-1)[:1].clone())  # on the post-reduce stream: no host sync

    def verdict(self, step: int, params: Iterable[tuple[str, nn.Parameter]], scaler_active: bool = False,
                now: bool = False) -> bool:  # fmt: skip
        """Take step ``step``'s local flags and start the all-reduce; decide now or at ``resolve()``."""
        self.resolve()
        t0 = time.perf_counter()
        seen, self._seen = self._seen, []
        outputs, self._outputs = self._outputs, []
        flags = ~torch.isfinite(torch.stack([mm for mm, _ in seen])).all(dim=-1) if seen else None
        count = torch.zeros(1, dtype=torch.int32, device=self._device or collective_device())
        if flags is not None:
            count += flags.any().to(device=count.device, dtype=torch.int32)
        if self.in_band and outputs:
            # a NaN formed inside the reduction lands on one rank's shard only, and a nonzero count leads
            # to a collective: the count is agreed by all ranks (the all-reduce below)
            count += torch.isnan(torch.cat(outputs).float()).any().to(device=count.device, dtype=torch.int32)
        work = dist.all_reduce(count, async_op=True) if is_distributed() else None
        self._pending = _PendingVerdict(step, HostRead(count, work), seen, flags, scaler_active)
        self.stats.add_time(time.perf_counter() - t0)
        if self.config.on_failure in ("raise", "warn") and not scaler_active and not now:
            return False
        return self._decide(list(params))

    def resolve(self) -> None:
        """Read the pending verdict, if any (every rank, same place); raise or warn naming its step."""
        if self._pending is not None:
            self._decide([])

    def discard(self, timeout_s: float = 30.0) -> int | None:
        """Drop the pending verdict without reading it (training stops on another error): its all-reduce is
        finished (at most ``timeout_s``, never raises: no collective left in flight on a path out)."""
        pending = self._pending
        self._pending, self._seen, self._outputs, self._peaks_seen = None, [], [], []
        if pending is not None:
            pending.count.finish(timeout_s)
        return None

    def _decide(self, params: list[tuple[str, nn.Parameter]]) -> bool:
        """Read the pending verdict; on a flag, name ranks and parameters: a rank's flagged groups, narrowed to
        those non-finite on some shard."""
        pending, self._pending = self._pending, None
        assert pending is not None
        t0 = time.perf_counter()
        self.stats.runs += 1
        if int(pending.count.get().item()) == 0:  # waits for this flag (and its all-reduce) only
            return self._clean(pending.step, t0)
        flagged: list[str] | None = None
        flags = pending.flags
        if flags is not None and bool(flags.any()):
            flagged = [n for f, (_, names) in zip(flags.tolist(), pending.seen, strict=True) if f for n in names]
        with torch.no_grad():
            reduced_bad = [n for n, p in params if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]
        gathered = all_gather_objects((flagged, reduced_bad)) if is_distributed() else [(flagged, reduced_bad)]
        bad_anywhere = {n for _, names in gathered for n in names}
        unique = [None if names is None else list(dict.fromkeys(names)) for names, _ in gathered]
        per_rank = [u and ([n for n in u if n in bad_anywhere] or u)[: self.config.max_names] for u in unique]
        extra: dict[str, Any] = {"sharded": True}
        if all(names is None for names, _ in gathered):  # no rank's local gradients: it formed in the reduction
            extra["formed_in_reduction"] = {r: names[: self.config.max_names] for r, (_, names) in enumerate(gathered)
                                            if names}  # fmt: skip
        return self._failure(pending.step, per_rank, pending.scaler_active, t0, params, extra)


def group_label(names: list[str]) -> str:
    """An FSDP parameter group's label: its first parameter's name, and how many follow."""
    if not names:
        return "?"
    return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})"


@dataclass
class _Pending:
    step: int
    groups: list[ReplicaGroup]
    per_tensor: list[torch.Tensor]  # per replicated group: its tensors' digests
    mismatch: torch.Tensor  # a replica mismatch here (0-d int64, on the device)
    baseline: Any  # (fp, per-tensor digests, group) of the unreplicated shards after the update, or None
    flags: HostRead | None = None  # [replica mismatch here, at-rest change here], MAX over the world
    at_rest: Any = None  # (digests after the update, digests before the next forward, group) or None


@dataclass
class ShardedFingerprint(FingerprintCommon):
    """``WeightFingerprint`` for sharded models; adapters call ``start`` after an update, ``before_use`` before the next
    forward, ``resolve`` before the next update (or one batch later), ``check_now`` before a save, ``finish`` at the
    end. Replica groups compare in their own process group; unreplicated shards are re-digested by ``before_use`` (a
    change is a bit changed at rest). Cost per check: one read of the local shards (two for unreplicated ones), 16
    bytes per rank in the replica group plus 8 in the world; no host synchronisation in the step."""

    _groups: list[ReplicaGroup] | None = None
    _pending: _Pending | None = None

    def start(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Digest the local shards after optimizer step ``step`` and start the comparisons."""
        self.resolve()
        t0 = time.perf_counter()
        if self._groups is None:  # planned once
            world = dist.get_world_size() if is_distributed() else 1
            self._groups = settle_groups(plan_groups(fingerprinted_tensors(module, list(optimizers), self.config),
                                                     world), world)  # fmt: skip
        groups = self._groups
        device = collective_device(home_device(local(t) for g in groups for t in g.tensors))
        replicated, per_tensor, reduced, works = [], [], [], []
        baseline = None
        for g in groups:
            rows = grouped_digests([local(t) for t in g.tensors], device=device)
            fp = combine(rows)
            if len(g.ranks) == 1:
                baseline = (fp, rows, g)
                continue
            pair = torch.stack([fp, torch.bitwise_not(fp)])
            works.append(dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=g.group, async_op=True))
            replicated.append(g)
            per_tensor.append(rows)
            reduced.append(pair)
        for w in works:  # on NCCL a stream wait, not a host wait
            w.wait()
        mismatch = torch.zeros((), dtype=torch.int64, device=device)
        for pair in reduced:
            mismatch = mismatch | (pair[0] != torch.bitwise_not(pair[1])).to(torch.int64)
        self._pending = _Pending(step, replicated, per_tensor, mismatch, baseline)
        self.stats.add_time(time.perf_counter() - t0)
        if baseline is None:  # nothing at rest to watch: the comparison travels now
            self.before_use()

    def before_use(self) -> None:
        """Close the pending window at rest (re-digest the unreplicated shards) and start the world all-reduce."""
        pending = self._pending
        if pending is None or pending.flags is not None:
            return
        t0 = time.perf_counter()
        rest = torch.zeros_like(pending.mismatch)
        if pending.baseline is not None:
            fp, rows, g = pending.baseline
            now_rows = grouped_digests([local(t) for t in g.tensors], device=fp.device)
            rest = (combine(now_rows) != fp).to(torch.int64).to(rest.device)  # on the device: no host wait
            pending.at_rest, pending.baseline = (rows, now_rows, g), None
        flags = torch.stack([pending.mismatch, rest])
        pending.flags = HostRead(flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True))
        self.stats.add_time(time.perf_counter() - t0)

    def resolve(self) -> None:
        """Read the pending comparison (every rank, same place); raise on a mismatch."""
        self.before_use()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        assert pending.flags is not None
        replica_bad, rest_bad = pending.flags.get().tolist()  # waits for this all-reduce only
        self.stats.runs += 1
        if not replica_bad and not rest_bad:
            self.stats.last_verified_step = pending.step
            self.stats.add_time(time.perf_counter() - t0)
            return
        self._fail(pending, bool(replica_bad), bool(rest_bad), t0)

    def discard(self, timeout_s: float = 30.0) -> None:
        """Finish the pending all-reduce unread, on a path out; waits at most ``timeout_s``, never raises."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.flags is not None:
            pending.flags.finish(timeout_s)

    def check_now(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Compare the pending comparison, then the current shards, at once (every rank, same place)."""
        self.start(step, module, optimizers)
        self.resolve()

    def finish(self) -> None:
        """At the end of training: the pending comparison, its window at rest closed now."""
        self.resolve()

    def _fail(self, pending: _Pending, replica_bad: bool, rest_bad: bool, t0: float) -> None:
        """Rare path: gather per-tensor digests and at-rest names, vote per replica group."""
        rank = dist.get_rank() if is_distributed() else 0
        mine = {
            "rows": {g.ranks: rows.tolist() for g, rows in zip(pending.groups, pending.per_tensor, strict=True)}
            if replica_bad else {},
            "names": {g.ranks: g.names for g in pending.groups} if replica_bad else {},
            "at_rest": _changed(pending.at_rest) if rest_bad else [],
        }  # fmt: skip
        gathered = all_gather_objects(mine)
        suspects: set[int] = set()
        differing: dict[int, list[str]] = {}
        groups_seen: dict[tuple[int, ...], list[str]] = {}
        heal_plan: list[tuple[tuple[int, ...], int]] = []
        no_majority = False
        names_of = {k: v for m in gathered for k, v in m["names"].items()}
        for ranks in sorted({k for m in gathered for k in m["rows"]}):
            rows = [tuple(gathered[r]["rows"].get(ranks, ())) for r in ranks]
            _, local_suspects, reference = vote(rows)
            if not local_suspects:
                continue
            names = names_of.get(ranks) or [f"tensor {i}" for i in range(len(rows[0]))]
            ref_row = rows[reference] if reference is not None else rows[0]
            for i, r in enumerate(ranks):
                if rows[i] != ref_row:
                    differing[r] = [n for n, a, b in zip(names, rows[i], ref_row, strict=False) if a != b][:10]
            suspects.update(ranks[i] for i in local_suspects)
            groups_seen[ranks] = [str(ranks[i]) for i in local_suspects]
            if reference is None:
                no_majority = True
            else:
                heal_plan.append((ranks, ranks[reference]))
        at_rest = {r: m["at_rest"] for r, m in enumerate(gathered) if m["at_rest"]}
        suspects.update(at_rest)
        self.stats.failures += 1
        topo = self.topology or Topology.gather()
        ordered = tuple(sorted(suspects))
        named = ordered[0] if len(ordered) == 1 and not no_majority else None
        details: dict[str, Any] = {
            "differing_tensors": differing,
            "replica_groups": {str(list(k)): v for k, v in groups_seen.items()},
            "changed_at_rest": at_rest,
            "at_rest_window": pending.step if pending.at_rest is not None else None,
            "node_ranks": topo.node_ranks(ordered),
            "world_size": len(gathered),
            "sharded": True,
        }
        parts = []
        if at_rest:
            who = ", ".join(f"rank {r}: {', '.join(n[:3])}" for r, n in sorted(at_rest.items()))
            parts.append(f"its shard changed at rest between the update of step {pending.step} and the next "
                         f"forward ({who})")  # fmt: skip
        if differing:
            parts.append("its shard differs from its replicas' in " + "; ".join(
                f"rank {r}: {', '.join(n[:3])}" for r, n in sorted(differing.items()) if r in suspects))  # fmt: skip
        reason = "; ".join(parts) or "the shards differ"
        heal = (self.config.on_failure == "heal" and not at_rest and not no_majority and heal_plan
                and self._may_heal(ordered))  # fmt: skip
        if heal:
            details["action"] = "healed from " + ", ".join(f"rank {src}" for _, src in heal_plan)
        elif self.config.on_failure == "heal":
            details["action"] = "not healed: " + ("a shard without replica changed at rest" if at_rest else
                                                  "no strict majority" if no_majority else "past max_heals")
        self.last_error = FingerprintMismatchError(
            step=pending.step, rank=named, suspects=ordered, hosts=topo.hosts(ordered), details=details, reason=reason)
        self.stats.add_time(time.perf_counter() - t0)
        if not heal:
            raise self.last_error
        self._count_heal(ordered)
        by_ranks = {g.ranks: g for g in pending.groups}
        with torch.no_grad():
            for ranks, src in heal_plan:
                g = by_ranks.get(ranks)
                if g is not None and rank in ranks:
                    for t in g.tensors:
                        dist.broadcast(local(t), src=src, group=g.group)


def _changed(held: Any) -> list[str]:
    """Names of the tensors whose digest changed between the two reads of a window at rest."""
    if held is None:
        return []
    rows, now_rows, g = held
    return [n for n, a, b in zip(g.names, rows.tolist(), now_rows.tolist(), strict=True) if a != b]


__all__ = ["ShardedFingerprint", "ShardedNonFinite", "is_sharded", "local"]
