"""One rank of a world of W, simulated in one process: what the checks cost per rank as W grows.

    python -m benchmarks.scale --world 16384 --out benchmarks/results/scale-16384.json

torch's fake process group stands in for the W ranks (``dist.init_process_group("fake")``: every
collective returns at once, without data). A thin shim wraps the ``torch.distributed`` functions
the package calls: it counts each call and the bytes this rank sends and receives, and fills what a
collective returns as the other ranks would, had they computed what this rank did (healthy
replicas): an all-gather's every slot gets this rank's row, an all-reduce's result is this rank's
value (what a MIN or MAX of equal values gives), and a point-to-point receive gets what this rank
last sent of the same shape (its partner runs the same step). Two checks of the package need what
the other ranks really hold, which the fake backend cannot give, and are stood in for:
``Topology.gather`` by the facts of W ranks on nodes of 8 (a gather filled with this rank's own
facts is refused as a forgery, rightly), and the exchange's plan check (``check_plans``: its
all-reduce is still made and counted; a world whose plans agree is assumed).

The real hook set (``sdc_core.SDCHooks`` at its defaults, the replay every ``--audit-every``
steps) drives a small MLP under DDP. Each configuration runs alone; per configuration the JSON
gives host milliseconds per clean step (median of the steady steps, the shim's own time taken
out), the calls and bytes per rank on a clean step and on an audited step, and the Python memory
allocated under ``sdc_core`` during the steps and still held after them (``tracemalloc``). Times
of the wire that the fake backend cannot show come from an alpha-beta model (``--alpha-us`` per
hop, ``--gbps`` per rank): a ring all-gather of m bytes a rank costs (W - 1)(alpha + m / beta),
a tree all-reduce 2 log2(W) alpha, a point-to-point message alpha + m / beta.

The ``"total"`` object is the defaults' row: ``host_ms_per_step``, ``bytes_per_rank_per_step``,
``memory_bytes``, ``audited_step_bytes_per_rank`` and ``collectives_per_step``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

NODE_SIZE = 8
_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "isend", "irecv", "send", "recv",
            "barrier", "reduce_scatter_tensor", "all_to_all_single")  # fmt: skip


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return 0


class Shim:
    """Counts the package's collectives and fills their results as healthy replicas would."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.calls: dict[str, int] = {}
        self.sent = self.received = 0
        self.model_s = 0.0  # alpha-beta time of the wire
        self.own_s = 0.0  # the shim's own time (taken out of the host time)
        self.last_sent: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._originals: dict[str, Any] = {}
        self.alpha, self.beta = 20e-6, 50e9

    def reset(self) -> None:
        self.calls, self.sent, self.received, self.model_s = {}, 0, 0, 0.0

    def _ring(self, m: int) -> float:
        return (self.world - 1) * (self.alpha + m / self.beta)

    def _tree(self) -> float:
        return 2 * math.log2(max(self.world, 2)) * self.alpha

    def _count(self, name: str, sent: int, received: int, wire_s: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.sent += sent
        self.received += received
        self.model_s += wire_s

    def _fill(self, name: str, args: tuple, kwargs: dict) -> None:
        """Count the call and make its result what the other (healthy) ranks would give."""
        if name == "all_gather":
            outs, inp = args[0], args[1]
            for o in outs:
                o.copy_(inp)
            self._count(name, _nbytes(inp), _nbytes(inp) * (self.world - 1), self._ring(_nbytes(inp)))
        elif name == "all_gather_into_tensor":
            out, inp = args[0], args[1]
            out.view(self.world, -1).copy_(inp.reshape(1, -1))
            self._count(name, _nbytes(inp), _nbytes(inp) * (self.world - 1), self._ring(_nbytes(inp)))
        elif name in ("all_reduce", "broadcast"):
            n = _nbytes(args[0])
            self._count(name, n, n, self._tree() + 2 * n / self.beta)
        elif name in ("isend", "send"):
            t = args[0]
            self.last_sent[(t.numel(), t.dtype)] = t.detach().clone()
            self._count(name, _nbytes(t), 0, self.alpha + _nbytes(t) / self.beta)
        elif name in ("irecv", "recv"):
            t = args[0]
            src = self.last_sent.get((t.numel(), t.dtype))
            if src is not None:
                t.copy_(src)
            self._count(name, 0, _nbytes(t), 0.0)  # its wire time is the send's
        elif name == "barrier":
            self._count(name, 0, 0, self._tree())
        else:
            n = _nbytes(args[1]) if len(args) > 1 else 0
            self._count(name, n, n, self._ring(n // max(self.world, 1)))

    @contextlib.contextmanager
    def installed(self) -> Iterator[Shim]:
        for name in _WRAPPED:
            real = getattr(dist, name)
            self._originals[name] = real

            def wrapper(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                out = _real(*args, **kwargs)
                t0 = time.perf_counter()
                self._fill(_name, args, kwargs)
                self.own_s += time.perf_counter() - t0
                return out

            setattr(dist, name, wrapper)
            if name in ("isend", "irecv"):  # ``P2POp`` and ``batch_isend_irecv`` look these up in their own module
                setattr(dist.distributed_c10d, name, wrapper)
        try:
            yield self
        finally:
            for name, real in self._originals.items():
                setattr(dist, name, real)
                if name in ("isend", "irecv"):
                    setattr(dist.distributed_c10d, name, real)


def synthetic_topology(world: int) -> Any:
    """The facts of ``world`` ranks, ``NODE_SIZE`` a node, rank 0 this process."""
    from sdc_core.dist.topology import RankFacts, Topology

    ranks = tuple(RankFacts(rank=r, host=f"node-{r // NODE_SIZE}", node_rank=r // NODE_SIZE, local_rank=r % NODE_SIZE)
                  for r in range(world))  # fmt: skip
    return Topology(ranks=ranks, rank=0)


CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "nonfinite": {"gradient_screen": False, "fingerprint_every_n_steps": 0, "replay_every_n_steps": 0},
    "screen": {"fingerprint_every_n_steps": 0, "replay_every_n_steps": 0},
    "fingerprint": {"gradient_screen": False, "nonfinite_gradient": False, "replay_every_n_steps": 0},
    "defaults": {},
    # HSDP (FSDP2 over a (W / 8 replicas) x (8 shards) mesh): FSDP's own collectives are in both rows
    "hsdp_none": {},
    "hsdp_fingerprint": {"gradient_screen": False, "nonfinite_gradient": False, "replay_every_n_steps": 0},
    "hsdp_defaults": {},
}
_MESHES: dict[int, Any] = {}  # one HSDP mesh per world size (its groups are made once)


def _replica_average(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient all-reduce among identical replicas: the average is this rank's own bucket
    (the fake backend's own all-reduce gives DDP no result to read)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations as objects (this module's are strings: ``from __future__``)
_replica_average.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                    "return": torch.futures.Future[torch.Tensor]}  # fmt: skip


def _plans_agree(sends_to: list[int], recv_from: list[int]) -> None:
    """``check_plans`` in a world whose plans agree: its all-reduce, counted, and no verdict."""
    dist.all_reduce(torch.zeros(4, dtype=torch.int64))


class _Net(nn.Module):
    """A small MLP whose forward returns its loss (what the replay recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x), y)


def _model(name: str, world: int) -> nn.Module:
    """DDP over every rank, or (``hsdp_*``) FSDP2 over a (W / 8) x 8 mesh: replicas of 8 shards."""
    if not name.startswith("hsdp"):
        model = DistributedDataParallel(_Net())
        model.register_comm_hook(None, _replica_average)  # the checks' tap wraps it where it hooks in
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if world % NODE_SIZE:
        raise SystemExit(f"HSDP needs a world of whole nodes of {NODE_SIZE}, got {world}")
    if world not in _MESHES:
        _MESHES[world] = init_device_mesh("cpu", (world // NODE_SIZE, NODE_SIZE), mesh_dim_names=("replicate", "shard"))
    net = _Net()
    for layer in net.body:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=_MESHES[world])
    return fully_shard(net, mesh=_MESHES[world])


def run_config(name: str, world: int, steps: int, audit_every: int, shim: Shim) -> dict[str, Any]:
    """``steps`` clean steps and one audited step of configuration ``name``; per-rank counts."""
    from sdc_core import SDCHooks
    from sdc_core.dist import topology

    model = _model(name, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooks = None
    x, y = torch.randn(16, 32), torch.randint(0, 8, (16,))
    if name not in ("none", "hsdp_none"):
        settings = dict(CONFIGS[name])
        if name in ("defaults", "hsdp_defaults"):
            settings["replay_every_n_steps"] = audit_every
        gather = topology.Topology.gather
        topology.Topology.gather = classmethod(lambda cls, **kw: synthetic_topology(world))  # type: ignore[method-assign]
        try:
            hooks = SDCHooks(**settings)
            hooks.attach(model, optimizer)
        finally:
            topology.Topology.gather = gather  # type: ignore[method-assign]
    check_plans, topology.check_plans = topology.check_plans, _plans_agree  # for the steps' exchanges
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    rows = []
    for step in range(steps):
        shim.reset()
        shim.own_s = 0.0
        t0 = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        host_s = time.perf_counter() - t0 - shim.own_s
        audited = name in ("defaults", "hsdp_defaults") and step % audit_every == 0
        rows.append({"step": step, "audited": audited, "host_ms": 1000 * host_s, "calls": dict(shim.calls),
                     "sent": shim.sent, "received": shim.received, "wire_ms": 1000 * shim.model_s})  # fmt: skip
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    topology.check_plans = check_plans
    held = sum(s.size_diff for s in snap.compare_to(base, "filename")
               if s.size_diff > 0 and "sdc_core" in str(s.traceback))  # fmt: skip
    if hooks is not None:
        hooks.detach()
    steady = [r for r in rows[2:] if not r["audited"]]
    audited = [r for r in rows if r["audited"] and r["step"] > 0]
    clean = steady[-1] if steady else rows[-1]
    out = {
        "host_ms_per_step": statistics.median(r["host_ms"] for r in steady),
        "collectives_per_step": sum(clean["calls"].values()),
        "calls_per_step": clean["calls"],
        "bytes_sent_per_rank_per_step": clean["sent"],
        "bytes_received_per_rank_per_step": clean["received"],
        "bytes_per_rank_per_step": clean["sent"] + clean["received"],
        "wire_ms_per_step_model": clean["wire_ms"],
        "memory_bytes": held,
    }
    if audited:
        a = audited[-1]
        out.update({"audited_step_bytes_per_rank": a["sent"] + a["received"], "audited_step_calls": a["calls"],
                    "audited_step_wire_ms_model": a["wire_ms"]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True, help="the world size W to simulate")
    parser.add_argument("--steps", type=int, default=12, help="steps per configuration (default 12)")
    parser.add_argument("--audit-every", type=int, default=5, help="the replay's cadence in the defaults' run")
    parser.add_argument("--alpha-us", type=float, default=20.0, help="latency per hop of the wire model (us)")
    parser.add_argument("--gbps", type=float, default=50.0, help="bandwidth per rank of the wire model (GB/s)")
    parser.add_argument("--configs", default=None, help="comma-separated configurations (default: all; the "
                        "HSDP ones only up to 16,384 ranks, where one process holds 5 GB of their groups)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error("--world must be at least 2: one rank has no replica to compare with")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    shim = Shim(args.world)
    shim.alpha, shim.beta = args.alpha_us * 1e-6, args.gbps * 1e9
    results: dict[str, Any] = {}
    try:
        configs = args.configs.split(",") if args.configs else [
            c for c in CONFIGS if args.world <= 16384 or not c.startswith("hsdp")]
        with shim.installed():
            run_config("none", args.world, 4, args.audit_every, shim)  # warm-up: first calls, allocator
            if any(c.startswith("hsdp") for c in configs):  # ... and the mesh's groups, made lazily
                run_config("hsdp_none", args.world, 4, args.audit_every, shim)
            for name in configs:
                results[name] = run_config(name, args.world, args.steps, args.audit_every, shim)
    finally:
        dist.destroy_process_group()
    none = results.get("none", {})
    for name, row in results.items():
        if name != "none" and none:
            row["host_ms_vs_none"] = row["host_ms_per_step"] - none["host_ms_per_step"]
    report = {"world": args.world, "node_size": NODE_SIZE, "steps": args.steps, "audit_every": args.audit_every,
              "wire_model": {"alpha_us": args.alpha_us, "gbps": args.gbps}, "torch": torch.__version__,
              "configs": results, "total": results.get("defaults", {})}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(args.out)
    total = report["total"]
    print(f"W={args.world}: defaults {total.get('host_ms_per_step', float('nan')):.2f} ms host a step, "
          f"{total.get('bytes_per_rank_per_step', 0)} B a clean step, "
          f"{total.get('audited_step_bytes_per_rank', 0)} B an audited step, {total.get('memory_bytes', 0)} B held")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
