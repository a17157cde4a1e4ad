"""Exact, linear integer digests of a tensor's bytes, computed on its own device without a host synchronisation: what
the weight fingerprint compares.

The digest (version 2). The bytes, zero-padded to a multiple of 8, are n signed 64-bit words. With r = min(16, n // 512)
rows (at least 1; more past 2**26 words: at most 2**22 classes) and m = n // r columns, odd when r > 1, class j < m is
the r words x_j, x_{j+m}, ..., x_{j+(r-1)m}, and each of the fewer than 2r words past r*m is a class of its own. With
c_j the class sums (wrapping mod 2**64) and h_j = c_j >> 32 (arithmetic shift), d = sum_j (A_j * c_j + B_j * h_j) mod
2**64, with A_j, B_j odd splitmix64 weights of fixed seeds (identical on every rank, device and run). The fingerprint
combines the d_t the same way with two more weight streams, plus the tensor count times an odd constant. Integer
arithmetic only: independent of the reduction order, CPU and CUDA agree.

Why it holds (a fault does not know the weights: treat them as uniform random odd numbers). (1) If a class sum changes
by D = 2**v * u != 0 (u odd): if its low 32 bits changed (v <= 31), A_j * D is uniform over 2**(63-v) values and cancels
the rest with probability <= 2**-32; if only its high half changed, h_j changed by a nonzero integer below 2**32 in
magnitude and B_j does the same. One level up likewise: a miss has probability <= 2**-31. (2) A class sum stays
unchanged only if two or more of its words changed and cancel mod 2**64. A class's words lie a multiple of m apart, m
odd, m >= 511 words (4 KiB) and m >= n/16 - 1. So every difference within fewer than m consecutive words, every
difference in a tensor under 1024 words, and every pattern with a power-of-two period of at least 16 words (a bad lane
or column: its hits lie a multiple of m * 2**k apart, more than a class spans) falls under (1): missed with probability
<= 2**-31, whatever the flips and carries. Two flips at random places share a class with probability < r/n <= 2**-9
(2**-16 from 8 MiB on); a fault over more than m words touches most classes, each of which must cancel on its own.

Version 1 (``tensor_digest_v1``, a wrap-around sum kept to verify old checkpoints) misses two opposite flips of one bit,
an even number of sign flips and a bad lane.

Cost: one read of every compared tensor (0.63-0.69x of a plain ``sum`` on a 2-core CPU; small tensors batched;
docs/performance.md), then O(n/r) work; on CUDA one Triton launch per device; weights cached per device (16 bytes per
class of the largest tensor, at most 128 MiB)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import torch

from sdc_core.checks import _triton_digest

DIGEST_VERSION = 2
_ROWS = 16  # at most this many words per class (more only past _MAX_CLASSES classes)
_MIN_COLUMNS = 1 << 9  # a class's words lie at least about this many words apart
_MAX_CLASSES = 1 << 22  # bounds the cached weights: 16 bytes per class
_MASK64 = (1 << 64) - 1
_COUNT_WEIGHT = 0x9E3779B97F4A7C15  # odd: the tensor count enters the fingerprint
_SEEDS = (0x5DC0DE0F1A9E12, 0x5DC0DE0F1A9E13, 0x5DC0DE0F1A9E14, 0x5DC0DE0F1A9E15)  # A, B; fingerprint A, B
_weight_cache: dict[tuple[torch.device, int], torch.Tensor] = {}
_triton = _triton_digest if _triton_digest.triton is not None else None


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


def splitmix64(seed: int, count: int) -> torch.Tensor:
    """``count`` odd 64-bit weights (int64, CPU): splitmix64 of ``seed + (i + 1) * golden``, low bit
    set. Integer arithmetic only: identical on every machine and torch version."""

    def shr(z: torch.Tensor, s: int) -> torch.Tensor:  # logical shift right of an int64
        return (z >> s) & ((1 << (64 - s)) - 1)

    z = torch.arange(1, count + 1, dtype=torch.int64) * _signed(0x9E3779B97F4A7C15) + _signed(seed)
    z = (z ^ shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ shr(z, 31)) | 1


def _weights(stream: int, count: int, device: torch.device) -> torch.Tensor:
    """The first ``count`` weights of ``stream`` on ``device`` (cached, grown by doubling)."""
    cached = _weight_cache.get((device, stream))
    if cached is None or cached.numel() < count:
        size = max(1024, 1 << max(count - 1, 0).bit_length())
        cached = splitmix64(_SEEDS[stream], size).to(device)
        _weight_cache[(device, stream)] = cached
    return cached[:count]


def _wdot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(a * w) mod 2**64 as a 0-d int64 tensor (one fused kernel where the device has one)."""
    return torch.dot(a, w) if a.device.type == "cpu" else (a * w).sum()


