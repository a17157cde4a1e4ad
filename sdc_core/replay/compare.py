"""Digests of a step's loss and gradients (per parameter: sum, L2 norm, exact fingerprint, count), and their comparison:
bit-identical when loss and every fingerprint are equal, else the largest relative norm, sum or loss difference. Cost:
per parameter three reductions on the gradient's device, read with one device-to-host copy per digest. Limits: gradients
with equal sum and norm differ only by fingerprint, which bit equality sees and a tolerance does not."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sdc_core.checks.digest import tensor_digest

AUTO_MARGIN = 100.0  # exact="auto": tolerance = AUTO_MARGIN * measured same-device noise floor (GPU noise
# fluctuates from batch to batch; a fault must stand out from it by two orders of magnitude)
Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # one gradient's digest_row


class Tolerances(Protocol):
    """What ``compare`` reads of a configuration (``sdc_core.replay.ring.ReplayConfig`` has it)."""

    @property
    def exact(self) -> bool | str: ...
    @property
    def rtol(self) -> float: ...
    @property
    def atol(self) -> float: ...


@dataclass
class Digest:
    """What one computation of a step's micro-batches produced, in comparable form."""

    loss: float
    sums: torch.Tensor  # float64 [P]: per-parameter gradient sum
    norms: torch.Tensor  # float64 [P]: per-parameter gradient L2 norm
    fps: torch.Tensor  # int64 [P]: per-parameter exact gradient fingerprint
    numels: torch.Tensor  # float64 [P]


def digest_row(g: torch.Tensor) -> Row:
    """``(sum, norm, exact fingerprint, numel)`` of one gradient, on its device (no sync): sum and norm reduced
    in float32 and returned as float64; the fingerprint reads -0.0 as +0.0 (kernels differ in a zero's sign)."""
    g = g.detach()
    fingerprint = tensor_digest(g + 0.0)
    g = g if g.dtype in (torch.float32, torch.float64) else g.float()
    return g.sum().double(), torch.linalg.vector_norm(g).double(), fingerprint, g.numel()


def assemble(names: Sequence[str], rows: dict[str, Row], loss: torch.Tensor | float) -> Digest:
    """A ``Digest`` in ``names`` order; a parameter without a row (no gradient) counts as zeros. Cost: ONE
    blocking device-to-host copy (never ``non_blocking=True``, which can read stale bytes)."""
    loss_t = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), dtype=torch.float64)
    present = [r for r in rows.values() if r is not None]
    device = next((r[0].device for r in present if r[0].device.type != "cpu"), None)
    device = device or (present[0][0].device if present else loss_t.device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    zero_fp = torch.zeros((), dtype=torch.int64, device=device)
    picked = [rows.get(n) for n in names]

    def col(i: int, z: torch.Tensor) -> list[torch.Tensor]:
        return [r[i].to(device) if r else z for r in picked]  # blocking: itself when already there

    parts = [loss_t.detach().reshape(1).to(device, torch.float64)]
    if picked:
        fps = torch.stack(col(2, zero_fp)).view(torch.float64)  # bit-cast: travels unchanged
        parts += [torch.stack(col(0, zero)), torch.stack(col(1, zero)), fps]
    packed = torch.cat(parts).cpu()  # the one device-to-host transfer (blocking)
    p = len(picked)
    return Digest(
        loss=float(packed[0]),
        sums=packed[1 : 1 + p].clone(),
        norms=packed[1 + p : 1 + 2 * p].clone(),
        fps=packed[1 + 2 * p : 1 + 3 * p].clone().view(torch.int64),
        numels=torch.tensor([r[3] if r else 0 for r in picked], dtype=torch.float64),
    )


def grad_digest(names: Sequence[str], grads: dict[str, torch.Tensor], loss: torch.Tensor | float) -> Digest:
    """Digest of gradients keyed by parameter name (a missing gradient counts as zeros)."""
    return assemble(names, {n: digest_row(g) for n, g in grads.items() if g is not None}, loss)


def compare_raw(a: Digest, b: Digest, names: Sequence[str], atol: float = 1e-6) -> tuple[bool, float, str]:
    """``(bit-identical, largest relative difference, where)`` between two digests of the same work."""
    if a.sums.shape != b.sums.shape:
        return False, math.inf, "parameter count"
    floor = max(atol, 1e-300)
    loss_same = a.loss == b.loss or (math.isnan(a.loss) and math.isnan(b.loss))
    loss_diff = 0.0 if loss_same else (abs(a.loss - b.loss) / max(abs(a.loss), abs(b.loss), floor))
    if math.isnan(loss_diff):
        loss_diff = math.inf
    norm_den = torch.maximum(torch.maximum(a.norms, b.norms), torch.tensor(floor, dtype=torch.float64))
    norm_diff = (a.norms - b.norms).abs() / norm_den
    sum_den = torch.maximum(norm_den * a.numels.clamp(min=1).sqrt(), torch.tensor(floor, dtype=torch.float64))
    sum_diff = (a.sums - b.sums).abs() / sum_den
    per_param = torch.maximum(norm_diff, sum_diff).nan_to_num(nan=math.inf)
    same_fp = a.fps == b.fps
    per_param = torch.where(same_fp, torch.zeros_like(per_param), per_param)  # bit-identical
    worst_param = int(per_param.argmax()) if per_param.numel() else -1
    grad_diff = float(per_param[worst_param]) if worst_param >= 0 else 0.0
    exact = loss_same and bool(same_fp.all())
    if not loss_same:
        where = "loss" if loss_diff >= grad_diff else names[worst_param]
    elif grad_diff > 0:
        where = names[worst_param]
    else:
        bad = (~same_fp).nonzero().flatten().tolist()
        where = names[bad[0]] if bad else ""
    return exact, max(loss_diff, grad_diff), where


def disagree(exact: bool, diff: float, tolerance: float) -> bool:
    """Whether a comparison is a mismatch: any bit with ``tolerance == 0``, else ``diff > tolerance``."""
    return (not exact) if tolerance == 0 else (diff > tolerance or math.isnan(diff))


def compare(a: Digest, b: Digest, config: Tolerances, names: Sequence[str]) -> tuple[bool, float, str]:
    """``(mismatch, largest relative difference, where)`` under ``config``'s fixed tolerance
    (bit equality for ``exact=True``, ``rtol`` otherwise; ``RingReplay`` calibrates ``"auto"``)."""
    exact, diff, where = compare_raw(a, b, names, config.atol)
    return disagree(exact, diff, 0.0 if config.exact is True else config.rtol), diff, where
