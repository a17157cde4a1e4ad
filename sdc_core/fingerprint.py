"""Exact weight fingerprints and the replica vote.

Contract: every ``every_n_steps`` optimizer steps each replica digests its parameters (and,
optionally, buffers and optimizer state) on its own device and the replicas compare the digests.
Any single bit flip in any element of any compared tensor changes the fingerprint, whatever the
floating-point format (fp32, bf16, fp16, fp64, integer buffers).

How: a tensor's digest is the wrap-around (mod 2**64) sum of its bytes read as 64-bit integers
(32/16/8-bit words widened to int64 where the size does not allow 64). Flipping bit ``k`` of a
word changes the sum by ``+-2**k``, never 0 mod 2**64. Tensor digests are combined with distinct
odd weights, which keeps that property. Two or more flips can in principle cancel; a random fault
almost never does.

Cost: one read of every compared tensor per check (the memory-read limit, about the speed of a
plain ``sum``), one kernel per tensor, no host synchronisation while digesting. The common case
exchanges 16 bytes per rank in one MAX all-reduce, whatever the world size; the host reads the
result one training batch later, when the GPU has long finished it. Only on a mismatch are the
per-tensor digests gathered, to name the tensors and vote.

Limits: it sees faults that make replicas differ (weights, optimizer state, a bad update on one
rank). A fault in one rank's gradient is spread to every replica by the all-reduce and leaves the
replicas identical: the ring replay audit is the check for that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sdc_core.errors import FingerprintMismatchError
from sdc_core.stats import CheckStats
from sdc_core.topology import Topology, all_gather_tensor, collective_device, is_distributed

_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64  # odd, as a signed int64


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """Wrap-around int64 sum of ``t``'s bit pattern, as a 0-d tensor on ``t``'s device (no sync)."""
    with torch.no_grad():
        return _digest(t)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """``tensor_digest`` without the ``no_grad`` guard (the caller holds it): the hot loop."""
    try:  # fast path, the common case: one view, one reduction
        return t.view(-1).view(torch.int64).sum()
    except RuntimeError:  # non-contiguous, misaligned, or a size that is not a multiple of 8 bytes
        pass
    flat = t.contiguous().view(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if (flat.numel() * flat.element_size()) % torch.empty((), dtype=dtype).element_size():
            continue
        try:
            words = flat.view(dtype)
        except RuntimeError:  # misaligned storage offset: try a narrower word
            continue
        return words.sum() if dtype == torch.int64 else words.sum(dtype=torch.int64)
    raise TypeError(f"cannot digest a tensor of dtype {t.dtype}")  # pragma: no cover


def tensor_digests(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Digests of ``tensors`` as one int64 vector on ``device`` (default: the first tensor's)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    device = device or tensors[0].device
    with torch.no_grad():
        return torch.stack([_on(_digest(t), device) for t in tensors])


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


SMALL_TENSOR = 1 << 12  # elements: tensors below this are digested in groups


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-d copy of ``tensors`` (same dtype), made by a single C++ call: with many
    small tensors the per-tensor Python overhead, not bandwidth, is what costs."""
    with torch.no_grad():
        return torch._utils._flatten_dense_tensors(list(tensors)).detach()


def group_small(tensors: Sequence[torch.Tensor]) -> tuple[list[int], dict[tuple[torch.dtype, torch.device], list[int]]]:
    """Indices of the tensors to reduce one by one, and of the small ones (under
    ``SMALL_TENSOR`` elements) grouped per dtype and device, to reduce as one flattened copy."""
    large: list[int] = []
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() >= SMALL_TENSOR or t.dtype == torch.bool:
            large.append(i)
        else:
            groups.setdefault((t.dtype, t.device), []).append(i)
    return large, groups


