"""Kernel launches of the non-finite check per DDP step do not grow with the number of parameters
(one gloo rank, in process; CPU ops counted with a dispatch mode, views excluded)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.gradients import GradientTap, NonFiniteGradient


class _Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step_ops(layers: int, checked: bool) -> tuple[int, NonFiniteGradient | None]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    ddp = DDP(net)
    check = None
    if checked:
        check = NonFiniteGradient()
        check.attach(GradientTap.attach(ddp, {id(p): n for n, p in net.named_parameters()}))
    x = torch.randn(4, 8)

    def step(i: int) -> None:
        net.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        if check is not None:
            check.verdict(i, net.named_parameters())
            check.resolve()

    for i in range(3):  # the first two read backwards choose the mode
        step(i)
    with _Kernels() as k:
        step(3)
    return k.count, check


def test_nonfinite_launches_per_step_do_not_grow_with_parameters(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        extra = {}
        for layers in (5, 100):  # 10 and 200 parameters
            plain, _ = _step_ops(layers, checked=False)
            checked, check = _step_ops(layers, checked=True)
            assert check is not None and check.batched  # local gradients read at the end of backward
            assert check.stats.runs == 4 and check.stats.failures == 0
            extra[layers] = checked - plain
        assert extra[5] == extra[100] > 0, extra
    finally:
        dist.destroy_process_group()