def _mix(values: torch.Tensor, stream: int) -> torch.Tensor:
    """sum_j A_j * v_j + B_j * (v_j >> 32) mod 2**64 (weights of ``stream`` and ``stream + 1``)."""
    n, device = values.numel(), values.device
    return _wdot(values, _weights(stream, n, device)) + _wdot(values >> 32, _weights(stream + 1, n, device))


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 words, zero-padded to a multiple of 8 (a view when possible)."""
    try:  # fast path, the common case: contiguous, aligned, a multiple of 8 bytes
        return t.view(-1).view(torch.int64)
    except RuntimeError:  # non-contiguous, misaligned, or a size that is not a multiple of 8 bytes
        pass
    flat = t.contiguous().view(-1)
    raw = flat.view(torch.uint8)
    buf = torch.zeros((raw.numel() + 7) // 8 * 8, dtype=torch.uint8, device=t.device)
    buf[: raw.numel()] = raw
    return buf.view(torch.int64)


def class_shape(n: int) -> tuple[int, int, int]:
    """(words, rows, cols) of the class layout of ``n`` words (``class_parts``; one row: cols = n)."""
    rows = max(1, min(_ROWS, n // _MIN_COLUMNS), -(-n // _MAX_CLASSES))
    if rows == 1:
        return n, 1, n
    cols = n // rows
    return n, rows, cols - (1 - cols % 2)  # odd: no power-of-two stride lands twice in a class


def class_parts(words: torch.Tensor) -> list[torch.Tensor]:
    """The class sums c_j in order, as the (r, m) sums and the words past r*m (not copied)."""
    n, rows, cols = class_shape(words.numel())
    if rows == 1:
        return [words]
    sums = words[: rows * cols].view(rows, cols).sum(0)
    return [sums, words[rows * cols :]] if rows * cols < n else [sums]


def class_sums(words: torch.Tensor) -> torch.Tensor:
    """The class sums c_j of the module docstring as one vector."""
    parts = class_parts(words)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The version-2 digest of ``t``'s bytes (0-d int64 on ``t``'s device, no host synchronisation).
    Depends only on the bytes, not the layout."""
    with torch.no_grad():
        return _mix(class_sums(words(t)), 0)


