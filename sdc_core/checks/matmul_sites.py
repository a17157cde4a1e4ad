"""Where a model's matrix products are checked: forward hooks on its ``nn.Linear`` modules, the
``F.linear`` calls of its ``nn.MultiheadAttention`` modules (a scoped wrapper of ``F.linear``), and
the autograd node of each product, whose hook sees its backward."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
            wanted = _PASS_THROUGH | _PRODUCTS.keys()
            node = next((f for f, _ in node.next_functions if f is not None and type(f).__name__ in wanted), None)
        else:
            return None
    return None


_LINEAR = F.linear
_SCOPE: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("sdc_matmul_scope", default=None)
_patch_users = 0


def _scoped_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that also hands its call to the checked attention module running on this thread
    (``_SCOPE``); elsewhere ``F.linear`` plus one context-variable read."""
    out = _LINEAR(input, weight, bias)
    scope = None if torch.compiler.is_compiling() else _SCOPE.get()
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
    """Which projection of ``mha`` a weight passed to ``F.linear`` is, or None."""
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


def _left_out(module: nn.Module, base: type[nn.Module], weight: torch.Tensor) -> str | None:
    """Why ``module`` (an instance of ``base``) is not checked, or None."""
    if type(module).forward is not base.forward:
        return f"{type(module).__name__} has its own forward"
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return "DTensor (tensor-parallel) weight" if isinstance(weight, DTensor) else None


LinearCheck = Callable[[int, Any, torch.Tensor, torch.Tensor | None, torch.Tensor], None]


@dataclass
class ProductSites:
    """The checked products of one model, by site, and the hooks that hand them to the check: ``on_linear(site, module,
    args, output)`` is each covered ``nn.Linear``'s forward hook (run first); a covered attention module's projections
    go to ``on_product(site, x, weight, bias, y)`` while ``armed()`` (read once per attention forward)."""

    on_linear: Callable[[int, nn.Module, tuple[Any, ...], Any], None]
    on_product: LinearCheck
    armed: Callable[[], bool]
    names: list[str] = field(default_factory=list)
    uncovered: dict[str, str] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list)
    _patched: bool = False

    def attach(self, model: nn.Module, attention: bool) -> list[str]:
        """Hook every covered product of ``model``; returns the checked sites (see ``uncovered``)."""
        skip: set[str] = set()
        for name, module in model.named_modules():
            if name in skip:
                continue
            if isinstance(module, nn.MultiheadAttention):
                skip.add(f"{name}.out_proj" if name else "out_proj")  # used through the functional call
                self._attach_attention(name, module, attention)
            elif isinstance(module, nn.Linear):
                reason = _left_out(module, nn.Linear, module.weight)
                if reason is not None:
                    self.uncovered[name] = reason
                else:
                    hook = functools.partial(self.on_linear, self._site(name))
                    self._handles.append(module.register_forward_hook(hook, prepend=True))
        return list(self.names)

    def _attach_attention(self, name: str, mha: nn.MultiheadAttention, attention: bool) -> None:
        reason = _left_out(mha, nn.MultiheadAttention, mha.out_proj.weight) if attention else "attention=False"
        if reason is not None:
            self.uncovered[name] = reason
            return
        prefix = f"{name}." if name else ""
        packed = ("in_proj", "in_proj[q]", "in_proj[k]", "in_proj[v]", "in_proj[kv]")
        parts = ["out_proj", *(packed if mha.in_proj_weight is not None else ("q_proj", "k_proj", "v_proj"))]
        sites = {part: self._site(prefix + part) for part in parts}
        original, armed, check = mha.forward, self.armed, self.on_product

        def on_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
            part = _attention_site(mha, weight)
            if part is not None and part in sites:
                check(sites[part], x, weight, bias, y)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not armed():
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
        """Remove every hook and wrapper (idempotent) and forget the sites."""
        for handle in self._handles:
            handle.remove()
        for module, forward in self._wrapped:
            if vars(module).get("forward") is forward:
                del module.forward
        if self._patched:
            _remove_patch()
        self._handles, self._wrapped, self._patched = [], [], False
        self.names, self._index, self.uncovered = [], {}, {}

    def _site(self, name: str) -> int:
        if name not in self._index:
            self._index[name] = len(self.names)
            self.names.append(name)
        return self._index[name]
