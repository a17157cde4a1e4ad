"""Exact weight fingerprints and the replica vote.

Every ``every_n_steps`` steps each replica digests its parameters (optionally buffers and optimizer state; with
``rolling=k`` a fixed 1/k of them in turn) on its own device and the replicas compare: any single bit flip changes the
fingerprint, any other difference is missed with probability at most 2**-31 (``digest``). The common case is one 16-byte
MAX all-reduce per rank, read a batch later; only on a mismatch are per-tensor digests gathered to name tensors and
vote. It sees faults that make replicas differ, not a faulty gradient the all-reduce spreads (the ring replay's job)."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from sdc_core.checks.contract import Role, check_settings
from sdc_core.checks.digest import combine, grouped_digests, home_device
from sdc_core.dist.topology import HostRead, Topology, all_gather_tensor, collective_device, is_distributed
from sdc_core.errors import FingerprintMismatchError
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

FingerprintFailurePolicy = Literal["raise", "heal", "rollback"]  # FingerprintConfig.on_failure


@documented
@dataclass(frozen=True, kw_only=True)
class FingerprintConfig:
    """Settings of the weight fingerprint check (keyword-only, validated on construction)."""

    every_n_steps: int = setting(
        1, "weight fingerprint cadence in optimizer steps", "Compare after every n-th optimizer step (>= 1).")
    include_buffers: bool = setting(
        False,
        "fingerprint buffers too (BatchNorm statistics excluded)",
        "BatchNorm running statistics differ per rank without SyncBatchNorm. Buffers a forward pass updates on "
        "each rank differ legitimately too: leave this off for such models.",
    )
    include_optimizer_state: bool = setting(
        False, "fingerprint the optimizer state too", "The optimizer state tensors (Adam moments, ...).")
    on_failure: FingerprintFailurePolicy = setting(
        "raise",
        "what a fingerprint mismatch does: raise, or heal from the majority",
        "``heal``: with a strict majority the differing replicas take the parameters, buffers and optimizer "
        "state of a majority rank by broadcast and training continues; without a majority, or after "
        "``max_heals`` heals of the same rank, it raises.",
    )
    max_heals: int = setting(3, "heals allowed per rank before a mismatch raises (>= 1)")
    rolling: int = setting(
        1,
        "fingerprint 1/k of the tensors per comparison, each within k comparisons (1: all)",
        "The tensors are split once into ``rolling`` slices (``rolling_slices``: by index, the same on every "
        "rank) and the comparisons take the slices in turn, so every tensor is compared once every ``rolling`` "
        "comparisons: a replica whose weights diverged is caught at most ``rolling * every_n_steps`` steps later "
        "(its weights stay apart), for about 1/rolling of the fingerprint's cost per comparison. On-demand "
        "comparisons (before a checkpoint is written, at the end of training, on a replay disagreement) still "
        "compare every tensor. Sharded (FSDP2) models compare every shard regardless (>= 1).",
    )

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "heal", "rollback"):
            raise ValueError(f"on_failure must be 'raise', 'heal' or 'rollback', got {self.on_failure!r}")
        check_settings(self, ints=("max_heals", "every_n_steps"))
        if isinstance(self.rolling, bool) or not isinstance(self.rolling, int) or self.rolling < 1:
            raise ValueError(f"rolling must be an integer >= 1 (1: every tensor each time), got {self.rolling!r}")
        check_settings(self, flags=("include_buffers", "include_optimizer_state"))


def _compared(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], config: FingerprintConfig,
              exclude: frozenset[str]) -> tuple[list[torch.Tensor], Callable[[], list[str]]]:  # fmt: skip
    """The tensors ``fingerprinted_tensors`` names, in its order, and a function naming them (on a
    mismatch, a step later: a tensor no longer in its place is named by its index)."""
    if config.include_buffers or config.include_optimizer_state or exclude:
        named = fingerprinted_tensors(module, optimizers, config, exclude)
        return [t for _, t in named], lambda: [n for n, _ in named]
    tensors = list(module.parameters())

    def names() -> list[str]:
        named = fingerprinted_tensors(module, (), config)
        if [id(t) for _, t in named] == [id(t) for t in tensors]:
            return [n for n, _ in named]
        return [f"tensor {i}" for i in range(len(tensors))]

    return tensors, names


def fingerprinted_tensors(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], config: FingerprintConfig,
                          exclude: frozenset[str] = frozenset()) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """The named tensors the check compares, in an order identical on every replica; none that ``exclude`` names."""
    named = [(f"param:{n}", p) for n, p in module.named_parameters() if n not in exclude]
    if config.include_buffers:
        skip = set()
        for mname, m in module.named_modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and not isinstance(m, nn.SyncBatchNorm):
                skip.update(
                    f"{mname}.{b}" if mname else b for b in ("running_mean", "running_var", "num_batches_tracked"))
        named += [(f"buffer:{n}", b) for n, b in module.named_buffers() if n not in skip and n not in exclude]
    if config.include_optimizer_state:
        names = {id(p): n for n, p in module.named_parameters()}
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in sorted(opt.state.get(p, {}).items() if names.get(id(p)) not in exclude else ()):
                        if isinstance(value, torch.Tensor):
                            named.append((f"optimizer{i}:{names.get(id(p), '?')}:{key}", value))
    return named


@functools.lru_cache(maxsize=16)
def rolling_slices(sizes: tuple[int, ...], k: int) -> list[list[int]]:
    """The tensor indices in ``k`` slices, each joining the slice with the fewest bytes so far (the
    lowest on a tie): the same on every replica, and appended tensors move no earlier one. Cached."""
    slices: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i, n in enumerate(sizes):
        j = min(range(k), key=lambda s: (load[s], s))
        slices[j].append(i)
        load[j] += n
    return slices


def copy_replica(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], src: int,
                 exclude: frozenset[str] = frozenset()) -> None:  # fmt: skip
    """Make every replica equal to rank ``src`` by broadcast of parameters, buffers and optimizer state, those of
    ``exclude`` (each rank's own) aside (a collective: every rank calls it, with the same ``src``)."""
    own = {id(t) for n, t in [*module.named_parameters(), *module.named_buffers()] if n in exclude}
    with torch.no_grad():
        for t in [t for t in [*module.parameters(), *module.buffers()] if id(t) not in own]:
            torch.distributed.broadcast(t.data, src=src)
        for opt in optimizers:
            for p in [p for group in opt.param_groups for p in group["params"] if id(p) not in own]:
                for _, value in sorted(opt.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        torch.distributed.broadcast(value, src=src)


NAMED_REPLICAS = 8  # replicas whose differing tensors a mismatch names (their per-tensor digests are fetched)


def vote_rows(per_tensor: torch.Tensor, names: Callable[[], list[str]]
              ) -> tuple[list[tuple[int, ...]], dict[int, list[str]], int]:  # fmt: skip
    """After a mismatch (a collective: every rank, with its ``T`` per-tensor digests): ``(rows, {rank:
    tensor names}, T)``, the same on every rank. Each row is one combined digest (8 bytes a rank);
    only the per-tensor digests of the reference and of the first ``NAMED_REPLICAS`` differing ranks
    are broadcast (8 T bytes each), to name their first 10 differing tensors."""
    rows = [tuple(r) for r in all_gather_tensor(combine(per_tensor).reshape(1)).tolist()]
    _, _, reference = vote(rows)
    ref = reference if reference is not None else 0
    named = [r for r in range(len(rows)) if rows[r] != rows[ref]][:NAMED_REPLICAS]
    fetched: dict[int, list[int]] = {}
    me = torch.distributed.get_rank() if is_distributed() else 0
    for r in [ref, *named]:
        buf = per_tensor.clone() if r == me else torch.empty_like(per_tensor)
        if is_distributed():
            torch.distributed.broadcast(buf, src=r)
        fetched[r] = buf.tolist()
    every = names()
    differing = {r: [every[i] for i, (a, b) in enumerate(zip(fetched[r], fetched[ref], strict=True)) if a != b][:10]
                 for r in named}  # fmt: skip
    return rows, differing, per_tensor.numel()


def replica_groups(rows: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[int]]:
    """The ranks of each distinct digest row, in rank order, by first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    return groups


def vote(rows: list[tuple[int, ...]]) -> tuple[int | None, tuple[int, ...], int | None]:
    """Vote on per-rank digest rows: ``(rank, suspects, reference)``. With a strict majority the
    suspects are the ranks outside it, ``rank`` the only one of them if there is exactly one,
    ``reference`` a majority rank; without (two replicas, a tie) every rank is a suspect."""
    biggest = max(replica_groups(rows).values(), key=len)
    if 2 * len(biggest) > len(rows):
        majority = set(biggest)
        suspects = tuple(r for r in range(len(rows)) if r not in majority)
        return (suspects[0] if len(suspects) == 1 else None), suspects, biggest[0]
    return None, tuple(range(len(rows))), None


@dataclass
class _Pending:
    step: int
    per_tensor: torch.Tensor  # each compared tensor's digest, on the device
    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    names: Callable[[], list[str]]  # the compared tensors' names (read on a mismatch only)
    reduced: HostRead  # the ranks' MAX of (digest, ~digest), and its all-reduce's work
    part: tuple[int, int] | None = None  # (slice, slices) of a rolling comparison; None: every tensor


@dataclass
class FingerprintCommon:
    """What the DDP and the sharded fingerprint checks share: settings, counters, cadence, heals per rank."""

    role: ClassVar[Role] = Role.FINGERPRINT

    config: FingerprintConfig = field(default_factory=FingerprintConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("weight_fingerprint"))
    topology: Topology | None = None
    last_error: FingerprintMismatchError | None = None
    heals: dict[int, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return is_distributed()

    def due(self, step: int) -> bool:
        """Whether the replicas are compared after step ``step`` (0-based): steps n-1, 2n-1, ..."""
        return (step + 1) % self.config.every_n_steps == 0

    def _may_heal(self, ranks: Iterable[int]) -> bool:
        return all(self.heals.get(r, 0) < self.config.max_heals for r in ranks)

    def _count_heal(self, ranks: Iterable[int]) -> None:
        for r in ranks:
            self.heals[r] = self.heals.get(r, 0) + 1
        self.stats.bump("heals")


@dataclass
class WeightFingerprint(FingerprintCommon):
    """Framework-neutral weight fingerprint check; adapters call ``start`` and ``resolve``. With
    ``rolling = k > 1`` each ``start`` digests the next of k slices; ``stats.last_verified_step`` is
    then the oldest of the slices' last clean comparisons."""

    exclude: frozenset[str] = frozenset()  # each rank's own parameters and buffers (DDP's parameters_to_ignore)
    _pending: _Pending | None = None
    _turn: int = 0  # rolling comparisons started: the next slice is _turn % slices
    _clean: list[int] = field(default_factory=list)  # per slice, the step of its last clean comparison

    def start(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer],
              every_tensor: bool = False) -> None:
        """Resolve any earlier comparison (may raise), digest the next rolling slice (or every tensor)
        and start its comparison: one asynchronous 16-byte MAX all-reduce. Every rank alike."""
        self.resolve()
        t0 = time.perf_counter()
        if self.stats.runs == 0:  # the first comparison: torch's ZeroRedundancyOptimizer (a class only once imported)?
            zero = getattr(getattr(torch.distributed, "optim", None), "ZeroRedundancyOptimizer", ())
            if any(isinstance(o, zero) for o in optimizers):
                warnings.warn("SDC weight_fingerprint cannot see weight or update faults with ZeroRedundancyOptimizer: "
                              "its step broadcasts each rank's shard, so the replicas agree by construction "
                              "(the non-finite check and the replay still work)", UserWarning, stacklevel=2)
        tensors, all_names = _compared(module, optimizers, self.config, self.exclude)
        names: Callable[[], list[str]] = all_names
        part = None
        if self.config.rolling > 1 and not every_tensor:
            slices = [s for s in rolling_slices(tuple(t.nbytes for t in tensors), self.config.rolling) if s]
            if slices:
                if len(self._clean) != len(slices):
                    self._clean = [-1] * len(slices)
                part = (self._turn % len(slices), len(slices))
                chosen = slices[part[0]]
                tensors = [tensors[i] for i in chosen]

                def names() -> list[str]:
                    every = all_names()
                    return [every[i] for i in chosen]

            self._turn += 1
        device = collective_device(home_device(tensors))  # the tensors' own device when the backend serves it
        per_tensor = grouped_digests(tensors, device=device)
        fp = combine(per_tensor)
        reduced = torch.stack([fp, torch.bitwise_not(fp)])
        work = torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self._pending = _Pending(step, per_tensor, module, list(optimizers), names, HostRead(reduced, work), part)
        self.stats.add_time(time.perf_counter() - t0)

    def resolve(self) -> None:
        """Read the pending comparison (every rank, same place); raise on a mismatch."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        hi, not_lo = pending.reduced.tolist()  # waits for this all-reduce only, not the stream
        self.stats.runs += 1
        if hi == ~not_lo:
            if pending.part is None:
                self._clean = [pending.step] * len(self._clean)
                self.stats.last_verified_step = pending.step
            elif len(self._clean) == pending.part[1]:
                self._clean[pending.part[0]] = pending.step
                self.stats.last_verified_step = max(self.stats.last_verified_step, min(self._clean))
            self.stats.add_time(time.perf_counter() - t0)
            return
        rows, differing, tensors = vote_rows(pending.per_tensor, pending.names)
        rank, suspects, reference = vote(rows)
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        topo = self.topology or Topology.gather()
        groups = replica_groups(rows)
        details = {
            "groups": sorted(groups.values()),
            "reference_rank": reference,
            "differing_tensors": differing,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": len(rows),
        }
        if pending.part is not None:  # the tensors of one rolling slice were compared
            details["rolling_slice"] = {"slice": pending.part[0], "slices": pending.part[1], "tensors": tensors}
        if rank is not None:
            tensors = ", ".join(differing.get(rank, [])[:3])
            reason = f"its weights differ from the majority of {len(rows)} replicas in {tensors}"
        elif reference is not None:
            reason = f"{len(suspects)} replicas differ from the majority"
        else:
            reason = f"replicas split into {len(groups)} groups with no majority"
        heal = self.config.on_failure == "heal" and reference is not None and self._may_heal(suspects)
        if heal:
            details["action"] = f"healed from rank {reference}"
            reason += f"; healed from majority rank {reference}"
        elif self.config.on_failure == "heal":
            details["action"] = "not healed: " + (
                "no strict majority" if reference is None else f"more than max_heals={self.config.max_heals} heals")
        self.last_error = FingerprintMismatchError(
            step=pending.step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason)
        if not heal:
            raise self.last_error
        self._count_heal(suspects)
        copy_replica(pending.module, pending.optimizers, reference, self.exclude)

    def discard(self, timeout_s: float = 30.0) -> None:
        """Finish the pending all-reduce without reading it, on a path out (no collective left in
        flight). Waits at most ``timeout_s``; never raises."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.reduced.finish(timeout_s)

    def check_now(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Digest every tensor, compare and resolve at once (raises on a mismatch)."""
        self.start(step, module, optimizers, every_tensor=True)
        self.resolve()


def healed_by_comparison(check: Any, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]
                         ) -> FingerprintMismatchError | None:  # fmt: skip
    """Compare every tensor of the replicas now (``check.check_now``; every rank together), after a
    replay disagreement. Raises when they differ unhealed; returns the healed fault, or None when
    they agree (by this comparison's failure count, never a stale ``last_error``)."""
    failures = check.stats.failures
    check.check_now(step, module, optimizers)
    return check.last_error if check.stats.failures != failures else None


__all__ = ["FingerprintCommon", "FingerprintConfig", "WeightFingerprint", "fingerprinted_tensors",
           "healed_by_comparison", "vote"]
