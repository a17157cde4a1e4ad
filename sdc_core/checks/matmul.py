"""Checksum-verified matrix products: a wrong multiply is caught on the rank and in the step where it happens
(algorithm-based fault tolerance; the bound: ``matmul_bound``, the hooks: ``matmul_sites``). The all-reduce spreads a
finite compute fault into every replica, where the fingerprint cannot see it.

Covered: each ``nn.Linear`` using ``nn.Linear.forward`` (forward, dX, dW) and, with ``attention``,
``nn.MultiheadAttention``'s projections; not SDPA, other products (``matmul``, ``bmm``, ``Conv1D``, convolutions,
embeddings), DTensor weights, the bias gradient, ``torch.compile`` (``coverage()``).

``verdict(step)`` starts one asynchronous 4-byte MAX all-reduce of the step's worst normalised residual, read at the
next ``arm`` or ``resolve()`` (``now=True``: before the update); only on a failure do the ranks gather who saw what, and
every rank raises the same ``ChecksumMismatchError``. Cost (docs/performance.md): per product about thirty-five small
kernels, thin block products of ``1/block`` of its multiply-adds (3% at 32). The check only reads: training is
bit-identical."""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from sdc_core.checks.contract import Role, check_settings
from sdc_core.checks.matmul_bound import (
    NOTHING,
    LinearBound,
    Rounding,
    operand,
    plain_arithmetic,
    rounding,
    worst_ratio,
)
from sdc_core.checks.matmul_sites import ProductSites, product_node
from sdc_core.dist.topology import HostRead, Topology, all_gather_objects, collective_device, is_distributed
from sdc_core.errors import ChecksumMismatchError
from sdc_core.schema import documented, setting
from sdc_core.stats import CheckStats

FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2
PRODUCTS = ("output", "input_gradient", "weight_gradient")
PHASES = ("forward", "backward", "backward")
_ON_FAILURE = ("raise", "warn")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

MatmulFailurePolicy = Literal["raise", "warn"]  # MatmulChecksumConfig.on_failure


