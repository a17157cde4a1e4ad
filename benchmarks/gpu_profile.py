"""Where the default checks' time goes in the GPT-style step of ``benchmarks.gpu_step``: a profile.

``python -m benchmarks.gpu_profile --size 60M --out DIR`` (one GPU, about a minute) or
``python -m benchmarks.gpu_profile --size tiny --device cpu --out DIR`` (seconds).

For no checks and the default checks (``gpu_step.Trainer``: non-finite + fingerprint every step;
with ``--matmul`` also the defaults plus the matrix-product check),
it runs ``--steps`` pipelined steps under ``torch.profiler`` and writes ``DIR/profile.txt``: per
configuration the host time per step with and without a device sync at the end of each block
(a step whose host time reaches its synced time is launch-bound: any host work of a check adds to
it in full), the kernel launches per step, the operators by host time and by device time, and
for the checks the Python of ``sdc_core`` by own time (cProfile). It explains ``gpu_step``'s
numbers; it adds none to its JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_step import SIZES, Trainer, sync

SIZES_ALL = {**SIZES, "tiny": (64, 2, 4, 256)}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")


def host_ms(tr: Trainer, steps: int) -> float:
    """Milliseconds per step of ``steps`` steps without the sync at the end that ``Trainer.block``
    makes: the host's time alone."""
    sync(tr.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.step()
    tr.resolve()
    return 1e3 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--size", default="60M", choices=sorted(SIZES_ALL))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--matmul", action="store_true", help="a third configuration: the defaults + the matmul check")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:  # a free port: one rank of its own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    batch, seq = (8, 1024) if args.size != "tiny" else (2, 32)
    tr = Trainer(SIZES_ALL[args.size], device, batch, seq)
    lines = [f"{args.size}: {tr.params / 1e6:.1f}M parameters, batch {batch} x {seq}, {args.device}"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for config in ("none", "checks", "matmul") if args.matmul else ("none", "checks"):
        if config != "none":
            tr.attach(matmul=config == "matmul")
        tr.block(3)  # warm-up
        synced = min(1e3 * tr.block(args.steps) for _ in range(3))
        host = min(host_ms(tr, args.steps) for _ in range(3))
        with profile(activities=activities) as prof:
            tr.block(args.steps)
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        lines += [f"\n== {config}: {synced:.2f} ms per step synced, {host:.2f} ms host only (pipelined), "
                  f"{launches / args.steps:.0f} kernel launches per step"]  # fmt: skip
        lines.append(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if device.type == "cuda":
            lines.append(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        if config != "none":  # the checks' own Python, function by function
            stats = io.StringIO()
            prof_py = cProfile.Profile()
            prof_py.runcall(tr.block, args.steps)
            pstats.Stats(prof_py, stream=stats).sort_stats("tottime").print_stats("sdc_core", args.rows)
            lines.append(stats.getvalue())
            tr.detach()
    (args.out / "profile.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1] + [ln for ln in lines if ln.startswith("\n==")]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
