"""GPU check of the ring replay (run by hand on a CUDA machine; not collected by pytest).

``torchrun --standalone --nproc-per-node 3 tests/gpu_replay_check.py`` puts 3 gloo ranks on one
GPU (``cuda:0``) and trains a small model whose step is nondeterministic on GPUs without
deterministic kernels: bf16 autocast, an embedding read with ``index_select`` (its backward is an
atomic ``index_add_``), a forward ``index_add_`` with repeated indices and causal
``scaled_dot_product_attention`` (flash backward). It audits every step with ``RingReplay`` and
prints one JSON line per scenario (rank 0), plus the digest stale-read check and the cost of the
deterministic window on one rank. Writes ``$OUT/gpu_replay.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.faults.inject import Fault, FaultInjector
from sdc_core.ops import process_exit
from sdc_core.replay.compare import assemble, digest_row
from sdc_core.replay.determinism import deterministic
from sdc_core.replay.ring import ReplayConfig, RingReplay
from sdc_core.replay.state import StateCapture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of the script only, tiny sizes
VOCAB, D, B, T = (4096, 256, 8, 256) if DEVICE == "cuda" else (64, 16, 2, 8)


class Net(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = D, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h = self.emb.index_select(0, idx.reshape(-1)).view(b, t, -1)
        pooled = torch.zeros(b * 4, h.shape[-1], device=h.device, dtype=h.dtype)
        pooled = pooled.index_add(0, torch.arange(b * t, device=h.device) % (b * 4), h.reshape(b * t, -1))
        h = h + pooled.repeat_interleave(t // 4, 0).view(b, t, -1)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        h = h + self.proj(a)
        return F.cross_entropy(self.out(h).float().view(b * t, -1), y.view(-1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (B, T), generator=g)
    return x.to(DEVICE), torch.roll(x, -1, 1).to(DEVICE)


def train(deterministic_: bool, steps: int, faults: list[Fault] = (), **kw: Any) -> dict[str, Any]:  # type: ignore[assignment]
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = Net().to(DEVICE)
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=[0] if DEVICE == "cuda" else None)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    tap = GradientTap.attach(ddp, {id(p): n for n, p in module.named_parameters()})
    core = RingReplay(ReplayConfig(every_n_steps=1, deterministic=deterministic_, **kw))
    core.attach(tap, names)
    core.capture = StateCapture(module, names)
    injector = FaultInjector(list(faults))
    injector.install(module, rank)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    autocast = lambda: torch.autocast(DEVICE, torch.bfloat16)  # noqa: E731
    error: Any = None
    step = 0
    try:
        for step in range(steps):
            injector.step = step
            x, y = batch(step, rank)
            if core.arm(step):
                core.record((x, y), 0, x.device)
            with autocast():
                loss = ddp(x, y)
            core.record_loss(loss)
            loss.backward()
            core.audit(step, module, lambda b, _i: module(*b), context=autocast)
            opt.step()
            opt.zero_grad()
    except ReplayMismatchError as err:
        err.__traceback__ = None  # the replay keeps its error: its frames would keep this DDP model until exit
        error = {"type": "ReplayMismatchError", "rank": err.rank, "step": err.step, "suspects": list(err.suspects),
                 "reason": err.reason}  # fmt: skip
    except ReplayUnavailableError as err:
        err.__traceback__ = None
        error = {"type": "ReplayUnavailableError", "message": str(err)[:400]}
    tap.remove()
    return {"error": error, "steps": step + 1, "mode": core.mode, "tolerance": core.tolerance,
            "max_diff": core.stats.max_diff, "extra": core.stats.extra}  # fmt: skip


def stale_read_check() -> dict[str, int]:
    """Rows on the GPU, the first one on the host, each read right after a long queue of GPU work:
    the old ``.to(cpu, non_blocking=True)`` + stack against ``assemble``."""
    big = torch.randn(4096 if DEVICE == "cuda" else 64, 4096 if DEVICE == "cuda" else 64, device=DEVICE)
    bad_old = bad_new = 0

    def rows_after_work(grads: dict[str, torch.Tensor]) -> dict[str, Any]:
        nonlocal big
        for _ in range(30):
            big = big @ big * 1e-4  # queued work the digests (and copies) wait behind
        return {"host": digest_row(torch.ones(10)), **{n: digest_row(g) for n, g in grads.items()}}

    for i in range(20):
        grads = {f"p{j}": torch.full((1000,), float(i * 100 + j), device=DEVICE) for j in range(64)}
        truth = [float(g.sum()) for g in grads.values()]
        rows = rows_after_work(grads)
        bad_old += torch.stack([r[0].to("cpu", non_blocking=True) for r in rows.values()])[1:].tolist() != truth
        rows = rows_after_work(grads)
        bad_new += assemble(list(rows), rows, 0.0).sums[1:].tolist() != truth
    return {"old_wrong_reads": bad_old, "new_wrong_reads": bad_new, "of": 20}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def window_cost() -> dict[str, float]:
    """Seconds per forward+backward of a larger ``Net`` step: outside, in the warn_only window, in strict."""
    torch.manual_seed(0)
    m = Net(vocab=32768, d=1024, heads=16).to(DEVICE) if DEVICE == "cuda" else Net().to(DEVICE)
    x, y = batch(0, 0)
    out: dict[str, float] = {}
    for label, on, strict in (("off", False, False), ("warn_only", True, False), ("strict", True, True)):
        for i in range(13):
            if i == 3:
                sync()
                t0 = time.perf_counter()
            with deterministic(on, strict), torch.autocast(DEVICE, torch.bfloat16):
                loss = m(x, y)
            with deterministic(on, strict):
                loss.backward()
            m.zero_grad(set_to_none=True)
        sync()
        out[label] = (time.perf_counter() - t0) / 10
    return out


def main() -> None:
    dist.init_process_group("gloo")
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    rank = dist.get_rank()
    report: dict[str, Any] = {"torch": torch.__version__, "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    scenarios = {
        "det_clean": lambda: train(True, 8),
        "off_clean": lambda: train(False, 12),
        "off_exact": lambda: train(False, 3, exact=True),
        "det_fault": lambda: train(True, 6, [Fault("module_output", rank=1, step=3, target="proj")]),
        # without deterministic kernels a fault is seen only above the measured noise (at most rtol): on an H200
        # this step's own noise is ~3e-4 and a x1.5 lane error moves the gradients ~4e-6, so the fault is x1e4
        "off_fault": lambda: train(False, 8, [Fault("module_output", rank=2, step=5, target="proj", factor=1e4)]),
    }
    for name, fn in scenarios.items():
        t0 = time.perf_counter()
        report[name] = fn()
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        if rank == 0:
            print(name, json.dumps(report[name]), flush=True)
    # the scenarios' DDP models (held in reference cycles) are freed now, while the group lives: a reducer freed at
    # interpreter exit, with gloo's threads still finishing, can abort the process (as ``SDCHooks``'s exit handler)
    process_exit.settle_threads()
    gc.collect()
    dist.barrier()
    if rank == 0:
        report["stale_read"] = stale_read_check()
        print("stale_read", report["stale_read"], flush=True)
        report["window_cost_s"] = window_cost()
        print("window_cost_s", report["window_cost_s"], flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_replay.json").write_text(json.dumps(report, indent=1, default=repr))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
