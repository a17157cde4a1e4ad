"""The side-effect free re-run of micro-batches, and the step's own gradients kept out of its way.

Contract: a re-run puts the owner's RNG and state in place, runs on detached aliases of the trainable parameters with
collectives refused, and restores everything afterwards, so training is bit-identical with the audit on and off. Cost:
one forward and backward per micro-batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.checks.gradient_tap import dense
from sdc_core.replay.guard import forbid_collectives
from sdc_core.replay.rng import all_rng, set_rng
from sdc_core.replay.state import MicroBatch, StateCapture, StepFn


def replay_gradients(
    module: nn.Module,
    names: Sequence[str],
    micro_batches: Iterable[MicroBatch],
    step_fn: StepFn,
    to_device: Callable[[Any], Any] = lambda b: b,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    capture: StateCapture | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Recompute the summed loss (float64 on the device) and every gradient of ``micro_batches`` without any side
    effect. ``step_fn(batch, batch_idx)`` returns the loss exactly as the owner back-propagated it; ``context()``
    is entered around each forward only, never the backward."""
    total: dict[str, torch.Tensor] = {}
    loss = replay_each_gradient(module, names, micro_batches, step_fn, total.__setitem__, to_device, context, capture)
    return loss, total


def replay_each_gradient(
    module: nn.Module,
    names: Sequence[str],
    micro_batches: Iterable[MicroBatch],
    step_fn: StepFn,
    consume: Callable[[str, torch.Tensor], None],
    to_device: Callable[[Any], Any] = lambda b: b,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    capture: StateCapture | None = None,
) -> torch.Tensor:
    """``replay_gradients`` that hands each final gradient to ``consume(name, grad)`` as it is produced, then frees
    it; ``consume`` runs on the autograd thread: no host sync, no raise."""
    capture = capture or StateCapture(module, names, max_state_mb=0)
    params = dict(module.named_parameters())
    aliases = {n: params[n].detach().requires_grad_() for n in names}
    device = next((p.device for p in params.values()), torch.device("cpu"))
    saved_rng = all_rng(device)
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    last = [False]

    def hand_on(name: str, alias: torch.Tensor, now: bool = False) -> None:
        if (now or last[0]) and alias.grad is not None:
            if dense(alias.grad):  # as the tap reads the owner's: a sparse gradient is left out on both sides
                consume(name, alias.grad)
            alias.grad = None

    handles = [a.register_post_accumulate_grad_hook(partial(hand_on, n)) for n, a in aliases.items()]
    batches = list(micro_batches)
    try:
        for i, mb in enumerate(batches):
            last[0] = i == len(batches) - 1
            set_rng(mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng, device)
            batch = to_device(mb.batch)
            with capture.applied(mb.state) as tensors:
                swapped = {**tensors, **aliases}
                with _reparametrize_module(module, swapped, tie_weights=True), forbid_collectives():
                    with context():  # the forward only, as the frameworks run it (autocast, ...)
                        loss = step_fn(batch, mb.batch_idx)
                    # the backward outside the precision context, as the owner's: on CPU a backward
                    # inside torch.autocast runs its ops under autocast and gives other gradients
                    loss.backward(inputs=list(aliases.values()))
            total_loss = total_loss + loss.detach().to(total_loss.device, torch.float64)
        for n, a in aliases.items():  # used by earlier micro-batches only
            hand_on(n, a, now=True)
    finally:
        for h in handles:
            h.remove()
        set_rng(*saved_rng, device)
    return total_loss


class _BucketCopies(TorchDispatchMode):
    """Records, while on, each ``copy_`` into one of ``grads`` and its source: DDP's copy of a reduced bucket
    view into ``.grad``. Never raises into the caller's operators."""

    def __init__(self, grads: dict[int, tuple[nn.Parameter, torch.Tensor]]) -> None:
        super().__init__()
        self.grads = grads
        self.found: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and len(args) >= 2:
            with suppress(Exception):  # a record missed is a gradient kept where it is
                dst, src = args[0], args[1]
                hit = self.grads.get(dst.data_ptr()) if isinstance(src, torch.Tensor) else None
                if hit is not None and hit[1] is dst:
                    self.found.append((hit[0], dst, src))
        return out


class GradientsAside:
    """Keeps an audited step's own gradients out of the way of its re-runs where DDP holds a copy anyway (its
    buckets, with DDP's default ``gradient_as_bucket_view=False``); restored bit for bit on every path, and
    nothing moves where that cannot be shown safe. Cost, on audited steps only: a Python call per operator of
    DDP's end-of-backward callback and two copies of the moved gradients; no host sync, no collective."""

    def __init__(self) -> None:
        self._mode: _BucketCopies | None = None
        self._found: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def clear(self) -> None:
        self._found = []

    def watch(self, ddp: Any, params: Sequence[nn.Parameter]) -> None:
        """At the end of a synchronised backward (queued before DDP's callback): record DDP's bucket copies."""
        self._found, self._mode = [], None  # a mode left by a failed callback is gone with that backward's state
        second_copy = (  # DDP's buckets are a second copy of ``.grad`` that nothing else reads
            ddp is not None and getattr(ddp, "gradient_as_bucket_view", True) is False
            and not getattr(ddp, "_comm_hooks", None) and getattr(ddp, "mixed_precision", None) is None
            and not getattr(ddp, "_delay_all_reduce_all_params", False))
        if not second_copy:
            return
        grads = {g.data_ptr(): (p, g) for p in params
                 if (g := p.grad) is not None and g.layout == torch.strided and g.numel() > 0 and g.data_ptr()}
        if not grads:
            return
        mode = _BucketCopies(grads)

        def stop() -> None:
            if self._mode is mode:
                self._mode = None
                self._found = mode.found
                mode.__exit__(None, None, None)

        mode.__enter__()
        self._mode = mode
        try:
            torch.autograd.Variable._execution_engine.queue_callback(stop)
        except Exception:  # no callback to leave the mode: leave it now, record nothing
            self._mode = None
            mode.__exit__(None, None, None)

    @contextmanager
    def aside(self) -> Iterator[int]:
        """Release the recorded gradients' storage for the block, put back on exit; yields the bytes set aside."""
        found, self._found = self._found, []
        moved: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        storages: dict[int, int] = {}
        for p, grad, view in found:
            g = p.grad
            if (g is not grad or g.requires_grad or view.requires_grad or g.dtype != view.dtype
                    or g.shape != view.shape or g.device != view.device or g.storage_offset() != 0):  # fmt: skip
                continue
            storage = g.untyped_storage()
            nbytes = g.numel() * g.element_size()
            dense = g.is_contiguous() or (g.dim() == 4 and g.is_contiguous(memory_format=torch.channels_last))
            if not dense or storage.nbytes() != nbytes or not storage.resizable():
                continue
            key = storage.data_ptr()
            if key == view.untyped_storage().data_ptr():
                continue
            storages[key] = storages.get(key, 0) + 1
            moved.append((g, nbytes, view))
        moved = [m for m in moved if storages[m[0].untyped_storage().data_ptr()] == 1]
        released: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        try:
            for g, nbytes, view in moved:
                view.copy_(g)
                g.untyped_storage().resize_(0)
                released.append((g, nbytes, view))
            yield sum(n for _, n, _ in released)
        finally:
            error: BaseException | None = None
            for g, nbytes, view in released:  # every one is tried, the first failure raised after
                try:
                    g.untyped_storage().resize_(nbytes)
                    g.copy_(view)
                except BaseException as err:  # the others are still put back
                    error = error or err
            if error is not None:
                raise error
