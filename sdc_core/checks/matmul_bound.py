"""The rounding bound of one matrix product's checksums, what ``matmul`` judges a product by.

For ``Y = X W^T + b`` (``X``: n x k, ``W``: m x k), over blocks B of ``block`` consecutive outputs (forward) or inputs
(backward) (``block=0``: whole rows), in the accumulation dtype from the operands as the product used them (the check
itself runs with autocast off):

* forward: ``sum_{j in B} Y_ij = X_i . c_B + sum_{j in B} b_j`` with ``c_B = sum_{j in B} W_j``;
* input gradient ``dX = dY W``: ``sum_{l in B} dX_il = dY_i . w_B`` with ``w_B = W_:,B 1``;
* weight gradient ``dW = dY^T X``: ``sum_{l in B} dW_jl = dY_:,j . s_B`` with ``s_B = X_:,B 1``.

A residual beyond the bound means the product was computed wrongly. A deterministic worst-case bound for reduction
length ``K``, blocks of ``L``, unit roundoff ``u``:

    |residual| <= safety * [ (2 u_in + (2K + 3L + 8) u + S u_out) * T + u_out * N + underflow ]

``T`` bounds the block's sum of absolute products (``||x_i||_2 sqrt(L) ||W_B||_F + ||b_B||_1``), ``u_in`` the TF32
(2^-11) or bf16 (2^-8) rounding of fp32 operands where allowed, ``u_out`` the rounding to a narrower output (twice in
the forward), ``N`` the block's absolute output sum (capped by ``T``: a huge wrong element cannot hide behind the bound
it inflates), ``S`` split-K partial sums reduced in the output precision (``REDUCED_PRECISION_SPLITS``). Blocks that
could overflow the output legitimately (``T`` over a quarter of its maximum) are not judged. What a verdict sees
(``visible_error_sizes``, docs/coverage.md): with blocks of 32, a wrong element of a few percent of its row's largest at
width 256 in fp32, about that largest at 4096."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REDUCED_PRECISION_SPLITS = 16  # split-K partial sums assumed at most, where CUDA may reduce them in bf16/fp16


@dataclass(frozen=True)
class Rounding:
    """Unit roundoffs of one product's arithmetic (see the module docstring)."""

    acc_dtype: torch.dtype  # the check computes in this dtype
    acc: float  # unit roundoff of the product's accumulation
    out: float  # rounding of the result to a narrower output dtype (0 when it is the accumulation dtype)
    inp: float  # rounding of fp32 operands to TF32/bf16 in fp32 products, the check's too (0 unless allowed)
    split: float  # split-K partial sums reduced in the output precision (CUDA reduced-precision reduction)
    tiny_acc: float  # smallest normal number of the accumulation (flush-to-zero underflow)
    tiny_out: float
    limit: float  # magnitudes at or over this may overflow the output legitimately: not judged


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _fp32_input_rounding(device_type: str) -> float:
    """Rounding of fp32 operands inside an fp32 matmul on this backend (TF32 or bf16 where allowed)."""
    precision = torch.get_float32_matmul_precision()
    unit = {"high": 2.0**-11, "medium": 2.0**-8}.get(precision, 0.0)
    with contextlib.suppress(AttributeError, RuntimeError):  # older torch: the generic setting above decides
        if device_type == "cuda":
            if torch.backends.cuda.matmul.allow_tf32 or torch.backends.cuda.matmul.fp32_precision == "tf32":
                unit = max(unit, 2.0**-11)
        elif device_type == "cpu":
            mode = torch.backends.mkldnn.matmul.fp32_precision
            unit = max(unit, {"tf32": 2.0**-11, "bf16": 2.0**-8}.get(mode, 0.0))
    return unit


