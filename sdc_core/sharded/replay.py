"""Ring replay audit on sharded models (FSDP2, HSDP, + tensor parallel): as ``RingReplay``, with the owner's digests
taken of its LOCAL unsharded gradients in the reduce-scatter tap, and all ranks replaying together in every round (the
replay's reduce-scatter is suppressed by the tap). Under tensor parallelism the ring runs over the data-parallel groups;
a referee is a whole third group.

Cost on an audited step: one forward and backward per micro-batch (twice at the first audit), the transfer, a digest per
FSDP parameter group, the state clones, two small all-gathers. Limits: an exception inside one rank's replay after its
first collective leaves the others in FSDP's all-gather until the process-group timeout. Gradient sync off on
accumulation micro-batches (``set_requires_gradient_sync(False)``, as Accelerate does) is replayed the same way: a later
micro-batch's reduce-scatter digests their sum."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from sdc_core.replay.compare import Digest, Row, assemble, digest_row
from sdc_core.replay.ring import RingReplay
from sdc_core.replay.rng import all_rng, set_rng
from sdc_core.replay.state import MicroBatch, Rerun, StateCapture
from sdc_core.sharded.checks import group_label, local
from sdc_core.sharded.tap import GradientTapComm, drop_unreduced_grads, fsdp_param_groups, fsdp_taps, set_gradient_sync


def _other_parallel_meshes(module: nn.Module) -> list[tuple[Any, tuple[str, ...], list[int]]]:
    """``(root mesh, dimension names, dimensions of size > 1 FSDP does not use)`` per distinct root mesh with any."""
    fsdp_meshes = [pg.mesh_info.mesh for pg in fsdp_param_groups(module)]
    fsdp_dims = {n for mesh in fsdp_meshes for n in (mesh.mesh_dim_names or ())}
    found: list[tuple[Any, tuple[str, ...], list[int]]] = []
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if any(root is m or root == m for m in fsdp_meshes):
            continue  # FSDP's (or HSDP's) own mesh
        names = tuple(root.mesh_dim_names or (f"dim {i}" for i in range(root.ndim)))
        dims = [i for i, (n, size) in enumerate(zip(names, root.shape, strict=True)) if size > 1 and n not in fsdp_dims]
        if dims and not any(root is r or root == r for r, _, _ in found):
            found.append((root, names, dims))
    return found


def tensor_parallel_groups(module: nn.Module, world: int) -> list[tuple[int, ...]] | None:
    """The ranks computing each batch together, per data-parallel index, in tensor-parallel order; None without
    tensor parallelism; ``ValueError`` for several such meshes or one not holding every rank exactly once."""
    meshes = _other_parallel_meshes(module)
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError(
            "The ring replay audit on a sharded model supports one tensor-parallel device mesh; the parameters use "
            f"{len(meshes)} ({[names for _, names, _ in meshes]})")
    root, names, dims = meshes[0]
    ranks = root.mesh.detach().cpu()
    if sorted(ranks.flatten().tolist()) != list(range(world)):
        raise ValueError(
            f"The ring replay audit on a sharded model needs the tensor-parallel device mesh {names} to hold every "
            f"one of the {world} ranks once (its ranks: {ranks.flatten().tolist()})")
    rest = [i for i in range(ranks.ndim) if i not in dims]
    table = ranks.permute(*rest, *dims).reshape(-1, math.prod(ranks.shape[i] for i in dims))
    return [tuple(int(r) for r in row) for row in table.tolist()]


def screenable(module: nn.Module, taps: list[Any]) -> bool:
    """Whether the every-step screen runs on this sharded model: some group is tapped and there is no tensor
    parallelism (its ranks hold different slices of each gradient). Alike on every rank."""
    if not taps:
        return False
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        return tensor_parallel_groups(module, world) is None
    except ValueError:  # a layout the replay cannot read either
        return False


@dataclass
class ShardedReplay(RingReplay):
    """``RingReplay`` for sharded models, with ``attach(module, ...)`` tapping the FSDP reduce-scatters."""

    taps: list[GradientTapComm] = field(default_factory=list)
    collective_reruns: bool = True
    _labels: list[str] = field(default_factory=list)
    _replayed: list[tuple[Row, str]] = field(default_factory=list)
    _frozen: list[torch.Tensor] = field(default_factory=list)  # sharded parameters that do not train
    _frozen_at: dict[int, list[torch.Tensor] | None] = field(default_factory=dict)  # per own micro-batch
    _on_replay: Callable[[torch.Tensor, list[str]], None] | None = None  # the screen's recompute: each flat
    _calls_step: int | None = None  # the step whose own reduce-scatters ``_calls`` counts, per tap
    _calls: list[int] = field(default_factory=list)
    _kept_versions: list[int] | None = None  # the frozen shards' versions when the kept step began

    def attach(  # type: ignore[override]
        self,
        module: nn.Module,
        exclude: Iterable[str] = (),
        get_state: Callable[[], Any] | None = None,
        load_state: Callable[[Any], None] | None = None,
    ) -> None:
        """Tap the FSDP reduce-scatters and capture ``module``'s state (``StateCapture``'s arguments); ``ValueError``
        for a layout that cannot be read (``tensor_parallel_groups``)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.groups = tensor_parallel_groups(module, world)
        self.taps = fsdp_taps(module)
        self._calls = [0] * len(self.taps)
        for i, tap in enumerate(self.taps):
            tap.consumers.append(self._consume_shard)
            tap.consumers.append(lambda flat, names, i=i: self._count(i))
            tap.replay_consumers.append(self._consume_replay)
        # every parameter counts as trained: sharded ones are the replayer's own shards, all-gathered
        # (replicated by definition), so only buffers and attributes travel
        self.capture = StateCapture(module, [n for n, _ in module.named_parameters()], exclude, get_state,
                                    load_state, self.config.max_state_mb)  # fmt: skip
        self._frozen = [p for p in module.parameters() if not p.requires_grad and local(p) is not p]

    def begin(self, device: torch.device | None = None, rng: bool = True) -> None:
        """As ``RingReplay.begin``; also copies this rank's shards of frozen sharded parameters (they cannot
        travel) within ``max_state_mb``; past it they are read live and guarded against change."""
        super().begin(device, rng)
        if (micro := self.recording) and not self.replaying:
            micro[-1].reduced = not self.taps  # until its backward's reduce-scatter (``_count``)
        if self.keeping and len(self.kept.batches) == 1 and not self.replaying:  # a kept step's first micro-batch
            self._kept_versions = [local(p)._version for p in self._frozen]
        if self._armed_step is None or not self._micro or self.replaying or not self._frozen:
            return
        index = len(self._micro) - 1
        if index == 0:
            self._frozen_at = {}
        used = sum(m.state.nbytes for m in self._micro if m.state is not None)
        used += sum(t.numel() * t.element_size() for c in self._frozen_at.values() if c for t in c)
        shards = [local(p).detach() for p in self._frozen]
        size = sum(t.numel() * t.element_size() for t in shards)
        fits = self.capture is None or used + size <= self.capture.max_bytes
        self._frozen_at[index] = [t.clone() for t in shards] if fits else None

    def _consume_shard(self, flat: torch.Tensor, names: list[str]) -> None:
        if self._armed_step is None or self.replaying:
            return
        if not self._local:
            self._labels = []
        self._local[str(len(self._local))] = digest_row(flat)
        self._labels.append(group_label(names))

    def arm(self, step: int) -> bool:
        """As ``RingReplay.arm``; also starts counting the step's own reduce-scatters per tap."""
        if step != self._calls_step and not self.replaying:
            self._calls_step, self._calls = step, [0] * len(self.taps)
        return super().arm(step)

    def _count(self, i: int) -> None:
        self._calls[i] += 1
        if micro := self.recording:
            micro[-1].reduced = True

    def _consume_replay(self, flat: torch.Tensor, names: list[str]) -> None:
        if self._on_replay is not None:
            self._on_replay(flat, names)
            return
        self._replayed.append((digest_row(flat), group_label(names)))

    def screen_ready(self, batches: list[MicroBatch]) -> str:
        """Why this rank cannot recompute a kept step's ``batches`` for the screen's confirmation, or ``""``.
        Host state only; the caller agrees on the answer with every rank before anyone replays."""
        if not batches:
            return "no micro-batches kept"
        if why := self._unread(batches):
            return why
        if self._frozen and self._kept_versions != [local(p)._version for p in self._frozen]:
            return "frozen sharded parameters changed in place during the step"
        return ""

    def recompute(self, rerun: Rerun, batches: list[MicroBatch], consume: Callable[[str, torch.Tensor], None]
                  ) -> torch.Tensor:  # fmt: skip
        """Recompute ``batches`` (a collective: every rank), handing each FSDP parameter group's flat LOCAL gradient
        of each micro-batch to ``consume(first parameter name, flat)``; frozen sharded parameters are read live."""
        self._on_replay = lambda flat, names: consume(names[0] if names else "?", flat)
        try:
            return self._rerun(rerun, batches, copies=False)
        finally:
            self._on_replay = None

    def _named(self, labels: list[str]) -> None:
        if len(labels) > len(self.names):  # the labels "where" reports (the same on every rank: SPMD)
            self.names = list(labels)

    def _unread(self, batches: list[MicroBatch]) -> str:
        """Why the tapped reduce-scatters do not hold ``batches``' gradients (each group once per micro-batch with
        gradient sync on, the last one's included), or ``""``."""
        ran, synced = max(self._calls, default=0), sum(mb.reduced for mb in batches)
        if self.taps and (ran != synced or not batches[-1].reduced):
            return (f"the reduce-scatters ran {ran} times for {len(batches)} micro-batches, {synced} with gradient "
                    "sync on" + ("" if batches[-1].reduced else ", but not the last (gradient sync off at the update)"))
        return ""

    def _own_digest(self) -> Digest:
        self._named(self._labels)
        if why := self._micro and self._unread(self._micro):
            self._capture_error = self._capture_error or f"reading its gradients: {why}"
        return assemble(list(self._local), self._local, self._loss if self._loss is not None else 0.0)

    def _replay_digest(self, rerun: Rerun, batches: list[MicroBatch]) -> Digest:
        """Replay ``batches`` through the sharded model and digest each group's gradient (collective: every rank)."""
        self._replayed = []
        loss_total = self._rerun(rerun, batches)
        replayed, self._replayed = self._replayed, []
        self._named([label for _, label in replayed])
        rows = {str(i): row for i, (row, _) in enumerate(replayed)}
        return assemble(list(rows), rows, loss_total)

    def _rerun(self, rerun: Rerun, batches: list[MicroBatch], copies: bool = True) -> torch.Tensor:
        """The replays of ``batches``; ``copies``: frozen shards from this rank's micro-batch copies (else read
        live). Returns the summed loss, float64 on the device."""
        module = rerun.module
        params = list(module.parameters())
        grads = [p.grad for p in params]
        device = next((p.device for p in params), torch.device("cpu"))
        capture = self.capture or StateCapture(module, [n for n, _ in module.named_parameters()], max_state_mb=0)
        saved_rng = all_rng(device)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)
        frozen = [local(p) for p in self._frozen]
        copies = [self._frozen_at.get(i) for i in range(len(batches))] if frozen and copies else []
        copies = copies if all(c is not None for c in copies) else []  # past the budget: read live, guarded
        versions = [t._version for t in frozen]
        saved = [t.detach().clone() for t in frozen] if copies else []
        mirror = not all(mb.reduced for mb in batches)  # the owner's gradient sync, micro-batch by micro-batch
        self.replaying = True
        for tap in self.taps:
            tap.replaying = True
        try:
            for p in params:
                p.grad = None
            for i, mb in enumerate(batches):
                if mirror:
                    set_gradient_sync(module, mb.reduced)
                with torch.no_grad():
                    for t, copy in zip(frozen, copies[i] if copies else [], strict=True):
                        t.copy_(copy)
                set_rng(mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng, device)
                batch = rerun.to_device(mb.batch)
                with capture.applied(mb.state) as tensors, _reparametrize_module(module, tensors, tie_weights=True):
                    with rerun.context():
                        loss = rerun.step_fn(batch, mb.batch_idx)
                    loss.backward()
                loss_total = loss_total + loss.detach().to(device, torch.float64)
        finally:
            if mirror:  # the sum of micro-batches whose last did not run stays with FSDP: dropped
                set_gradient_sync(module, True)
                drop_unreduced_grads(module)
            for tap in self.taps:
                tap.replaying = False
            self.replaying = False
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            set_rng(*saved_rng, device)
            guarded = [i for i, (t, v) in enumerate(zip(frozen, versions, strict=True)) if t._version != v]
            with torch.no_grad():
                for t, copy in zip(frozen, saved, strict=True):
                    t.copy_(copy)
        if guarded and not saved:
            names = {id(p): n for n, p in module.named_parameters()}
            raise RuntimeError(
                f"the replay changed the frozen sharded parameters {[names.get(id(self._frozen[i])) for i in guarded]} "
                f"in place, which the capture could not copy (over max_state_mb={self.config.max_state_mb:g}): "
                "raise max_state_mb")
        return loss_total


__all__ = ["ShardedReplay", "screenable"]