def tensor_digest_v1(t: torch.Tensor) -> torch.Tensor:
    """The version-1 digest (wrap-around sum of 64/32/16/8-bit words), kept to verify checkpoints
    written with it; never for new fingerprints."""
    with torch.no_grad():
        flat = t.contiguous().view(-1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        if flat.numel() == 0:
            return torch.zeros((), dtype=torch.int64, device=t.device)
        for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
            if (flat.numel() * flat.element_size()) % torch.empty((), dtype=dtype).element_size():
                continue
            try:
                words = flat.view(dtype)
            except RuntimeError:  # misaligned storage offset: try a narrower word
                continue
            return words.sum() if dtype == torch.int64 else words.sum(dtype=torch.int64)
        raise TypeError(f"cannot digest a tensor of dtype {t.dtype}")  # pragma: no cover


def tensor_digests(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Digests of ``tensors`` as one int64 vector on ``device`` (default: the first tensor's)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    device = device or tensors[0].device
    # digests move with blocking copies (here and below): a non_blocking device-to-host copy read at once
    # (a ``stack``, a gloo collective) reads stale bytes
    return torch.stack([tensor_digest(t).to(device) for t in tensors])


def home_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where the digests of ``tensors`` are combined: the first non-CPU device among them, else the host."""
    return next((t.device for t in tensors if not t.is_cpu), torch.device("cpu"))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-d copy of ``tensors`` (same dtype), made by a single C++ call."""
    with torch.no_grad():
        return torch._utils._flatten_dense_tensors(list(tensors)).detach()


_BATCH_CLASSES = 1 << 15  # units with at most this many classes share one batched weighting


def _unit_weights(device: torch.device, classes: Sequence[int]) -> list[torch.Tensor]:
    """Per class of units laid end to end its weights A and B, and each unit's last class index."""
    top = max(classes)
    wa, wb = _weights(0, top, device), _weights(1, top, device)
    ends = torch.tensor(classes, dtype=torch.int64).cumsum(0).sub_(1).to(device)
    return [torch.cat([wa[:k] for k in classes]), torch.cat([wb[:k] for k in classes]), ends]


_batch_weights = functools.lru_cache(maxsize=64)(_unit_weights)  # mix_units' layouts (read only)


def _scan_digests(sums: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The digests of units whose class sums lie end to end in ``sums``: one exact wrapping scan."""
    weighted = (sums >> 32).mul_(wb).addcmul_(sums, wa)
    running = weighted.cumsum_(0)[ends]  # exact, wrapping: a deterministic scan
    return torch.diff(running, prepend=running.new_zeros(1))


def mix_units(parts: Sequence[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``tensor_digest`` of each unit from its ``class_parts``, one int64 vector on ``device``: large
    units weighted one by one, the small ones per device in one scan."""
    batches: dict[torch.device, list[int]] = {}
    singles: list[int] = []
    sizes = [sum(p.numel() for p in unit) for unit in parts]
    for u, unit in enumerate(parts):
        if 0 < sizes[u] <= _BATCH_CLASSES:
            batches.setdefault(unit[0].device, []).append(u)
        else:
            singles.append(u)
    pieces = [torch.stack([_mix(torch.cat(parts[u]), 0).to(device) for u in singles])] if singles else []
    order = list(singles)
    for dev, members in batches.items():
        wa, wb, ends = _batch_weights(dev, tuple(sizes[u] for u in members))
        pieces.append(_scan_digests(torch.cat([p for u in members for p in parts[u]]), wa, wb, ends).to(device))
        order += members
    return _in_order(pieces, order, device)


def _in_order(pieces: list[torch.Tensor], order: list[int], device: torch.device) -> torch.Tensor:
    """The digest vectors ``pieces`` (on ``device``) of the units listed in ``order``, joined and put back in
    unit order (the permutation cached per device)."""
    digests = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return digests if order == sorted(order) else digests[_unsorting(tuple(order), device)]


@functools.lru_cache(maxsize=64)
def _unsorting(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(order, dtype=torch.int64).argsort().to(device)


def _kernel_digests(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Indices of the tensors the multi-tensor CUDA kernel digests (contiguous, 8-byte aligned CUDA
    tensors of whole words; one launch per device) and their digests in that order, a vector per device."""
    if _triton is None:
        return [], []
    by_device: dict[torch.device, tuple[list[int], list[int], list[int]]] = {}
    for i, t in enumerate(tensors):
        if t.is_cuda and t.is_contiguous() and t.dtype != torch.bool:
            nbytes, ptr = t.nbytes, t.data_ptr()
            if not nbytes % 8 and not ptr % 8:
                idx, ptrs, sizes = by_device.setdefault(t.device, ([], [], []))
                idx.append(i)
                ptrs.append(ptr)
                sizes.append(nbytes >> 3)
    order: list[int] = []
    pieces = []
    for dev, (idx, ptrs, sizes) in by_device.items():
        pieces.append(_triton.digests(dev, tuple(ptrs), tuple(sizes), class_shape, _SEEDS[:2]))
        order += idx
    return order, pieces


def grouped_digests(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """``tensor_digest`` of each tensor as one int64 vector on ``device`` (default ``home_device``),
    with few launches (the values do not depend on the path)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    device = device or home_device(tensors)
    with torch.no_grad():
        order, fast = _kernel_digests(tensors)
        pieces = [p.to(device) for p in fast]
        if len(order) < len(tensors):
            taken = set(order)
            rest = [i for i in range(len(tensors)) if i not in taken] if taken else range(len(tensors))
            more, host = _host_digests(tensors, rest, device)
            order += more
            pieces += host
        return _in_order(pieces, order, device)


# The host path's thresholds, measured on a 2-core AMD EPYC, one thread (``benchmarks/kernels.py``):
_BATCH_WORDS = 1 << 15  # words: smaller tensors are batched; larger ones cost bandwidth, not overhead
_MIXED_WORDS = 1 << 13  # words: only smaller tensors join a mixed-size batch (its scatter costs ~3 ns a word)
_CHUNK_WORDS = 1 << 21  # words per batch (16 MiB): bounds the transient copy and the cached layouts
_SAME_FIXED_NS = (30_000, 60_000)  # a same-size batch's fixed cost (one row, several rows) ...
_SAME_SAVES_NS = (1_000, 2)  # ... against what it saves per tensor over a mixed batch: 1 us + 2 ns a word


def _host_digests(
    tensors: Sequence[torch.Tensor], indices: Sequence[int], device: torch.device
) -> tuple[list[int], list[torch.Tensor]]:
    """``tensor_digest`` of ``tensors[i]`` for ``i`` in ``indices``: the indices in the order digested and the digest
    vectors (on ``device``). Small tensors are copied into batches (at most ``_CHUNK_WORDS`` words at a time)."""
    meta = tuple([(t.device, t.dtype, t.shape) for t in [tensors[i] for i in indices]])  # lists: no call per tensor
    batches, singles, padded, order = _host_plan(meta)
    pieces = []
    for same, positions, arg, cat in batches:
        parts = _padded([tensors[indices[p]] for p in positions], [p in padded for p in positions] if padded else None)
        # cat: a copy, and cheaper per tensor; reshape, since cat keeps a channels-last layout (logical order, as
        # tensor_digest reads it)
        values = torch.cat(parts).reshape(-1) if cat else flatten(parts)
        if not cat and len(parts) == 1:
            values = values.clone()  # ``flatten`` of one tensor is a view of it
        values = values.view(torch.int64)  # our own buffer: shifted in place
        digests = _same_size_digests(values, len(positions), arg) if same else _mixed_digests(values, arg)
        pieces.append(digests.to(device))
    if singles:
        pieces.append(mix_units([class_parts(words(tensors[indices[p]])) for p in singles], device))
    return [indices[p] for p in order], pieces


@functools.lru_cache(maxsize=64)
def _host_plan(meta: tuple[tuple[torch.device, torch.dtype, torch.Size], ...]) -> tuple:
    """``_host_digests``' plan for tensors of ``meta`` (device, dtype, shape): the batches (same size?,
    positions, words or sizes, whether ``cat`` can join them), the positions digested one by one,
    those padded to whole words, and the order of the digests produced."""
    sized: dict[tuple[torch.device, torch.dtype, int], list[int]] = {}
    singles: list[int] = []
    nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in meta]
    for p, (dev, dtype, _) in enumerate(meta):
        if 0 < nbytes[p] < 8 * _BATCH_WORDS and dtype != torch.bool:
            sized.setdefault((dev, dtype, (nbytes[p] + 7) >> 3), []).append(p)
        else:
            singles.append(p)
    padded = {p for members in sized.values() for p in members if nbytes[p] & 7}

    def cat(positions: list[int]) -> bool:
        tails = {tuple(meta[p][2][1:]) if meta[p][2] else None for p in positions}
        return None not in tails and len(tails) == 1 and (tails == {()} or padded.isdisjoint(positions))

    batches: list[tuple[bool, list[int], object, bool]] = []
    mixed: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for (dev, dtype, w), members in sized.items():
        if not _own_batch(len(members), w):
            mixed.setdefault((dev, dtype), []).extend(members)
        elif len(members) == 1 and w >= _MIXED_WORDS:
            singles += members
        else:
            step = max(1, _CHUNK_WORDS // w)
            chunks = [members[s : s + step] for s in range(0, len(members), step)]
            batches += [(True, chunk, w, cat(chunk)) for chunk in chunks]
    for members in mixed.values():
        chunks = [[]]
        room = _CHUNK_WORDS
        for p in members:
            w = (nbytes[p] + 7) >> 3
            if w > room and chunks[-1]:
                chunks.append([])
                room = _CHUNK_WORDS
            chunks[-1].append(p)
            room -= w
        batches += [(False, chunk, tuple((nbytes[p] + 7) >> 3 for p in chunk), cat(chunk)) for chunk in chunks]
    order = [p for _, positions, _, _ in batches for p in positions] + singles
    return batches, singles, padded, order


_zeros = functools.lru_cache(maxsize=64)(torch.zeros)  # the pads: read only


def _padded(parts: list[torch.Tensor], pad: list[bool] | None) -> list[torch.Tensor]:
    """``parts``, each with ``pad`` set followed by the (cached) zeros that pad it to whole words."""
    if pad is None or not any(pad):
        return parts
    out: list[torch.Tensor] = []
    for t, needed in zip(parts, pad, strict=True):
        out.append(t)
        if needed:
            out.append(_zeros((8 - (t.nbytes & 7)) // t.element_size(), dtype=t.dtype, device=t.device))
    return out


def _own_batch(count: int, w: int) -> bool:
    """Whether ``count`` tensors of ``w`` words get a batch of their own rather than join the mixed one."""
    if w >= _MIXED_WORDS:
        return True
    return count * (_SAME_SAVES_NS[0] + _SAME_SAVES_NS[1] * w) >= _SAME_FIXED_NS[w >= 2 * _MIN_COLUMNS]


def _same_size_digests(flat: torch.Tensor, k: int, w: int) -> torch.Tensor:
    """Digests of ``k`` tensors of ``w`` words each, laid end to end in ``flat`` (int64; changed)."""
    values = flat.view(k, w)
    _, rows, cols = class_shape(w)
    wa, wb = _weights(0, w, flat.device), _weights(1, w, flat.device)
    if rows == 1:  # the class sums are the words
        return _wmv(values, wa) + _wmv(values.bitwise_right_shift_(32), wb)
    sums = values[:, : rows * cols].view(k, rows, cols).sum(1)
    digests = _wmv(sums, wa[:cols]) + _wmv(sums.bitwise_right_shift_(32), wb[:cols])
    if rows * cols < w:  # each word past rows * cols is a class of its own
        tail, ends = values[:, rows * cols :], w - (rows - 1) * cols
        digests += _wmv(tail, wa[cols:ends]) + _wmv(tail >> 32, wb[cols:ends])
    return digests


def _wmv(m: torch.Tensor, w: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``m @ w`` mod 2**64 for int64 ``m`` (k, n) and ``w`` (n,) (CUDA has no integer ``mv``)."""
    return torch.mv(m, w) if (m.is_cpu if fused is None else fused) else (m * w).sum(1)


def _mixed_digests(values: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Digests of tensors of ``sizes`` words laid end to end in ``values`` (int64), in one batch."""
    wa, wb, ends, *index = _host_layout(values.device, sizes)
    sums = values if not index else values.new_zeros(wa.numel()).index_add_(0, index[0], values)
    return _scan_digests(sums, wa, wb, ends)


@functools.lru_cache(maxsize=64)
def _host_layout(device: torch.device, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``_unit_weights`` for tensors of ``sizes`` words and, with several rows, each word's class (cached)."""
    classes, where, start = [], [], 0
    for n in sizes:
        _, rows, cols = class_shape(n)
        if rows == 1:
            classes.append(n)
            where.append(torch.arange(start, start + n, dtype=torch.int32))
        else:
            i = torch.arange(n, dtype=torch.int32)
            where.append(torch.where(i < rows * cols, i % cols, i - (rows - 1) * cols).add_(start))
            classes.append(n - (rows - 1) * cols)
        start += classes[-1]
    layout = _unit_weights(device, classes)
    if start < sum(sizes):
        layout.append(torch.cat(where).to(device))
    return tuple(layout)


def combine(digests: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint of tensor digests (plus their count: a missing tensor is never silent)."""
    return _mix(digests, 2) + _signed(digests.numel() * _COUNT_WEIGHT)


__all__ = ["DIGEST_VERSION", "combine", "grouped_digests", "tensor_digest", "tensor_digest_v1", "tensor_digests"]
