"""Checkpoint alteration (as in the SBAC-PAD 2022 study of DDP and Horovod training): flip seeded bits in a saved
checkpoint's tensors and log every flip, for ``sdc corrupt-checkpoint`` and the campaign. The input is never written
unless asked; outputs are written atomically."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdc_core.faults.inject import flip_bit
from sdc_core.io.checkpoints import Checkpoint
from sdc_core.io.safe_files import atomic_write_text, check_output

BIT_CLASSES = ("sign", "exponent_top", "exponent", "mantissa")
# (exponent bits, mantissa bits) per float format
_LAYOUT = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10), torch.float64: (11, 52)}


def bits_of_class(dtype: torch.dtype, bit_class: str) -> list[int]:
    """Bit positions (0 = least significant) of a bit class in a float format."""
    if dtype not in _LAYOUT:
        raise ValueError(f"bit classes are defined for float formats, not {dtype}")
    exp, man = _LAYOUT[dtype]
    width = 1 + exp + man
    classes = {
        "sign": [width - 1],
        "exponent_top": [width - 2],
        "exponent": list(range(man, width - 2)),
        "mantissa": list(range(man)),
    }
    if bit_class not in classes:
        raise ValueError(f"bit class must be one of {BIT_CLASSES}, got {bit_class!r}")
    return classes[bit_class]


@dataclass(frozen=True)
class Corruption:
    """What to flip (validated on construction)."""

    target: str = "weights"  # "weights", "optimizer" or "all"
    pattern: str | None = None  # regular expression on tensor names
    count: int | None = 1
    fraction: float | None = None
    bit_class: str | None = "exponent_top"
    bits: tuple[int, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.target not in ("weights", "optimizer", "all"):
            raise ValueError(f"target must be weights, optimizer or all, got {self.target!r}")
        if (self.count is None) == (self.fraction is None):
            raise ValueError("give exactly one of count and fraction")
        if self.count is not None and self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if (self.bit_class is None) == (self.bits is None):
            raise ValueError("give exactly one of bit_class and bits")
        if self.bit_class is not None and self.bit_class not in BIT_CLASSES:
            raise ValueError(f"bit_class must be one of {BIT_CLASSES}, got {self.bit_class!r}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {err}") from None
        if self.bits is not None and (not self.bits or any(not 0 <= b < 64 for b in self.bits)):
            raise ValueError(f"bits must be bit positions in 0..63, got {list(self.bits)}")


def distinct_positions(total: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct positions in ``range(total)``, sorted, every ``n``-subset equally likely.

    Memory O(n), not O(total): uniform draws pooled until ``n`` are distinct (a uniform subset),
    then ``n`` of them kept at random; for ``n >= total / 2`` a permutation, which costs no more."""
    if not 0 <= n <= total:
        raise ValueError(f"cannot pick {n} distinct positions out of {total}")
    if 2 * n >= total:
        return torch.randperm(total, generator=gen)[:n].sort().values
    pool = torch.empty(0, dtype=torch.int64)
    while pool.numel() < n:
        need = n - pool.numel()
        draws = torch.randint(total, (need + need // 2 + 16,), generator=gen, dtype=torch.int64)
        pool = torch.unique(torch.cat([pool, draws]))
    if pool.numel() > n:
        pool = pool[torch.randperm(pool.numel(), generator=gen)[:n]]
    return pool.sort().values


def corrupt(ckpt: Checkpoint, spec: Corruption) -> list[dict[str, Any]]:
    """Flip bits of ``ckpt``'s tensors in memory as ``spec`` says; returns the flip log."""
    rx = re.compile(spec.pattern) if spec.pattern else None
    chosen = [(name, t) for name, group, t in ckpt.tensors()
              if (spec.target == "all" or group == spec.target) and (rx is None or rx.search(name))]  # fmt: skip
    if not chosen:
        raise ValueError(f"no floating tensor matches target={spec.target!r} pattern={spec.pattern!r} in {ckpt.path}")
    bounds = torch.cumsum(torch.tensor([t.numel() for _, t in chosen], dtype=torch.int64), 0)
    total = int(bounds[-1])
    if total == 0:
        raise ValueError(f"the tensors matching target={spec.target!r} pattern={spec.pattern!r} are empty")
    n = spec.count if spec.count is not None else max(1, round(spec.fraction * total))  # type: ignore[operator]
    gen = torch.Generator().manual_seed(spec.seed)
    flat = distinct_positions(total, min(n, total), gen)
    log = []
    for pos in flat.tolist():
        ti = int(torch.searchsorted(bounds, torch.tensor(pos), right=True))
        name, t = chosen[ti]
        index = pos - (int(bounds[ti - 1]) if ti else 0)
        options = list(spec.bits) if spec.bits is not None else bits_of_class(t.dtype, spec.bit_class)  # type: ignore[arg-type]
        bit = options[int(torch.randint(len(options), (1,), generator=gen))]
        if not t.is_contiguous():
            raise ValueError(f"tensor {name} is not contiguous")
        old, new = flip_bit(t, index, bit)
        log.append({"tensor": name, "index": index, "bit": bit, "old": old, "new": new, "dtype": str(t.dtype)})
    return log


def corrupt_file(src: str | Path, out: str | Path | None, spec: Corruption, in_place: bool = False,
                 trust_pickle: bool = False) -> dict[str, Any]:  # fmt: skip
    """Load ``src``, flip as ``spec`` says, write ``out`` (or ``src`` with ``in_place``) and the log beside it
    (``<out>.flips.json``), both atomically; return the log. The input is never written unless ``in_place``, not even
    through another name for it (a hard link). Raises ``ValueError`` for a bad request, ``UnreadableError`` for an
    unreadable input, ``OutputError`` for an output that cannot be written."""
    src = Path(src)
    if in_place and out is not None and Path(out) != src:
        raise ValueError("give an output path or in_place=True (--in-place), not both")
    if out is None and not in_place:
        raise ValueError("give an output path (-o), or in_place=True (--in-place) to overwrite the input")
    dst = src if in_place else Path(out)  # type: ignore[arg-type]
    log_path = Path(f"{dst}.flips.json")
    if not in_place and _same(dst, src):
        raise ValueError(f"the output {dst} is the input file; pass --in-place (in_place=True) to overwrite it")
    if _same(log_path, src) or (src.is_dir() and _inside(log_path, src) and not in_place):
        raise ValueError(f"the flip log {log_path} would overwrite the input; choose another output name")
    if src.is_dir() and not in_place and _inside(dst, src):
        raise ValueError(f"the output {dst} is inside the input folder {src}; choose a folder outside it")
    if not src.is_dir():
        check_output(dst)  # a device, FIFO or folder is refused before any work
    check_output(log_path)
    ckpt = Checkpoint.load(src, trust_pickle)
    flips = corrupt(ckpt, spec)
    ckpt.save(dst)
    log = {"input": str(src), "output": str(dst), "kind": ckpt.kind, "spec": spec.__dict__, "flips": flips}
    atomic_write_text(log_path, json.dumps(log, indent=1, default=list))
    return log


def _same(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file or folder (hard links and symlinks included)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _inside(a: Path, folder: Path) -> bool:
    return a.resolve().is_relative_to(folder.resolve())


__all__ = ["BIT_CLASSES", "Corruption", "bits_of_class", "corrupt", "corrupt_file", "distinct_positions"]
