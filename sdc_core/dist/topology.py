"""Who is where: ranks, hosts and nodes, replay partners, and the few collectives the checks use.

Each rank's facts are gathered once, at set-up. Nothing a peer sends is unpickled:
``all_gather_objects`` and ``exchange`` carry ``sdc_core.dist.payload`` buffers, agree on sizes
before any buffer is allocated, and raise ``PayloadError`` on every rank together for anything
malformed, oversized or refused: one bad rank can neither run code on its partners nor leave them waiting."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sdc_core.dist.payload import (
    ALLOW_PICKLE_ENV,
    MAX_PAYLOAD_ENV,
    NotEncodable,
    PayloadError,
    decode,
    encode,
    max_payload_bytes,
    pickle_allowed,
)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device_backends(config: str | None = None) -> dict[str, str]:
    """Device type -> backend name for a backend string (``"cpu:gloo,cuda:nccl"``; default: the group's)."""
    if config is None:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        config = dist.get_backend_config()
    from torch.distributed.distributed_c10d import BackendConfig

    return {str(d): str(b) for d, b in BackendConfig(config).get_device_backend_map().items()}


def _current(kind: str) -> torch.device:
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def collective_device(device: torch.device | str | None = None, config: str | None = None) -> torch.device:
    """Where tensors made on ``device`` (None: the host) go to the default group's collectives:
    ``device`` when a backend serves its type, else the host when one serves ``cpu``, else the
    group's device type. Without a group: ``device``, or the host."""
    backends = device_backends(config)
    if device is not None:
        device = torch.device(device)
        if not backends or device.type in backends:
            return device if device.index is not None or device.type == "cpu" else _current(device.type)
    if not backends or "cpu" in backends:
        return torch.device("cpu")
    return _current(next(iter(backends)))


class HostRead:
    """A device tensor's value, read on the host later without draining the device's queue: create
    it where the value is produced (after starting any asynchronous ``work`` on it); on CUDA
    ``get()`` copies it on a side stream and waits for that copy only. Cost: one event, one copy."""

    def __init__(self, value: torch.Tensor, work: Any = None) -> None:
        self.value = value
        self.work = work
        self.event = None
        if value.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(value.device))

    def get(self) -> torch.Tensor:
        if self.event is None:
            if self.work is not None:
                self.work.wait()
            return self.value if self.value.device.type == "cpu" else self.value.to("cpu")
        device = self.value.device
        if device not in _side_streams:  # one side stream per CUDA device
            _side_streams[device] = torch.cuda.Stream(device)
        stream = _side_streams[device]
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            if self.work is not None:
                self.work.wait()  # NCCL: this stream waits for it; gloo: the host waits, then this stream
            host = torch.empty(self.value.shape, dtype=self.value.dtype, pin_memory=True)
            host.copy_(self.value, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
        landed.synchronize()  # the copy (and what it waited for) only
        return host

    def tolist(self) -> list[Any]:
        return self.get().tolist()

    def finish(self, timeout_s: float = 30.0) -> None:
        """Wait for ``work`` (if any) without reading the value, on a path out (no collective left in flight):
        at most ``timeout_s``, never raises."""
        if self.work is not None:
            with contextlib.suppress(Exception):
                self.work.wait(timeout=timedelta(seconds=timeout_s))


_side_streams: dict[torch.device, Any] = {}


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def node_name() -> str:
    """The node's name to drain: ``SLURMD_NODENAME``, else ``NODE_NAME`` (Kubernetes), else the host name."""
    for name in ("SLURMD_NODENAME", "NODE_NAME"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return socket.gethostname()


@dataclass(frozen=True)
class RankFacts:
    """What is known of one rank (gathered once)."""

    rank: int
    host: str
    node_rank: int
    local_rank: int
    device: str = "cpu"
    device_uuid: str | None = None
    versions: tuple[tuple[str, str], ...] = ()


def _device_facts() -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    import platform

    versions = [("torch", str(torch.__version__)), ("python", platform.python_version())]
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        versions += [("cuda", str(torch.version.cuda)), ("cudnn", str(torch.backends.cudnn.version()))]
        with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:  # where the driver shows it
            versions.append(("driver", f.readline().strip()))
        uuid = getattr(props, "uuid", None)
        return props.name, (str(uuid) if uuid is not None else None), tuple(versions)
    return platform.processor() or platform.machine() or "cpu", None, tuple(versions)


@dataclass(frozen=True)
class Topology:
    """The facts of every rank, identical on all ranks once gathered."""

    ranks: tuple[RankFacts, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def gather(cls, node_rank: int | None = None, local_rank: int | None = None) -> Topology:
        """Every rank's facts (one ``all_gather_objects``; call on every rank); ranks default to the launcher's."""
        rank = dist.get_rank() if is_distributed() else 0
        if node_rank is None:
            node_rank = _env_int("GROUP_RANK", "NODE_RANK", "SLURM_NODEID") or 0
        if local_rank is None:
            local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID") or 0
        mine = RankFacts(rank, node_name(), node_rank, local_rank, *_device_facts())
        if not is_distributed():
            return cls(ranks=(mine,), rank=0)
        gathered = all_gather_objects(mine)
        if not all(isinstance(f, RankFacts) and f.rank == r for r, f in enumerate(gathered)):
            raise PayloadError("gathering the ranks' facts failed: a rank sent something else than its own facts")
        return cls(ranks=tuple(gathered), rank=rank)

    def hosts(self, ranks: Any) -> dict[int, str]:
        return {int(r): self.ranks[int(r)].host for r in ranks}

    def node_ranks(self, ranks: Any) -> dict[int, int]:
        return {int(r): self.ranks[int(r)].node_rank for r in ranks}

    def partners(self) -> tuple[int, ...]:
        """``partners()[r]`` is the rank that replays rank ``r``'s batch (``ring_partners``)."""
        return ring_partners([f.node_rank for f in self.ranks])


def ring_partners(node_of_rank: list[int]) -> tuple[int, ...]:
    """Replay permutation for ranks on the given nodes: one cycle with ranks interleaved across nodes, so
    no two ranks replay each other and, with equal node sizes, every partner is on another node."""
    world = len(node_of_rank)
    seen: dict[int, int] = {}
    local_index = []
    for node in node_of_rank:
        local_index.append(seen.get(node, 0))
        seen[node] = local_index[-1] + 1
    order = sorted(range(world), key=lambda r: (local_index[r], node_of_rank[r], r))
    next_in_ring = dict(zip(order, order[1:] + order[:1], strict=True))
    return tuple(next_in_ring[r] for r in range(world))


def group_ring_partners(groups: list[tuple[int, ...]], node_of_rank: list[int]) -> tuple[int, ...]:
    """Replay permutation over tensor-parallel ``groups`` (coordinate order): rank ``t`` of the next
    group replays rank ``t`` of ``g``, so a group's collectives pair up. ``ValueError`` unless the
    groups are of one size and cover every rank once."""
    world = len(node_of_rank)
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or sorted(r for g in groups for r in g) != list(range(world)):
        raise ValueError(f"tensor-parallel groups must be of one size and cover the {world} ranks once, got {groups}")
    ring = ring_partners([node_of_rank[g[0]] for g in groups])
    partner = {r: groups[ring[g]][t] for g, members in enumerate(groups) for t, r in enumerate(members)}
    return tuple(partner[r] for r in range(world))


def owners_of(partners: tuple[int, ...] | list[int]) -> list[int]:
    """The inverse of a replay permutation: the rank whose batch rank ``q`` replays."""
    owners = [0] * len(partners)
    for o, q in enumerate(partners):
        owners[q] = o
    return owners


def all_gather_tensor(value: torch.Tensor) -> torch.Tensor:
    """Stack every rank's ``value`` (same shape on all ranks) along a new first dimension."""
    if not is_distributed():
        return value.unsqueeze(0)
    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return torch.stack(out)


def _agree(failures: list[str], what: str) -> None:
    """Raise ``PayloadError`` on every rank when any rank lists a failure (a collective). One 4-byte
    all-reduce; the texts (512 bytes a rank) are gathered only when some rank failed."""
    flag = torch.tensor([len(failures)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    mine = "; ".join(failures).encode("utf-8", "replace")[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\0")
    text = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    rows = all_gather_tensor(text.to(collective_device())).cpu()
    said = [bytes(r.tolist()).rstrip(b"\0").decode("utf-8", "replace") for r in rows]
    raise PayloadError(f"{what} failed: " + "; ".join(t for t in said if t))


_TEXT_BYTES = 512


def all_gather_objects(obj: Any, *, max_bytes: int | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, never unpickled. Sizes (against the smallest ``max_bytes``
    of all ranks) and allocation are agreed, so a bad size, buffer or object raises ``PayloadError``
    naming the rank on every rank. Rare paths only: three collectives."""
    if not is_distributed():
        return [obj]
    world, me = dist.get_world_size(), dist.get_rank()
    device = collective_device()
    limit = max_payload_bytes(max_bytes)
    try:
        data, ok = encode(obj, where=f"rank {me}'s object"), 1
    except (NotEncodable, RuntimeError) as err:
        data, ok = encode(f"{type(err).__name__}: {err}"), 0
    table = all_gather_tensor(torch.tensor([data.numel(), limit, ok], dtype=torch.int64, device=device)).tolist()
    agreed = min(r[1] for r in table)
    bad = [f"rank {r} announced {n} bytes (the limit is {agreed} bytes, {MAX_PAYLOAD_ENV})"
           for r, (n, _, _) in enumerate(table) if not 0 < n <= agreed]  # fmt: skip
    if bad:
        raise PayloadError("gathering objects failed: " + "; ".join(bad))
    longest = max(r[0] for r in table)
    failure = []
    try:
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data.to(device)
        bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    except Exception as err:  # out of memory: decided together below
        failure = [f"rank {me} cannot hold {world} x {longest} bytes: {type(err).__name__}: {err}"]
    _agree(failure, "gathering objects")
    dist.all_gather(bufs, padded)
    out = []
    for r, (n, _, sent) in enumerate(table):
        try:
            value = decode(bufs[r][:n])
        except PayloadError as err:
            raise PayloadError(f"gathering objects failed: rank {r}'s object cannot be read: {err}") from None
        if not sent:
            raise PayloadError(f"gathering objects failed: rank {r} could not send its object: {value}")
        out.append(value)
    return out


TRANSFER_ERROR = "__sdc_transfer_error__"


def _outgoing(obj: Any, allow_pickle: bool, limit: int) -> torch.Tensor:
    """The payload of ``obj``, or of ``{TRANSFER_ERROR: why}`` when it cannot travel or is over the limit."""
    try:
        data = encode(obj, allow_pickle=allow_pickle)
    except (NotEncodable, RuntimeError) as err:
        hint = (" Make the batch (and the state the replay carries) tensors and plain values, or, if you trust "
                f"every rank, allow pickled batches on every rank (allow_pickled_batches, {ALLOW_PICKLE_ENV}=1)."
                if isinstance(err, NotEncodable) and not allow_pickle else "")  # fmt: skip
        return encode({TRANSFER_ERROR: f"cannot send: {err}.{hint}"})
    if data.numel() > limit:
        return encode({TRANSFER_ERROR: f"cannot send: the payload is {data.numel()} bytes, above the limit of "
                                       f"{limit} bytes (raise {MAX_PAYLOAD_ENV}, in MiB, on every rank)"})  # fmt: skip
    return data


def _fit(data: torch.Tensor, size: int) -> torch.Tensor:
    if data.numel() == size:
        return data
    out = torch.zeros(size, dtype=torch.uint8)
    out[: min(size, data.numel())] = data[:size]
    return out


def _pair_key(src: int, dst: int) -> int:
    """A pseudo-random 40-bit key of the transfer ``src -> dst`` (sums of up to 2^23 keys fit an int64)."""
    return ((src * 2_654_435_761 + dst * 40_503 + 1) * 0x9E3779B97F4A7C15 % (1 << 64)) >> 24


def check_plans(sends_to: list[int], recv_from: list[int]) -> None:
    """Raise ``PayloadError`` on every rank unless every send is matched by a receive and vice versa
    (one all-reduce of four integers: the counts and sums of a key of each pair ``src -> dst``)."""
    me = dist.get_rank()
    plan = torch.tensor([len(sends_to), len(recv_from), sum(_pair_key(me, d) for d in sends_to),
                         sum(_pair_key(s, me) for s in recv_from)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(plan)
    sent, expected, sent_keys, expected_keys = plan.tolist()
    if sent != expected or sent_keys != expected_keys:
        raise PayloadError(f"payload exchange failed: the ranks' plans do not match ({sent} sends, {expected} "
                           "receives expected, or other pairs)")  # fmt: skip


def exchange(
    sends: dict[int, Any],
    recv_from: list[int],
    *,
    allow_pickle: bool | None = None,
    max_bytes: int | None = None,
    validate: Callable[[Any], None] | None = None,
) -> dict[int, Any]:
    """Point-to-point exchange (every rank at the same point): ``sends[dst] = obj``; returns ``{src: obj}``.

    Objects arrive on the CPU, unpickled only when THIS rank's ``allow_pickle`` (default
    ``SDC_ALLOW_PICKLED_BATCHES``, off) says so; one this rank cannot send arrives as
    ``{TRANSFER_ERROR: why}``. The plans, the smallest ``max_bytes``, each size, the allocation and
    each receiver's decoding and ``validate`` are agreed: any failure raises ``PayloadError`` on every
    rank. Cost: one copy of each payload in and out, 8 bytes per partner, five tiny all-reduces."""
    me, device = dist.get_rank(), collective_device()
    allow = pickle_allowed(allow_pickle)
    agreed = torch.tensor([max_payload_bytes(max_bytes)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # the smallest limit of all ranks
    limit = int(agreed.item())
    check_plans(list(sends), recv_from)
    payloads = {dst: _outgoing(obj, allow, limit) for dst, obj in sends.items()}
    announced = {dst: torch.tensor([data.numel()], dtype=torch.int64, device=device) for dst, data in payloads.items()}
    sizes = {src: torch.zeros(1, dtype=torch.int64, device=device) for src in recv_from}
    for work in [dist.isend(t, d) for d, t in announced.items()] + [dist.irecv(t, s) for s, t in sizes.items()]:
        work.wait()
    got = {s: int(t.item()) for s, t in sizes.items()}  # what each sender announced, read once
    problems = [f"rank {s} announced {n} bytes for rank {me} (the limit is {limit} bytes, {MAX_PAYLOAD_ENV})"
                for s, n in got.items() if not 0 < n <= limit]  # fmt: skip
    _agree(problems, "payload exchange")
    failure = []
    try:  # exactly the announced sizes go on the wire, whatever the payload's length (gloo aborts a receiver
        # that gets more bytes than it expects); a payload that disagrees with its size fails to decode
        outgoing = {d: _fit(data, int(announced[d].item())).to(device) for d, data in payloads.items()}
        incoming = {s: torch.empty(n, dtype=torch.uint8, device=device) for s, n in got.items()}
    except Exception as err:  # out of memory: decided together below
        failure = [f"rank {me} cannot hold the payloads: {type(err).__name__}: {err}"]
    _agree(failure, "payload exchange")
    works = [(None, dist.isend(t, d)) for d, t in outgoing.items()]
    works += [(s, dist.irecv(b, s)) for s, b in incoming.items()]
    failures, broken = [], set()
    for src, work in works:
        try:
            work.wait()
        except Exception as err:  # a transfer that failed here (a peer sent other bytes than it announced)
            what = f"receive from rank {src}" if src is not None else "send"
            failures.append(f"rank {me} could not {what}: {type(err).__name__}: {err}")
            broken.add(src)
    received = {}
    for src in [s for s in incoming if s not in broken]:
        try:
            received[src] = decode(incoming[src], allow_pickle=allow)
            if validate is not None:
                validate(received[src])
        except Exception as err:
            failures.append(f"rank {me} refused the payload of rank {src}: {err}")
    _agree(failures, "payload exchange")
    return received
