"""``GradientsAside`` (sdc_core.replay.state): an audited step's own gradients wait in DDP's buckets
during the re-runs, with DDP's default layout only, and come back bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, worker_env

_SCRIPT = r"""
import json, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from sdc_core.replay.rerun import GradientsAside

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out = {}


def case(name, view=False, hook=False, clip=False, watch=True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DDP(net, gradient_as_bucket_view=view, bucket_cap_mb=0.0005)  # several buckets
    if hook:
        ddp.register_comm_hook(None, allreduce_hook)
    aside, params = GradientsAside(), list(net.parameters())
    y = ddp(torch.randn(4, 8))
    if watch:  # as the tap's finisher: a callback queued before DDP's own end-of-backward callback
        y.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(
            lambda: aside.watch(ddp, params)))
    y.square().mean().backward()
    if clip:  # .grad changed after the backward: the values set aside are the clipped ones
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
    before = [p.grad.clone() for p in params]
    objects = [p.grad for p in params]
    with aside.aside() as moved:
        inside = sum(p.grad.untyped_storage().nbytes() for p in params)
    same = all(torch.equal(a.view(torch.int32), p.grad.view(torch.int32)) for a, p in zip(before, params))
    out[name] = {"moved": moved, "inside": inside, "same": same,
                 "objects": all(a is p.grad for a, p in zip(objects, params)),
                 "weights": sum(p.numel() * p.element_size() for p in params)}


case("default")
case("clipped", clip=True)
case("bucket_view", view=True)
case("comm_hook", hook=True)
case("not_watched", watch=False)
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_gradients_wait_in_ddp_buckets_only_where_ddp_keeps_a_copy() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=worker_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("default", "clipped"):  # every gradient set aside, then back: same objects, same bits
        row = out[name]
        assert row["moved"] == row["weights"] and row["inside"] == 0, (name, row)
        assert row["same"] and row["objects"], (name, row)
    for name in ("bucket_view", "comm_hook", "not_watched"):  # nothing moves, nothing changes
        row = out[name]
        assert row["moved"] == 0 and row["same"] and row["objects"], (name, row)
    assert out["comm_hook"]["inside"] == out["comm_hook"]["weights"]
