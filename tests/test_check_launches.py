"""Kernel launches of the cheap checks per DDP step do not grow with the number of parameters
(one gloo rank, in process; CPU ops counted with a dispatch mode, views excluded), and the
multi-tensor reads of the non-finite check keep a fixed count on the device path too (meta
tensors take the path CUDA takes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.checks.fingerprint import WeightFingerprint
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.checks.reductions import peaks


class _Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step_ops(
    layers: int, checked: bool, fingerprint: WeightFingerprint | None = None
) -> tuple[int, NonFiniteGradient | None]:
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
        if fingerprint is not None:  # digest, 16-byte all-reduce, read (the default every step)
            fingerprint.start(i, net, [])
            fingerprint.resolve()

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


def test_default_checks_launches_per_step_do_not_grow_with_parameters(tmp_path):
    """The gradient check and the weight fingerprint together (the default checks of a clean
    step, the replay audit aside): the same number of ops for 200 and 800 parameters (with few
    tensors of a size, the fingerprint puts them in one mixed batch: another fixed count)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        extra = {}
        for layers in (100, 400):
            plain, _ = _step_ops(layers, checked=False)
            fingerprint = WeightFingerprint()
            checked, check = _step_ops(layers, checked=True, fingerprint=fingerprint)
            assert check is not None and check.batched and fingerprint.stats.runs == 4
            assert fingerprint.stats.failures == 0
            extra[layers] = checked - plain
        assert extra[100] == extra[400] > 0, extra
    finally:
        dist.destroy_process_group()


def _ops(fn, tensors: list[torch.Tensor]) -> int:
    with _Kernels() as k:
        fn(tensors)
    return k.count


def test_multi_tensor_reads_keep_a_fixed_op_count_on_the_device_path_and_the_cpu_path():
    """``peaks`` (the local read): on meta tensors (the branch CUDA takes: ``_foreach_norm(inf)``)
    and on small CPU tensors (the same, multi-tensor), the op count is the same for 10 and 200
    tensors, whatever they hold: a non-finite or huge finite tensor costs no re-read (and no host
    read: nothing here waits for the values)."""
    for device in ("meta", "cpu"):
        counts = {n: _ops(peaks, [torch.ones(8 + i % 3, device=device) for i in range(n)]) for n in (10, 200)}
        assert counts[10] == counts[200] > 0, (device, counts)
    clean = [torch.ones(9) for _ in range(10)]
    bad = [t.clone() for t in clean]
    bad[4][3] = float("inf")
    huge = [t * torch.finfo(torch.float32).max / 2 for t in clean]  # squares overflow unscaled
    assert _ops(peaks, bad) == _ops(peaks, clean) == _ops(peaks, huge)
    assert bool(torch.isfinite(peaks(huge)).all())
    assert torch.isfinite(peaks(bad)).tolist() == [i != 4 for i in range(10)]
