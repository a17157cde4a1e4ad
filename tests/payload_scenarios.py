"""Hostile peers on 3 real gloo ranks (torchrun): a rank that sends a pickle that runs code, bytes
that are no payload, or a size it does not keep. Every rank must raise the same typed error
within a bounded time and no code may run. Each scenario writes, per rank, what it raised and
how long it took."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import main_for
from torch import nn

import sdc_core.dist.payload as payload
import sdc_core.dist.topology as topology
import sdc_core.sharded.update_audit as sharded_update
from sdc_core.dist.payload_checks import check_replay_payload
from sdc_core.dist.topology import Topology, all_gather_objects, exchange
from sdc_core.replay.compare import Digest
from sdc_core.replay.state import MicroBatch

HOSTILE = 1  # the rank that misbehaves in each scenario
WORLD = 3
MARKER = "ran_code"  # a file unpickling creates: the stand-in for code run on a partner


class Evil:
    """Unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def digest(n: int = 3) -> Digest:
    z = torch.zeros(n, dtype=torch.float64)
    return Digest(0.5, z, z.clone(), torch.arange(n, dtype=torch.int64), torch.ones(n, dtype=torch.float64))


def replay_payload(rank: int) -> dict[str, Any]:
    batch = {"x": torch.full((2, 3), float(rank)), "y": (torch.tensor([rank]), "text", [1.5, None])}
    micro = MicroBatch(batch=batch, batch_idx=rank, cpu_rng=torch.get_rng_state())
    return {"micro": [micro], "digest": digest()}


def ring(value: Callable[[int], Any], **kw: Any) -> dict[int, Any]:
    me = dist.get_rank()
    return exchange({(me + 1) % WORLD: value(me)}, [(me - 1) % WORLD], **kw)


