"""Update audit for shards without replicas (pure FSDP): a partner recomputes a rank's update from its snapshot (shards,
reduced gradients, optimizer state) and compares the digests bit for bit; attribution as in the ring replay. Every
received payload is checked (``check_update_payload``).

Cost on an audited step (S: a rank's shard bytes, k: optimizer state tensors per parameter): a copy of (2 + k) * S
bytes, as many sent and received, one extra optimizer step on a shard, two digests. Limits: the partner must compute
like the owner (same device type and torch build); optimizers with a closure or cross-parameter state (LBFGS) are not
recomputed faithfully."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from sdc_core.checks.contract import Role
from sdc_core.checks.digest import tensor_digest
from sdc_core.dist.payload_checks import check_update_payload
from sdc_core.dist.topology import (
    TRANSFER_ERROR,
    Topology,
    all_gather_objects,
    all_gather_tensor,
    exchange,
    is_distributed,
    owners_of,
)
from sdc_core.errors import FingerprintMismatchError, ReplayUnavailableError
from sdc_core.replay.attribution import describe, explain, pick_referee, settle
from sdc_core.schema import setting
from sdc_core.sharded.checks import local
from sdc_core.stats import CheckStats


def _snapshot(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """Copies of the local shards, gradients and state, per parameter group, just before a step."""
    groups = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            items = []
            for p in group["params"]:
                state = {k: (local(v).detach().clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in optimizer.state.get(p, {}).items()}  # fmt: skip
                grad = local(p.grad).detach().clone() if p.grad is not None else None
                items.append({"name": names.get(id(p), "?"), "param": local(p).detach().clone(), "grad": grad,
                              "state": state})  # fmt: skip
            groups.append({"hyper": {k: v for k, v in group.items() if k != "params"}, "items": items})
    return groups


def recompute(kind: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> list[int]:
    """The digests of the shards after one step of a fresh ``kind`` optimizer on the snapshot."""
    params, param_groups = [], []
    for g in groups:
        ps = []
        for item in g["items"]:
            p = item["param"].clone()
            p.grad = item["grad"].clone() if item["grad"] is not None else None
            ps.append(p)
            params.append((p, item["state"]))
        param_groups.append({"params": ps, **g["hyper"]})
    opt = kind(param_groups)
    for p, state in params:
        if state:
            opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    with torch.no_grad():
        opt.step()
    return [int(tensor_digest(p)) for p, _ in params]


@dataclass(kw_only=True)
class UpdateAudit:
    """Partner recomputation of each rank's optimizer update on its shard. Adapters call ``attach`` once,
    ``before_update`` right before the update and ``audit(step)`` after it, on every rank."""

    role: ClassVar[Role] = Role.UPDATE_AUDIT

    every_n_steps: int = setting(1, "FSDP2: a partner recomputes each rank's optimizer update every n steps (>= 1)")
    stats: CheckStats = field(default_factory=lambda: CheckStats("update_audit"))
    topology: Topology | None = None
    last_error: FingerprintMismatchError | None = None
    _kind: type | None = None
    _names: dict[int, str] = field(default_factory=dict)
    _armed: int | None = None
    _snap: list[dict[str, Any]] | None = None
    _after: list[int] | None = None

    def __post_init__(self) -> None:
        n = self.every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"update_audit_every_n_steps must be an integer >= 0 (0: off), got {n!r}")

    @property
    def config(self) -> dict[str, Any]:
        """The settings an incident report records."""
        return {"update_audit_every_n_steps": self.every_n_steps}

    def attach(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> Any:
        """Watch ``optimizer``'s updates of ``module``'s parameters; returns the removable post-step hook."""
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        self._kind = type(inner)
        self._names = {id(p): n for n, p in module.named_parameters()}

        def after(opt: torch.optim.Optimizer, *_: Any) -> None:
            if self._snap is not None and self._after is None:
                live = [p for g in opt.param_groups for p in g["params"]]
                items = [item for g in self._snap for item in g["items"]]
                for p, item in zip(live, items, strict=True):
                    if p.grad is None:  # dropped after the snapshot (e.g. a skipped step): no update
                        item["grad"] = None
                self._after = [int(tensor_digest(local(p))) for p in live]

        return inner.register_step_post_hook(after)

    def before_update(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """Snapshot the shards if ``step`` is audited (a step the optimizer skips is audited as a no-op)."""
        self._armed = step if is_distributed() and step % self.every_n_steps == 0 else None
        self._snap = self._after = None
        if self._armed is not None:
            self._snap = _snapshot(getattr(optimizer, "optimizer", optimizer), self._names)

    def audit(self, step: int) -> None:
        """Exchange and recompute the armed step's updates (every rank alike); raise on a verdict."""
        if self._armed != step:
            return
        t0 = time.perf_counter()
        snap, after, self._armed, self._snap, self._after = self._snap, self._after, None, None, None
        topo = self.topology or Topology.gather()
        world, me = topo.world_size, topo.rank
        partners = topo.partners()
        inverse = owners_of(partners)
        payload = {"groups": snap, "after": after} if snap is not None and after is not None else {"skipped": True}
        received = exchange({partners[me]: payload}, [inverse[me]], validate=check_update_payload)[inverse[me]]
        failure, names, mine = "", [], None
        try:
            if TRANSFER_ERROR in received:
                raise RuntimeError(received[TRANSFER_ERROR])
            if "skipped" not in received:
                assert self._kind is not None
                mine = recompute(self._kind, received["groups"])
                owner_names = [i["name"] for g in received["groups"] for i in g["items"]]
                names = [n for n, a, b in zip(owner_names, mine, received["after"], strict=True) if a != b]
        except Exception as err:  # decided together below
            failure = describe(err)
        row = torch.tensor([float(bool(names)), float(bool(failure))], dtype=torch.float64)
        table = all_gather_tensor(row).tolist()
        self.stats.runs += 1
        if any(f for _, f in table):
            failures = all_gather_objects(failure)
            why = "; ".join(f"rank {r}: {f}" for r, f in enumerate(failures) if f)
            raise ReplayUnavailableError(f"update audit could not recompute step {step}: {why}")
        pairs = [(inverse[q], q) for q, (m, _) in enumerate(table) if m]
        if not pairs:
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return
        where = all_gather_objects((names[:5], mine))  # rare path: names and recomputed digests
        culprits, disputed = explain(world, partners, pairs)
        rulings = self._referee(disputed, payload, [m for _, m in where], topo)
        where = [w for w, _ in where]
        rank, suspects, notes = settle(world, culprits, disputed, rulings)
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        details = {
            "update_audit": [{"owner": o, "recomputed_by": q, "tensors": where[q]} for o, q in pairs],
            "rulings": notes,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": world,
            "sharded": True,
        }
        if rank is not None and rank in culprits:
            reason = ("its optimizer update of its shard disagrees with a partner's recomputation, and its "
                      "recomputation of another rank's update disagrees too")  # fmt: skip
        elif rank is not None:
            reason = "its optimizer update of its shard disagrees with two other ranks' recomputations"
        else:
            reason = "an optimizer update and its recomputation by a partner disagree"
        first = next(w for w in where if w)
        reason += f" (in {', '.join(first[:3])})"
        self.last_error = FingerprintMismatchError(step=step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects),
                                                   details=details, reason=reason)  # fmt: skip
        raise self.last_error

    def _referee(self, disputed: list[tuple[int, int]], payload: dict[str, Any], recomputed: list[Any],
                 topo: Topology) -> dict[tuple[int, int], tuple[bool, bool]]:  # fmt: skip
        """A third rank recomputes each disputed owner's update: ``{pair: (agrees with owner, with replayer)}``."""
        world, me = topo.world_size, topo.rank
        node_of = [f.node_rank for f in topo.ranks]
        busy = {r for pair in disputed for r in pair}
        referees = {pair: pick_referee(pair[0], pair[1], world, node_of, busy) for pair in disputed}
        sends = {ref: payload for (o, _), ref in referees.items() if o == me and ref is not None}
        recv = [o for (o, _), ref in referees.items() if ref == me]
        got = exchange(sends, recv, validate=check_update_payload)
        verdicts: dict[int, tuple[bool, bool]] = {}
        for (o, q), ref in referees.items():
            if ref == me and "skipped" not in got[o] and TRANSFER_ERROR not in got[o]:
                assert self._kind is not None
                mine = recompute(self._kind, got[o]["groups"])
                verdicts[o] = (mine == got[o]["after"], mine == recomputed[q])
        return {next(p for p in disputed if p[0] == o): verdict  # the pair each referee judged
                for theirs in all_gather_objects(verdicts) for o, verdict in theirs.items()}  # fmt: skip


def update_audit(every_n_steps: int) -> UpdateAudit | None:
    """The update audit at ``update_audit_every_n_steps``: None for 0 (off); else ``ValueError`` if invalid."""
    if isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool) and every_n_steps == 0:
        return None
    return UpdateAudit(every_n_steps=every_n_steps)


__all__ = ["UpdateAudit", "recompute", "update_audit"]
