"""The batched fingerprint paths give exactly the per-tensor version-2 digests, and their kernel
launches do not grow with the number of tensors (CPU here; the CUDA kernel where a GPU is, and in
Triton's interpreter on the CPU where Triton is installed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.checks import _triton_digest
from sdc_core.checks.digest import combine, grouped_digests, tensor_digest


def _mixed(seed: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g).to(dtype) for n, dtype in [
        (0, torch.float32), (1, torch.float32), (3, torch.bfloat16), (4, torch.bfloat16), (1023, torch.float64),
        (1024, torch.float64), (2047, torch.float32), (2048, torch.float32), (5000, torch.float16),
        (16_383, torch.float64), (70_001, torch.float32), (300_000, torch.bfloat16)]]  # fmt: skip
    out.append(torch.randn(600, 700, generator=g).t())  # non-contiguous
    out.append(torch.randn(101, generator=g)[1:])  # misaligned for int64 words
    out.append(torch.randint(0, 2, (77,), generator=g).bool())
    out.append(torch.randint(-(2**62), 2**62, (513,), generator=g))
    return [t.to(device) for t in out]


def test_grouped_digests_are_the_per_tensor_digests():
    tensors = _mixed(1)
    digests = grouped_digests(tensors)
    expected = [int(tensor_digest(t)) for t in tensors]
    assert digests.tolist() == expected
    assert int(combine(digests)) == int(combine(torch.tensor(expected)))


class _Kernels(TorchDispatchMode):
    """Counts the ops that run kernels (views and other aliasing ops excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in (torch.ops.aten.view.dtype, torch.ops.aten.detach.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _launches(tensors: list[torch.Tensor]) -> int:
    combine(grouped_digests(tensors))  # warm the caches (weights, layouts): built once per layout
    with _Kernels() as k:
        combine(grouped_digests(tensors))
    return k.count


def test_fingerprint_launches_do_not_grow_with_the_number_of_small_tensors():
    # sizes shared by many tensors (a batch per size) and sizes of their own (one mixed batch)
    few = [torch.randn(300) for _ in range(50)] + [torch.randn(5000).bfloat16() for _ in range(50)]
    many = [torch.randn(300) for _ in range(1000)] + [torch.randn(5000).bfloat16() for _ in range(1000)]
    assert _launches(few) == _launches(many)
    few = [torch.randn(3000 + i) for i in range(10)] + [torch.randn(52 + i).bfloat16() for i in range(10)]
    many = [torch.randn(3000 + i) for i in range(200)] + [torch.randn(52 + i).bfloat16() for i in range(200)]
    assert _launches(few) == _launches(many)


@pytest.mark.skipif(not torch.cuda.is_available() or _triton_digest.triton is None, reason="needs CUDA and Triton")
def test_cuda_kernel_gives_the_cpu_digests_in_one_launch():  # pragma: no cover - GPU only
    for seed in range(3):
        cpu = _mixed(seed)
        cuda = [t.cuda() for t in cpu]
        big = torch.randn(70_000_000, device="cuda")  # past 2**26 words: more than 16 rows
        digests = grouped_digests([*cuda, big])
        assert digests.device.type == "cuda"
        assert digests.tolist() == [int(tensor_digest(t)) for t in cpu] + [int(tensor_digest(big.cpu()))]
    few = [torch.randn(1 << 16, device="cuda") for _ in range(10)]
    many = [torch.randn(1 << 16, device="cuda") for _ in range(200)]
    assert _launches(few) == _launches(many)


_INTERPRETED = """
import torch
from sdc_core.checks import _triton_digest as kernel
from sdc_core.checks.digest import _SEEDS, class_shape, tensor_digest, words
assert kernel.triton is not None
g = torch.Generator().manual_seed(0)
sizes = (1, 7, 511, 512, 1023, 1024, 1025, 8191, 8192, 16_385, 100_003)  # one row, 2-16 rows, tails
units = [torch.randint(-(2**62), 2**62, (n,), generator=g) for n in sizes]
units += [words(torch.randn(300, 7, generator=g)), words(torch.randn(5000, generator=g).bfloat16())]
expected = [int(tensor_digest(t)) for t in units]
for block in (kernel.BLOCK, 128):  # the launch shape changes the speed only
    nwords, rows, cols, owner, starts, ends = kernel._tables(torch.device("cpu"), tuple(t.numel() for t in units),
                                                             class_shape, block)
    partial = torch.empty(owner.numel(), dtype=torch.int64)
    table = kernel._pointers(torch.device("cpu"), tuple(t.data_ptr() for t in units))
    kernel._digest_blocks[(owner.numel(),)](table, nwords, rows, cols, owner, starts, partial,
                                            SEED_A=_SEEDS[0], SEED_B=_SEEDS[1], BLOCK=block)
    running = partial.cumsum(0)[ends]  # as kernel.digests scans the partial sums
    got = (running - torch.cat([running.new_zeros(1), running[:-1]])).tolist()
    assert got == expected, (block, got, expected)
print("kernel digests equal", len(units), "units")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs Triton (pip install triton) and no GPU (on a GPU the kernel itself is tested)")
def test_cuda_kernel_in_tritons_interpreter_gives_the_cpu_digests():
    """The CUDA digest kernel's arithmetic, run by Triton's interpreter on CPU tensors
    (``TRITON_INTERPRET=1``, read when the kernel is defined: a process of its own), gives
    ``tensor_digest`` bit for bit: one row and up to 16 rows, tails, several tensors in one launch,
    two launch shapes. Where no GPU is lent this is the kernel's only run."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernel digests equal 13 units" in out.stdout


def test_kernel_tables_give_every_class_to_exactly_one_program():
    """The launch's tables (CPU-side, for the shipped ``BLOCK`` and others): each tensor's classes
    [0, classes) are split into consecutive blocks of ``block``, every class in one block, and ``ends`` names
    each tensor's last block, which the scan's differences rely on."""
    sizes = (1, 511, 512, 513, 4097, 1 << 20, (1 << 26) + 7)
    for block in (_triton_digest.BLOCK, 128, 2048):
        _check_tables(sizes, block)


def _check_tables(sizes: tuple[int, ...], block: int) -> None:
    from sdc_core.checks.digest import class_shape

    nwords, rows, cols, units, starts, ends = _triton_digest._tables(torch.device("cpu"), sizes, class_shape, block)
    for u, n in enumerate(sizes):
        words, r, m = class_shape(n)
        assert (int(nwords[u]), int(rows[u]), int(cols[u])) == (words, r, m)
        mine = (units == u).nonzero().flatten()
        classes = m + n - r * m
        assert starts[mine].tolist() == [block * b for b in range(len(mine))]
        assert block * (len(mine) - 1) < classes <= block * len(mine)
        assert int(ends[u]) == int(mine[-1])
