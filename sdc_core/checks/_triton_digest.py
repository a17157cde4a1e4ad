"""The version-2 tensor digest of many CUDA tensors in ONE kernel launch (Triton).

Same value as ``digest.tensor_digest`` for every tensor, bit for bit (wrapping 64-bit integer arithmetic; the weights
are computed in registers). Each program sums ``BLOCK`` classes of one tensor, weights them and writes one partial sum;
one exact integer scan adds each tensor's up. Launches per call: the kernel and four small ones, whatever the number of
tensors; every byte read once. ``triton`` is None where Triton is missing or ``SDC_TRITON=0`` (the caller takes the
torch path)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

try:  # pragma: no cover - CPU machines have no Triton
    if os.environ.get("SDC_TRITON", "1") == "0":  # opt out: the torch path everywhere
        raise ImportError("SDC_TRITON=0")
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

# The launch shape (each thread loads two words per row), measured on an H200 (benchmarks/digest_blocks.py):
# 0.93-1.06x of a flat sum on 40 MB to 4.8 GB. The digests do not depend on it.
BLOCK = 512
WARPS = 8


if triton is not None:  # pragma: no cover - needs a GPU

    @triton.jit
    def _splitmix(j, seed: tl.constexpr):
        z = (j + 1).to(tl.uint64) * 0x9E3779B97F4A7C15 + seed
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = (z ^ (z >> 31)) | 1
        return z.to(tl.int64, bitcast=True)

    @triton.jit
    def _digest_blocks(ptrs, nwords, rows, cols, blk_unit, blk_start, out,
                       SEED_A: tl.constexpr, SEED_B: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        u = tl.load(blk_unit + pid)
        j0 = tl.load(blk_start + pid)
        base = tl.load(ptrs + u).to(tl.pointer_type(tl.int64))
        n = tl.load(nwords + u)
        r = tl.load(rows + u)
        m = tl.load(cols + u)
        main = r * m
        classes = m + n - main
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        in_main = j < m
        acc = tl.load(base + j, mask=in_main, other=0)
        for k in tl.static_range(1, 16):  # unrolled; a vector mask (TRITON_INTERPRET mistypes a scalar one)
            acc += tl.load(base + (j + k * m), mask=in_main & (tl.full([BLOCK], k, tl.int64) < r), other=0)
        for k in range(16, r):  # more than 16 rows: tensors over 2**26 words only
            acc += tl.load(base + (j + k * m), mask=in_main, other=0)
        in_tail = (j >= m) & (j < classes)
        acc += tl.load(base + (main + j - m), mask=in_tail, other=0)
        term = _splitmix(j, SEED_A) * acc + _splitmix(j, SEED_B) * (acc >> 32)
        term = tl.where(j < classes, term, 0)
        tl.store(out + pid, tl.sum(term, axis=0))


@functools.lru_cache(maxsize=8)
def _tables(device: torch.device, sizes: tuple[int, ...], shape: Callable[[int], tuple[int, int, int]],
            block: int = BLOCK) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Per-unit (words, rows, cols), per-block (unit, first class) and each unit's last block, on
    ``device`` (cached per list of word counts)."""
    shapes = [shape(n) for n in sizes]
    units, starts, ends = [], [], []
    for u, (n, r, m) in enumerate(shapes):
        classes = m + n - r * m
        count = max(1, -(-classes // block))
        units += [u] * count
        starts += [block * b for b in range(count)]
        ends.append(len(units) - 1)
    cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*shapes, strict=True)]
    return tuple(t.to(device) for t in (*cols, torch.tensor(units), torch.tensor(starts), torch.tensor(ends)))


@functools.lru_cache(maxsize=8)
def _pointers(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    """The words' addresses as an int64 table on ``device`` (cached: the steady state copies nothing)."""
    return torch.tensor(ptrs, dtype=torch.int64).to(device)


def digests(device: torch.device, ptrs: tuple[int, ...], sizes: tuple[int, ...],
            shape: Callable[[int], tuple[int, int, int]], seeds: tuple[int, int],
            block: int = BLOCK, warps: int = WARPS) -> torch.Tensor:  # fmt: skip
    """The digest of each run of ``sizes[i]`` int64 words at address ``ptrs[i]`` (8-byte aligned
    memory of CUDA ``device``, kept alive by the caller; ``shape``: ``digest.class_shape``) as one
    int64 vector on that device. ``block`` and ``warps`` change the speed only, never the values."""
    nwords, rows, cols, units, starts, ends = _tables(device, sizes, shape, block)
    table = _pointers(device, ptrs)
    partial = torch.empty(units.numel(), dtype=torch.int64, device=device)
    with torch.cuda.device(device):
        _digest_blocks[(units.numel(),)](table, nwords, rows, cols, units, starts, partial,
                                          SEED_A=seeds[0], SEED_B=seeds[1], BLOCK=block, num_warps=warps)  # fmt: skip
    running = partial.cumsum(0)[ends]  # wrapping integer scan: exact in any order
    return running - torch.cat([running.new_zeros(1), running[:-1]])