def grouped_digests(
    tensors: Sequence[torch.Tensor], device: torch.device | None = None
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Digests for the fast path, and a function giving the per-tensor digests later.

    Large tensors are digested one by one. Small ones (under ``SMALL_TENSOR`` elements) are
    copied, per dtype and device, into one buffer (one ``cat`` kernel instead of a reduction per
    tensor: per-kernel overhead, not bandwidth, limits many small tensors) that is digested as a
    whole and kept, so ``per_tensor()`` can name the tensors on a mismatch without touching the
    weights again. Any single bit flip changes some returned digest. Memory: a copy of the small
    tensors only.
    """
    if not tensors:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, lambda: empty
    device = device or tensors[0].device
    large, groups = group_small(tensors)
    slots = [-1] * len(tensors)  # per tensor: its unit's index, or -1 when it sits in a group buffer
    with torch.no_grad():
        units = [_on(_digest(tensors[i]), device) for i in large]
    for unit, i in enumerate(large):
        slots[i] = unit
    buffers: list[torch.Tensor] = []
    places: dict[int, tuple[int, int, int]] = {}
    for (dtype, dev), members in groups.items():
        parts = [tensors[i] for i in members]
        start = 0
        for i, part in zip(members, parts, strict=True):
            places[i] = (len(buffers), start, part.numel())
            start += part.numel()
        size = torch.empty((), dtype=dtype).element_size()
        pad = (-start * size) % 8 // size
        if pad:
            parts.append(torch.zeros(pad, dtype=dtype, device=dev))
        buffers.append(flatten(parts))
        units.append(_on(tensor_digest(buffers[-1]), device))
    digests = torch.stack(units)

    def per_tensor() -> torch.Tensor:
        out = []
        for i, slot in enumerate(slots):
            if slot >= 0:
                out.append(digests[slot])
            else:
                b, start, n = places[i]
                out.append(_on(tensor_digest(buffers[b][start : start + n]), device))
        return torch.stack(out)

    return digests, per_tensor


def combine(digests: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint from a vector of tensor digests (distinct odd weights, wrap-around)."""
    n = digests.numel()
    weights = torch.arange(n, dtype=torch.int64, device=digests.device) * 2 + 1
    mixed = (digests * weights).sum() * _MULTIPLIER
    return mixed + n  # the count, so a missing tensor is never silent


@dataclass(frozen=True)
class FingerprintConfig:
    """Settings of the weight fingerprint check (validated on construction).

    Args:
        every_n_steps: compare after every n-th optimizer step (>= 1).
        include_buffers: also compare buffers, except BatchNorm running statistics, which
            differ per rank without SyncBatchNorm. Buffers a forward pass updates on each rank
            differ legitimately too: leave this off for such models.
        include_optimizer_state: also compare the optimizer state tensors (Adam moments, ...).
        on_failure: ``"raise"`` (default), or ``"heal"``: with a strict majority the differing
            replicas take the parameters, buffers and optimizer state of a majority rank by
            broadcast and training continues; without a majority, or after ``max_heals`` heals
            of the same rank, it raises.
        max_heals: heals allowed per rank before a mismatch on it raises (>= 1).
    """

    every_n_steps: int = 1
    include_buffers: bool = False
    include_optimizer_state: bool = False
    on_failure: str = "raise"
    max_heals: int = 3

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "heal", "rollback"):
            raise ValueError(f"on_failure must be 'raise', 'heal' or 'rollback', got {self.on_failure!r}")
        if isinstance(self.max_heals, bool) or not isinstance(self.max_heals, int) or self.max_heals < 1:
            raise ValueError(f"max_heals must be an integer >= 1, got {self.max_heals!r}")
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        for name in ("include_buffers", "include_optimizer_state"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


def fingerprinted_tensors(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], config: FingerprintConfig
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors the check compares, in an order identical on every replica."""
    named = [(f"param:{n}", p) for n, p in module.named_parameters()]
    if config.include_buffers:
        skip = set()
        for mname, m in module.named_modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and not isinstance(m, nn.SyncBatchNorm):
                skip.update(
                    f"{mname}.{b}" if mname else b for b in ("running_mean", "running_var", "num_batches_tracked")
                )
        named += [(f"buffer:{n}", b) for n, b in module.named_buffers() if n not in skip]
    if config.include_optimizer_state:
        names = {id(p): n for n, p in module.named_parameters()}
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in sorted(opt.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            named.append((f"optimizer{i}:{names.get(id(p), '?')}:{key}", value))
    return named


def copy_replica(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], src: int) -> None:
    """Make every replica equal to rank ``src``: broadcast parameters, buffers and optimizer state
    tensors in place (a collective: every rank calls it, with the same ``src``)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            torch.distributed.broadcast(t.data, src=src)
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p, {})
                    for key in sorted(state):
                        if isinstance(state[key], torch.Tensor):
                            torch.distributed.broadcast(state[key], src=src)


