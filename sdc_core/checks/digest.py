"""The tensor digests the weight fingerprint compares: exact, linear integer digests of a tensor's
bytes, computed on the tensor's own device without a host synchronisation.

The digest (version 2). A tensor's bytes, zero-padded to a multiple of 8, are read as n signed
64-bit words x_0 .. x_{n-1}. With r = min(16, n // 512) rows (at least 1, and more for tensors
over 2**26 words, so that no more than 2**22 classes arise) and m = n // r columns, made odd
when r > 1, the words are summed per class, wrapping mod 2**64: class j < m holds the r words
x_j, x_{j+m}, ..., x_{j+(r-1)m} (one memory-speed reduction over a (r, m) view), and each of the
fewer than 2r words past r*m is a class of its own. With c_j the class sums and h_j = c_j >> 32
(arithmetic shift: the high half, an exact integer in [-2**31, 2**31)), the digest is

    d = sum_j (A_j * c_j + B_j * h_j)      (mod 2**64)

with A_j, B_j odd 64-bit weights from splitmix64 (fixed seeds: identical on every rank, device
and run, no power-of-two period). It is linear: all-zero bytes digest to 0. The fingerprint
combines the per-tensor digests d_t the same way, with two further weight streams, plus the
tensor count times an odd constant. All of it is integer arithmetic mod 2**64, so the result
does not depend on the order a device reduces in (CPU and CUDA agree bit for bit), and nothing
waits for the host.

Why it holds (the weights are fixed, but a fault does not know them: treat them as uniform random
odd numbers independent of the fault). Let replica Y differ from X. (1) If some class sum changes,
c'_j - c_j = D != 0 (mod 2**64), fix every weight but the ones of class j. If the low 32 bits of
c_j changed, D = 2**v * u with u odd and v <= 31, and A_j * D (mod 2**64) is uniform over 2**(63-v)
values, so it hits the one value that cancels the rest with probability <= 2**(v-63) <= 2**-32.
If only the high 32 bits changed, h_j changed by a nonzero integer of magnitude < 2**32 (v <= 31)
and B_j does the same job. So d_t changes except with probability <= 2**-32, and the same argument
one level up gives 2**-32 for the combination: a miss has probability <= 2**-31. (2) A class sum
stays unchanged only if two or more of its words changed and the changes cancel mod 2**64. The
words of a class lie exactly a multiple of m apart, m >= 511 words (4 KiB) and m >= n/16 - 1,
and m is odd. So: every difference confined to fewer than m consecutive words, every difference
in a tensor under 1024 words (one row: every word its own class), and every pattern with a
power-of-two period of at least 16 words (a bad lane or column in hardware: its hits are a
multiple of lcm(m, 2**k) = m * 2**k apart, more than the (r-1)*m a class spans) falls under (1):
missed with probability <= 2**-31, whatever the directions of the flips, whatever the carries.
Two flips at uniformly random places share a class with probability < r/n <= 2**-9 (16/n
for tensors of 8192 words or more: 2**-16 from 8 MiB on); a fault covering more than m words
touches most classes, and each must cancel on its own.

A plain wrap-around sum (version 1, ``tensor_digest_v1``, kept to verify old checkpoints) misses
two opposite flips of one bit, an even number of sign flips and a bad lane; this digest sees them.

Cost: one read of every compared tensor per check (one (r, m) sum, 0.63-0.69x of a plain ``sum`` on
large tensors on a 2-core CPU; many small tensors are batched, ``_host_digests``; docs/performance.md),
then O(n/r) work on the class sums; on CUDA one Triton launch per device (``_triton_digest``);
weights cached per device (16 bytes per class of the largest tensor, at most 128 MiB).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

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
    """``count`` odd 64-bit weights (int64, CPU): splitmix64 of ``seed + (i + 1) * golden`` for
    i < count, low bit set. Integer arithmetic only: identical on every machine and torch version."""

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
    """The class sums c_j of the module docstring, in order, as one or two pieces: the (r, m) sums
    (wrapping int64, one reduction) and the words past r*m (left apart: no copy per tensor)."""
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
    """The version-2 digest of ``t``'s bytes (module docstring), a 0-d int64 tensor on ``t``'s
    device, computed without a host synchronisation. Depends only on the bytes, not the layout."""
    with torch.no_grad():
        return _digest(t)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """``tensor_digest`` without the ``no_grad`` guard (the caller holds it): the hot loop."""
    return _mix(class_sums(words(t)), 0)


def tensor_digest_v1(t: torch.Tensor) -> torch.Tensor:
    """The version-1 digest (wrap-around sum of 64/32/16/8-bit words), kept to verify checkpoints
    written with it. Blind to some structured faults: never use it for new fingerprints."""
    with torch.no_grad():
        try:
            return t.view(-1).view(torch.int64).sum()
        except RuntimeError:
            pass
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
    with torch.no_grad():
        return torch.stack([_on(_digest(t), device) for t in tensors])


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. Blocking: a device-to-host copy made with ``non_blocking=True`` and read
    at once (a ``stack``, a gloo collective) reads stale bytes. The checks keep digests on their
    tensors' device (``collective_device(device)``), so a copy to the host is the exception."""
    return t if t.device == device else t.to(device)


