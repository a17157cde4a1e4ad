"""Read-only reductions of gradients on their device, without a host synchronisation: the
largest magnitudes (peaks) and their log2 per group, NaN/Inf flags."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from sdc_core.checks.digest import flatten

SMALL_TENSOR = 1 << 12  # elements: ``any_nonfinite`` (the host path) flattens smaller tensors together


_AMINMAX_FROM = 1 << 11  # elements: on the CPU, tensors this large or larger are read one by one (``aminmax``)


def peaks(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor (all of one dtype and device) its largest magnitude, 1-d on their device: non-finite exactly when the
    tensor holds NaN or Inf. Off the CPU a few multi-tensor kernels; on the CPU (whose inf-norm is a scalar loop) one
    ``aminmax`` per tensor from ``_AMINMAX_FROM`` elements, and three ops for all of them together."""
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, float("inf")))
    small = [t for t in tensors if t.numel() < _AMINMAX_FROM]
    norms = iter(torch._foreach_norm(small, float("inf")) if small else ())
    ends: list[torch.Tensor] = []  # two values a tensor, the largest magnitude among them its peak
    for t in tensors:
        ends += (v := next(norms), v) if t.numel() < _AMINMAX_FROM else torch.aminmax(t)
    return torch.stack(ends).abs_().view(-1, 2).amax(1)


Index = torch.Tensor | Sequence[int]


def log2_peaks_by_group(pairs: Sequence[tuple[torch.Tensor, Index]], groups: int) -> torch.Tensor:
    """Per group the log2 of the largest peak given to it (``pairs`` of ``peaks`` and group indices):
    NaN for none nonzero, +Inf for a non-finite one; float32 on the first peaks' device, no host sync."""
    home = pairs[0][0].device
    out = torch.full((groups,), float("-inf"), device=home)
    for values, index in pairs:
        v = values.to(home, torch.float32)
        v = torch.where(torch.isfinite(v), v, torch.full_like(v, float("inf")))
        where = torch.as_tensor(index, device=home)
        out.scatter_reduce_(0, where, torch.log2(v), "amax")  # zero peaks: -inf, ignored by amax
    return torch.where(out == float("-inf"), torch.full_like(out, float("nan")), out)


def nonfinite_flags(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per-tensor flags, True where a tensor holds NaN or Inf (exact; no host synchronisation): one
    ``aminmax`` each, taken as float64 (exact for every float format, so dtypes stack)."""
    return ~torch.isfinite(torch.stack([torch.stack(torch.aminmax(t)).double() for t in tensors])).all(dim=-1)


def any_nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flag (0-d bool tensor, no host synchronisation): does any tensor hold NaN or Inf? Tensors
    under ``SMALL_TENSOR`` elements are flattened per dtype and device first (one copy kernel
    instead of one reduction each)."""
    large: list[torch.Tensor] = []
    small: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() >= SMALL_TENSOR or t.dtype == torch.bool:
            large.append(t)
        else:
            small.setdefault((t.dtype, t.device), []).append(t)
    return nonfinite_flags(large + [flatten(ts) for ts in small.values()]).any()
