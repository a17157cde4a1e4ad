"""What the checks cost in a GPT-style training step on one GPU (``--quick``: tiny sizes on CPU).

``python -m benchmarks.gpu_step --out gpu.json`` (one GPU, about 2-3 minutes) or
``python -m benchmarks.gpu_step --quick --device cpu --out q.json`` (seconds, what the tests run).

Setup: GPT-style decoder models of three sizes (about 60M, 270M and 1.4B parameters; fp32
weights, bf16 autocast, fused AdamW, batch 8 x 1024 tokens) wrapped in a ONE-rank
``DistributedDataParallel`` (NCCL on CUDA, gloo on CPU), so the checks run their DDP paths: the
gradient tap's hooks in backward, the local gradients' read at the end of backward, the weight
fingerprint's digest and its all-reduce (16 bytes). The
core objects (``GradientTap``, ``NonFiniteGradient``, ``WeightFingerprint``) are driven as the hook
set drives them: verdict after backward, fingerprint after the update, both read one step later.

Per size it reports:

* ``step_ms``: wall time per step, no checks vs the default checks (non-finite + fingerprint every
  step), PIPELINED as training runs: ``steps`` steps back to back, one device sync at the end of
  the block, blocks of the two configurations interleaved over ``rounds`` rounds (medians);
* ``work_ms``: each check's work alone, device-synchronised before and after (serialized: what it
  adds when nothing overlaps it), on the gradients and weights of a real step: ``nonfinite`` =
  the per-parameter hook work + the end-of-backward read of the local gradients + the read of
  the reduced gradients' flag + its host read;
  ``fingerprint`` = digest, combine, all-reduce and read;
* ``peak_mem_gib``: peak device memory over a block of steps without and with the checks;
* ``fingerprint_gbps``: the fingerprint over the parameters against one ``sum`` per tensor and
  one ``sum`` over a single flat buffer of the same bytes (the memory-read limit), GB/s;
* ``digest_matches_cpu``: per-tensor digests on the device equal those of the CPU copies.

``--matmul`` adds a third configuration to the interleaved blocks: the default checks plus the
matrix-product check (``MatmulChecksum`` at its defaults, armed before each forward, its verdict
sent after backward), reported as ``step_ms["matmul"]`` and ``step_ms["matmul_overhead"]``.
``--host-wait`` adds another: the default checks plus what the every-step screen adds to the
step's timeline (the screen itself needs two ranks, so two GPUs under NCCL): before the update, a
small row gathered across the ranks (one ``all_gather``) and read on the host (``tolist()``), so
the host waits for backward and the gather to finish before it queues the update; reported as
``step_ms["host_wait"]`` and ``step_ms["host_wait_overhead"]``: what the same-step read costs
(``ScreenConfig(read="same_step")``, what ``skip_step`` needs). ``--screen-next`` adds the
read at the defaults: each step's row gathered asynchronously after backward and the
previous step's rows read before the update (``read="next_step"``), as ``step_ms["screen_next"]``.
Both read through ``HostRead``, as the screen does. Proxies of the screen's reads, not the screen's
own work (``benchmarks.screen_cost`` measures that on CPU ranks).
The JSON is rewritten after each model size, so a run cut short keeps the sizes it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdc_core.checks.digest import combine, grouped_digests, tensor_digests
from sdc_core.checks.fingerprint import FingerprintConfig, WeightFingerprint
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.checks.matmul import MatmulChecksum
from sdc_core.dist.topology import HostRead

SIZES = {  # name: (d_model, layers, heads, vocab)
    "60M": (576, 10, 9, 32000),
    "270M": (1024, 20, 16, 32000),
    "1.4B": (2048, 28, 16, 32000),
}
QUICK = {"tiny": (64, 2, 4, 256), "small": (96, 3, 4, 256)}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)  # fmt: skip
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1]) + self.pos.weight[: tokens.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Trainer:
    """One model, its optimizer and the checks, attachable and detachable between blocks."""

    def __init__(self, spec: tuple[int, int, int, int], device: torch.device, batch: int, seq: int) -> None:
        d, layers, heads, vocab = spec
        torch.manual_seed(0)
        self.device = device
        with torch.device(device):  # built on the device: no host copy of a 1.4B model
            model = GPT(d, layers, heads, vocab, seq)
        self.ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        self.model = model
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        self.data = torch.randint(0, vocab, (batch, seq + 1), device=device)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.amp = torch.autocast(device.type, dtype=torch.bfloat16)
        self.step_no = 0
        self.tap: GradientTap | None = None
        self.nonfinite: NonFiniteGradient | None = None
        self.fingerprint: WeightFingerprint | None = None
        self.matmul: MatmulChecksum | None = None
        self.host_wait = False  # the screen's read before the update (``--host-wait``)
        self.screen_next = False  # the screen's read of the previous step's rows (``--screen-next``)
        self._rows: HostRead | None = None  # the previous step's gathered rows, not read yet
        self._checks = (NonFiniteGradient(), WeightFingerprint(FingerprintConfig()))  # kept across blocks
        self._matmul = MatmulChecksum()

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def attach(self, matmul: bool = False, host_wait: bool = False, screen_next: bool = False) -> None:
        self.host_wait, self.screen_next = host_wait, screen_next
        self.tap = GradientTap.attach(self.ddp, self.names)
        self.nonfinite, self.fingerprint = self._checks
        self.nonfinite.attach(self.tap)
        if matmul:
            self.matmul = self._matmul
            self.matmul.attach(self.model)

    def detach(self) -> None:
        self.resolve()
        if self.tap is not None:
            self.tap.remove()
        if self.matmul is not None:
            self.matmul.detach()
        self.tap = self.nonfinite = self.fingerprint = self.matmul = None
        self.host_wait = self.screen_next = False

    def resolve(self) -> None:
        if self.nonfinite is not None:
            self.nonfinite.resolve()
        if self.fingerprint is not None:
            self.fingerprint.resolve()
        if self.matmul is not None:
            self.matmul.resolve()
        if self._rows is not None:
            self._rows.tolist()
            self._rows = None

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.matmul is not None:
            self.matmul.arm(self.step_no)
        with self.amp:
            loss = self.ddp(self.data)
        loss.backward()
        if self.matmul is not None:
            self.matmul.verdict(self.step_no)
        if self.nonfinite is not None:  # as the hook set does: after backward, before the update
            self.nonfinite.verdict(self.step_no, self.model.named_parameters())
        if self.host_wait or self.screen_next:  # as the screen: a small row per rank, gathered asynchronously
            row = loss.detach().double().reshape(1).repeat(19)
            out = torch.empty(dist.get_world_size(), row.numel(), dtype=row.dtype, device=row.device)
            rows = HostRead(out, dist.all_gather(list(out.unbind(0)), row, async_op=True))
            if self.host_wait:  # read now: the host waits for backward and the gather
                rows.tolist()
            else:  # the previous step's rows, landed during this step's backward
                if self._rows is not None:
                    self._rows.tolist()
                self._rows = rows
        self.opt.step()
        if self.fingerprint is not None:  # after the update, in its own all-reduce; read one step later
            self.fingerprint.start(self.step_no, self.model, [self.opt])
        self.step_no += 1

    def block(self, steps: int) -> float:
        """Seconds per step over ``steps`` back-to-back steps (one sync at the end, as training runs)."""
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.resolve()
        sync(self.device)
        return (time.perf_counter() - t0) / steps


def timed(device: torch.device, fn: Any, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return med(out)


def measure(name: str, spec: tuple[int, int, int, int], device: torch.device, batch: int, seq: int,
            steps: int, rounds: int, matmul: bool = False, host_wait: bool = False,
            screen_next: bool = False) -> dict[str, Any]:  # fmt: skip
    tr = Trainer(spec, device, batch, seq)
    params = list(tr.model.parameters())
    row: dict[str, Any] = {"model": name, "params": tr.params, "tensors": len(params), "batch": [batch, seq]}
    # warm-up both configurations (allocator, cuBLAS, autotuning)
    tr.block(2)
    tr.attach()
    tr.block(2)
    tr.detach()
    configs = ("none", "checks") + ("matmul",) * matmul + ("host_wait",) * host_wait + ("screen_next",) * screen_next
    def attach(config: str) -> None:
        tr.attach(matmul=config == "matmul", host_wait=config == "host_wait", screen_next=config == "screen_next")

    for extra in configs[2:]:
        attach(extra)
        tr.block(2)
        tr.detach()
    times: dict[str, list[float]] = {c: [] for c in configs}
    peaks: dict[str, float] = {}
    for r in range(rounds):
        for config in configs if r % 2 == 0 else configs[::-1]:
            if config != "none":
                attach(config)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[config].append(tr.block(steps))
            if device.type == "cuda":
                peaks[config] = max(peaks.get(config, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
            if config != "none":
                tr.detach()
    none, checks = med(times["none"]), med(times["checks"])
    row["step_ms"] = {"none": 1e3 * none, "checks": 1e3 * checks, "overhead": checks / none - 1,
                      "samples_none": [1e3 * t for t in times["none"]],
                      "samples_checks": [1e3 * t for t in times["checks"]]}  # fmt: skip
    for extra in configs[2:]:
        row["step_ms"].update({extra: 1e3 * med(times[extra]), f"{extra}_overhead": med(times[extra]) / none - 1,
                               f"samples_{extra}": [1e3 * t for t in times[extra]]})  # fmt: skip
    if peaks:
        row["peak_mem_gib"] = peaks

    # each check's work alone, on the gradients and weights of a real step
    tr.attach()
    tr.step()
    tr.resolve()
    assert tr.nonfinite is not None and tr.fingerprint is not None and tr.tap is not None
    nf, fp, tap = tr.nonfinite, tr.fingerprint, tr.tap
    grads = [(p, p.grad) for p in params if p.grad is not None]

    def nonfinite_work() -> None:
        for p, g in grads:  # what the hook runs per parameter in backward
            for consume in tap.consumers:
                consume(p, g)
        for finish in tap.finishers:  # and at the end of backward
            finish()
        nf.verdict(tr.step_no, tr.model.named_parameters())  # the reduced gradients' flag, left pending
        nf.resolve()  # its host read

    def fingerprint_work() -> None:
        fp.start(tr.step_no, tr.model, [tr.opt])
        fp.resolve()

    repeats = max(3, rounds)
    work = {
        "nonfinite": timed(device, nonfinite_work, repeats),
        "fingerprint": timed(device, fingerprint_work, repeats),
    }
    row["work_ms"] = {k: 1e3 * v for k, v in work.items()}
    row["work_vs_step"] = {k: v / none for k, v in work.items()}
    tr.detach()

    # fingerprint throughput against plain sums over the same bytes
    nbytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    with torch.no_grad():
        gb = {
            "fingerprint": timed(device, lambda: combine(grouped_digests(params)), repeats),
            "sum_per_tensor": timed(device, lambda: torch.stack([p.sum() for p in params]).sum(), repeats),
            "sum_flat": timed(device, lambda: flat.sum(), repeats),
        }
    flat = torch.empty(0)
    row["fingerprint_gbps"] = {k: nbytes / v / 1e9 for k, v in gb.items()}
    row["fingerprint_vs_sum"] = {"per_tensor": gb["sum_per_tensor"] / gb["fingerprint"],
                                 "flat": gb["sum_flat"] / gb["fingerprint"]}  # fmt: skip
    some = [p.detach() for p in params[:: max(1, len(params) // 12)]]
    row["digest_matches_cpu"] = tensor_digests(some).cpu().tolist() == tensor_digests([t.cpu() for t in some]).tolist()
    tr.model = tr.ddp = tr.opt = None  # type: ignore[assignment]
    params = grads = some = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny models (CPU test)")
    parser.add_argument("--sizes", default=None, help="comma-separated subset of " + ",".join(SIZES))
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--matmul", action="store_true", help="also the default checks + the matrix-product check")
    parser.add_argument("--host-wait", action="store_true", help="also the default checks + the screen's host read")
    parser.add_argument("--screen-next", action="store_true",
                        help="also the default checks + the screen's read one step later (its default on NCCL)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    sizes = QUICK if args.quick else SIZES
    if args.sizes:
        sizes = {k: v for k, v in {**SIZES, **QUICK}.items() if k in args.sizes.split(",")}
    batch, seq = (2, 32) if args.quick else (8, 1024)
    steps = args.steps or (2 if args.quick else 8)
    rounds = args.rounds or (2 if args.quick else 4)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    rows = []
    t_start = time.perf_counter()
    for name, spec in sizes.items():
        t0 = time.perf_counter()
        row = measure(name, spec, device, batch, seq, steps, rounds, args.matmul, args.host_wait, args.screen_next)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        s, w, g = row["step_ms"], row["work_ms"], row["fingerprint_gbps"]
        print(f"{name:>5} {row['params'] / 1e6:8.1f}M {row['tensors']:4d} tensors | step {s['none']:8.2f} ms, "
              f"checks {s['checks']:8.2f} ms ({100 * s['overhead']:+.1f}%) | work nonfinite {w['nonfinite']:.2f} ms "
              f"({100 * row['work_vs_step']['nonfinite']:.1f}%), fingerprint {w['fingerprint']:.2f} ms "
              f"({100 * row['work_vs_step']['fingerprint']:.1f}%) | fp {g['fingerprint']:.0f} GB/s, sum/tensor "
              f"{g['sum_per_tensor']:.0f}, flat {g['sum_flat']:.0f} | digests match CPU: {row['digest_matches_cpu']}"
              + (f" | matmul {s['matmul']:8.2f} ms ({100 * s['matmul_overhead']:+.1f}%)" if "matmul" in s else "")
              + (f" | host wait {s['host_wait']:8.2f} ms ({100 * s['host_wait_overhead']:+.1f}%)"
                 if "host_wait" in s else "")
              + (f" | screen next step {s['screen_next']:8.2f} ms ({100 * s['screen_next_overhead']:+.1f}%)"
                 if "screen_next" in s else "")
              + (f" | peak GiB {row['peak_mem_gib']}" if "peak_mem_gib" in row else ""), flush=True)  # fmt: skip
        result = {  # rewritten after each size: a run cut short keeps what it finished
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "backend": dist.get_backend_config(),
            "steps_per_block": steps,
            "rounds": rounds,
            "total_s": time.perf_counter() - t_start,
            "rows": rows,
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
        os.replace(tmp, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
