"""Fault injection: simulate a faulty rank without touching the checks' code (tests, demos, fire drills). Each fault
fires on one global rank only; nothing here runs unless a fault is installed.

``Fault`` kinds: ``module_output`` (one element of a named module's output, from ``step`` on); ``matmul_output`` (one
element of a named ``nn.Linear``'s product, inside the layer: its output, or the input or weight gradient its autograd
node returns, per ``phase``); ``nonfinite_gradient``, ``gradient_bit_flip``, ``gradient_scale`` (one element of a
parameter's local gradient at ``step``, before the all-reduce); ``weight_bit_flip``, ``optimizer_state`` (right after
optimizer step ``step``). Modes of the first two: ``persistent`` (every forward, replays included), ``intermittent``
(the first forward of each step), ``once`` (the first forward of ``step``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
KINDS = ("module_output", "nonfinite_gradient", "gradient_bit_flip", "weight_bit_flip", "optimizer_state")
KINDS += ("matmul_output", "gradient_scale")
MATMUL_PHASES = ("forward", "input_grad", "weight_grad")


def flip_bit(t: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip bit ``bit`` (0 = least significant) of flat element ``index`` of ``t`` (any float or
    integer dtype, contiguous) in place; returns ``(old, new)``."""
    width = t.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}) for {t.dtype}, got {bit}")
    if not 0 <= index < t.numel():
        raise ValueError(f"index must be in [0, {t.numel()}), got {index}")
    with torch.no_grad():
        flat = t.view(-1) if t.is_contiguous() else None
        if flat is None:
            raise ValueError("flip_bit needs a contiguous tensor")
        old = float(flat[index])
        words = flat.view(_INT_VIEW[t.element_size()])
        mask = -(1 << bit) if bit == width - 1 else 1 << bit  # a signed word's top bit is its sign
        words[index] ^= mask
        return old, float(flat[index])


