"""The gradient tap of FSDP2: ``fsdp_taps`` wraps every FSDP2 parameter group's reduce-scatter comm in place (FSDP's
default, or one the user set) with a ``GradientTapComm``, whose consumers read the group's LOCAL unsharded gradients
before the reduce-scatter and the HSDP all-reduce mix them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

try:  # torch >= 2.4
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - old torch: nothing here is sharded
    FSDPModule = None  # type: ignore[assignment,misc]
    ReduceScatter = object  # type: ignore[assignment,misc]


class GradientTapComm(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2 reduce-scatter that lets consumers read one parameter group's LOCAL unsharded gradients (flat,
    pre-divided, padding zero), then runs the comm it wraps. Consumers must not synchronise with the host."""

    def __init__(self, inner: Any, names: list[str], param_group: Any = None) -> None:
        self.inner = inner
        self.names = names
        self.consumers: list[Any] = []
        self.replay_consumers: list[Any] = []
        self.output_consumers: list[Any] = []  # see ``watch_output``
        self.replaying = False  # an audit replay: digest, then no reduction at all (output zeros)
        self.param_group = param_group
        self.group_size = 1  # ranks of the reduce-scatter being tapped (set on each call)

    @property
    def mesh_size(self) -> int:
        """Ranks the group's gradients are reduced over (shard x replicate): its FSDP mesh."""
        mesh = getattr(getattr(self.param_group, "mesh_info", None), "mesh", None)
        return int(mesh.size()) if mesh is not None else 0

    def watch_output(self) -> None:
        """Let ``output_consumers`` read this rank's fully reduced shard (a wrapper of the all-reduce hook,
        after the user's); not during replays."""
        pg = self.param_group
        if pg is None or isinstance(pg._all_reduce_hook, _OutputHook):
            return
        pg._all_reduce_hook = _OutputHook(pg._all_reduce_hook, self)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:  # fmt: skip
        if self.replaying:
            for consume in self.replay_consumers:
                consume(input_tensor, self.names)
            output_tensor.zero_()
            return None
        self.group_size = group.size() if group is not None else 1
        for consume in self.consumers:
            consume(input_tensor, self.names)
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)  # fmt: skip


class _OutputHook:
    """An FSDP2 all-reduce hook: the user's hook, then the tap's output consumers."""

    def __init__(self, inner: Any, tap: GradientTapComm) -> None:
        self.inner, self.tap = inner, tap

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if self.inner is not None:
            self.inner(reduce_output)
        if not self.tap.replaying:
            for consume in self.tap.output_consumers:
                consume(reduce_output)


def fsdp_taps(module: nn.Module) -> list[GradientTapComm]:
    """The gradient taps of every FSDP2 parameter group in ``module``, installed once; a group whose
    reduce-scatter spans one rank never calls the comm: it is left out, with a warning."""
    names = {id(p): n for n, p in module.named_parameters()}
    taps: list[GradientTapComm] = []
    for pg in fsdp_param_groups(module):
        comm = pg._reduce_scatter_comm
        if not isinstance(comm, GradientTapComm):
            group = pg.mesh_info.shard_process_group if hasattr(pg.mesh_info, "shard_process_group") else None
            if group is not None and group.size() == 1:
                warnings.warn("a parameter group is not sharded (shard size 1): its local gradients are "
                              "not visible to the non-finite check", UserWarning, stacklevel=2)  # fmt: skip
                continue
            comm = GradientTapComm(comm, [names.get(id(fp.sharded_param), "?") for fp in pg.fsdp_params], pg)
            pg._reduce_scatter_comm = comm
        taps.append(comm)
    return taps


def _fsdp_modules(module: nn.Module) -> list[Any]:
    return [m for m in module.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """Every FSDP2 parameter group in ``module`` (FSDP's own objects: there is no public view of them)."""
    return [pg for m in _fsdp_modules(module) for pg in m._get_fsdp_state()._fsdp_param_groups]


def set_gradient_sync(module: nn.Module, on: bool) -> None:
    """Turn FSDP2's gradient sync (reduce-scatter at each backward) on or off in every FSDP module of ``module``."""
    for m in _fsdp_modules(module):
        m.set_requires_gradient_sync(on, recurse=False)


def drop_unreduced_grads(module: nn.Module) -> None:
    """Drop the unsharded gradients FSDP2 accumulates while gradient sync is off (no public API does)."""
    for fp in (fp for pg in fsdp_param_groups(module) for fp in pg.fsdp_params):
        fp.unsharded_accumulated_grad = None
        if getattr(fp, "_unsharded_param", None) is not None:
            fp._unsharded_param.grad = None


__all__ = ["GradientTapComm", "drop_unreduced_grads", "fsdp_param_groups", "fsdp_taps", "set_gradient_sync"]
