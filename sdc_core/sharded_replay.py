"""Ring replay audit on sharded models (FSDP2, HSDP): every rank replays its partner's micro-batches.

Contract: on every ``every_n_steps``-th optimizer step, after backward and before the update,
every rank receives its ring partner's micro-batches (inputs, RNG state, loss and digests of its
LOCAL unsharded gradients, taken in the reduce-scatter tap) and all ranks replay together: one extra
forward and backward through the sharded model per micro-batch, each rank on its partner's batch.
The all-gathers are those of training; the replay's reduce-scatter is suppressed by the tap (it
digests its input, writes zeros, reduces nothing), and the real ``.grad``, buffers and RNG state are
put back afterwards, so training is bit-identical with the audit on and off. Owner and replayer
compare the loss and per-parameter-group digests (sum, norm, exact fingerprint) of the local
unsharded gradients; attribution as under DDP: a rank that disagrees as owner and as replayer is
the faulty one (persistent faults); a single disagreeing pair names both as suspects (the DDP
path's referee round is not run under sharding).

Cost on an audited step: one forward and backward per micro-batch (the all-gathers included, the
reduce-scatter not), the batch transfer, a digest per FSDP parameter group, one all-gather of
three float64 per rank. Other steps pay nothing. Memory: the partner's micro-batches.

Limits: every rank must replay: an exception inside one rank's replay leaves the others in FSDP's
all-gather until the process-group timeout (the DDP path, which replays without collectives, can
decide such failures together). The owner's reduce-scatter must run on every micro-batch, as
Lightning's ``ModelParallelStrategy`` does; with ``set_requires_gradient_sync(False)`` on
accumulation micro-batches the owner's digests cover their sum and the comparison fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.replay import (
    Digest,
    MicroBatch,
    ReplayConfig,
    StepFn,
    _digest_row,
    capture_rng,
    compare,
    explain,
    settle,
)
from sdc_core.sharded import GradientTapComm, fsdp_taps
from sdc_core.stats import CheckStats
from sdc_core.topology import (
    TRANSFER_ERROR,
    Topology,
    all_gather_objects,
    all_gather_tensor,
    exchange,
    is_distributed,
    owners_of,
)


def _digest(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], loss: float) -> Digest:
    zero64 = torch.zeros(0, dtype=torch.float64)
    if not rows:
        return Digest(float(loss), zero64, zero64, torch.zeros(0, dtype=torch.int64), zero64)
    return Digest(
        loss=float(loss),
        sums=torch.stack([r[0].cpu() for r in rows]),
        norms=torch.stack([r[1].cpu() for r in rows]),
        fps=torch.stack([r[2].cpu() for r in rows]),
        numels=torch.tensor([r[3] for r in rows], dtype=torch.float64),
    )


def _other_parallel_dims(module: nn.Module) -> list[str]:
    """Mesh dimensions (size > 1) of the parameters' root meshes that FSDP does not use."""
    from sdc_core.sharded import FSDPModule

    fsdp_meshes: list[Any] = []
    for m in module.modules():
        if FSDPModule is not None and isinstance(m, FSDPModule):
            fsdp_meshes += [pg.mesh_info.mesh for pg in m._get_fsdp_state()._fsdp_param_groups]
    fsdp_dims = {n for mesh in fsdp_meshes for n in (mesh.mesh_dim_names or ())}
    other: set[str] = set()
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if any(root is m or root == m for m in fsdp_meshes):
            continue  # FSDP's (or HSDP's) own mesh
        names = root.mesh_dim_names or tuple(f"dim {i}" for i in range(root.ndim))
        other.update(n for n, size in zip(names, root.shape, strict=True) if size > 1 and n not in fsdp_dims)
    return sorted(other)