@dataclass(frozen=True)
class Fault:
    """One simulated hardware fault (validated on construction)."""

    kind: str
    rank: int
    step: int = 0
    target: str = ""
    index: int = 0
    bit: int | None = None
    factor: float = 1.5
    mode: str = "persistent"
    value: float = float("nan")
    state_key: str = "exp_avg"
    phase: str = "forward"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.mode not in ("persistent", "intermittent", "once"):
            raise ValueError(f"mode must be 'persistent', 'intermittent' or 'once', got {self.mode!r}")
        for name in ("rank", "step", "index"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.kind in ("weight_bit_flip", "optimizer_state", "gradient_bit_flip") and self.bit is None:
            raise ValueError(f"bit is required for kind={self.kind!r}")
        if self.kind == "matmul_output" and self.phase not in MATMUL_PHASES:
            raise ValueError(f"phase must be one of {MATMUL_PHASES} for kind='matmul_output', got {self.phase!r}")


@dataclass
class FaultInjector:
    """Installs ``faults`` on this process's module; the adapter reports step boundaries."""

    faults: Sequence[Fault]
    rank: int = 0
    step: int = 0
    fired: list[dict[str, Any]] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _calls: dict[int, int] = field(default_factory=dict)

    def install(self, module: nn.Module, rank: int) -> None:
        """Register the forward and gradient hooks of this rank's faults."""
        self.rank = rank
        modules = dict(module.named_modules())
        params = dict(module.named_parameters())
        for i, fault in enumerate(self.faults):
            if fault.rank != rank:
                continue
            if fault.kind == "module_output":
                if fault.target not in modules:
                    raise ValueError(f"no module named {fault.target!r}; known: {sorted(modules)[:10]}")
                self._handles.append(modules[fault.target].register_forward_hook(self._output_hook(i, fault)))
            elif fault.kind == "matmul_output":
                module_ = modules.get(fault.target)
                if not isinstance(module_, nn.Linear):
                    raise ValueError(f"{fault.target!r} is not an nn.Linear; known: {sorted(modules)[:10]}")
                self._handles.append(_MatmulFault(self, i, fault, module_))
            elif fault.target not in params:
                raise ValueError(f"no parameter named {fault.target!r}; known: {sorted(params)[:10]}")
            elif fault.kind in ("nonfinite_gradient", "gradient_bit_flip", "gradient_scale"):
                self._handles.append(params[fault.target].register_hook(self._grad_hook(fault)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def set_step(self, step: int) -> None:
        """The optimizer step the coming micro-batches belong to."""
        if step != self.step:
            self._calls.clear()
        self.step = step

    def after_step(self, step: int, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Apply weight and optimizer-state faults due right after optimizer step ``step``."""
        params = dict(module.named_parameters())
        for fault in self.faults:
            due = (fault.rank, fault.step) == (self.rank, step)
            if not due or fault.kind not in ("weight_bit_flip", "optimizer_state"):
                continue
            p = params[fault.target]
            t = p.data
            if fault.kind == "optimizer_state":
                state = next((opt.state[p] for opt in optimizers if p in opt.state), None)
                if state is None or fault.state_key not in state:
                    raise ValueError(f"no optimizer state {fault.state_key!r} for parameter {fault.target!r}")
                t = state[fault.state_key]
            old, new = flip_bit(t, fault.index % t.numel(), int(fault.bit))  # type: ignore[arg-type]
            self.fired.append({"kind": fault.kind, "step": step, "target": fault.target, "old": old, "new": new})

    def _due(self, i: int, fault: Fault) -> bool:
        """Whether fault ``i`` of a module fires at this call (its mode's rule)."""
        if self.step < fault.step or (fault.mode == "once" and self.step != fault.step):
            return False
        self._calls[i] = self._calls.get(i, 0) + 1
        return fault.mode == "persistent" or self._calls[i] == 1

    def _output_hook(self, i: int, fault: Fault) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or not self._due(i, fault):
                return None
            flat = output.detach().reshape(-1)
            j = fault.index % flat.numel()
            old = flat[j].clone()
            new = _wrong(old, fault)
            delta = torch.zeros_like(flat)
            delta[j] = new - old
            self.fired.append({"kind": fault.kind, "step": self.step, "target": fault.target, "old": float(old),
                               "new": float(new)})  # fmt: skip
            return output + delta.view_as(output)

        return hook

    def _grad_hook(self, fault: Fault) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if self.step != fault.step:
                return None
            grad = grad.clone().contiguous()
            j = fault.index % grad.numel()
            old = float(grad.view(-1)[j])
            if fault.kind == "gradient_bit_flip":
                flip_bit(grad, j, int(fault.bit))  # type: ignore[arg-type]
            elif fault.kind == "gradient_scale":
                grad.view(-1)[j] *= fault.factor
            else:
                grad.view(-1)[j] = fault.value
            self.fired.append({"kind": fault.kind, "step": self.step, "target": fault.target, "old": old,
                               "new": float(grad.view(-1)[j])})  # fmt: skip
            return grad

        return hook


def _wrong(old: torch.Tensor, fault: Fault) -> torch.Tensor:
    """The value of one element ``old`` once ``fault`` hit it: its bit ``bit`` flipped, or times ``factor``."""
    new = old.clone().reshape(1)
    if fault.bit is not None:
        flip_bit(new, 0, fault.bit)
    else:
        new.mul_(fault.factor)
    return new[0]


class _MatmulFault:
    """A wrong element inside one ``nn.Linear``'s product: ``forward`` is wrapped on the instance, so
    forward hooks (the matmul check's included) see the wrong value; backward faults ride a hook on
    the product's autograd node registered before anyone else's. ``remove()`` restores the layer."""

    def __init__(self, injector: FaultInjector, i: int, fault: Fault, module: nn.Module) -> None:
        self.injector, self.fault, self.module = injector, fault, module
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            y = original(*args, **kwargs)
            grads = fault.phase == "forward" or torch.is_grad_enabled()  # a backward fault needs one
            if isinstance(y, torch.Tensor) and grads and injector._due(i, fault):
                self._corrupt(y)
            return y

        self._forward = forward
        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if vars(self.module).get("forward") is self._forward:
            del self.module.forward

    def _hit(self, t: torch.Tensor) -> tuple[float, float]:
        """Make one element of ``t`` (flat ``index`` modulo its size, any layout) wrong, in place."""
        j = self.fault.index % t.numel()
        at = tuple(int(v) for v in torch.unravel_index(torch.tensor(j), t.shape))
        old = t[at].clone()
        t[at] = new = _wrong(old, self.fault)
        return float(old), float(new)

    def _corrupt(self, y: torch.Tensor) -> None:
        fault, inj = self.fault, self.injector
        record = {"kind": fault.kind, "phase": fault.phase, "step": inj.step, "target": fault.target}
        if fault.phase == "forward":
            with torch.no_grad():
                old, new = self._hit(y.detach())
            inj.fired.append({**record, "old": old, "new": new})
            return
        from sdc_core.checks.matmul_sites import product_node

        found = product_node(y)
        if found is None:
            raise ValueError(f"no matrix product found behind the output of {fault.target!r}")
        node, dx_at = found
        at = dx_at if fault.phase == "input_grad" else dx_at + 1

        def hook(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
            grads = list(grad_inputs)
            if grads[at] is None:
                return None
            grads[at] = grads[at].clone()
            old, new = self._hit(grads[at])
            inj.fired.append({**record, "old": old, "new": new})
            return tuple(grads)

        node.register_hook(hook)
