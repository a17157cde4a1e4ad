"""Raw DDP (gloo, no framework) under the gradient tap: run with torchrun, 3 ranks.

Each scenario trains a small model with the non-finite check's core on the tap and writes what
every rank saw: the verdict, the weights' bytes, what the hooks recorded."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import main_for
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteConfig, NonFiniteGradient
from sdc_core.errors import NonFiniteGradientError
from sdc_core.ops import process_exit

STEPS = 4


class Checkpointed(nn.Sequential):
    """Every layer under reentrant activation checkpointing, the last one included: its
    parameters' gradients are computed in nested backward passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()  # reentrant checkpointing needs an input that requires grad
        for layer in self:
            x = checkpoint(layer, x, use_reentrant=True)
        return x


def model(conv: bool = False, ckpt: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if ckpt:
        return Checkpointed(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    if conv:  # channels-last: the convolution's gradient is not contiguous in the default sense
        net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(16, 1))
        return net.to(memory_format=torch.channels_last)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def poisoned(grad: torch.Tensor) -> torch.Tensor:
    """The gradient with NaN in its LAST element (not the element the flag rides in)."""
    grad = grad.clone()
    grad[(-1,) * grad.dim()] = float("nan")
    return grad


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sanitising_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses string annotations here
    """A user's hook that hides non-finite reduced values: the all-reduce, then NaN and Inf set to 0."""
    return allreduce_hook(state, bucket).then(lambda fut: torch.nan_to_num(fut.value(), 0.0, 0.0, 0.0))


def train(
    tapped: bool,
    bucket_view: bool = False,
    nan_at: tuple[int, int, int] | None = None,
    accumulate: int = 1,
    comm_hook: str | None = None,
    conv: bool = False,
    static: bool = False,
    ckpt: bool = False,
) -> dict[str, Any]:
    """``STEPS`` optimizer steps of ``accumulate`` micro-batches; ``nan_at`` = (rank, step,
    micro-batch) puts a NaN into the LOCAL gradient of ``0.weight`` there; ``comm_hook``: the user's
    ``"allreduce"`` hook, or ``"sanitising"`` (it zeroes NaN and Inf in the reduced buckets)."""
    rank = dist.get_rank()
    net = model(conv, ckpt)
    ddp = DDP(net, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.0005, static_graph=static)  # several buckets
    inner = None
    if comm_hook is not None:
        inner = allreduce_hook if comm_hook == "allreduce" else sanitising_hook
        ddp.register_comm_hook(None, inner)  # the user's, registered before the tap
        # and handed to it too (Accelerate's setting read after prepare)
    check = NonFiniteGradient(NonFiniteConfig(on_failure="raise"))
    tap = None
    if tapped:
        tap = GradientTap.attach(ddp, {id(p): n for n, p in net.named_parameters()}, inner_hook=inner)
        check.attach(tap)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    error: dict[str, Any] | None = None
    recorded: list[int] = []
    contiguous: list[bool] = []
    try:
        for step in range(STEPS):
            for micro in range(accumulate):
                x = (
                    torch.randn(4, 2, 4, 4, generator=g).to(memory_format=torch.channels_last)
                    if conv
                    else (torch.randn(4, 8, generator=g))
                )
                sync = micro == accumulate - 1
                handle = None
                if nan_at == (rank, step, micro):
                    handle = net[0].weight.register_hook(poisoned)
                if sync:
                    ddp(x).pow(2).mean().backward()
                else:
                    with ddp.no_sync():
                        ddp(x).pow(2).mean().backward()
                if handle is not None:
                    handle.remove()
                recorded.append(sum(len(params) for _, params in check._local))  # parameters read
                contiguous.append(net[0].weight.grad.is_contiguous())
            if tapped:
                check.verdict(step, net.named_parameters())
            opt.step()
            opt.zero_grad()
        if tapped:
            check.resolve()
    except NonFiniteGradientError as err:
        error = {"step": err.step, "rank": err.rank, "parameters": err.details["parameters"]}
    result: dict[str, Any] = {
        "weights": digest(net),
        "error": error,
        "recorded": recorded,
        "grad_contiguous": all(contiguous),
    }
    if tap is not None:
        result["inner_hook"] = getattr(tap.inner_hook, "__name__", None)
        # after training: a backward outside DDP must not be read (the tap disarmed itself) ...
        net(torch.randn(4, 2, 4, 4) if conv else torch.randn(4, 8, generator=g)).sum().backward()
        result["read_outside_ddp"] = len(check._local)
        tap.remove()
        result["hooks_left"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
    return result


SCENARIOS = {
    "plain": lambda o: train(tapped=False),
    "tapped": lambda o: train(tapped=True),
    "plain_view": lambda o: train(tapped=False, bucket_view=True),
    "tapped_view": lambda o: train(tapped=True, bucket_view=True),
    "nan": lambda o: train(tapped=True, nan_at=(1, 2, 0)),
    "nan_view": lambda o: train(tapped=True, bucket_view=True, nan_at=(1, 2, 0)),
    # a NaN in a no_sync micro-batch: the sync micro-batch's .grad holds the sum, the tap sees it
    "nan_accumulated": lambda o: train(tapped=True, nan_at=(2, 1, 0), accumulate=3),
    "nan_comm_hook": lambda o: train(tapped=True, nan_at=(0, 1, 0), comm_hook="allreduce"),
    # a hook that zeroes non-finite reduced values: the local NaN is still named (the ranks share flags)
    "nan_sanitised": lambda o: train(tapped=True, nan_at=(0, 1, 0), comm_hook="sanitising"),
    # static graph: the first iteration's reduction is delayed to the end of backward
    "plain_static": lambda o: train(tapped=False, static=True),
    "tapped_static": lambda o: train(tapped=True, static=True),
    "nan_static_first": lambda o: train(tapped=True, static=True, nan_at=(1, 0, 0)),
    "nan_static": lambda o: train(tapped=True, static=True, nan_at=(0, 2, 0)),
    # reentrant checkpointing (DDP needs a static graph for it): nested backward passes
    "plain_ckpt": lambda o: train(tapped=False, static=True, ckpt=True),
    "tapped_ckpt": lambda o: train(tapped=True, static=True, ckpt=True),
    "nan_ckpt": lambda o: train(tapped=True, static=True, ckpt=True, nan_at=(1, 1, 0)),
    "plain_conv": lambda o: train(tapped=False, conv=True),
    "tapped_conv": lambda o: train(tapped=True, conv=True),
    "nan_conv": lambda o: train(tapped=True, conv=True, nan_at=(2, 3, 0)),
}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    process_exit.arm()  # a Python comm hook (nan_comm_hook) needs what the adapters arm at exit
    try:
        main_for(SCENARIOS)
    finally:
        dist.destroy_process_group()