def outcome(body: Callable[[], Any], out: Path) -> dict[str, Any]:
    """What ``body`` raised (type and message) or returned, how long it took, and whether code ran."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        result, error, message = body(), None, ""
    except Exception as err:
        result, error, message = None, type(err).__name__, str(err)
    seconds = time.monotonic() - t0
    dist.barrier()
    ran = (out / MARKER).exists()
    dist.barrier()
    if dist.get_rank() == 0 and ran:
        (out / MARKER).unlink()
    return {"error": error, "message": message, "seconds": seconds, "ran_code": ran, "result": result}


def patched(module: Any, name: str, make: Callable[[Any], Any]) -> Any:
    """``module.name`` replaced on the hostile rank only (the real one is given to ``make``)."""
    original = getattr(module, name)
    if dist.get_rank() == HOSTILE:
        setattr(module, name, make(original))
    return original


def restore(module: Any, name: str, original: Any) -> None:
    setattr(module, name, original)


# -- scenarios ----------------------------------------------------------------------------------


def clean(out: Path) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        got = ring(replay_payload, validate=check_replay_payload)
        ((src, received),) = got.items()
        mb = received["micro"][0]
        gathered = all_gather_objects(({(dist.get_rank(), 1): (True, False)}, f"rank {dist.get_rank()}"))
        topo = Topology.gather()
        return {
            "src": src, "x": mb.batch["x"].tolist(), "y": mb.batch["y"][0].tolist(), "rest": mb.batch["y"][1:],
            "idx": mb.batch_idx, "rng_same": torch.equal(mb.cpu_rng, torch.get_rng_state()),
            "digest_fps": received["digest"].fps.tolist(), "gathered": [[list(d.items()), s] for d, s in gathered],
            "ranks": [f.rank for f in topo.ranks],
        }  # fmt: skip

    return outcome(body, out)


def unencodable(out: Path) -> dict[str, Any]:
    """An honest rank whose batch would need pickling: the partner gets a transfer error text."""
    return outcome(lambda: {s: v for s, v in ring(lambda r: {"micro": [Evil(out / MARKER)]} if r == HOSTILE
                                                    else replay_payload(r)).items()}, out)  # fmt: skip


def malicious_pickle(out: Path) -> dict[str, Any]:
    """The hostile rank sends a pickle that runs code (its encoder forced to pickle)."""
    original = patched(payload, "encode", lambda enc: lambda obj, allow_pickle=False, where="payload": enc(
        obj, allow_pickle=True, where=where))  # fmt: skip
    topology.encode = payload.encode
    try:
        return outcome(lambda: ring(lambda r: {"micro": [Evil(out / MARKER)], "digest": digest()}), out)
    finally:
        restore(payload, "encode", original)
        topology.encode = original


def foreign_bytes(out: Path) -> dict[str, Any]:
    """The hostile rank sends a torch.save pickle (what the exchange used to send) that runs code."""

    def evil(_: Any) -> Any:
        def outgoing(obj: Any, allow_pickle: bool, limit: int) -> torch.Tensor:
            buf = io.BytesIO()
            torch.save({"micro": [Evil(out / MARKER)]}, buf)
            return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

        return outgoing

    original = patched(topology, "_outgoing", evil)
    try:
        return outcome(lambda: ring(replay_payload), out)
    finally:
        restore(topology, "_outgoing", original)


def _inflate(size: Callable[[int], int]) -> Callable[[Any], Any]:
    """A collective wrapper on the hostile rank that announces ``size(true size)`` for what it
    sends: in the size row of ``exchange`` (an all-gather of 2W+1 integers) and in the one-integer
    size message of a point-to-point protocol."""

    def wrap(real: Any) -> Any:
        def fake(*args: Any, **kwargs: Any) -> Any:
            t = args[1] if real.__name__ == "all_gather" else args[0]
            if isinstance(t, torch.Tensor) and t.dtype == torch.int64:
                if t.numel() == 2 * WORLD + 1:  # exchange's plan: sizes to each rank first
                    t[:WORLD] = torch.where(t[:WORLD] > 0, torch.tensor([size(int(v)) for v in t[:WORLD]]), t[:WORLD])
                elif t.numel() == 3 or (t.numel() == 1 and t.item() > 0):  # all_gather_objects: (size, limit, ok)
                    t[0] = size(int(t[0]))
            return real(*args, **kwargs)

        fake.__name__ = real.__name__
        return fake

    return wrap


def lying(size: Callable[[int], int], body: Callable[[], Any], out: Path) -> dict[str, Any]:
    originals = [(dist, name, patched(dist, name, _inflate(size))) for name in ("all_gather", "isend", "send")]
    try:
        return outcome(body, out)
    finally:
        for module, name, original in originals:
            restore(module, name, original)


def huge_size(out: Path) -> dict[str, Any]:
    return lying(lambda n: 1 << 50, lambda: ring(replay_payload), out)


def short_size(out: Path) -> dict[str, Any]:
    """Announces fewer bytes than it sends (within the limit)."""
    return lying(lambda n: max(1, n // 3), lambda: ring(replay_payload), out)


def gather_huge_size(out: Path) -> dict[str, Any]:
    return lying(lambda n: 1 << 50, lambda: all_gather_objects(f"rank {dist.get_rank()}"), out)


def gather_pickle(out: Path) -> dict[str, Any]:
    """The hostile rank gathers an object that runs code when unpickled."""
    return outcome(lambda: all_gather_objects(Evil(out / MARKER) if dist.get_rank() == HOSTILE else "fine"), out)


def bad_shape(out: Path) -> dict[str, Any]:
    """A well formed payload of the wrong shape (no digest): refused by ``validate`` everywhere."""
    return outcome(lambda: ring(lambda r: {"micro": []} if r == HOSTILE else replay_payload(r),
                                validate=check_replay_payload), out)  # fmt: skip


def over_limit(out: Path) -> dict[str, Any]:
    """An honest payload over the limit travels as a transfer error, not as a hang or a crash."""
    big = {"x": torch.zeros(4096)}
    return outcome(lambda: {s: sorted(v) for s, v in ring(lambda r: big, max_bytes=8192).items()}, out)


def _update_audit_steps(steps: int) -> dict[str, Any]:
    """``steps`` Adam steps of one replica of a small layer under the FSDP2 update audit (every
    step audited; without shards each rank's whole tensors stand for its shard)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    audit = sharded_update.UpdateAudit(every_n_steps=1)
    audit.attach(opt, model)
    for step in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        audit.before_update(step, opt)
        opt.step()
        audit.audit(step)
    return {"runs": audit.stats.runs, "verified": audit.stats.last_verified_step}


def update_clean(out: Path) -> dict[str, Any]:
    """Honest update audit payloads (parameters, gradients, Adam state) pass its validation."""
    return outcome(lambda: _update_audit_steps(2), out)


def update_bad_payload(out: Path) -> dict[str, Any]:
    """The hostile rank's update audit snapshot holds a gradient of another shape than its
    parameter: refused by ``check_update_payload`` on every rank, before any recomputation."""

    def bad(real: Any) -> Any:
        def snapshot(*args: Any) -> Any:
            groups = real(*args)
            groups[0]["items"][0]["grad"] = torch.ones(1)
            return groups

        return snapshot

    original = patched(sharded_update, "_snapshot", bad)
    try:
        return outcome(lambda: _update_audit_steps(1), out)
    finally:
        restore(sharded_update, "_snapshot", original)


SCENARIOS = {f.__name__: f for f in (clean, unencodable, malicious_pickle, foreign_bytes, huge_size, short_size,
                                     gather_huge_size, gather_pickle, bad_shape, over_limit, update_clean,
                                     update_bad_payload)}  # fmt: skip

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "60"))))
    try:
        main_for({name: (lambda out, f=f: f(out)) for name, f in SCENARIOS.items()})
    finally:
        dist.destroy_process_group()