@dataclass
class ShardedReplay:
    """``RingReplay`` for sharded models: the same adapter calls (``arm``, ``record``,
    ``record_loss``, ``audit``), with ``attach(module)`` tapping the FSDP reduce-scatters."""

    config: ReplayConfig = field(default_factory=ReplayConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("ring_replay"))
    topology: Topology | None = None
    last_error: ReplayMismatchError | None = None
    taps: list[GradientTapComm] = field(default_factory=list)
    _armed_step: int | None = None
    _micro: list[MicroBatch] = field(default_factory=list)
    _loss: float = 0.0
    _local: list[tuple[Any, ...]] = field(default_factory=list)
    _labels: list[str] = field(default_factory=list)
    _replayed: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return is_distributed()

    def attach(self, module: nn.Module) -> None:
        """Tap the FSDP reduce-scatters. Raises ``ValueError`` under tensor (or any non-FSDP)
        parallelism: its peers must compute the same batch together, which a ring of partners
        replaying different batches breaks."""
        other = _other_parallel_dims(module)
        if other:
            raise ValueError(
                f"RingReplayAudit on a sharded model supports FSDP and HSDP, not tensor parallelism (mesh dimensions "
                f"{other}): tensor-parallel peers must replay the same batch together. NonFiniteGradientCheck and "
                "WeightFingerprintCheck support it (Accelerate: set replay_every_n_steps=0)."
            )
        self.taps = fsdp_taps(module)
        for tap in self.taps:
            tap.consumers.append(self._consume)
            tap.replay_consumers.append(self._consume_replay)

    def arm(self, step: int) -> bool:
        due = self.active and step % self.config.every_n_steps == 0
        if not due:
            self._armed_step = None
            return False
        if self._armed_step != step:
            self._armed_step, self._micro, self._loss, self._local, self._labels = step, [], 0.0, [], []
        return True

    @property
    def armed(self) -> bool:
        return self._armed_step is not None

    @property
    def recorded(self) -> int:
        return len(self._micro)

    def record(self, batch: Any, batch_idx: int, device: torch.device | None = None) -> None:
        cpu, cuda = capture_rng(device)
        self._micro.append(MicroBatch(batch, batch_idx, cpu, cuda))

    def record_loss(self, loss: torch.Tensor) -> None:
        if self._armed_step is not None:
            self._loss += float(loss.detach().double())

    def _consume(self, flat: torch.Tensor, names: list[str]) -> None:
        if self._armed_step is not None:
            self._local.append(_digest_row(flat))
            self._labels.append(names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1})")

    def _consume_replay(self, flat: torch.Tensor, names: list[str]) -> None:
        self._replayed.append(_digest_row(flat))

    def _replay(self, module: nn.Module, micro: list[MicroBatch], step_fn: StepFn, to_device: Callable[[Any], Any],
                context: Callable[[], AbstractContextManager[Any]]) -> Digest:  # fmt: skip
        """Forward and backward of ``micro`` through the sharded model, no side effect."""
        params = list(module.parameters())
        grads = [p.grad for p in params]
        buffers = [(b, b.clone()) for b in module.buffers()]
        device = next((p.device for p in params), torch.device("cpu"))
        saved_cpu, saved_cuda = capture_rng(device)
        self._replayed = []
        loss_total = 0.0
        for tap in self.taps:
            tap.replaying = True
        try:
            for p in params:
                p.grad = None
            for mb in micro:
                torch.set_rng_state(mb.cpu_rng.clone())
                if mb.cuda_rng is not None and device.type == "cuda":
                    torch.cuda.set_rng_state(mb.cuda_rng.clone(), device)
                with context():
                    loss = step_fn(to_device(mb.batch), mb.batch_idx)
                loss.backward()
                loss_total += float(loss.detach().double())
        finally:
            for tap in self.taps:
                tap.replaying = False
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda, device)
        rows, self._replayed = self._replayed, []
        return _digest(rows, loss_total)

    def audit(self, step: int, module: nn.Module, step_fn: StepFn, to_device: Callable[[Any], Any] = lambda b: b,
              context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> bool:  # fmt: skip
        """Run the audit of ``step`` if it was armed (every rank alike); raise on a verdict."""
        if self._armed_step != step:
            return False
        t0 = time.perf_counter()
        topo = self.topology or Topology.gather()
        world, me = topo.world_size, topo.rank
        partners = topo.partners()
        inverse = owners_of(partners)
        own, labels = _digest(self._local, self._loss), list(self._labels)
        micro, self._micro, self._armed_step = self._micro, [], None
        received = exchange({partners[me]: {"micro": micro, "digest": own, "labels": labels}}, [inverse[me]])
        received = received[inverse[me]]
        bad = torch.tensor([float(TRANSFER_ERROR in received)], dtype=torch.float64)  # decided before any all-gather
        if any(all_gather_tensor(bad).flatten().tolist()):
            raise ReplayUnavailableError(f"RingReplayAudit could not send the micro-batches of step {step} "
                                         "(they must be picklable)")  # fmt: skip
        mine = self._replay(module, received["micro"], step_fn, to_device, context)
        mismatch, diff, where = compare(received["digest"], mine, self.config, received["labels"] or ["loss"])
        row = torch.tensor([float(mismatch), diff, 0.0], dtype=torch.float64)
        table = all_gather_tensor(row).tolist()
        self.stats.runs += 1
        self.stats.max_diff = max(self.stats.max_diff, max(d for _, d, _ in table))
        pairs = [(inverse[q], q) for q, (m, _, _) in enumerate(table) if m]
        if not pairs:
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return False
        wheres = all_gather_objects(where if mismatch else "")  # rare path: the same words on every rank
        where = next(w for (_, q), w in zip(pairs, [wheres[q] for _, q in pairs], strict=True) if w) or where
        culprits, disputed = explain(world, partners, pairs)
        rank, suspects, notes = settle(world, culprits, disputed, {})
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        details = {
            "pairs": [{"owner": o, "replayer": q, "difference": table[q][1], "where": wheres[q]} for o, q in pairs],
            "rulings": notes,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": world,
            "sharded": True,
        }
        if rank is not None:
            reason = "its results disagree with its partners' replays and its replay of another rank disagrees too"
        else:
            reason = "owner and replayer disagree and no third replay settled it under sharding"
        reason += f" (largest difference {max(d for _, d, _ in table):.3g} in {where})"
        self.last_error = ReplayMismatchError(step=step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects),
                                              details=details, reason=reason)  # fmt: skip
        raise self.last_error


__all__ = ["ShardedReplay"]
