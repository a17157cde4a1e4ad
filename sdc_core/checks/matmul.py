"""Checksum-verified matrix products: a wrong multiply is caught on the rank and in the step where it
happens (algorithm-based fault tolerance).

Why: a compute fault whose result is finite (a wrong multiply-accumulate in one rank's forward or
backward) changes that rank's local gradient; the all-reduce then spreads it into every replica
equally, so the fingerprint sees nothing and only the replay (one step in ``every_n_steps``) can.
This check verifies every product of every checked step on the rank that computed it.

The identities, for ``Y = X W^T + b`` (``X``: n x k, ``W``: m x k, ``dY``: n x m), over blocks of
``block`` consecutive outputs (forward) or inputs (backward) (``block=0``: whole rows), computed
in the accumulation dtype from the operands exactly as the product used them (autocast: the
bf16/fp16 casts; the check's own arithmetic runs with autocast off):

* forward, row i, output block B: ``sum_{j in B} Y_ij = X_i . c_B + sum_{j in B} b_j`` with
  ``c_B = sum_{j in B} W_j`` (one thin product ``X [c_B ...]`` for all blocks);
* input gradient ``dX = dY W``, row i, input block B: ``sum_{l in B} dX_il = dY_i . w_B`` with
  ``w_B = W_:,B 1``;
* weight gradient ``dW = dY^T X``, row j, input block B: ``sum_{l in B} dW_jl = dY_:,j . s_B``
  with ``s_B = X_:,B 1`` (kept from the forward: n x k/block numbers per product).

A residual beyond the rounding bound means the product was computed wrongly on this rank. The
bound is a worst-case (deterministic) rounding-error bound, never a statistical one: with ``u``
the unit roundoff of the accumulation (fp32: 2^-24), a product of reduction length ``K`` checked
over blocks of ``L`` entries has, per block,

    |residual| <= safety * [ (2 u_in + (2K + 3L + 8) u + S u_out) * T + u_out * N + underflow ]

where ``T`` bounds the block's sum of absolute products ``sum |x||w|`` (Cauchy-Schwarz on row
norms and the block's Frobenius norm: ``||x_i||_2 sqrt(L) ||W_B||_F + ||b_B||_1``), ``u_in`` the
rounding of fp32 operands to TF32 (2^-11) or bf16 (2^-8) where the backend allows it for fp32
matmuls (the product's own for fp32 products, and the check's fp32 thin products for every
dtype), ``u_out`` the rounding of the result to a narrower output (bf16 2^-8, fp16 2^-11; 0 for
fp32; twice in the forward, which may round before adding the bias), ``N`` the block's absolute
sum of the narrow output (at most ``sqrt(L)`` times its 2-norm, capped by ``T`` so a huge wrong
element cannot hide behind the bound it inflates), ``S`` the partial sums of a split-K reduction
done in the output precision (CUDA bf16/fp16 with reduced-precision reduction allowed:
``REDUCED_PRECISION_SPLITS``), and the underflow term a multiple of the smallest normal number.
``safety`` (default 2) covers what the model leaves out. Blocks whose magnitudes could overflow
the output dtype legitimately (``T`` over a quarter of its maximum, e.g. fp16 under a GradScaler)
are not judged. The weight-gradient bound is the same for every row of ``dW`` (``sqrt(L) sum_i
||x_i,B||_2 ||dY_i||_2``). Property tests (tests/test_matmul_unit.py) hold the bound against
random shapes, magnitudes from 1e-12 to 1e12, all-positive and constant data (rounding errors all
of one sign), every precision and layout.

What a verdict sees: a wrong element whose error exceeds the bound of its block (the
``*_threshold`` methods; ``visible_error_sizes`` for a layer of a given width; docs/coverage.md).
The bound grows with the block and with ``K^1.5``: with blocks of 32 a wrong element of a few
percent of its row's largest is caught at width 256 in fp32, of about that largest at 4096; bf16
and fp16 outputs add their own rounding (about a third of the row's largest at width 256). Whole
rows see errors ``width / 32`` times larger and cost less (``block=0``).

Covered: every ``nn.Linear`` whose ``forward`` is ``nn.Linear.forward`` (checked from a forward
hook that runs first, so a later hook that edits the output is not mistaken for a fault; the
backward from a hook on the product's own autograd node, which receives dY, dX and dW as the
product produced them), and with ``attention=True`` the in- and out-projections of
``nn.MultiheadAttention`` (``F.multi_head_attention_forward`` calls ``F.linear`` with the module's
weights, not ``nn.Linear`` modules: while attached, ``torch.nn.functional.linear`` is a wrapper
that hands the calls made while such a module runs (a context variable) to the check; it is
restored at ``detach``). Attention blocks built from ``nn.Linear`` (Hugging Face, timm) are
covered as linears. Not covered: the attention products themselves (``Q K^T``, ``softmax V``:
SDPA), ``nn.Linear`` subclasses with their own ``forward`` (LoRA-style layers: their inner
``nn.Linear`` are covered), other matrix products (``torch.matmul``/``bmm``/``addmm`` calls,
Hugging Face ``Conv1D``, convolutions, embeddings), DTensor (tensor-parallel) weights, the bias
gradient, modules run through ``torch.compile`` (the hooks stand aside while it traces).
``coverage()`` lists what a model has of each.

Verdict: no host synchronisation and no extra synchronous collective in the step. Each product
appends its worst normalised residual (a 0-d device tensor) to the step's list. ``verdict(step)``
(after backward, before the update) stacks them and issues one asynchronous 4-byte MAX
all-reduce of the step's worst value; ``arm(step + 1)`` (or ``verdict``, or ``resolve()``: before
a checkpoint, at the end of training) reads it when the next step starts, identical on every
rank, before any other check reads its own verdict; only then (the rare path) do the ranks
gather who saw what, and every rank raises the same ``ChecksumMismatchError`` naming step ``s``,
the rank, its host, the module and the phase. ``verdict(step, now=True)`` reads it before the
update instead (one host wait).

Cost (benchmarks/matmul.py, docs/performance.md): per product, reads of the output and the
input in the forward (a block sum, the thin product, block norms and block sums), of dY (a row
norm and two thin products), dX and dW in the backward, about thirty-five small kernels and two
Python calls; per weight and step three reads of the weight and about twenty small kernels. The
reads are memory-bound work next to a compute-bound product: their share falls as ``1/width``
(at width 256 on a CPU one read of an output costs 1-2% of the product that wrote it). The thin
products of blocks are ``1/block`` of the product's multiply-adds at every width: blocks of 32
cannot cost under about 3% of the products; whole rows (``block=0``) have none. Bit-identical
training: the check only reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdc_core.dist.topology import HostRead, Topology, all_gather_objects, collective_device, is_distributed
from sdc_core.errors import ChecksumMismatchError
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2
PRODUCTS = ("output", "input_gradient", "weight_gradient")
PHASES = ("forward", "backward", "backward")
REDUCED_PRECISION_SPLITS = 16  # split-K partial sums assumed at most, where CUDA may reduce them in bf16/fp16
_ON_FAILURE = ("raise", "warn")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@documented
@dataclass(frozen=True, kw_only=True)
class MatmulChecksumConfig:
    """Settings of the matrix-product checksum check (keyword-only, validated on construction)."""

    on_failure: str = setting(
        "raise",
        "what a wrong matrix product does: raise, or warn and go on",
        "``raise``: every rank raises ``ChecksumMismatchError``; ``warn``: every rank warns and training goes on.",
    )
    every_n_steps: int = setting(
        1,
        "checked optimizer steps: 0, n, 2n, ... (1: every step)",
        "The cost and the share of transient faults caught both scale with 1/n (>= 1).",
    )
    safety: float = setting(2.0, "factor on the worst-case rounding bound (>= 1)")
    block: int = setting(
        32,
        "outputs (forward) and inputs (backward) per checksum, at least (0: whole rows)",
        "The block is the smallest divisor of the width from there. Smaller blocks catch smaller errors: the "
        "bound of a block grows with it; the price is a thin extra product of ``width / block`` columns per product.",
    )
    attention: bool = setting(
        True,
        "also check nn.MultiheadAttention's in- and out-projections",
        "Replaces ``torch.nn.functional.linear`` by a checking wrapper while attached.",
    )
    max_names: int = setting(5, "violations reported per rank (>= 1)")

    def __post_init__(self) -> None:
        if self.on_failure not in _ON_FAILURE:
            raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {self.on_failure!r}")
        for name in ("every_n_steps", "max_names"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.safety, bool) or not isinstance(self.safety, int | float) or not self.safety >= 1:
            raise ValueError(f"safety must be a number >= 1, got {self.safety!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0:
            raise ValueError(f"block must be an integer >= 0 (0: whole rows), got {self.block!r}")
        if not isinstance(self.attention, bool):
            raise ValueError(f"attention must be True or False, got {self.attention!r}")


# -------------------------------------------------------------------------------- the bound


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
    """Rounding of fp32 operands inside an fp32 matmul on this backend: TF32 or bf16 where allowed."""
    precision = torch.get_float32_matmul_precision()
    unit = {"high": 2.0**-11, "medium": 2.0**-8}.get(precision, 0.0)
    try:
        if device_type == "cuda":
            if torch.backends.cuda.matmul.allow_tf32 or torch.backends.cuda.matmul.fp32_precision == "tf32":
                unit = max(unit, 2.0**-11)
        elif device_type == "cpu":
            mode = torch.backends.mkldnn.matmul.fp32_precision
            unit = max(unit, {"tf32": 2.0**-11, "bf16": 2.0**-8}.get(mode, 0.0))
    except (AttributeError, RuntimeError):  # older torch: the generic setting above decides
        pass
    return unit


def rounding(dtype: torch.dtype, device_type: str) -> Rounding:
    """The rounding model of an ``F.linear`` computing in ``dtype`` on ``device_type`` under the
    current backend settings (TF32, reduced-precision reductions): read on every call."""
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
            else m.allow_bf16_reduced_precision_reduction
        )
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
    """The host-side factors of one product's bounds as 0-d device tensors, made once per shape,
    block sizes (``bf`` outputs per forward checksum, ``bx`` inputs per backward one), rounding
    model and device (so the per-step work is tensor-tensor kernels only: a Python float in an op
    costs a host-to-tensor conversion each time). See ``LinearBound`` for their use."""
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


@dataclass
class LinearBound:
    """What the three checks of one ``F.linear`` need of its weight and bias as the product used them
    (cast to ``dtype``), its sizes and its rounding model: computed once per step (about twenty
    small kernels and a few reads of the weight, no host synchronisation) and reused by every
    call of that step.

    Checksums cover blocks: the forward one ``bf`` consecutive outputs of a row (``nf`` blocks:
    ``Y_i,b 1 = X_i c_b + sum(b_b)``, with ``c_b`` the column sums of the block's weight rows),
    the backward ones ``bx`` consecutive inputs (``nx`` blocks: ``dX_i,b 1 = dY_i (W_:,b 1)`` and
    ``dW_j,b 1 = dY_:,j . (X_:,b 1)``). A block's rounding bound grows with the block, so smaller
    blocks see smaller errors, for the price of a thinner extra product (``X [k x nf]``).

    Forward bound of row i, block b: ``f_slope_b ||x_i|| + f_icpt_b`` (plus the narrow-output
    term), judged where ``||x_i|| < f_xmax_b``; input-gradient bound: ``d_slope_b ||dy_i|| +
    d_icpt``, judged where ``||dy_i|| < d_ymax_b``; the weight-gradient bound depends on the rows
    and is built per call.
    """

    k: int
    m: int
    nf: int  # forward blocks (of the m outputs)
    bf: int
    nx: int  # backward blocks (of the k inputs)
    bx: int
    rnd: Rounding
    safety: float
    consts: tuple[torch.Tensor, ...]
    cf: torch.Tensor  # nf x k: column sums of each block of weight rows
    dx: torch.Tensor  # nx x m: row sums of each block of weight columns (thin products are fastest with few rows)
    bias_sum: torch.Tensor  # nf
    t_slope: torch.Tensor  # T_ib = t_slope_b ||x_i|| + t_icpt_b >= sum_{j in b} (sum_l |x_il w_jl| + |b_j|)
    t_icpt: torch.Tensor
    f_slope: torch.Tensor
    f_icpt: torch.Tensor
    f_xmax: torch.Tensor
    dt_slope: torch.Tensor  # T'_ib = dt_slope_b ||dy_i|| + dt_icpt_b >= sum_{l in b} sum_j |dy_ij w_jl|
    dt_icpt: torch.Tensor
    d_slope: torch.Tensor
    d_icpt: torch.Tensor
    d_ymax: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rnd: Rounding,
           safety: float = 2.0, block: int = 0) -> LinearBound:  # fmt: skip
        """The bound of one weight (and bias) used in ``dtype``; ``block``: the target number of
        outputs (forward) and inputs (backward) per checksum, 0 for whole rows."""
        m, k = weight.shape
        nf, bf = blocks(m, block)
        nx, bx = blocks(k, block)
        acc = rnd.acc_dtype
        k_ = _constants(weight.device, k, m, bf, bx, rnd, float(safety))
        # detached operands: nothing here is recorded by autograd (no grad-mode switch needed)
        wt = weight.detach()
        wt = wt if wt.dtype == dtype else wt.to(dtype)
        if bias is None:
            bias_sum = bias_abs = k_[9].expand(nf)
        else:
            bt = bias.detach()
            bt = (bt if bt.dtype == dtype else bt.to(dtype)).reshape(nf, bf)
            bias_sum, bias_abs = bt.sum(-1, dtype=acc), torch.linalg.vector_norm(bt, 1, dim=-1, dtype=acc)
        cols = wt.reshape(m, nx, bx)
        # one read of the weight for both Frobenius norms: the 2-norm of each row's backward block
        # (m x nx), then over the rows of a backward block (nx) and over the forward block's rows (nf):
        # a norm of norms is the norm, computed with no more rounding than the direct one
        q = torch.linalg.vector_norm(cols, dim=-1, dtype=acc)
        fro_x = torch.linalg.vector_norm(q, dim=0)
        fro_f = torch.linalg.vector_norm(q.reshape(nf, bf * nx), dim=-1)
        t_slope = fro_f * k_[0]
        t_icpt = torch.addcmul(bias_abs * k_[1], t_slope, k_[10])  # + the underflow allowance of ||x_i||
        f_slope = fro_f * k_[2]
        dt_slope, d_slope = fro_x * k_[5], fro_x * k_[6]
        dt_icpt = dt_slope * k_[12]
        return cls(
            k=k,
            m=m,
            nf=nf,
            bf=bf,
            nx=nx,
            bx=bx,
            rnd=rnd,
            safety=float(safety),
            consts=k_,
            cf=wt.reshape(nf, bf, k).sum(1, dtype=acc),
            dx=cols.sum(-1, dtype=acc).t(),  # a transposed view: the thin product reads it as it is
            bias_sum=bias_sum,
            t_slope=t_slope,
            t_icpt=t_icpt,
            f_slope=f_slope,
            f_icpt=torch.addcmul(torch.addcmul(k_[4], bias_abs, k_[3]), f_slope, k_[10]),
            f_xmax=(k_[8] - t_icpt) / t_slope,  # inf for a zero block, NaN (nothing judged) for a NaN one
            dt_slope=dt_slope,
            dt_icpt=dt_icpt,
            d_slope=d_slope,
            d_icpt=torch.addcmul(k_[7], d_slope, k_[12]),
            d_ymax=(k_[8] - dt_icpt) / dt_slope,
        )

    def x_blocks(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2`` (n x k) as n x nx x bx (the backward blocks)."""
        return x2.reshape(x2.shape[0], self.nx, self.bx)

    # -- forward

    def forward_bound(self, x_norms: torch.Tensor, y3: torch.Tensor | None) -> torch.Tensor:
        """Per row and block (n x nf), the bound on the forward residual; ``y3=None`` gives the
        largest the bound can become whatever the output holds (what a wrong element is measured
        against)."""
        col = x_norms.unsqueeze(-1)
        bound = torch.addcmul(self.f_icpt, col, self.f_slope)
        if self.rnd.out:
            t = torch.addcmul(self.t_icpt, col, self.t_slope)
            if y3 is not None:  # the output's rounding: sum_j |y_ij| <= sqrt(bf) ||y_ib||, capped by T_ib
                norms = torch.linalg.vector_norm(y3, dim=-1, dtype=self.rnd.acc_dtype)
                norms = norms.add_(self.consts[11]).mul_(self.consts[0])
                t = torch.minimum(norms, t)
            bound.add_(t, alpha=2 * self.safety * self.rnd.out)
        return bound

    def forward_ratio(
        self, x2: torch.Tensor, y2: torch.Tensor, need_blocks: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward check of ``y2 = x2 W^T + b`` (2-D; ``x2`` the operand in the accumulation dtype).

        Returns ``(ratio, x_norms, x_block_norms, x_block_sums)``: per row and block (n x nf) the
        residual over its bound (> 1: wrong; NaN: a non-finite result of finite operands; 0 where
        not judged), the operand's row 2-norms, its 2-norms per backward block (n x nx) and, with
        ``need_blocks``, its sums per backward block (for the weight-gradient check)."""
        n = x2.shape[0]
        y3 = y2.reshape(n, self.nf, self.bf)
        # X c_b for every block as one thin product with few rows (fast everywhere; n x nf is slow on CPUs)
        residual = torch.addmm(y3.sum(-1, dtype=self.rnd.acc_dtype).t(), self.cf, x2.t(), alpha=-1).t()
        residual = residual.sub_(self.bias_sum).abs_()
        xb = self.x_blocks(x2)
        x_block_norms = torch.linalg.vector_norm(xb, dim=-1)
        x_norms = torch.linalg.vector_norm(x_block_norms, dim=-1) if self.nx > 1 else x_block_norms.reshape(n)
        ratio = residual.div_(self.forward_bound(x_norms, y3))
        ratio = torch.where(torch.lt(x_norms.unsqueeze(-1), self.f_xmax), ratio, self.consts[9])
        return ratio, x_norms, x_block_norms, (xb.sum(-1) if need_blocks else None)

    def forward_threshold(self, x_norms: torch.Tensor, y2: torch.Tensor | None = None) -> torch.Tensor:
        """Per row and block (n x nf), an error of one element of the output ``y2`` (as computed
        correctly) at least this large is always caught; without ``y2``, for any output."""
        y3 = None if y2 is None else y2.reshape(y2.shape[0], self.nf, self.bf)
        g = _slack(self.rnd, max(self.k, self.m))
        threshold = _threshold(self.forward_bound(x_norms, y3), self.safety, 2 * self.rnd.out * g * math.sqrt(self.bf))
        return torch.where(torch.lt(x_norms.unsqueeze(-1), self.f_xmax), threshold, math.inf)

    # -- input gradient

    def input_grad_bound(self, dy_norms: torch.Tensor, dx3: torch.Tensor | None) -> torch.Tensor:
        col = dy_norms.unsqueeze(-1)
        bound = torch.addcmul(self.d_icpt, col, self.d_slope)
        if self.rnd.out:
            t = torch.addcmul(self.dt_icpt, col, self.dt_slope)
            if dx3 is not None:
                norms = torch.linalg.vector_norm(dx3, dim=-1, dtype=self.rnd.acc_dtype)
                norms = norms.add_(self.consts[13]).mul_(self.consts[5])
                t = torch.minimum(norms, t)
            bound.add_(t, alpha=self.safety * self.rnd.out)
        return bound

    def input_grad_ratio(
        self, dy2: torch.Tensor, dx2: torch.Tensor, dy_norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Check of ``dx2 = dy2 W`` (``dy2`` in the accumulation dtype, ``dx2`` as produced): per
        row and backward block (n x nx), the residual over its bound (as ``forward_ratio``)."""
        dx3 = dx2.reshape(dx2.shape[0], self.nx, self.bx)
        residual = torch.addmm(dx3.sum(-1, dtype=self.rnd.acc_dtype).t(), self.dx, dy2.t(), alpha=-1).t().abs_()
        if dy_norms is None:
            dy_norms = torch.linalg.vector_norm(dy2, dim=-1)
        ratio = residual.div_(self.input_grad_bound(dy_norms, dx3))
        return torch.where(torch.lt(dy_norms.unsqueeze(-1), self.d_ymax), ratio, self.consts[9])

    def input_grad_threshold(self, dy_norms: torch.Tensor, dx2: torch.Tensor | None = None) -> torch.Tensor:
        """As ``forward_threshold``, for one element of the input gradient ``dx2``."""
        dx3 = None if dx2 is None else dx2.reshape(dx2.shape[0], self.nx, self.bx)
        g = _slack(self.rnd, max(self.k, self.m))
        threshold = _threshold(self.input_grad_bound(dy_norms, dx3), self.safety, self.rnd.out * g * math.sqrt(self.bx))
        return torch.where(torch.lt(dy_norms.unsqueeze(-1), self.d_ymax), threshold, math.inf)

    # -- weight gradient

    def weight_grad_bound(
        self, x_block_norms: torch.Tensor, dy_norms: torch.Tensor, dw3: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bound, judged)``: the bound on each row of ``dW`` and backward block (m x nx, the same
        for every row unless the output is narrow) and whether each block is judged (its sum of
        absolute products far enough from the output's overflow)."""
        slope, const, g_sqrt_b, dot_max = _weight_grad_constants(
            dy_norms.device, self.bx, dy_norms.shape[0], self.rnd, self.safety
        )
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
        """Check of ``dW = dY^T X`` given as ``dwt`` (k x m: the gradient of ``W^T`` as the product
        produced it) from ``dy2`` (accumulation dtype) and the forward operand's block sums and
        block 2-norms: per row of ``dW`` and backward block (m x nx), the residual over the bound."""
        dw3 = dwt.t().reshape(self.m, self.nx, self.bx)
        sums = dw3.sum(-1, dtype=self.rnd.acc_dtype).t()  # nx x m
        residual = torch.addmm(sums, x_block_sums.t(), dy2, alpha=-1).t().abs_()  # BLAS reads the transposed view
        if dy_norms is None:
            dy_norms = torch.linalg.vector_norm(dy2, dim=-1)
        bound, judged = self.weight_grad_bound(x_block_norms, dy_norms, dw3)
        return torch.where(judged, residual.div_(bound), self.consts[9])

    def weight_grad_threshold(
        self, x_block_norms: torch.Tensor, dy_norms: torch.Tensor, dwt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """As ``forward_threshold``, for one element of the weight gradient (given as ``dwt``):
        per row of ``dW`` and backward block (m x nx)."""
        dw3 = None if dwt is None else dwt.t().reshape(self.m, self.nx, self.bx)
        bound, judged = self.weight_grad_bound(x_block_norms, dy_norms, dw3)
        g = _slack(self.rnd, max(dy_norms.shape[0], self.bx))
        threshold = _threshold(bound.expand(self.m, self.nx), self.safety, self.rnd.out * g * math.sqrt(self.bx))
        return torch.where(judged, threshold, math.inf)


_NOTHING = contextlib.nullcontext()  # reusable: no state


def plain_arithmetic(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off where it is on (the check's arithmetic runs in its own dtypes: a check computed
    in bf16 would be no check); nothing otherwise."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NOTHING


def _threshold(bound: torch.Tensor, safety: float, growth: float) -> torch.Tensor:
    """The error of one element always caught where the clean bound is ``bound``: the residual is
    at least the error less the true rounding (``bound / safety``), and the wrong element can
    raise the bound by ``safety * growth`` times itself (the narrow-output term). For tests and
    the documented sizes, not the hot path."""
    shrink = 1 - safety * growth
    return bound * (1 + 1 / safety) / shrink if shrink > 0 else torch.full_like(bound, math.inf)


def operand(x: torch.Tensor, dtype: torch.dtype, acc: torch.dtype, width: int) -> torch.Tensor:
    """``x`` as the 2-D operand a product computing in ``dtype`` used (autocast casts it), in the
    accumulation dtype ``acc`` (a copy only when a cast is needed or ``x`` cannot be viewed 2-D)."""
    x2 = x.reshape(-1, width)
    if x2.dtype != dtype:
        x2 = x2.to(dtype)
    return x2 if x2.dtype == acc else x2.to(acc)


def check_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    safety: float = 2.0,
    block: int = 32,
) -> torch.Tensor:
    """Worst forward ratio of one ``y = F.linear(x, weight, bias)`` (a 0-d tensor; > 1: wrong).
    For tests and one-off checks; the training check reuses the weight's bound for a step."""
    dtype = y.dtype
    rnd = rounding(dtype, y.device.type)
    with torch.no_grad(), plain_arithmetic(y.device.type):
        lb = LinearBound.of(weight, bias, dtype, rnd, safety, block)
        x2 = operand(x.detach(), dtype, rnd.acc_dtype, weight.shape[1])
        return _worst(lb.forward_ratio(x2, y.detach().reshape(-1, weight.shape[0]))[0])


def visible_error_sizes(width: int, dtype: torch.dtype = torch.float32, rows: int = 1024, seed: int = 0,
                        safety: float = 2.0, block: int = 32) -> dict[str, float]:  # fmt: skip
    """The error of one element that is always caught, relative to the product's own magnitude, for
    a ``nn.Linear(width, width)`` at its default initialisation fed unit-variance rows (as after a
    LayerNorm) and unit-variance output gradients on the CPU, computing in ``dtype``: per product,
    the median over rows (and blocks) of the stated threshold over the row's largest absolute
    element (``*_vs_max``) and over its root-mean-square (``*_vs_rms``); for the weight gradient,
    over the whole gradient's. What docs/coverage.md quotes; the unit tests check that errors
    this large are caught."""
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
    x_block_norms = torch.linalg.vector_norm(lb.x_blocks(x.to(acc)), dim=-1)
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


def _worst(ratio: torch.Tensor) -> torch.Tensor:
    """The largest ratio (NaN when any is NaN; 0 for no rows): one reduction, no host read."""
    return ratio.amax() if ratio.numel() else ratio.new_zeros(())


# -------------------------------------------------------------------------------- the product's autograd node

_PASS_THROUGH = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "SqueezeBackward3", "SqueezeBackward4",
})  # fmt: skip
_PRODUCTS = {"AddmmBackward0": 1, "MmBackward0": 0}  # where dX sits among the node's gradients (dW^T follows)


def product_node(y: torch.Tensor) -> tuple[Any, int] | None:
    """The autograd node of the matrix product inside ``F.linear``'s output ``y`` and the position
    of ``dX`` among its input gradients, or None (no graph, or an unexpected structure)."""
    node = y.grad_fn
    for _ in range(6):
        if node is None:
            return None
        name = type(node).__name__
        if name in _PRODUCTS:
            return node, _PRODUCTS[name]
        if name in _PASS_THROUGH:
            node = node.next_functions[0][0]
        elif name == "AddBackward0":  # a bias added after the product (non-contiguous input)
            node = next(
                (
                    f
                    for f, _ in node.next_functions
                    if f is not None and type(f).__name__ in _PASS_THROUGH | _PRODUCTS.keys()
                ),
                None,
            )
        else:
            return None
    return None


# -------------------------------------------------------------------------------- F.linear inside attention

_LINEAR = F.linear
_SCOPE: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("sdc_matmul_scope", default=None)
_patch_users = 0


def _scoped_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also hands its call to the checked attention module running on this
    thread (``_SCOPE``); anywhere else it is ``F.linear`` plus one context-variable read."""
    out = _LINEAR(input, weight, bias)
    if not torch.compiler.is_compiling():
        scope = _SCOPE.get()
        if scope is not None:
            scope(input, weight, bias, out)
    return out


def _install_patch() -> None:
    global _patch_users
    if _patch_users == 0:
        F.linear = _scoped_linear  # type: ignore[assignment]
    _patch_users += 1


def _remove_patch() -> None:
    global _patch_users
    _patch_users = max(_patch_users - 1, 0)
    if _patch_users == 0 and F.linear is _scoped_linear:
        F.linear = _LINEAR  # type: ignore[assignment]


_ATTENTION_PARTS = {(0, 1): "in_proj[q]", (1, 1): "in_proj[k]", (2, 1): "in_proj[v]", (1, 2): "in_proj[kv]",
                    (0, 3): "in_proj"}  # fmt: skip


def _attention_site(mha: nn.MultiheadAttention, weight: torch.Tensor) -> str | None:
    """Which projection of ``mha`` a weight passed to ``F.linear`` is (a parameter or a row slice of
    the packed in-projection), or None."""
    if weight is mha.out_proj.weight:
        return "out_proj"
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        if weight is getattr(mha, name, None):
            return name.removesuffix("_weight")
    packed = mha.in_proj_weight
    if packed is None:
        return None
    if weight is packed:
        return "in_proj"
    if weight._base is packed and weight.dim() == 2 and weight.shape[1] == packed.shape[1]:
        e = mha.embed_dim
        start = (weight.storage_offset() - packed.storage_offset()) // max(packed.stride(0), 1)
        if start % e == 0 and weight.shape[0] % e == 0:
            return _ATTENTION_PARTS.get((start // e, weight.shape[0] // e))
    return None


# -------------------------------------------------------------------------------- the check


@dataclass
class _Pending:
    step: int
    payload: torch.Tensor  # the step's worst ratio, all-reduced (MAX) in place
    work: Any
    records: list[tuple[int, int, torch.Tensor]]  # this rank's (site, product, worst ratio) (for the names)
    read: HostRead | None = None  # the all-reduced value, read on the host without draining the queue


@dataclass
class MatmulChecksum:
    """Framework-neutral matrix-product checksum check; any loop driver can run it.

    Calls, on every rank alike: ``attach(model)`` once (hooks the model's products), per optimizer
    step ``arm(step)`` before the step's first forward (idempotent: call it before every
    micro-batch) and ``verdict(step)`` after the step's last backward and before the update;
    ``resolve()`` where a pending verdict must be known (before a checkpoint is written, at the
    end of training); ``discard()`` on an error path (no collective); ``detach()`` at the end.
    ``verdict`` reads the previous step's result and may raise ``ChecksumMismatchError`` naming
    that step. Checks run only between ``arm`` and ``verdict`` of a checked step.
    """

    config: MatmulChecksumConfig = field(default_factory=MatmulChecksumConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("matmul_checksum"))
    topology: Topology | None = None
    last_error: ChecksumMismatchError | None = None
    sites: list[str] = field(default_factory=list)
    uncovered: dict[str, str] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list)
    _patched: bool = False
    _armed: bool = False
    _armed_step: int | None = None
    _records: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    _bounds: dict[tuple[Any, ...], LinearBound] = field(default_factory=dict)
    _rounding: dict[tuple[torch.dtype, str], Rounding] = field(default_factory=dict)
    _pending: _Pending | None = None
    _home: torch.device | None = None  # the model's device: where the step's flag is made

    # -- set-up

    def attach(self, model: nn.Module) -> list[str]:
        """Hook every covered product of ``model`` (names relative to it); returns the checked
        sites. What is not covered, and why, is in ``uncovered``."""
        self.detach()
        self._home = next((p.device for p in model.parameters()), None)
        skip: set[str] = set()
        for name, module in model.named_modules():
            if name in skip:
                continue
            if isinstance(module, nn.MultiheadAttention):
                skip.add(f"{name}.out_proj" if name else "out_proj")  # used through the functional call
                self._attach_attention(name, module)
            elif isinstance(module, nn.Linear):
                if type(module).forward is not nn.Linear.forward:
                    self.uncovered[name] = f"{type(module).__name__} has its own forward"
                elif _is_dtensor(module.weight):
                    self.uncovered[name] = "DTensor (tensor-parallel) weight"
                else:
                    hook = functools.partial(self._on_linear, self._site(name))
                    self._handles.append(module.register_forward_hook(hook, prepend=True))
        return list(self.sites)

    def _attach_attention(self, name: str, mha: nn.MultiheadAttention) -> None:
        if not self.config.attention:
            self.uncovered[name] = "attention=False"
            return
        if type(mha).forward is not nn.MultiheadAttention.forward:
            self.uncovered[name] = f"{type(mha).__name__} has its own forward"
            return
        if _is_dtensor(mha.out_proj.weight):
            self.uncovered[name] = "DTensor (tensor-parallel) weight"
            return
        prefix = f"{name}." if name else ""
        packed = ("in_proj", "in_proj[q]", "in_proj[k]", "in_proj[v]", "in_proj[kv]")
        parts = ["out_proj", *(packed if mha.in_proj_weight is not None else ("q_proj", "k_proj", "v_proj"))]
        sites = {part: self._site(prefix + part) for part in parts}
        original = mha.forward

        def on_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
            part = _attention_site(mha, weight)
            if part is not None and part in sites:
                self._check(sites[part], x, weight, bias, y)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self._armed:
                return original(*args, **kwargs)
            token = _SCOPE.set(on_linear)
            try:
                return original(*args, **kwargs)
            finally:
                _SCOPE.reset(token)

        mha.forward = forward  # type: ignore[method-assign]
        self._wrapped.append((mha, forward))
        if not self._patched:
            _install_patch()
            self._patched = True

    def detach(self) -> None:
        """Remove every hook and wrapper (idempotent); a pending verdict stays readable."""
        for handle in self._handles:
            handle.remove()
        for module, forward in self._wrapped:
            if vars(module).get("forward") is forward:
                del module.forward
        if self._patched:
            _remove_patch()
        self._handles, self._wrapped, self._patched = [], [], False
        self.sites, self._index, self.uncovered = [], {}, {}
        self._armed, self._records, self._bounds = False, [], {}

    def coverage(self) -> dict[str, Any]:
        """Checked sites (module names; attention projections as ``<mha>.in_proj``, ``.in_proj[q]``
        (cross-attention) etc.) and the linear-like modules left out, with the reason."""
        return {"checked": list(self.sites), "not_checked": dict(self.uncovered)}

    def _site(self, name: str) -> int:
        if name not in self._index:
            self._index[name] = len(self.sites)
            self.sites.append(name)
        return self._index[name]

    # -- per step

    def arm(self, step: int) -> bool:
        """Start checking optimizer step ``step`` if it is due (call before each of its forwards,
        every rank alike). The first call of a step reads the previous step's verdict (may raise,
        naming that step; on CUDA it waits for that step's backward, long enqueued, if the device
        is not past it yet). A step armed earlier and never given its verdict gets it here."""
        if self._armed_step == step:
            return self._armed
        if self._armed and self._armed_step is not None:
            self.verdict(self._armed_step)
        self.resolve()
        self._armed_step = step
        self._armed = step % self.config.every_n_steps == 0
        self._records, self._bounds, self._rounding = [], {}, {}
        return self._armed

    @property
    def armed(self) -> bool:
        return self._armed

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending.step

    def worst(self) -> dict[tuple[str, str], float]:
        """This rank's worst ratio so far in the armed step, per (site, product) (a host read: for
        tests and diagnostics, not the hot path)."""
        return _by_site(self.sites, self._records)

    def verdict(self, step: int, now: bool = False) -> None:
        """Close step ``step``: read the previous step's result (may raise, naming that step), then
        send this step's worst residual on its way (one asynchronous 4-byte MAX all-reduce, no
        host wait). With ``now``, read it before returning (a host wait)."""
        self.resolve()
        if not self._armed or self._armed_step != step:
            return
        t0 = time.perf_counter()
        self._armed = False
        records, self._records = self._records, []
        # decided from the model's device and the group's backends, alike on every rank whatever each saw
        device = collective_device(self._home)
        groups: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, worst in records:
            groups.setdefault(worst.device, []).append(worst)
        peaks = [torch.stack(values).amax().to(device) for values in groups.values()]
        payload = (torch.stack(peaks).amax() if peaks else torch.zeros((), device=device)).reshape(1).float()
        payload = torch.nan_to_num(payload, nan=math.inf)
        work = dist.all_reduce(payload, op=dist.ReduceOp.MAX, async_op=True) if is_distributed() else None
        pending = _Pending(step, payload, work, records)
        pending.read = HostRead(payload, work)  # on CUDA: an event now, a side-stream copy when read
        self._pending = pending
        self.stats.add_time(time.perf_counter() - t0)
        if now:
            self.resolve()

    def resolve(self) -> None:
        """Read the pending verdict, if any (every rank, same place); raise or warn naming its step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        assert pending.read is not None
        value = float(pending.read.get()[0])  # waits for this value (and its all-reduce) only
        self.stats.runs += 1
        if value <= 1.0:
            self.stats.last_verified_step = pending.step
            self.stats.add_time(time.perf_counter() - t0)
            return
        # Rare path, entered by every rank together: who saw what.
        per_rank = all_gather_objects(self._local_report(pending.records))
        self._failure(pending.step, per_rank, t0)

    def discard(self) -> int | None:
        """Drop the pending verdict without any collective (training stops on another error, maybe
        on this rank only); warns when this rank's own products failed that step. Returns the
        step, or None."""
        pending, self._pending = self._pending, None
        self._armed, self._records = False, []
        if pending is None:
            return None
        mine = self._local_report(pending.records)
        if not mine:
            return None
        warnings.warn(
            f"SDC check 'matmul_checksum': step {pending.step}: {mine[0]['module']} ({mine[0]['phase']}) "
            "failed its checksum on this rank; not compared with the other ranks because training stopped "
            "on another error first",
            RuntimeWarning,
            stacklevel=2,
        )
        return pending.step

    def _local_report(self, records: list[tuple[int, int, torch.Tensor]]) -> list[dict[str, Any]]:
        """This rank's failed products, worst first (a host read: rare paths only)."""
        found = []
        for (site, product), value in _by_site(self.sites, records, names=False).items():
            if not value <= 1.0:
                ratio: float | str = value if math.isfinite(value) else "inf" if value > 0 else "non-finite result"
                found.append({"module": self.sites[site], "phase": PHASES[product], "product": PRODUCTS[product],
                              "ratio": ratio})  # fmt: skip
        found.sort(key=lambda v: -v["ratio"] if isinstance(v["ratio"], float) else -math.inf)
        return found[: self.config.max_names]

    def _failure(self, step: int, per_rank: list[list[dict[str, Any]]], t0: float) -> None:
        offenders = tuple(r for r, found in enumerate(per_rank) if found)
        if not offenders:  # cannot happen: the ratio that made the maximum is in some report
            self.stats.last_verified_step = step
            return
        topo = self.topology or Topology.gather()
        first = per_rank[offenders[0]][0]
        rank = offenders[0] if len(offenders) == 1 else None
        ratio = first["ratio"]
        size = {"inf": "more than the float range (a huge error)", "non-finite result": "a non-finite result"}.get(
            ratio, f"{ratio:.3g} times its rounding bound" if isinstance(ratio, float) else str(ratio)
        )
        where = "this rank's" if rank is not None else f"rank {offenders[0]}'s"
        reason = (f"{where} {first['product'].replace('_', ' ')} of {first['module']} ({first['phase']}) "
                  f"missed its checksum by {size}: the product was computed wrongly")  # fmt: skip
        if len(offenders) > 1:
            reason += f"; ranks {', '.join(map(str, offenders))} each failed their own products"
        error = ChecksumMismatchError(
            step=step,
            rank=rank,
            suspects=offenders,
            hosts=topo.hosts(offenders),
            module=first["module"],
            phase=first["phase"],
            details={
                "product": first["product"],
                "ratio": ratio,
                "violations": {r: per_rank[r] for r in offenders},
                "world_size": len(per_rank),
                "node_ranks": topo.node_ranks(offenders),
            },
            reason=reason,
        )
        self.stats.failures += 1
        self.last_error = error
        self.stats.add_time(time.perf_counter() - t0)
        if self.config.on_failure == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)

    # -- the hot path

    def _on_linear(self, site: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._armed and args and isinstance(output, torch.Tensor) and not torch.compiler.is_compiling():
            self._check(site, args[0], module.weight, module.bias, output)

    def _failed_check(self, err: Exception) -> None:
        """A check that could not run (never the product's fault): counted and warned once, never
        raised, so one rank's surprise cannot leave the others waiting in a collective."""
        self.stats.bump("check_errors")
        if self.stats.extra and self.stats.extra.get("check_errors") == 1:
            warnings.warn(f"SDC check 'matmul_checksum' skipped a product: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)  # fmt: skip

    def _check(self, site: int, x: Any, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
        """Forward check of one product, and the hook on its node for the backward checks."""
        try:
            self._check_forward(site, x, weight, bias, y)
        except Exception as err:
            self._failed_check(err)

    def _bound(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: str) -> LinearBound:
        rnd = self._rounding.get((dtype, device))
        if rnd is None:
            rnd = self._rounding[(dtype, device)] = rounding(dtype, device)
        key = (weight.data_ptr(), weight.shape, weight.stride(), weight._version, dtype,
               None if bias is None else (bias.data_ptr(), bias._version))  # fmt: skip
        lb = self._bounds.get(key)
        if lb is None:
            lb = self._bounds[key] = LinearBound.of(weight, bias, dtype, rnd, self.config.safety, self.config.block)
        return lb

    def _check_forward(
        self, site: int, x: Any, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
    ) -> None:
        if not isinstance(x, torch.Tensor) or y.dtype not in _FLOATS or weight.dim() != 2:
            return
        m, k = weight.shape
        if y.numel() == 0 or y.shape[-1] != m or x.shape[-1] != k:
            return
        node = product_node(y) if torch.is_grad_enabled() else None
        # every operand is detached (the bound detaches the weight): nothing is recorded, no grad-mode switch
        with plain_arithmetic(y.device.type):
            lb = self._bound(weight, bias, y.dtype, y.device.type)
            x2 = operand(x.detach(), y.dtype, lb.rnd.acc_dtype, k)
            needs_dw = node is not None and weight.requires_grad
            ratio, _, x_block_norms, x_block_sums = lb.forward_ratio(x2, y.detach().reshape(-1, m), needs_dw)
            self._records.append((site, FORWARD, _worst(ratio)))
        if node is not None:
            graph, dx_at = node
            graph.register_hook(functools.partial(self._on_backward, site, dx_at, lb, x_block_sums, x_block_norms))
        elif torch.is_grad_enabled() and y.requires_grad:
            self.stats.bump("backward_not_located")

    def _on_backward(
        self,
        site: int,
        dx_at: int,
        lb: LinearBound,
        x_block_sums: torch.Tensor | None,
        x_block_norms: torch.Tensor,
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
    ) -> None:
        """Post-hook of the product's node: dY in, dX and dW^T out, as the product computed them."""
        try:
            self._check_backward(site, dx_at, lb, x_block_sums, x_block_norms, grad_inputs, grad_outputs)
        except Exception as err:
            self._failed_check(err)

    def _check_backward(
        self,
        site: int,
        dx_at: int,
        lb: LinearBound,
        x_block_sums: torch.Tensor | None,
        x_block_norms: torch.Tensor,
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
    ) -> None:
        dy = grad_outputs[0] if grad_outputs else None
        if not self._armed or dy is None or len(grad_inputs) < dx_at + 2:
            return
        dx, dwt = grad_inputs[dx_at], grad_inputs[dx_at + 1]
        n, k, m, acc = x_block_norms.shape[0], lb.k, lb.m, lb.rnd.acc_dtype
        # the backward runs with grad mode off unless it builds a graph (create_graph=True)
        grad = torch.no_grad() if torch.is_grad_enabled() else _NOTHING
        with grad, plain_arithmetic(dy.device.type):
            dy2 = dy.reshape(-1, m)
            if dy2.shape[0] != n:
                return
            dy2 = dy2 if dy2.dtype == acc else dy2.to(acc)
            dy_norms = torch.linalg.vector_norm(dy2, dim=-1)
            if dx is not None and dx.shape == (n, k):
                self._records.append((site, INPUT_GRAD, _worst(lb.input_grad_ratio(dy2, dx, dy_norms))))
            if dwt is not None and x_block_sums is not None and dwt.shape == (k, m):
                ratio = lb.weight_grad_ratio(dy2, dwt, x_block_sums, x_block_norms, dy_norms)
                self._records.append((site, WEIGHT_GRAD, _worst(ratio)))


def _by_site(sites: list[str], records: list[tuple[int, int, torch.Tensor]], names: bool = True) -> dict[Any, float]:
    """The worst ratio per (site, product) of some records (one host read)."""
    if not records:
        return {}
    values = torch.stack([w.float().cpu() for _, _, w in records]).tolist()
    out: dict[Any, float] = {}
    for (site, product, _), value in zip(records, values, strict=True):
        key = (sites[site], PRODUCTS[product]) if names else (site, product)
        old = out.get(key)
        if old is None or value != value or (old == old and value > old):  # NaN wins
            out[key] = value
    return out


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)