def rounding(dtype: torch.dtype, device_type: str) -> Rounding:
    """The rounding model of an ``F.linear`` computing in ``dtype`` on ``device_type`` under the
    current backend settings (read on every call)."""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = _unit(acc_dtype)
    out = 0.0 if dtype == acc_dtype else _unit(dtype)
    split = 0.0
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        m = torch.backends.cuda.matmul
        if dtype == torch.float16 and getattr(m, "allow_fp16_accumulation", False):
            acc = _unit(torch.float16)  # fp16 GEMMs accumulating in fp16
        reduced = (
            m.allow_fp16_reduced_precision_reduction
            if dtype == torch.float16
            else m.allow_bf16_reduced_precision_reduction)
        split = REDUCED_PRECISION_SPLITS * out if reduced else 0.0
    # fp32 operands rounded to TF32/bf16 where the backend allows it: the product's own (fp32 products)
    # and the check's thin products, which run in fp32 whatever the product's dtype (bf16/fp16 too)
    inp = _fp32_input_rounding(device_type) if acc_dtype == torch.float32 else 0.0
    return Rounding(
        acc_dtype=acc_dtype,
        acc=acc,
        out=out,
        inp=inp,
        split=split,
        tiny_acc=torch.finfo(acc_dtype).tiny,
        tiny_out=torch.finfo(dtype).tiny,
        limit=torch.finfo(dtype).max / 4,
    )


def _slack(rnd: Rounding, length: int) -> float:
    """Relative error of computing a norm or dot product of ``length`` terms (applied to bounds)."""
    return 1.0 + (length + 4) * rnd.acc


@functools.lru_cache(maxsize=4096)
def blocks(total: int, target: int) -> tuple[int, int]:
    """``(count, size)``: ``total`` split into equal blocks of the smallest size >= ``target`` that
    divides it (the whole when ``target`` is 0 or at least ``total``)."""
    if target <= 0 or target >= total:
        return 1, total
    size = next(s for s in range(target, total + 1) if total % s == 0)
    return total // size, size


