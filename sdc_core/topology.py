"""Who is where: ranks, hosts and nodes, replay partners, and the few collectives the checks use.

Facts about each rank (hostname, node rank, local rank) are gathered once, at set-up, with one
``all_gather_object``; nothing here runs per step except the small helpers the checks call on
their own cadence.
"""

from __future__ import annotations

import io
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device_backends(config: str | None = None) -> dict[str, str]:
    """Device type -> name of the backend that serves it, for a backend string as
    ``dist.get_backend_config()`` writes it (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...),
    by default the default process group's (empty when none is initialized). Parsed by torch's
    own ``BackendConfig`` (a single name stands for every device type torch says it serves:
    ``"gloo"`` serves ``cpu`` and ``cuda``, ``"nccl"`` only ``cuda``). Raises ``ValueError`` on a
    malformed string."""
    if config is None:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        config = dist.get_backend_config()
    from torch.distributed.distributed_c10d import BackendConfig

    return {str(d): str(b) for d, b in BackendConfig(config).get_device_backend_map().items()}


def _current(kind: str) -> torch.device:
    """The current device of type ``kind`` (``cuda`` -> ``cuda:<current>``)."""
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def collective_device(device: torch.device | str | None = None, config: str | None = None) -> torch.device:
    """Where tensors made on ``device`` go to the default group's collectives.

    ``device`` itself when a backend of the group serves its type (NCCL for ``cuda``; gloo, UCC
    and MPI also carry ``cuda`` tensors, through the host on their own threads, waiting on the
    producing stream themselves), so device-made values never cross to the host on the checks'
    side. Otherwise the host when the group serves ``cpu``, else the device type the group serves
    (``"nccl"`` with CPU tensors: the current CUDA device). ``device=None`` asks for values made
    on the host (pickled payloads, host counters): the host when the group serves it, else the
    group's device. Without a process group: ``device``, or the host. ``config`` overrides the
    group's backend string (``device_backends``).
    """
    backends = device_backends(config)
    if device is not None:
        device = torch.device(device)
        if not backends or device.type in backends:
            return device if device.index is not None or device.type == "cpu" else _current(device.type)
    if not backends or "cpu" in backends:
        return torch.device("cpu")
    return _current(next(iter(backends)))


class HostRead:
    """A device tensor's value, to be read on the host later without draining the device's queue.

    Create it right where the value is produced (after starting any asynchronous collective
    ``work`` on it): on CUDA it records an event on the producing stream. ``get()`` then makes a
    side stream wait for that event (and for ``work``), copies the value into pinned host memory
    there and waits for that copy only: work queued after the value (the next step's forward and
    backward) is not waited for. Never a ``non_blocking`` copy read before it landed. On the host
    (CPU tensors) ``get()`` waits for ``work`` and returns the value; other device types take a
    blocking copy. Cost: one event, one tiny copy, and one wait when read.
    """

    def __init__(self, value: torch.Tensor, work: Any = None) -> None:
        self.value = value
        self.work = work
        self.event = None
        if value.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(value.device))

    def get(self) -> torch.Tensor:
        """The value as a CPU tensor, once it (and ``work``) has landed."""
        if self.event is None:
            if self.work is not None:
                self.work.wait()
            return self.value if self.value.device.type == "cpu" else self.value.to("cpu")
        device = self.value.device
        stream = _side_stream(device)
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


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One side stream per CUDA device, for ``HostRead`` copies."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class RankFacts:
    """What is known of one rank: its host, node rank, local rank and device (gathered once)."""

    rank: int
    host: str
    node_rank: int
    local_rank: int
    device: str = "cpu"
    device_uuid: str | None = None
    versions: tuple[tuple[str, str], ...] = ()


def _device_facts() -> tuple[str, str | None, tuple[tuple[str, str], ...]]:
    """This process's device name, UUID (where the device has one) and library versions."""
    import platform

    versions = [("torch", torch.__version__), ("python", platform.python_version())]
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        versions += [("cuda", str(torch.version.cuda)), ("cudnn", str(torch.backends.cudnn.version()))]
        try:  # the kernel driver's version line, where the NVIDIA driver exposes it
            with open("/proc/driver/nvidia/version") as f:
                versions.append(("driver", f.readline().strip()))
        except OSError:
            pass
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
        """Collect every rank's facts (one ``all_gather_object``; call once, on every rank).

        ``node_rank`` defaults to ``GROUP_RANK`` (torchrun), ``NODE_RANK`` (Lightning) or
        ``SLURM_NODEID``; ``local_rank`` to ``LOCAL_RANK`` or ``SLURM_LOCALID``.
        """
        rank = dist.get_rank() if is_distributed() else 0
        mine = RankFacts(
            rank=rank,
            host=socket.gethostname(),
            node_rank=node_rank
            if node_rank is not None
            else (_env_int("GROUP_RANK", "NODE_RANK", "SLURM_NODEID") or 0),
            local_rank=local_rank if local_rank is not None else (_env_int("LOCAL_RANK", "SLURM_LOCALID") or 0),
            **dict(zip(("device", "device_uuid", "versions"), _device_facts(), strict=True)),
        )
        if not is_distributed():
            return cls(ranks=(mine,), rank=0)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return cls(ranks=tuple(gathered), rank=rank)

    def hosts(self, ranks: Any) -> dict[int, str]:
        return {int(r): self.ranks[int(r)].host for r in ranks}

    def node_ranks(self, ranks: Any) -> dict[int, int]:
        return {int(r): self.ranks[int(r)].node_rank for r in ranks}

    @property
    def num_nodes(self) -> int:
        return len({f.node_rank for f in self.ranks})

    def partners(self) -> tuple[int, ...]:
        """``partners()[r]`` is the rank that replays rank ``r``'s batch: one cycle through all
        ranks, crossing nodes at every hop when the nodes are of equal size."""
        return ring_partners([f.node_rank for f in self.ranks])


