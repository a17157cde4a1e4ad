"""Where the checks' tensors go to a collective, and how device values reach the host (CPU, no GPU).

A digest computed on CUDA and copied to the host with ``non_blocking=True`` reads stale bytes when
read before the copy lands: these tests pin the backend parsing that decides whether a copy is
needed at all, and fail if a non-blocking copy to another device comes back on a read path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.checks.digest import combine, grouped_digests, home_device, tensor_digests
from sdc_core.dist.topology import HostRead, collective_device, device_backends

ROOT = Path(__file__).resolve().parents[1]
CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


@pytest.mark.parametrize(
    ("config", "served"),
    [
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() with CUDA present
        ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),  # what get_backend_config() says for "gloo"
        ("cuda:nccl", {"cuda": "nccl"}),
        ("mpi", {"cpu": "mpi", "cuda": "mpi"}),
        ("xccl", {"xpu": "xccl"}),
    ],
)
def test_backend_strings_are_parsed_per_device(config, served):
    assert device_backends(config) == served


@pytest.mark.parametrize(
    ("config", "device", "expected"),
    [
        ("nccl", CUDA1, CUDA1),
        ("gloo", CUDA1, CUDA1),  # gloo carries CUDA tensors itself: no copy on the checks' side
        ("gloo", CPU, CPU),
        ("gloo", None, CPU),
        ("cpu:gloo,cuda:nccl", CUDA0, CUDA0),  # the old rule (exactly "nccl") sent these to the host
        ("cpu:gloo,cuda:nccl", CPU, CPU),
        ("cpu:gloo,cuda:nccl", None, CPU),  # host-made payloads stay on the host
        ("cuda:nccl", CPU, torch.device("cuda")),  # NCCL only: host values must go to the device
        ("mpi", CUDA0, CUDA0),
        ("xccl", torch.device("xpu", 0), torch.device("xpu", 0)),
        ("xccl", CPU, torch.device("xpu")),
    ],
)
def test_collective_device_follows_the_backend_serving_the_tensors(config, device, expected):
    got = collective_device(device, config=config)
    assert got.type == expected.type and (expected.index is None or got.index == expected.index)


def test_a_malformed_backend_string_is_refused():
    with pytest.raises(ValueError):
        device_backends("cpu:gloo:extra")


def test_collective_device_of_a_real_gloo_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert device_backends() == {"cpu": "gloo", "cuda": "gloo"}
        assert collective_device() == CPU
        assert collective_device(CUDA1) == CUDA1
        value = torch.tensor([3, 4])
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        assert HostRead(value, work).get().tolist() == [3, 4]  # waits for the work before reading
    finally:
        dist.destroy_process_group()
    assert device_backends() == {} and collective_device() == CPU and collective_device(CUDA0) == CUDA0


class _NonBlockingCopies(TorchDispatchMode):
    """Records every copy made with ``non_blocking=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("non_blocking") or (func is torch.ops.aten.copy_.default and len(args) > 2 and args[2]):
            self.seen.append(str(func))
        return func(*args, **kwargs)


def test_digests_moved_to_another_device_use_no_non_blocking_copy():
    """The digests of tensors on one device gathered on another (what a CUDA model under a host
    backend does): the meta device stands in for the other device, which a CPU machine lacks. A
    ``non_blocking`` copy here is the false-verdict bug (a stale read of the digest)."""
    tensors = [torch.randn(n) for n in (10, 5000, 70_000, 3)]
    with _NonBlockingCopies() as mode:
        digests = grouped_digests(tensors, device=torch.device("meta"))
        combine(digests)
        tensor_digests(tensors, device=torch.device("meta"))
    assert digests.device.type == "meta"
    assert mode.seen == []


def test_home_device_prefers_the_accelerator():
    assert home_device([torch.zeros(1)]) == CPU
    assert home_device([torch.zeros(1), torch.zeros(1, device="meta")]).type == "meta"
    assert home_device([]) == CPU


# A copy with non_blocking=True is allowed only where an event gates its read.
_ALLOWED = {
    ("dist/topology.py", "get"),  # HostRead.get: a side-stream copy behind an event it waits on
}


def test_non_blocking_copies_only_behind_an_event():
    found = set()
    for path in sorted((ROOT / "sdc_core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and any(
                    k.arg == "non_blocking" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords
                ):
                    found.add((path.relative_to(ROOT / "sdc_core").as_posix(), fn.name))
    assert found <= _ALLOWED, f"non_blocking copies outside an event-gated read: {sorted(found - _ALLOWED)}"
    assert ("dist/topology.py", "get") in found
