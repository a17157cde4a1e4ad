"""``LoopCapture``: what the ring replay and the screen take from a plain loop's forwards.

On an audited step each micro-batch is recorded (by ``replayable(fn)`` wrappers, else by forward hooks on the unwrapped
model) with its autocast state and attention backends and the loss as back-propagated (divided by the accumulation
steps, scaled by the GradScaler), so that a partner recomputes it the same way (``replay_step``). A loss computed
outside the model, without ``loss_fn``: the gradient that reached each output is recorded instead (up to
``max_state_mb``), and a partner back-propagates it from its own outputs, whose product with it is the loss compared.
Nothing is recorded in a replay, outside training or without gradients. No communication; cost: a few Python calls per
forward."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from sdc_core.driver.framework import Framework, LossFn


class Loop(Protocol):
    """What the capture reads of its hook set, at every call (each may change between calls)."""

    replay: Any  # the DDP or sharded replay core, or None
    screen: Any  # the every-step screen, or None
    step: int  # the index of the coming update
    loss_fn: LossFn | None

    @property
    def module(self) -> nn.Module | None: ...


class LoopCapture:
    """The replay's records of a loop's micro-batches, their recomputation, and the screen's loss (``take_loss``).
    ``loop``: the hook set; ``fw``: its framework; ``replay_state`` / ``load_replay_state``: as ``SDCHooks``'."""

    def __init__(self, loop: Loop, fw: Framework, replay_state: Callable[[], Any] | None = None,
                 load_replay_state: Callable[[Any], None] | None = None) -> None:  # fmt: skip
        self._loop = loop
        self._fw = fw
        self._state = (replay_state, load_replay_state)
        self._replayables: list[Callable[..., torch.Tensor]] = []
        self._uses_replayable = False
        self._in_replayable = 0
        self._replaying = False
        self._loss: torch.Tensor | None = None  # the loss of the step's forwards so far (the screen's value)
        self._grads: list[Any] | None = None  # the recorded forward's output gradients, filled in its backward
        self._awaiting_backward: int | None = None  # the step of a recorded forward whose backward has not run yet

    def state_hooks(self, module: nn.Module) -> tuple[Any, Any]:
        """``(get, load)`` for the replay's state capture: the explicit hooks, else the model's own methods."""
        get, load = self._state
        if get is None and load is None:
            get, load = getattr(module, "sdc_replay_state", None), getattr(module, "sdc_load_replay_state", None)
        return get, load

    def hook_forward(self, module: nn.Module) -> list[Any]:
        """Record ``module``'s forwards (removable handles): its inputs before, its loss after."""
        return [module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                module.register_forward_hook(self._after_forward, with_kwargs=True)]  # fmt: skip

    def in_replay(self) -> bool:
        """True while a replay runs (the DDP core says so; the sharded one runs ``replay_step``)."""
        return self._replaying or bool(getattr(self._loop.replay, "replaying", False))

    def replayable(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` wrapped (``SDCHooks.replayable``); from now on the forward hooks record nothing."""
        index = len(self._replayables)
        self._replayables.append(fn)
        self._uses_replayable = True

        @functools.wraps(fn)
        def wrapper(model: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            loop = self._loop
            module, replay = loop.module, loop.replay
            record = replay is not None and module is not None and self._training(module) and replay.arm(loop.step)
            if record:
                _record(replay, module, ("fn", index, args, kwargs))
            self._in_replayable += 1
            try:
                loss = fn(model, *args, **kwargs)
            finally:
                self._in_replayable -= 1
            if record:
                normalized = self.normalize(_loss_of(loss)).detach()
                replay.record_loss(normalized)
                if loop.screen is not None:
                    self._add_loss(normalized)
            return loss

        return wrapper

    def _training(self, module: nn.Module) -> bool:
        """A training forward with gradients, not a replay's: one that is recorded."""
        return module.training and torch.is_grad_enabled() and not self.in_replay()

    def _recording_forward(self, module: nn.Module) -> bool:
        return not (self._uses_replayable or self._in_replayable) and self._training(module)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        replay = self._loop.replay
        assert replay is not None
        self._grads = None
        if self._recording_forward(module) and replay.arm(self._loop.step):
            if self._awaiting_backward == self._loop.step:  # two forwards feed one backward: each replays alone
                replay.refuse("the model ran again before the backward of its previous forward")
            self._grads = []
            _record(replay, module, ("forward", 0, args, kwargs), self._grads)

    def _after_forward(self, module: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
        replay = self._loop.replay
        assert replay is not None
        if not self._recording_forward(module):
            return None
        grads, self._grads = self._grads, None
        if grads is not None and self._loop.loss_fn is None and _own_loss(outputs) is None:  # a loss outside
            aliased = self._through_outputs(outputs, grads, replay)  # watches for the backward itself
            if aliased is not None:
                return aliased
        if grads is not None:
            self._watch_backward(outputs)
        loss = self.backward_loss(outputs, args, kwargs).detach() if replay.armed else None
        if loss is not None:
            replay.record_loss(loss)
        if self._loop.screen is not None and self._loop.loss_fn is None:  # the model's own loss (no compute)
            own = _own_loss(outputs)
            if loss is None and isinstance(own, torch.Tensor):
                loss = self.normalize(own.detach())
            if loss is not None:
                self._add_loss(loss)
        return None

    def _watch_backward(self, outputs: Any) -> None:
        """Until a gradient reaches one of a recorded forward's ``outputs``, another forward of the step shares its
        backward (``_before_forward`` refuses the step)."""
        watched: list[torch.Tensor] = []
        _aliased(outputs, watched, alias=False)
        if watched:
            self._awaiting_backward = self._loop.step
            torch.autograd.graph.register_multi_grad_hook(watched, self._backward_ran, mode="any")

    def _backward_ran(self, grad: Any) -> None:
        self._awaiting_backward = None

    def _through_outputs(self, outputs: Any, grads: list[Any], replay: Any) -> Any:
        """``outputs`` aliased (``_aliased``), the gradient the loss sends into them recorded in ``grads`` (and the
        owner's loss as a partner computes it, ``_unit_loss``); None when none has a gradient or over the budget."""
        tensors: list[torch.Tensor] = []
        outputs = _aliased(outputs, tensors)
        budget = replay.config.max_state_mb * 2**20  # the step's, as the state capture's
        kept = [g for mb in replay.recording[:-1] for g in (mb.batch[6] if len(mb.batch) > 6 else []) if g is not None]
        if not tensors or sum(t.numel() * 8 for t in [*kept, *tensors]) > budget:  # as float64 (``_unit_loss``)
            return None
        values = [t.detach() for t in tensors]

        def landed(gs: Any) -> None:
            self._backward_ran(gs)
            grads[:] = [None if g is None else g.detach() for g in gs]
            if any(g is not None for g in grads):
                replay.record_loss(loss := _unit_loss(values, grads).detach())
                if self._loop.screen is not None:
                    self._add_loss(loss)

        self._awaiting_backward = self._loop.step
        torch.autograd.graph.register_multi_grad_hook(tensors, landed)
        return outputs

    def _add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss as back-propagated to the step's loss for the screen (what a replay returns)."""
        self._loss = loss if self._loss is None else self._loss + loss

    def take_loss(self) -> torch.Tensor | None:
        """The step's loss for the screen (no host read), and a fresh sum for the next step."""
        loss, self._loss = self._loss, None
        return loss

    def backward_loss(self, outputs: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The loss as the loop back-propagates it (normalised, scaled)."""
        loss_fn = self._loop.loss_fn
        loss = loss_fn(outputs, *args, **kwargs) if loss_fn is not None else _own_loss(outputs)
        if loss is None:
            raise ValueError(
                "the ring replay audit cannot find the loss: the model returns neither `.loss` nor a scalar, and its "
                "outputs are over replay_max_state_mb (or carry no gradient); raise replay_max_state_mb, "
                "wrap your loss computation with SDCHooks.replayable(fn), or pass "
                "loss_fn=(outputs, *args, **kwargs) -> loss to SDCHooks or attach()")
        return self.normalize(loss)

    def normalize(self, loss: torch.Tensor) -> torch.Tensor:
        """The framework's division by the accumulation steps and the GradScaler's scaling."""
        divisor = self._fw.loss_divisor
        loss = loss / divisor if divisor != 1 else loss
        scaler = self._fw.scaler
        return scaler.scale(loss) if scaler is not None else loss

    def replay_step(self, batch: tuple[Any, ...], batch_idx: int) -> torch.Tensor:
        """The loss of a recorded micro-batch, recomputed by the unwrapped model under its recorded states."""
        module = self._loop.module
        assert module is not None
        kind, index, args, kwargs, *rest = batch
        amp, sdpa, grads = (*rest, None, None, None)[:3]  # validated where they are used (a peer sent them)
        self._replaying = True
        try:
            with _autocast(amp), _sdpa_backends(sdpa):
                if kind == "fn":
                    model = self._fw.replay_model(module)
                    return self.normalize(_loss_of(self._replayables[index](model, *args, **kwargs)))
                with self._fw.replay_context():
                    outputs = module(*args, **kwargs)
                if not grads:
                    return self.backward_loss(outputs, args, kwargs)
                tensors: list[torch.Tensor] = []
                _aliased(outputs, tensors)
                self._loop.replay.projected = True  # the outputs' projection: what the owner's screen row holds
                return _unit_loss(tensors, grads)
        finally:
            self._replaying = False

    def to_device(self, batch: Any) -> Any:
        module = self._loop.module
        return self._fw.to_device(batch, _device(module) if module is not None else None)


def _own_loss(outputs: Any) -> Any:
    """The loss a model's output carries (``outputs.loss``, a dict's ``"loss"``, a scalar output), or None."""
    if getattr(outputs, "loss", None) is not None:
        return outputs.loss
    if isinstance(outputs, dict) and "loss" in outputs:
        return outputs["loss"]
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs
    return None


def _aliased(outputs: Any, found: list[torch.Tensor], alias: bool = True) -> Any:
    """``outputs`` (nested tuples, lists, dicts, ``ModelOutput``) with each tensor that requires grad replaced by a view
    of itself, added to ``found`` (dicts and lists changed in place; ``alias=False``: found, not replaced): the gradient
    a loss sends into an alias is that loss's alone, not also that of another output computed from it."""
    if isinstance(outputs, torch.Tensor) and outputs.requires_grad:
        found.append(outputs.view_as(outputs) if alias else outputs)
        return found[-1]
    if isinstance(outputs, dict | list):
        for key in list(outputs.keys() if isinstance(outputs, dict) else range(len(outputs))):
            outputs[key] = _aliased(outputs[key], found, alias)
    elif isinstance(outputs, tuple):  # rebuilt when a plain or named tuple (another kind is found, not aliased)
        alias = alias and (type(outputs) is tuple or hasattr(outputs, "_fields"))
        items = [_aliased(item, found, alias) for item in outputs]
        if alias:
            return type(outputs)(*items) if hasattr(outputs, "_fields") else tuple(items)
    return outputs


def _unit_loss(outputs: list[torch.Tensor], grads: Any) -> torch.Tensor:
    """A float64 scalar whose gradient at each output is exactly ``grads_i`` (that of sum_i <outputs_i, grads_i>), so
    back-propagating it gives the owner's gradients, and whose value, sum of |p| + p / 2 over the products p of outputs
    and gradients, changes with a changed output value (the gradients alone would not show a wrong value of the last
    layer's output: the owner's gradient of the loss is taken as given) and is at least half of sum |p|: no sum that
    cancels, a magnitude the screen can compare. ``ValueError`` for recorded gradients that do not fit the outputs.
    Cost: the outputs and gradients in float64, once."""
    fits = isinstance(grads, list) and len(grads) == len(outputs)
    if not fits or any(g is not None and (not isinstance(g, torch.Tensor) or g.shape != t.shape)
                       for t, g in zip(outputs, grads, strict=True)):  # fmt: skip
        raise ValueError("the recorded output gradients do not match the model's outputs")
    with torch.autocast(outputs[0].device.type if outputs else "cpu", enabled=False):  # alike in forward and backward
        terms = [t.double() * g.to(t.device).double() for t, g in zip(outputs, grads, strict=True) if g is not None]
    if not terms:
        raise ValueError("no gradient reached the model's outputs")
    unit = sum((p.sum() for p in terms[1:]), terms[0].sum())
    return unit + (sum(p.detach().abs().sum() for p in terms) - unit.detach() / 2).detach()  # value: sum |p| + unit/2


def _loss_of(result: Any) -> torch.Tensor:
    """The loss in what a ``replayable`` function returned: the tensor, or the first item of ``(loss, outputs)``."""
    if isinstance(result, tuple | list) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"a replayable function must return the loss tensor, got {type(result).__name__}")
    return result


def _record(replay: Any, module: nn.Module, call: tuple, *more: Any) -> None:
    """Record a micro-batch's call with the autocast state and attention backends it runs under (then ``more``)."""
    device = _device(module)
    replay.record((*call, _autocast_state(device), _sdpa_state(), *more), len(replay.recording), device)


def _device(module: nn.Module | None) -> torch.device | None:
    first = None if module is None else next(module.parameters(), None)
    return None if first is None else first.device


def _autocast_state(device: torch.device | None) -> tuple[str, str] | None:
    """``(device_type, dtype name)`` of the autocast the current code runs under, or None."""
    kind = device.type if device is not None else "cpu"
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        return kind, str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None


def _autocast(state: Any) -> AbstractContextManager[Any]:
    """Re-enter the autocast recorded by ``_autocast_state`` (nothing when it was off)."""
    if state is None:
        return nullcontext()
    kind, dtype = state
    if not isinstance(kind, str) or not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None),
                                                                                 torch.dtype):  # fmt: skip
        raise ValueError(f"bad recorded autocast state {state!r}")
    return torch.autocast(kind, dtype=getattr(torch, dtype))


_SDPA = ("flash", "mem_efficient", "math", "cudnn")
_SDPA_READS = tuple(getattr(torch._C, f"_get_{name}_sdp_enabled") for name in _SDPA)  # what torch.backends.cuda's call


def _sdpa_state() -> tuple[bool, ...]:
    """Which scaled-dot-product-attention backends the forward may use: the replay must pick the same kernel, or
    dropout masks and roundings differ."""
    return tuple(bool(read()) for read in _SDPA_READS)


@contextmanager
def _sdpa_backends(state: Any) -> Iterator[None]:
    """Re-enter the SDPA backend flags recorded by ``_sdpa_state`` (validated: a partner sent them)."""
    if state is None:
        yield
        return
    if not (isinstance(state, tuple | list) and len(state) == len(_SDPA) and all(isinstance(v, bool) for v in state)):
        raise ValueError(f"bad recorded attention backends {state!r}")
    b = torch.backends.cuda
    before = _sdpa_state()
    for name, on in zip(_SDPA, state, strict=True):
        getattr(b, f"enable_{name}_sdp")(on)
    try:
        yield
    finally:
        for name, on in zip(_SDPA, before, strict=True):
            getattr(b, f"enable_{name}_sdp")(on)


__all__ = ["Loop", "LoopCapture"]