def ring_partners(node_of_rank: list[int]) -> tuple[int, ...]:
    """Replay permutation for ranks placed on the given nodes (see ``Topology.partners``).

    The ranks are interleaved across nodes (first rank of each node, then the second of each,
    ...) and each replays the batch of the one before it in that cycle. One cycle through all
    ranks means no two ranks replay each other (which would make a faulty rank and its partner
    indistinguishable); with equal node sizes every partner sits on another node. On one node
    the partner of ``r`` is ``r + 1``.
    """
    world = len(node_of_rank)
    seen: dict[int, int] = {}
    local_index = []
    for node in node_of_rank:
        local_index.append(seen.get(node, 0))
        seen[node] = local_index[-1] + 1
    order = sorted(range(world), key=lambda r: (local_index[r], node_of_rank[r], r))
    partner = [0] * world
    for i, r in enumerate(order):
        partner[r] = order[(i + 1) % world]
    return tuple(partner)


def group_ring_partners(groups: list[tuple[int, ...]], node_of_rank: list[int]) -> tuple[int, ...]:
    """Replay permutation when ranks compute each batch together in ``groups`` (tensor-parallel
    groups, one per data-parallel index, each listed in tensor-parallel coordinate order).

    The ring runs over the groups (``ring_partners`` on the node of each group's first rank): the
    group after ``g`` replays ``g``'s batches, its rank with coordinate ``t`` replaying what rank
    ``t`` of ``g`` computed, so the members of a group replay one batch together and their
    collectives pair up. With ``D`` groups the permutation is ``T`` cycles of length ``D``.
    Raises ``ValueError`` unless the groups are of one size and cover every rank exactly once."""
    world = len(node_of_rank)
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or sorted(r for g in groups for r in g) != list(range(world)):
        raise ValueError(f"tensor-parallel groups must be of one size and cover the {world} ranks once, got {groups}")
    ring = ring_partners([node_of_rank[g[0]] for g in groups])
    partner = [0] * world
    for g, members in enumerate(groups):
        for t, r in enumerate(members):
            partner[r] = groups[ring[g]][t]
    return tuple(partner)


def owners_of(partners: tuple[int, ...] | list[int]) -> list[int]:
    """The inverse of a replay permutation: ``owners_of(partners)[q]`` is the rank whose batch
    rank ``q`` replays."""
    owners = [0] * len(partners)
    for o, q in enumerate(partners):
        owners[q] = o
    return owners


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """In-place MAX all-reduce on the collective device (a no-op without a process group)."""
    if is_distributed():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def all_gather_tensor(value: torch.Tensor) -> torch.Tensor:
    """Stack every rank's ``value`` (same shape on all ranks) along a new first dimension."""
    if not is_distributed():
        return value.unsqueeze(0)
    out = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(out, value)
    return torch.stack(out)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (rare paths only: it pickles)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def exchange(sends: dict[int, Any], recv_from: list[int]) -> dict[int, Any]:
    """Point-to-point exchange of picklable objects: ``sends[dst] = obj``; receive from each source.

    Every rank must call this with a plan consistent with the others' (a send to ``d`` on rank
    ``s`` matches ``s`` in ``recv_from`` on rank ``d``). Tensors travel as CPU copies and arrive
    on the CPU; sizes travel first, then the payloads.
    """
    device = collective_device()
    payloads = {dst: _serialize(obj).to(device) for dst, obj in sends.items()}
    sizes_out = {d: torch.tensor([p.numel()], dtype=torch.int64, device=device) for d, p in payloads.items()}
    sizes_in = {s: torch.zeros(1, dtype=torch.int64, device=device) for s in recv_from}
    works = [dist.isend(t, d) for d, t in sizes_out.items()]
    works += [dist.irecv(t, s) for s, t in sizes_in.items()]
    for w in works:
        w.wait()
    bufs_in = {s: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for s, t in sizes_in.items()}
    works = [dist.isend(p, d) for d, p in payloads.items()]
    works += [dist.irecv(b, s) for s, b in bufs_in.items()]
    for w in works:
        w.wait()
    return {s: _deserialize(b) for s, b in bufs_in.items()}


TRANSFER_ERROR = "__sdc_transfer_error__"


def _serialize(obj: Any) -> torch.Tensor:
    """Bytes of ``obj``; an object that cannot be pickled becomes ``{TRANSFER_ERROR: why}`` so the
    receiver still gets a message and no rank is left waiting."""
    buf = io.BytesIO()
    try:
        torch.save(_to_cpu(obj), buf)
    except Exception as err:
        buf = io.BytesIO()
        torch.save({TRANSFER_ERROR: f"cannot send: {type(err).__name__}: {err}"}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _deserialize(data: torch.Tensor) -> Any:
    try:
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=False, map_location="cpu")
    except Exception as err:
        return {TRANSFER_ERROR: f"cannot receive: {type(err).__name__}: {err}"}