def vote(rows: list[tuple[int, ...]]) -> tuple[int | None, tuple[int, ...], int | None]:
    """Vote on per-rank digest rows.

    Returns ``(rank, suspects, reference)``: with a strict majority, the suspects are the ranks
    outside it, ``rank`` is the only one of them if there is exactly one, and ``reference`` is a
    majority rank. Without a strict majority (two replicas, or a tie) ``rank`` and ``reference``
    are None and every rank is a suspect.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row, []).append(r)
    biggest = max(groups.values(), key=len)
    if len(groups) == 1:
        return None, (), biggest[0]
    if 2 * len(biggest) > len(rows):
        suspects = tuple(r for r in range(len(rows)) if r not in biggest)
        return (suspects[0] if len(suspects) == 1 else None), suspects, biggest[0]
    return None, tuple(range(len(rows))), None


@dataclass
class _Pending:
    step: int
    per_tensor: Callable[[], torch.Tensor]
    module: nn.Module
    optimizers: list[torch.optim.Optimizer]
    names: list[str]
    reduced: torch.Tensor
    work: object | None


@dataclass
class WeightFingerprint:
    """Framework-neutral weight fingerprint check; adapters call ``start`` and ``resolve``."""

    config: FingerprintConfig = field(default_factory=FingerprintConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("weight_fingerprint"))
    topology: Topology | None = None
    last_error: FingerprintMismatchError | None = None
    heals: dict[int, int] = field(default_factory=dict)
    _pending: _Pending | None = None

    @property
    def active(self) -> bool:
        return is_distributed()

    def due(self, step: int) -> bool:
        """Whether the replicas are compared after optimizer step ``step`` (0-based): after every
        ``every_n_steps``-th update, i.e. steps n-1, 2n-1, ..."""
        return (step + 1) % self.config.every_n_steps == 0

    def start(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Digest the replica after optimizer step ``step`` and start the O(1) comparison.

        Resolves any earlier pending comparison first (it may raise).
        """
        self.resolve()
        t0 = time.perf_counter()
        named = fingerprinted_tensors(module, optimizers, self.config)
        device = collective_device()
        digests, per_tensor = grouped_digests([t for _, t in named], device=device)
        fp = combine(digests)
        reduced = torch.stack([fp, torch.bitwise_not(fp)])
        work = torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self._pending = _Pending(step, per_tensor, module, list(optimizers), [n for n, _ in named], reduced, work)
        self.stats.add_time(time.perf_counter() - t0)

    def resolve(self) -> None:
        """Read the pending comparison (every rank, same place); raise on a mismatch."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        pending.work.wait()  # type: ignore[union-attr]
        hi, not_lo = pending.reduced.tolist()
        self.stats.runs += 1
        if hi == ~not_lo:
            self.stats.last_verified_step = pending.step
            self.stats.add_time(time.perf_counter() - t0)
            return
        rows_t = all_gather_tensor(pending.per_tensor())
        rows = [tuple(r) for r in rows_t.tolist()]
        rank, suspects, reference = vote(rows)
        ref_row = rows[reference] if reference is not None else rows[0]
        differing = {
            r: [pending.names[i] for i, (a, b) in enumerate(zip(rows[r], ref_row, strict=True)) if a != b][:10]
            for r in range(len(rows))
            if rows[r] != ref_row
        }
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        topo = self.topology or Topology.gather()
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(row, []).append(r)
        details = {
            "groups": sorted(groups.values()),
            "reference_rank": reference,
            "differing_tensors": differing,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": len(rows),
        }
        if rank is not None:
            tensors = ", ".join(differing.get(rank, [])[:3])
            reason = f"its weights differ from the majority of {len(rows)} replicas in {tensors}"
        elif reference is not None:
            reason = f"{len(suspects)} replicas differ from the majority"
        else:
            reason = f"replicas split into {len(groups)} groups with no majority"
        heal = (
            self.config.on_failure == "heal"
            and reference is not None
            and all(self.heals.get(r, 0) < self.config.max_heals for r in suspects)
        )
        if heal:
            details["action"] = f"healed from rank {reference}"
            reason += f"; healed from majority rank {reference}"
        elif self.config.on_failure == "heal":
            details["action"] = "not healed: " + (
                "no strict majority" if reference is None else f"more than max_heals={self.config.max_heals} heals"
            )
        self.last_error = FingerprintMismatchError(
            step=pending.step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason
        )
        if not heal:
            raise self.last_error
        for r in suspects:
            self.heals[r] = self.heals.get(r, 0) + 1
        self.stats.bump("heals")
        copy_replica(pending.module, pending.optimizers, src=reference)

    def check_now(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Digest, compare and resolve at once (raises on a mismatch)."""
        self.start(step, module, optimizers)
        self.resolve()


__all__ = [
    "FingerprintConfig",
    "WeightFingerprint",
    "combine",
    "fingerprinted_tensors",
    "grouped_digests",
    "tensor_digest",
    "tensor_digests",
    "vote",
]
