"""The local-gradient tap: each parameter's LOCAL gradient of a DDP model, read before DDP's
reducer copies it into its all-reduce bucket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

GradConsumer = Callable[[nn.Parameter, torch.Tensor], None]


class GradientTap:
    """Lets the checks read each parameter's LOCAL gradient of a DDP model before DDP's reducer copies it.

    A post-accumulate-grad hook per trainable parameter runs before the reducer's own (checked in tests). On a
    synchronised backward ``consumers`` read ``(parameter, local gradient)``, then ``writers`` may change it in
    place; ``finishers`` run at the end of that backward, before DDP's own callback. All run on the autograd thread
    and must neither synchronise with the host nor raise. Armed by DDP's forward, disarmed at the end of the
    backward through its output: nested backwards (reentrant checkpointing) are read, a later one outside DDP is
    not. No communication hook of its own (a user's, ``inner_hook``, is registered unchanged). The per-parameter
    hooks are installed only while some consumer needs them (``wanted_when``); otherwise finishers read
    ``present()`` and a step costs a constant number of Python calls."""

    def __init__(self, ddp_model: nn.parallel.DistributedDataParallel, names: dict[int, str]) -> None:
        self.ddp = ddp_model
        self.names = names
        self.rank_own = frozenset(getattr(ddp_model, "parameters_to_ignore", ()))  # DDP reduces none: each rank's own
        self.params = [p for n, p in ddp_model.module.named_parameters() if p.requires_grad and n not in self.rank_own]
        self.inner_hook: Callable[..., Any] | None = None
        self.consumers: list[GradConsumer] = []
        self.writers: list[GradConsumer] = []
        self.finishers: list[Callable[[], None]] = []  # run at the end of each read backward
        # consumer or writer -> whether it needs the per-parameter reads of the coming backward
        # (asked after each synchronised forward); one not listed needs them always
        self.wanted_when: dict[GradConsumer, Callable[[], bool]] = {}
        self.reading_each = True  # the per-parameter hooks are installed (for the coming backward)
        self._armed = False
        self._queued = False
        self._each: list[Any] = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._handles = [ddp_model.register_forward_pre_hook(self._on_forward),
                         ddp_model.register_forward_hook(self._on_output)]  # fmt: skip

    @classmethod
    def attach(
        cls,
        ddp_model: nn.parallel.DistributedDataParallel,
        names: dict[int, str],
        inner_hook: Callable[..., Any] | None = None,
        inner_state: Any = None,
    ) -> GradientTap:
        """The tap of ``ddp_model`` (installed once), with ``inner_hook`` registered on the model."""
        tap = getattr(ddp_model, "_sdc_gradient_tap", None)
        if tap is None:
            tap = cls(ddp_model, names)
            ddp_model._sdc_gradient_tap = tap  # type: ignore[assignment]
        registered = getattr(ddp_model, "_comm_hooks", None)
        if registered:  # registered by the framework or the user already (DDP accepts one)
            tap.inner_hook = registered[0][0]
        elif inner_hook is not None:
            ddp_model.register_comm_hook(state=inner_state, hook=inner_hook)
            tap.inner_hook = inner_hook
        return tap

    def remove(self) -> None:
        """Remove the hooks from the parameters and the model (a removed tap reads nothing)."""
        for handle in [*self._handles, *self._each]:
            handle.remove()
        self._handles, self._each, self.reading_each = [], [], False
        if getattr(self.ddp, "_sdc_gradient_tap", None) is self:
            del self.ddp._sdc_gradient_tap

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        # DDP decides here whether this forward's backward synchronises (not under no_sync); a
        # backward that failed before its end-of-backward callback ran leaves nothing behind
        self._armed = torch.is_grad_enabled() and bool(module.require_backward_grad_sync)
        self._queued = False

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """Disarm at the end of the backward through this output (the output's gradient hook runs in
        that backward's own graph task, also with nested ones)."""
        if not self._armed:
            return
        hooked = False
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)
                hooked = True
        # without a hooked output no finisher would run: the consumers then read per parameter
        self._read_each(not hooked or self._wanted())

    def _wanted(self) -> bool:
        """Whether a consumer or writer needs the coming backward's per-parameter reads."""
        return any((when := self.wanted_when.get(c)) is None or when() for c in [*self.consumers, *self.writers])

    def _read_each(self, wanted: bool) -> None:
        """Install or remove the per-parameter hooks (a pass over the parameters, only when that changes)."""
        if wanted and not self.reading_each and self._handles:
            self._each = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        elif not wanted and self.reading_each:
            for handle in self._each:
                handle.remove()
            self._each = []
        self.reading_each = wanted and bool(self._handles)

    def present(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with a gradient the tap reads (``dense``) and that gradient, in the tap's order."""
        return [(p, g) for p in self.params  # dense()'s test inline: no Python call per tensor (benchmarks/calls.py)
                if (g := p.grad) is not None and g.layout == torch.strided and g.numel() > 0]  # fmt: skip

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._disarm)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed or not dense(p.grad):
            return
        g = p.grad
        for consume in self.consumers:
            consume(p, g)
        for write in self.writers:
            write(p, g)

    def _disarm(self) -> None:
        self._armed = self._queued = False
        for finish in self.finishers:
            finish()


def dense(grad: torch.Tensor | None) -> bool:
    """A gradient the tap reads and flags: present, strided (not sparse) and not empty."""
    return grad is not None and grad.layout == torch.strided and grad.numel() > 0