def home_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where the digests of ``tensors`` are combined: the first non-CPU device among them (copies
    from the host to it are safe to read at once), else the host."""
    return next((t.device for t in tensors if not t.is_cpu), torch.device("cpu"))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-d copy of ``tensors`` (same dtype), made by a single C++ call: with many
    small tensors the per-tensor Python overhead, not bandwidth, is what costs."""
    with torch.no_grad():
        return torch._utils._flatten_dense_tensors(list(tensors)).detach()


_BATCH_CLASSES = 1 << 15  # units with at most this many classes share one batched weighting
_layout_cache: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _layout(device: torch.device, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenated weights A, B (each unit's from index 0) and each unit's last index, for
    ``sizes`` (cached)."""
    key = (device, sizes)
    if key not in _layout_cache:
        if len(_layout_cache) >= 64:
            _layout_cache.clear()
        wa, wb, ends = _unit_weights(device, sizes)
        _layout_cache[key] = (wa, wb, ends)
    return _layout_cache[key]


def _unit_weights(device: torch.device, classes: Sequence[int]) -> list[torch.Tensor]:
    """For units of ``classes`` classes laid end to end: the weights A and B of each class (each
    unit's from index 0) and the index of each unit's last class."""
    top = max(classes)
    wa, wb = _weights(0, top, device), _weights(1, top, device)
    ends = torch.tensor(classes, dtype=torch.int64).cumsum(0).sub_(1).to(device)
    return [torch.cat([wa[:k] for k in classes]), torch.cat([wb[:k] for k in classes]), ends]


def _scan_digests(sums: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The digests of units whose class sums lie end to end in ``sums`` (int64; ``_unit_weights``):
    every class weighted, one exact wrapping scan, its differences at the units' last classes."""
    weighted = (sums >> 32).mul_(wb).addcmul_(sums, wa)
    running = weighted.cumsum_(0)[ends]  # exact, wrapping: a deterministic scan
    return torch.diff(running, prepend=running.new_zeros(1))


def mix_units(parts: Sequence[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``tensor_digest`` of each unit from its class sums (``class_parts``), as one int64 vector on ``device``: large
    units weighted one by one, the small ones on each device in one concatenation and one scan."""
    batches: dict[torch.device, list[int]] = {}
    singles: list[int] = []
    sizes = [sum(p.numel() for p in unit) for unit in parts]
    for u, unit in enumerate(parts):
        if 0 < sizes[u] <= _BATCH_CLASSES:
            batches.setdefault(unit[0].device, []).append(u)
        else:
            singles.append(u)
    pieces = [torch.stack([_on(_mix(torch.cat(parts[u]), 0), device) for u in singles])] if singles else []
    order = list(singles)
    for dev, members in batches.items():
        wa, wb, ends = _layout(dev, tuple(sizes[u] for u in members))
        pieces.append(_on(_scan_digests(torch.cat([p for u in members for p in parts[u]]), wa, wb, ends), device))
        order += members
    digests = torch.cat(pieces)
    return digests if order == sorted(order) else digests[_inverse(tuple(order), device)]


_perm_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _inverse(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Indices that put values listed in ``order`` back in unit order (cached per device)."""
    key = (device, order)
    if key not in _perm_cache:
        if len(_perm_cache) >= 64:
            _perm_cache.clear()
        _perm_cache[key] = torch.tensor(order, dtype=torch.int64).argsort().to(device)
    return _perm_cache[key]


def _kernel_digests(tensors: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
    """Indices of the tensors digested by the multi-tensor CUDA kernel (one launch per device:
    contiguous, 8-byte aligned CUDA tensors of whole words) and their digests in that order
    (None when none qualifies). Per tensor only a few attribute reads on the host: no view ops."""
    if _triton is None:
        return [], None
    by_device: dict[torch.device, tuple[list[int], list[int], list[int]]] = {}
    for i, t in enumerate(tensors):
        if t.is_cuda and t.is_contiguous() and t.dtype != torch.bool:
            nbytes, ptr = t.nbytes, t.data_ptr()
            if not nbytes % 8 and not ptr % 8:
                idx, ptrs, sizes = by_device.setdefault(t.device, ([], [], []))
                idx.append(i)
                ptrs.append(ptr)
                sizes.append(nbytes >> 3)
    if not by_device:
        return [], None
    order: list[int] = []
    pieces = []
    for dev, (idx, ptrs, sizes) in by_device.items():
        pieces.append(_triton.digests(dev, tuple(ptrs), tuple(sizes), class_shape, _SEEDS[:2]))
        order += idx
    home = pieces[0].device
    return order, pieces[0] if len(pieces) == 1 else torch.cat([_on(p, home) for p in pieces])


def grouped_digests(
    tensors: Sequence[torch.Tensor], device: torch.device | None = None
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """The per-tensor digests (``tensor_digest`` of each, in order, one int64 vector on ``device``, default
    ``home_device(tensors)``) with few kernel launches, and a function returning them again.

    On CUDA with Triton: one multi-tensor launch per device (``_triton_digest``); elsewhere ``_host_digests``. The
    values do not depend on the path."""
    if not tensors:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, lambda: empty
    device = device or home_device(tensors)
    with torch.no_grad():
        order, fast = _kernel_digests(tensors)
        pieces = [_on(fast, device)] if fast is not None else []
        if len(order) < len(tensors):
            taken = set(order)
            rest = [i for i in range(len(tensors)) if i not in taken] if taken else range(len(tensors))
            more, host = _host_digests(tensors, rest, device)
            order += more
            pieces += host
        digests = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if order != sorted(order):
            digests = digests[_inverse(tuple(order), device)]
    return digests, lambda: digests


# The host path (``_host_digests``). Thresholds measured on a 2-core AMD EPYC (AVX2, no 64-bit
# vector multiply), one thread, CPU time (``benchmarks/kernels.py``, benchmarks/results/performance-history.md):
_BATCH_WORDS = 1 << 15  # words: smaller tensors are batched; larger ones cost bandwidth, not overhead
_MIXED_WORDS = 1 << 13  # words: only smaller tensors join a mixed-size batch (its scatter costs ~3 ns a word)
_CHUNK_WORDS = 1 << 21  # words per batch (16 MiB): bounds the transient copy and the cached layouts
_SAME_FIXED_NS = (30_000, 60_000)  # a same-size batch's fixed cost (one row, several rows) ...
_SAME_SAVES_NS = (1_000, 2)  # ... against what it saves per tensor over a mixed batch: 1 us + 2 ns a word
_host_layouts: dict[tuple[torch.device, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}


def _host_digests(
    tensors: Sequence[torch.Tensor], indices: Sequence[int], device: torch.device
) -> tuple[list[int], list[torch.Tensor]]:
    """``tensor_digest`` of ``tensors[i]`` for ``i`` in ``indices`` with torch ops: the indices in the order digested
    and the digest vectors (on ``device``).

    Tensors under ``_BATCH_WORDS`` words are copied per device, dtype and size into one buffer and digested together
    (a (k, r, m) sum and two matrix-vector products); sizes too rare for a batch of their own (``_own_batch``) share
    a mixed batch (one cached ``index_add_``); larger tensors are reduced one by one (``class_parts``) and weighted
    together (``mix_units``). The plan is cached per list of (device, dtype, shape). Memory: a transient copy of the
    batched tensors (at most ``_CHUNK_WORDS`` words at a time) and cached weights."""
    meta = tuple([(t.device, t.dtype, t.shape) for t in [tensors[i] for i in indices]])  # lists: no call per tensor
    plan = _host_plans.get(meta)
    if plan is None:
        if len(_host_plans) >= 64:
            _host_plans.clear()
        plan = _host_plans[meta] = _host_plan(meta)
    batches, singles, padded, order = plan
    pieces = []
    for same, positions, arg, cat in batches:
        parts = _padded([tensors[indices[p]] for p in positions], [p in padded for p in positions] if padded else None)
        # cat: a copy, and cheaper per tensor; reshape, since cat keeps a channels-last layout (logical order, as
        # tensor_digest reads it)
        values = torch.cat(parts).reshape(-1) if cat else flatten(parts)
        if not cat and len(parts) == 1:
            values = values.clone()  # ``flatten`` of one tensor is a view of it
        values = values.view(torch.int64)  # our own buffer: shifted in place
        pieces.append(
            _on(_same_size_digests(values, len(positions), arg) if same else _mixed_digests(values, arg), device)
        )
    if singles:
        pieces.append(mix_units([class_parts(words(tensors[indices[p]])) for p in singles], device))
    return [indices[p] for p in order], pieces


_host_plans: dict[tuple, tuple] = {}


def _host_plan(meta: tuple[tuple[torch.device, torch.dtype, torch.Size], ...]) -> tuple:
    """``_host_digests``' plan for tensors of ``meta`` (device, dtype, shape) by position: the
    batches (same size?, positions, words or the tuple of sizes, whether ``cat`` joins them:
    all at least 1-d with the same trailing dimensions), the positions digested one by one,
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


_pads: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


def _padded(parts: list[torch.Tensor], pad: list[bool] | None) -> list[torch.Tensor]:
    """``parts``, each with ``pad`` set followed by the zeros that pad its bytes to whole words
    (cached), ready for ``flatten``."""
    if pad is None or not any(pad):
        return parts
    out: list[torch.Tensor] = []
    for t, needed in zip(parts, pad, strict=True):
        out.append(t)
        if needed:
            key = (t.device, t.dtype, (8 - (t.nbytes & 7)) // t.element_size())
            if key not in _pads:
                _pads[key] = torch.zeros(key[2], dtype=t.dtype, device=t.device)
            out.append(_pads[key])
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
    """``m @ w`` mod 2**64 for int64 ``m`` (k, n) and ``w`` (n,): one ``mv`` on the CPU (no
    temporary), a product and a row sum where ``mv`` has no integer kernel (CUDA)."""
    return torch.mv(m, w) if (m.is_cpu if fused is None else fused) else (m * w).sum(1)


def _mixed_digests(values: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Digests of tensors of ``sizes`` words laid end to end in ``values`` (int64), in one batch: a
    cached class index gathers the class sums, each tensor weighted with its own weights."""
    wa, wb, ends, *index = _host_layout(values.device, sizes)
    sums = values if not index else values.new_zeros(wa.numel()).index_add_(0, index[0], values)
    return _scan_digests(sums, wa, wb, ends)


def _host_layout(device: torch.device, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """For tensors of ``sizes`` words laid end to end: the weights A, B of each class (each
    tensor's from index 0), the index of each tensor's last class and, when some tensor has
    several rows, each word's class (int32; cached, at most 64 layouts)."""
    key = (device, sizes)
    if key not in _host_layouts:
        if len(_host_layouts) >= 64:
            _host_layouts.clear()
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
        _host_layouts[key] = tuple(layout)
    return _host_layouts[key]


def combine(digests: torch.Tensor) -> torch.Tensor:
    """One int64 fingerprint from a vector of tensor digests (weighted as the module docstring
    says, plus the count, so a missing tensor is never silent)."""
    return _mix(digests, 2) + _signed(digests.numel() * _COUNT_WEIGHT)


__all__ = [
    "DIGEST_VERSION",
    "combine",
    "grouped_digests",
    "tensor_digest",
    "tensor_digest_v1",
    "tensor_digests",
]