@functools.lru_cache(maxsize=4096)
def _constants(device: torch.device, k: int, m: int, bf: int, bx: int, rnd: Rounding,
               safety: float) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The host-side factors of one product's bounds as 0-d device tensors, made once per shape, block sizes (``bf``
    forward, ``bx`` backward), rounding model and device (a Python float in an op costs a conversion each time)."""
    g = _slack(rnd, max(k, m))
    inp = 2 * rnd.inp * (1 + rnd.inp) + rnd.split
    # forward: the product (k + 1 terms), the block sum of Y (bf), c_b (bf), X c_b (k), the bias block sum (bf),
    # 3 subtractions
    coef_f = safety * (inp + (2 * k + 3 * bf + 8) * rnd.acc)
    const_f = safety * ((2 * bf * k + 4 * bf + 4 * k) * rnd.tiny_acc + 2 * bf * rnd.tiny_out)
    # input gradient: the product (m terms), its block sum (bx), w_b (bx), dY w_b (m), 1 subtraction
    coef_d = safety * (inp + (2 * m + 2 * bx + 6) * rnd.acc)
    const_d = safety * ((2 * m * bx + 4 * m + 4 * bx) * rnd.tiny_acc + bx * rnd.tiny_out)
    values = [
        g * math.sqrt(bf),  # 0: T_ib = g (sqrt(bf) ||W_b||_F ||x_i|| + ||b_b||_1)
        g,  # 1
        g * math.sqrt(bf) * coef_f,  # 2: forward slope per ||W_b||_F
        g * coef_f + 2 * safety * rnd.out,  # 3: per ||b_b||_1 (a narrow product may round before the bias)
        const_f,  # 4
        g * math.sqrt(bx),  # 5: T'_ib = g sqrt(bx) ||W_:b||_F ||dy_i||
        g * math.sqrt(bx) * coef_d,  # 6
        const_d,  # 7
        rnd.limit,  # 8
        0.0,  # 9
        # a 2-norm computed in the accumulation dtype can lose up to the root of its smallest normal per element
        # to underflow (squares of tiny values flush or go subnormal): what is added to each before use
        2 * math.sqrt(k) * math.sqrt(rnd.tiny_acc),  # 10: ||x_i|| (over its blocks)
        math.sqrt(bf) * math.sqrt(rnd.tiny_acc),  # 11: ||y_ib||
        math.sqrt(m) * math.sqrt(rnd.tiny_acc),  # 12: ||dy_i||
        math.sqrt(bx) * math.sqrt(rnd.tiny_acc),  # 13: ||x_ib||, ||dx_ib||, ||dW_jb||
    ]
    return tuple(torch.tensor(values, dtype=rnd.acc_dtype, device=device).unbind())


@functools.lru_cache(maxsize=4096)
def _weight_grad_constants(device: torch.device, bx: int, n: int, rnd: Rounding,
                           safety: float) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """As ``_constants``, for the weight-gradient bound of ``n`` rows (the reduction length)."""
    g = _slack(rnd, max(n, bx))
    # the product (n terms), its block sum (bx), s_b = X_b 1 (bx), dY^T s_b (n), 1 subtraction
    coef = safety * (2 * rnd.inp * (1 + rnd.inp) + rnd.split + (2 * n + 2 * bx + 6) * rnd.acc)
    const = safety * ((2 * n * bx + 4 * n + 4 * bx) * rnd.tiny_acc + bx * rnd.tiny_out)
    values = [g * math.sqrt(bx) * coef, const, g * math.sqrt(bx), rnd.limit / (g * math.sqrt(bx))]
    return tuple(torch.tensor(values, dtype=rnd.acc_dtype, device=device).unbind())


class LinearBound:
    """What the three checks of one ``F.linear`` need of its weight and bias (cast to ``dtype``): made
    once per step (about twenty small kernels, no host synchronisation), reused by every call.

    Forward checksums cover ``bf`` consecutive outputs (``nf`` blocks), backward ones ``bx``
    inputs (``nx`` blocks). Forward bound of row i, block b: ``f_slope_b ||x_i|| + f_icpt_b`` (plus
    the narrow-output term), judged where ``||x_i|| < f_xmax_b``; input gradient likewise with
    ``d_slope``, ``d_icpt``, ``d_ymax``; the weight-gradient bound is built per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rnd: Rounding,
                 safety: float = 2.0, block: int = 0) -> None:  # fmt: skip
        """The bound of one weight (and bias) used in ``dtype``; ``block``: entries per checksum (0: rows)."""
        self.m, self.k = m, k = weight.shape
        self.nf, self.bf = nf, bf = blocks(m, block)  # forward blocks (of the m outputs)
        self.nx, self.bx = nx, bx = blocks(k, block)  # backward blocks (of the k inputs)
        self.rnd, self.safety, acc = rnd, float(safety), rnd.acc_dtype
        self.consts = k_ = _constants(weight.device, k, m, bf, bx, rnd, float(safety))
        wt = weight.detach()  # detached operands: nothing here is recorded by autograd (no grad-mode switch needed)
        wt = wt if wt.dtype == dtype else wt.to(dtype)
        if bias is None:
            bias_sum = bias_abs = k_[9].expand(nf)
        else:
            bt = bias.detach()
            bt = (bt if bt.dtype == dtype else bt.to(dtype)).reshape(nf, bf)
            bias_sum, bias_abs = bt.sum(-1, dtype=acc), torch.linalg.vector_norm(bt, 1, dim=-1, dtype=acc)
        self.bias_sum = bias_sum  # nf
        cols = wt.reshape(m, nx, bx)
        # one read of the weight for both Frobenius norms: the 2-norm of each row's backward block
        # (m x nx), then over the rows of a backward block (nx) and over the forward block's rows (nf):
        # a norm of norms is the norm, computed with no more rounding than the direct one
        q = torch.linalg.vector_norm(cols, dim=-1, dtype=acc)
        fro_x = torch.linalg.vector_norm(q, dim=0)
        fro_f = torch.linalg.vector_norm(q.reshape(nf, bf * nx), dim=-1)
        # T_ib = t_slope_b ||x_i|| + t_icpt_b >= sum_{j in b} (sum_l |x_il w_jl| + |b_j|)
        self.t_slope = fro_f * k_[0]
        self.t_icpt = torch.addcmul(bias_abs * k_[1], self.t_slope, k_[10])  # + the underflow allowance of ||x_i||
        self.f_slope = fro_f * k_[2]
        # T'_ib = dt_slope_b ||dy_i|| + dt_icpt_b >= sum_{l in b} sum_j |dy_ij w_jl|
        self.dt_slope, self.d_slope = fro_x * k_[5], fro_x * k_[6]
        self.dt_icpt = self.dt_slope * k_[12]
        self.cf = wt.reshape(nf, bf, k).sum(1, dtype=acc)  # nf x k: column sums of each block of weight rows
        # nx x m: row sums of each block of weight columns, a transposed view (the thin product reads it as it is)
        self.dx = cols.sum(-1, dtype=acc).t()
        self.f_icpt = torch.addcmul(torch.addcmul(k_[4], bias_abs, k_[3]), self.f_slope, k_[10])
        self.f_xmax = (k_[8] - self.t_icpt) / self.t_slope  # inf for a zero block, NaN (nothing judged) for a NaN one
        self.d_icpt = torch.addcmul(k_[7], self.d_slope, k_[12])
        self.d_ymax = (k_[8] - self.dt_icpt) / self.dt_slope

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rnd: Rounding,
           safety: float = 2.0, block: int = 0) -> LinearBound:  # fmt: skip
        """``LinearBound(...)``: the bound of one weight (and bias) used in ``dtype``."""
        return cls(weight, bias, dtype, rnd, safety, block)

    def _row_bound(self, norms: torch.Tensor, out3: torch.Tensor | None, forward: bool) -> torch.Tensor:
        """Per row and block, the bound on the forward (n x nf) or the input-gradient (n x nx) residual
        from the row norms of ``x`` or ``dy``; a narrow output's term is capped by its blocks ``out3``
        where given (None: whatever the output holds). A forward output may round twice (around the bias)."""
        k_ = self.consts
        icpt, slope, t_icpt, t_slope, allowance, root = (
            (self.f_icpt, self.f_slope, self.t_icpt, self.t_slope, k_[11], k_[0])
            if forward
            else (self.d_icpt, self.d_slope, self.dt_icpt, self.dt_slope, k_[13], k_[5]))
        col = norms.unsqueeze(-1)
        bound = torch.addcmul(icpt, col, slope)
        if self.rnd.out:
            t = torch.addcmul(t_icpt, col, t_slope)
            if out3 is not None:
                sums = torch.linalg.vector_norm(out3, dim=-1, dtype=self.rnd.acc_dtype)
                t = torch.minimum(sums.add_(allowance).mul_(root), t)
            bound.add_(t, alpha=(2 if forward else 1) * self.safety * self.rnd.out)
        return bound

    def forward_ratio(
        self, x2: torch.Tensor, y2: torch.Tensor, need_blocks: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward check of ``y2 = x2 W^T + b``: per row and block (n x nf) the residual over its bound
        (> 1: wrong; NaN: non-finite; 0: not judged), and ``x2``'s row norms, norms per backward block
        and (``need_blocks``) sums per backward block."""
        n = x2.shape[0]
        y3 = y2.reshape(n, self.nf, self.bf)
        # X c_b for every block as one thin product with few rows (fast everywhere; n x nf is slow on CPUs)
        residual = torch.addmm(y3.sum(-1, dtype=self.rnd.acc_dtype).t(), self.cf, x2.t(), alpha=-1).t()
        residual = residual.sub_(self.bias_sum).abs_()
        xb = x2.reshape(n, self.nx, self.bx)  # the backward blocks
        x_block_norms = torch.linalg.vector_norm(xb, dim=-1)
        x_norms = torch.linalg.vector_norm(x_block_norms, dim=-1) if self.nx > 1 else x_block_norms.reshape(n)
        ratio = residual.div_(self._row_bound(x_norms, y3, forward=True))
        ratio = torch.where(torch.lt(x_norms.unsqueeze(-1), self.f_xmax), ratio, self.consts[9])
        return ratio, x_norms, x_block_norms, (xb.sum(-1) if need_blocks else None)

    def forward_threshold(self, x_norms: torch.Tensor, y2: torch.Tensor | None = None) -> torch.Tensor:
        """Per row and block (n x nf), the error of one element of the output ``y2`` always caught
        (without ``y2``: for any output)."""
        y3 = None if y2 is None else y2.reshape(y2.shape[0], self.nf, self.bf)
        g = _slack(self.rnd, max(self.k, self.m))
        threshold = self._threshold(self._row_bound(x_norms, y3, True), 2 * self.rnd.out * g * math.sqrt(self.bf))
        return torch.where(torch.lt(x_norms.unsqueeze(-1), self.f_xmax), threshold, math.inf)

    def input_grad_ratio(
        self, dy2: torch.Tensor, dx2: torch.Tensor, dy_norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Check of ``dx2 = dy2 W``: per row and backward block (n x nx), as ``forward_ratio``."""
        dx3 = dx2.reshape(dx2.shape[0], self.nx, self.bx)
        residual = torch.addmm(dx3.sum(-1, dtype=self.rnd.acc_dtype).t(), self.dx, dy2.t(), alpha=-1).t().abs_()
        dy_norms = torch.linalg.vector_norm(dy2, dim=-1) if dy_norms is None else dy_norms
        ratio = residual.div_(self._row_bound(dy_norms, dx3, forward=False))
        return torch.where(torch.lt(dy_norms.unsqueeze(-1), self.d_ymax), ratio, self.consts[9])

    def input_grad_threshold(self, dy_norms: torch.Tensor, dx2: torch.Tensor | None = None) -> torch.Tensor:
        """As ``forward_threshold``, for one element of the input gradient ``dx2``."""
        dx3 = None if dx2 is None else dx2.reshape(dx2.shape[0], self.nx, self.bx)
        g = _slack(self.rnd, max(self.k, self.m))
        threshold = self._threshold(self._row_bound(dy_norms, dx3, False), self.rnd.out * g * math.sqrt(self.bx))
        return torch.where(torch.lt(dy_norms.unsqueeze(-1), self.d_ymax), threshold, math.inf)

    def weight_grad_bound(
        self, x_block_norms: torch.Tensor, dy_norms: torch.Tensor, dw3: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bound, judged)`` per row of ``dW`` and backward block (m x nx; the same for every row
        unless the output is narrow), judged where far enough from the output's overflow."""
        slope, const, g_sqrt_b, dot_max = _weight_grad_constants(
            dy_norms.device, self.bx, dy_norms.shape[0], self.rnd, self.safety)
        # g sqrt(bx) dots_b >= sum_{l in b} sum_i |dy_ij x_il| for every row j; both norms may have lost
        # their underflow allowance: dots_b = sum_i (||dy_i|| + da)(||x_i,b|| + db), one thin product
        da, db = self.consts[12], self.consts[13]
        dots = torch.mv(torch.add(x_block_norms, db).t(), torch.add(dy_norms, da))
        bound = torch.addcmul(const, dots, slope)
        if self.rnd.out:
            cap = dots * g_sqrt_b
            if dw3 is not None:
                norms = torch.linalg.vector_norm(dw3, dim=-1, dtype=self.rnd.acc_dtype).add_(db).mul_(g_sqrt_b)
                cap = torch.minimum(norms, cap)
            bound = torch.add(bound, cap, alpha=self.safety * self.rnd.out)
        return bound, torch.lt(dots, dot_max)

    def weight_grad_ratio(
        self,
        dy2: torch.Tensor,
        dwt: torch.Tensor,
        x_block_sums: torch.Tensor,
        x_block_norms: torch.Tensor,
        dy_norms: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Check of ``dW = dY^T X`` given as ``dwt`` (k x m, as the product produced it) from the
        forward operand's block sums and norms: per row of ``dW`` and backward block (m x nx)."""
        dw3 = dwt.t().reshape(self.m, self.nx, self.bx)
        sums = dw3.sum(-1, dtype=self.rnd.acc_dtype).t()  # nx x m
        residual = torch.addmm(sums, x_block_sums.t(), dy2, alpha=-1).t().abs_()  # BLAS reads the transposed view
        dy_norms = torch.linalg.vector_norm(dy2, dim=-1) if dy_norms is None else dy_norms
        bound, judged = self.weight_grad_bound(x_block_norms, dy_norms, dw3)
        return torch.where(judged, residual.div_(bound), self.consts[9])

    def weight_grad_threshold(
        self, x_block_norms: torch.Tensor, dy_norms: torch.Tensor, dwt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``forward_threshold``, per row of ``dW`` (given as ``dwt``) and backward block."""
        dw3 = None if dwt is None else dwt.t().reshape(self.m, self.nx, self.bx)
        bound, judged = self.weight_grad_bound(x_block_norms, dy_norms, dw3)
        g = _slack(self.rnd, max(dy_norms.shape[0], self.bx))
        threshold = self._threshold(bound.expand(self.m, self.nx), self.rnd.out * g * math.sqrt(self.bx))
        return torch.where(judged, threshold, math.inf)

    def _threshold(self, bound: torch.Tensor, growth: float) -> torch.Tensor:
        """The error of one element always caught where the clean bound is ``bound``: the residual is
        at least the error less ``bound / safety``, and the wrong element can raise the bound by
        ``safety * growth`` times itself (the narrow-output term)."""
        shrink = 1 - self.safety * growth
        return bound * (1 + 1 / self.safety) / shrink if shrink > 0 else torch.full_like(bound, math.inf)


NOTHING = contextlib.nullcontext()  # reusable: no state


def plain_arithmetic(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off where it is on (a check computed in bf16 would be no check)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return NOTHING


def operand(x: torch.Tensor, dtype: torch.dtype, acc: torch.dtype, width: int) -> torch.Tensor:
    """``x`` as the 2-D operand a product computing in ``dtype`` used, in the accumulation dtype ``acc``."""
    x2 = x.reshape(-1, width)
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    return x2 if x2.dtype == acc else x2.to(acc)


def visible_error_sizes(width: int, dtype: torch.dtype = torch.float32, rows: int = 1024, seed: int = 0,
                        safety: float = 2.0, block: int = 32) -> dict[str, float]:  # fmt: skip
    """The error of one element always caught, relative to the row's largest element (``*_vs_max``) and
    root-mean-square (``*_vs_rms``), median over rows, for a default ``nn.Linear(width, width)`` fed
    unit-variance data on the CPU in ``dtype`` (what docs/coverage.md quotes)."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(width, width)
    with torch.no_grad():
        bound = 1 / math.sqrt(width)
        layer.weight.uniform_(-bound, bound, generator=gen)
        layer.bias.uniform_(-bound, bound, generator=gen)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    dy = torch.randn(rows, width, generator=gen).to(dtype)
    w, b = layer.weight.detach().to(dtype), layer.bias.detach().to(dtype)
    rnd = rounding(dtype, "cpu")
    lb = LinearBound.of(w, b, dtype, rnd, safety, block)
    acc = rnd.acc_dtype
    y, dx, dw = F.linear(x, w, b), dy @ w, dy.t() @ x  # as computed, in dtype
    x_block_norms = torch.linalg.vector_norm(x.to(acc).reshape(rows, lb.nx, lb.bx), dim=-1)
    x_norms = torch.linalg.vector_norm(x_block_norms, dim=-1)
    dy_norms = torch.linalg.vector_norm(dy.to(acc), dim=-1)
    f, d = lb.forward_threshold(x_norms, y), lb.input_grad_threshold(dy_norms, dx)
    wt = lb.weight_grad_threshold(x_block_norms, dy_norms, dw.t())

    def rms(t: torch.Tensor, dim: int | None = -1) -> torch.Tensor:
        return t.square().mean(dim, keepdim=True).sqrt() if dim is not None else t.square().mean().sqrt()

    y, dx, dw = y.to(acc), dx.to(acc), dw.to(acc)
    return {
        "output_vs_max": float((f / y.abs().amax(-1, keepdim=True)).median()),
        "output_vs_rms": float((f / rms(y)).median()),
        "input_gradient_vs_max": float((d / dx.abs().amax(-1, keepdim=True)).median()),
        "input_gradient_vs_rms": float((d / rms(dx)).median()),
        "weight_gradient_vs_max": float((wt / dw.abs().amax()).median()),
        "weight_gradient_vs_rms": float((wt / rms(dw, None)).median()),
    }


def worst_ratio(ratio: torch.Tensor) -> torch.Tensor:
    """The largest ratio (NaN when any is NaN; 0 for no rows): one reduction, no host read."""
    return ratio.amax() if ratio.numel() else ratio.new_zeros(())
