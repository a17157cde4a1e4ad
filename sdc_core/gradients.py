"""Local-gradient tap and the non-finite gradient check.

Contract: each rank's LOCAL gradients (before the all-reduce mixes them) are checked for NaN and
Inf on the step's sync micro-batch; every rank learns which ranks produced non-finite values, and
all ranks act alike (raise, skip the optimizer step, or warn) in the same step.

How: a single DDP communication hook per model, the ``GradientTap``, lets consumers read each
gradient bucket before the inner hook (the default all-reduce, or the user's compression hook,
which it wraps rather than replaces). The check reduces each bucket with one ``aminmax`` kernel,
exact (no overflow: NaN and Inf survive min/max, finite values never become Inf) and at the
memory-read speed. Under gradient accumulation the hook sees the sum of the micro-batches'
gradients, so a NaN in any micro-batch is seen.

Cost: one read of the local gradients per step, no host synchronisation inside the hook, and one
SUM all-reduce of a single int32 plus one host read of it before the optimizer step (the verdict
must be known before the update can be skipped). Only when a rank is flagged are the per-rank
flags gathered and the offending parameters named.

Limits: a fault that leaves gradients finite is invisible here (the ring replay audit sees it).
Without DDP the check reads ``.grad`` before the optimizer step; there is then only one rank.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdc_core.errors import NonFiniteGradientError
from sdc_core.fingerprint import flatten, group_small
from sdc_core.stats import CheckStats
from sdc_core.topology import Topology, all_gather_objects, collective_device, is_distributed

BucketConsumer = Callable[[Any], None]
_ON_FAILURE = ("raise", "skip_step", "warn", "rollback")


class GradientTap:
    """The one communication hook per DDP model; consumers see each bucket before the all-reduce.

    ``GradientTap.attach(ddp_model, ...)`` returns the model's existing tap or registers a new
    one wrapping ``inner_hook`` (default: DDP's all-reduce). Consumers must not synchronise with
    the host.
    """

    def __init__(self, names: dict[int, str], inner_hook: Callable[..., Any] | None, inner_state: Any) -> None:
        if inner_hook is None:
            inner_hook = default_allreduce
        self.names = names
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.consumers: list[BucketConsumer] = []

    @classmethod
    def attach(
        cls,
        ddp_model: nn.parallel.DistributedDataParallel,
        names: dict[int, str],
        inner_hook: Callable[..., Any] | None = None,
        inner_state: Any = None,
    ) -> GradientTap:
        """Return the tap of ``ddp_model``, registering it (once) if there is none yet.

        Raises ``ValueError`` when the model already carries a communication hook that is not
        a tap: DDP accepts only one, so it must be handed to the tap as ``inner_hook`` instead.
        """
        tap = getattr(ddp_model, "_sdc_gradient_tap", None)
        if tap is not None:
            return tap
        if getattr(ddp_model, "_comm_hooks", None):
            raise ValueError(
                "the DDP model already has a communication hook registered; DDP accepts only one. "
                "Pass it to the strategy (DDPStrategy(ddp_comm_hook=...)) or to the SDC hooks so the "
                "SDC gradient tap can wrap it."
            )
        tap = cls(names, inner_hook, inner_state)
        ddp_model.register_comm_hook(state=tap, hook=_tap_hook)
        ddp_model._sdc_gradient_tap = tap  # type: ignore[assignment]
        return tap

    def bucket_names(self, bucket: Any) -> list[str]:
        """Parameter names of a bucket's gradients, in bucket order.

        Not cached: DDP rebuilds its buckets after the first iteration and may reuse the same
        memory for a different parameter order. A dictionary lookup per parameter per step.
        """
        return [self.names.get(id(p), "?") for p in bucket.parameters()]


def default_allreduce(process_group: dist.ProcessGroup | None, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in reduction as a hook: scale by ``1 / world_size``, then sum.

    Bit-identical to DDP without a hook (its reducer multiplies each gradient by the reciprocal
    while copying it into the bucket; ``default_hooks.allreduce_hook`` divides instead, which
    rounds differently), so registering the tap does not change training numerics.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _tap_hook(tap, bucket):  # type: ignore[no-untyped-def]  # DDP inspects these annotations
    """DDP communication hook: consumers read the local bucket, then the inner hook runs."""
    for consume in tap.consumers:
        consume(bucket)
    return tap.inner_hook(tap.inner_state, bucket)


@dataclass(frozen=True)
class NonFiniteConfig:
    """Settings of the non-finite gradient check (validated on construction).

    Args:
        on_failure: ``"raise"`` (default), ``"skip_step"`` (every rank drops the optimizer step,
            the weights stay clean), ``"warn"``, or ``"rollback"`` (raised here; the Lightning
            adapter reloads the newest verified checkpoint).
        overflow_patience: with an fp16 GradScaler, overflow is the scaler's business; a rank is
            flagged only when it is the only rank with non-finite local gradients on this many
            consecutive steps (>= 1).
        max_names: how many offending parameter names to report per rank.
    """

    on_failure: str = "raise"
    overflow_patience: int = 3
    max_names: int = 5

    def __post_init__(self) -> None:
        if self.on_failure not in _ON_FAILURE:
            raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {self.on_failure!r}")
        for name in ("overflow_patience", "max_names"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class NonFiniteGradient:
    """Framework-neutral non-finite gradient check.

    Adapters call ``attach`` (DDP) once, then ``verdict(step, params, ...)`` once per optimizer
    step, after backward and before the update.
    """

    config: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("nonfinite_gradient"))
    topology: Topology | None = None
    tap: GradientTap | None = None
    _buckets: list[tuple[torch.Tensor, list[str]]] = field(default_factory=list)
    _sole_rank: int | None = None
    _streak: int = 0
    last_error: NonFiniteGradientError | None = None

    def attach(self, tap: GradientTap) -> None:
        """Consume the tap's buckets (local gradients, pre-all-reduce)."""
        self.tap = tap
        tap.consumers.append(self._consume)

    def _consume(self, bucket: Any) -> None:
        assert self.tap is not None
        self._buckets.append((_minmax(bucket.buffer()), self.tap.bucket_names(bucket)))

    def verdict(
        self,
        step: int,
        params: Iterable[tuple[str, nn.Parameter]],
        scaler_active: bool = False,
    ) -> bool:
        """Decide, on every rank alike, whether step ``step`` is clean.

        ``params`` are the named parameters of the model (their ``.grad`` is all-reduced by
        now). Returns True when the optimizer step must be skipped (``on_failure="skip_step"``);
        raises ``NonFiniteGradientError`` with ``on_failure="raise"``.
        """
        t0 = time.perf_counter()
        params = list(params)
        buckets, self._buckets = self._buckets, []
        distributed = is_distributed() and self.tap is not None
        if distributed:
            flags = _nonfinite(torch.stack([mm for mm, _ in buckets])) if buckets else None
        else:
            grads = [p.grad for _, p in params if p.grad is not None]
            flags = any_nonfinite(grads).reshape(1) if grads else None
        device = collective_device()
        local = torch.zeros(1, dtype=torch.int32, device=device)
        if flags is not None:
            local += flags.any().to(device=device, dtype=torch.int32)
        if distributed:
            dist.all_reduce(local)
        count = int(local.item())
        self.stats.runs += 1
        if count == 0:
            self._streak, self._sole_rank = 0, None
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return False

        # Rare path: name the ranks and parameters.
        mine = self._local_names(params, buckets, flags, distributed)
        per_rank = all_gather_objects(mine) if distributed else [mine]
        offenders = tuple(r for r, names in enumerate(per_rank) if names is not None)
        world = len(per_rank)
        if world == 1:
            pattern = "single_process"
        elif len(offenders) == 1:
            pattern = "one_rank"
        elif len(offenders) == world:
            pattern = "all_ranks"
        else:
            pattern = "some_ranks"
        topo = self.topology or Topology.gather()
        details: dict[str, Any] = {
            "pattern": pattern,
            "parameters": {r: per_rank[r] for r in offenders},
            "world_size": world,
            "node_ranks": topo.node_ranks(offenders),
        }
        if scaler_active:
            sole = offenders[0] if len(offenders) == 1 and world > 1 else None
            self._streak = (
                self._streak + 1 if sole is not None and sole == self._sole_rank else (1 if sole is not None else 0)
            )
            self._sole_rank = sole
            self.stats.bump("scaler_overflows")
            if self._streak < self.config.overflow_patience:
                self.stats.add_time(time.perf_counter() - t0)
                return False  # the GradScaler skips this step itself
            details["pattern"] = "one_rank_repeatedly"
            details["consecutive_steps"] = self._streak
        self.stats.failures += 1
        rank = offenders[0] if len(offenders) == 1 else None
        first = per_rank[offenders[0]][:3] if offenders and per_rank[offenders[0]] else []
        reason = {
            "one_rank": "only this rank produced NaN/Inf local gradients (the SDC signature)",
            "one_rank_repeatedly": f"only this rank overflowed on {self._streak} consecutive fp16 steps",
            "all_ranks": "every rank produced NaN/Inf gradients: ordinary divergence (learning rate, data, "
            "numerics) is likelier than a faulty device",
            "some_ranks": "several ranks produced NaN/Inf local gradients",
            "single_process": "NaN/Inf gradients (single process: no replica to compare with)",
        }[details["pattern"]]
        reason += f" in {', '.join(first)}" if first else ""
        error = NonFiniteGradientError(
            step=step, rank=rank, suspects=offenders, hosts=topo.hosts(offenders), details=details, reason=reason
        )
        self.stats.add_time(time.perf_counter() - t0)
        self.last_error = error
        if self.config.on_failure in ("raise", "rollback"):  # rollback: the adapter acts on the error
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        if self.config.on_failure == "skip_step":
            self.stats.bump("skipped_steps")
            if not scaler_active:  # a GradScaler skips a non-finite step itself (and needs the grads to see it)
                drop_step(p for _, p in params)
            return True
        return False

    def _local_names(
        self,
        params: list[tuple[str, nn.Parameter]],
        buckets: list[tuple[torch.Tensor, list[str]]],
        flags: torch.Tensor | None,
        distributed: bool,
    ) -> list[str] | None:
        """This rank's offending parameter names, or None when its local gradients were finite."""
        if flags is None or not bool(flags.any()):
            return None
        limit = self.config.max_names
        grads = dict(params)
        if not distributed:
            bad = [n for (n, p) in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            return bad[:limit]
        # The local buffer is gone (reduced in place); the reduced .grad is non-finite exactly
        # where some rank's local gradient was, so intersect with this rank's flagged buckets.
        names: list[str] = []
        for flagged, (_, bucket_names) in zip(flags.tolist(), buckets, strict=True):
            if not flagged:
                continue
            for n in bucket_names:
                g = grads[n].grad if n in grads else None
                if g is not None and not bool(torch.isfinite(g).all()):
                    names.append(n)
            if not names:
                names.extend(bucket_names)
        return names[:limit]


def drop_step(params: Iterable[torch.Tensor], scaler_active: bool = False) -> None:
    """Make the coming optimizer step a no-op on this rank (call on every rank alike).

    Without a GradScaler the gradients are dropped (``grad = None``: torch optimizers skip such
    parameters). A GradScaler needs gradients to decide, so one element is set to Inf instead and
    the scaler skips the step itself (and lowers its scale, as after any overflow)."""
    params = [p for p in params if p.grad is not None]
    if scaler_active and params:
        params[0].grad.view(-1)[0] = float("inf")
        return
    for p in params:
        p.grad = None


def _minmax(t: torch.Tensor) -> torch.Tensor:
    """(min, max) of ``t`` as float64 (exact for every float format, so tensors of different
    dtypes stack), NaN/Inf preserved. One reduction kernel, no host synchronisation."""
    lo, hi = torch.aminmax(t)
    return torch.stack([lo, hi]).double()


def _nonfinite(minmax: torch.Tensor) -> torch.Tensor:
    """Per-row flag from stacked (min, max) pairs: True where either is NaN or Inf."""
    return ~torch.isfinite(minmax).all(dim=-1)


def nonfinite_flags(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per-tensor flags, True where a tensor holds NaN or Inf (exact; no host synchronisation)."""
    return _nonfinite(torch.stack([_minmax(t) for t in tensors]))


def any_nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flag (0-d bool tensor, no host synchronisation): does any tensor hold NaN or Inf?

    Tensors under ``fingerprint.SMALL_TENSOR`` elements are concatenated per dtype first (one copy kernel
    instead of one reduction each: with many small tensors per-kernel overhead dominates).
    """
    large, groups = group_small(tensors)
    units = [tensors[i] for i in large] + [flatten([tensors[i] for i in g]) for g in groups.values()]
    return nonfinite_flags(units).any()