@documented
@dataclass(frozen=True, kw_only=True)
class MatmulChecksumConfig:
    """Settings of the matrix-product checksum check (keyword-only, validated on construction)."""

    on_failure: MatmulFailurePolicy = setting(
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
        check_settings(self, ints=("every_n_steps", "max_names"))
        if isinstance(self.safety, bool) or not isinstance(self.safety, int | float) or not self.safety >= 1:
            raise ValueError(f"safety must be a number >= 1, got {self.safety!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0:
            raise ValueError(f"block must be an integer >= 0 (0: whole rows), got {self.block!r}")
        check_settings(self, flags=("attention",))


@dataclass
class _Pending:
    step: int
    records: list[tuple[int, int, torch.Tensor]]  # this rank's (site, product, worst ratio) (for the names)
    read: HostRead  # the step's worst ratio, all-reduced (MAX), read on the host without draining the queue


@dataclass
class MatmulChecksum:
    """Framework-neutral matrix-product checksum check. On every rank alike: ``attach(model)`` once,
    per step ``arm(step)`` before each forward (idempotent) and ``verdict(step)`` before the update;
    ``resolve()`` where a pending verdict must be known; ``discard()`` on an error path (no
    collective); ``detach()`` at the end. Products are checked between ``arm`` and ``verdict``."""

    role: ClassVar[Role] = Role.MATMUL

    config: MatmulChecksumConfig = field(default_factory=MatmulChecksumConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("matmul_checksum"))
    topology: Topology | None = None
    last_error: ChecksumMismatchError | None = None
    _armed: bool = False
    _armed_step: int | None = None
    _records: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    _bounds: dict[tuple[Any, ...], LinearBound] = field(default_factory=dict)
    _rounding: dict[tuple[torch.dtype, str], Rounding] = field(default_factory=dict)
    _pending: _Pending | None = None
    _home: torch.device | None = None  # the model's device: where the step's flag is made
    _products: ProductSites = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._products = ProductSites(self._on_linear, self._check, self._is_armed)  # bound methods: picklable

    @property
    def sites(self) -> list[str]:
        """The checked sites' names, in the order they were found (a record's site is its index)."""
        return self._products.names

    @property
    def uncovered(self) -> dict[str, str]:
        """The linear-like modules left out, with the reason."""
        return self._products.uncovered

    def attach(self, model: nn.Module) -> list[str]:
        """Hook every covered product of ``model``; returns the checked sites (see ``uncovered``)."""
        self.detach()
        self._home = next((p.device for p in model.parameters()), None)
        return self._products.attach(model, self.config.attention)

    def detach(self) -> None:
        """Remove every hook and wrapper (idempotent); a pending verdict stays readable."""
        self._products.detach()
        self._armed, self._records, self._bounds = False, [], {}

    def arm(self, step: int) -> bool:
        """Start checking step ``step`` if it is due (before each of its forwards, every rank alike).
        The first call of a step reads the previous step's verdict (may raise, naming that step)."""
        if self._armed_step == step:
            return self._armed
        if self._armed and self._armed_step is not None:
            self.verdict(self._armed_step)
        self.resolve()
        self._armed_step = step
        self._armed = step % self.config.every_n_steps == 0
        self._records, self._bounds, self._rounding = [], {}, {}
        return self._armed

    def _is_armed(self) -> bool:
        return self._armed

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending.step

    def worst(self) -> dict[tuple[str, str], float]:
        """This rank's worst ratio so far in the armed step, per (site, product) (a host read)."""
        return {(self.sites[s], PRODUCTS[p]): v for (s, p), v in _by_site(self._records).items()}

    def verdict(self, step: int, now: bool = False) -> None:
        """Close step ``step``: read the previous step's result (may raise), then start this step's
        all-reduce (no host wait; ``now``: read it before returning)."""
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
        self._pending = _Pending(step, records, HostRead(payload, work))
        self.stats.add_time(time.perf_counter() - t0)
        if now:
            self.resolve()

    def resolve(self) -> None:
        """Read the pending verdict, if any (every rank, same place); raise or warn naming its step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        value = float(pending.read.get()[0])  # waits for this value (and its all-reduce) only
        self.stats.runs += 1
        if value <= 1.0:
            self.stats.last_verified_step = pending.step
            self.stats.add_time(time.perf_counter() - t0)
            return
        # Rare path, entered by every rank together: who saw what.
        per_rank = all_gather_objects(self._local_report(pending.records))
        if not any(per_rank):  # cannot happen: the ratio that made the maximum is in some report
            self.stats.last_verified_step = pending.step
            return
        error = mismatch_error(pending.step, per_rank, self.topology or Topology.gather())
        self.stats.failures += 1
        self.last_error = error
        self.stats.add_time(time.perf_counter() - t0)
        if self.config.on_failure == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)

    def discard(self) -> int | None:
        """Drop the pending verdict without a collective; warns when this rank's own products failed
        that step. Returns the step, or None."""
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
        for (site, product), value in _by_site(records).items():
            if not value <= 1.0:
                ratio: float | str = value if math.isfinite(value) else "inf" if value > 0 else "non-finite result"
                found.append({"module": self.sites[site], "phase": PHASES[product], "product": PRODUCTS[product],
                              "ratio": ratio})  # fmt: skip
        found.sort(key=lambda v: -v["ratio"] if isinstance(v["ratio"], float) else -math.inf)
        return found[: self.config.max_names]

    def _on_linear(self, site: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._armed and args and isinstance(output, torch.Tensor) and not torch.compiler.is_compiling():
            self._check(site, args[0], module.weight, module.bias, output)

    def _failed_check(self, err: Exception) -> None:
        """A check that could not run: counted and warned once, never raised (a raise on one rank
        would leave the others waiting in a collective)."""
        self.stats.bump("check_errors")
        if self.stats.extra and self.stats.extra.get("check_errors") == 1:
            warnings.warn(f"SDC check 'matmul_checksum' skipped a product: {type(err).__name__}: {err}",
                          RuntimeWarning, stacklevel=3)  # fmt: skip

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

    def _check(self, site: int, x: Any, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
        """Forward check of one product, and the hook on its node for the backward checks."""
        try:
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
                self._records.append((site, FORWARD, worst_ratio(ratio)))
            if node is not None:
                graph, dx_at = node
                hook = functools.partial(self._check_backward, site, dx_at, lb, x_block_sums, x_block_norms)
                graph.register_hook(hook)
            elif torch.is_grad_enabled() and y.requires_grad:
                self.stats.bump("backward_not_located")
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
        """Post-hook of the product's node: dY in, dX and dW^T out, as the product computed them."""
        try:
            dy = grad_outputs[0] if grad_outputs else None
            if not self._armed or dy is None or len(grad_inputs) < dx_at + 2:
                return
            dx, dwt = grad_inputs[dx_at], grad_inputs[dx_at + 1]
            n, k, m, acc = x_block_norms.shape[0], lb.k, lb.m, lb.rnd.acc_dtype
            # the backward runs with grad mode off unless it builds a graph (create_graph=True)
            grad = torch.no_grad() if torch.is_grad_enabled() else NOTHING
            with grad, plain_arithmetic(dy.device.type):
                dy2 = dy.reshape(-1, m)
                if dy2.shape[0] != n:
                    return
                dy2 = dy2 if dy2.dtype == acc else dy2.to(acc)
                dy_norms = torch.linalg.vector_norm(dy2, dim=-1)
                if dx is not None and dx.shape == (n, k):
                    self._records.append((site, INPUT_GRAD, worst_ratio(lb.input_grad_ratio(dy2, dx, dy_norms))))
                if dwt is not None and x_block_sums is not None and dwt.shape == (k, m):
                    ratio = lb.weight_grad_ratio(dy2, dwt, x_block_sums, x_block_norms, dy_norms)
                    self._records.append((site, WEIGHT_GRAD, worst_ratio(ratio)))
        except Exception as err:
            self._failed_check(err)


def mismatch_error(step: int, per_rank: list[list[dict[str, Any]]], topo: Topology) -> ChecksumMismatchError:
    """The verdict on ``step`` from every rank's failed products (identical on every rank): the first
    failing rank's worst product names the fault; ``rank`` only when a single rank failed."""
    offenders = tuple(r for r, found in enumerate(per_rank) if found)
    first = per_rank[offenders[0]][0]
    rank = offenders[0] if len(offenders) == 1 else None
    ratio = first["ratio"]
    size = {"inf": "more than the float range (a huge error)", "non-finite result": "a non-finite result"}.get(
        ratio, f"{ratio:.3g} times its rounding bound" if isinstance(ratio, float) else str(ratio))
    where = "this rank's" if rank is not None else f"rank {offenders[0]}'s"
    reason = (f"{where} {first['product'].replace('_', ' ')} of {first['module']} ({first['phase']}) "
              f"missed its checksum by {size}: the product was computed wrongly")  # fmt: skip
    if len(offenders) > 1:
        reason += f"; ranks {', '.join(map(str, offenders))} each failed their own products"
    return ChecksumMismatchError(
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


def _by_site(records: list[tuple[int, int, torch.Tensor]]) -> dict[tuple[int, int], float]:
    """The worst ratio per (site, product) index of some records (one host read)."""
    if not records:
        return {}
    values = torch.stack([w.float().cpu() for _, _, w in records]).tolist()
    out: dict[tuple[int, int], float] = {}
    for (site, product, _), value in zip(records, values, strict=True):
        old = out.get((site, product))
        if old is None or value != value or (old == old and value > old):  # NaN wins
            out[(site, product)] = value
    return out
