"""Kernel throughput: fingerprint and non-finite check against the alternatives.

For each parameter set (total size, large or 1,000+ small tensors, fp32 or bf16) the candidates
run in alternating rounds over the same tensors and report GB/s and the ratio to a plain ``sum``
(the memory-read limit):

* ``sum``: one ``sum`` per tensor, stacked, one host read at the end;
* ``fingerprint``: ``combine(grouped_digests(...))`` as the weight fingerprint check runs it;
* ``class_sums``: only the first stage of the digest, the (r, m) sums of the 64-bit words (no
  weighting): the floor under ``fingerprint`` with torch's own kernels;
* ``nonfinite_ddp``: what the non-finite check runs under DDP: the local gradients' read at the
  end of backward (``peaks``: on CUDA the largest magnitudes, a few multi-tensor kernels per
  dtype; on the CPU ``aminmax`` per large tensor and one multi-tensor inf-norm of the small ones),
  then the flag every rank all-reduces (a few kernels on the peaks) and its one host read;
* ``nonfinite_tensor``: one ``aminmax`` per tensor, the check's single-process (``.grad``) path;
* ``sha1_host``: SHA-1 of the bytes copied to the host (Megatron-LM's cross-replica check);
* ``hash_tensor``: ``torch.hash_tensor`` (xor) per tensor;
* ``isfinite_loop``: ``torch.isfinite(g).all().item()`` per tensor, the loop people write;
* ``copy``: one device-to-device copy of the same bytes (the device's copy bandwidth).

``python -m benchmarks.kernels --nonfinite`` times one CPU read of the non-finite check
(``nonfinite_reads``) against the inf-norm it replaced and a plain sum.

``python -m benchmarks.kernels --host --baseline REV[,REV...]`` times the host (CPU) fingerprint
path alone on mixes of tensor counts, sizes and dtypes against earlier git revisions of
``sdc_core/checks/fingerprint.py`` and a plain ``sum``: CPU time of this process, one thread (what a
DDP rank on a small host runs), alternating rounds.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

import torch

from benchmarks.common import interleaved, summary
from sdc_core.checks.digest import class_parts, combine, grouped_digests, words
from sdc_core.checks.reductions import any_nonfinite, peaks


def make_tensors(total: int, layout: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    count = 1000 if layout == "small" else max(1, total // 10_000_000)
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(total // count, generator=g).to(device=device, dtype=dtype) for _ in range(count)]


def candidates(tensors: list[torch.Tensor]) -> dict[str, Any]:
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1) for t in tensors])

    def nonfinite_ddp() -> bool:
        local = peaks(tensors)  # the local read at the end of backward
        return bool((~torch.isfinite(local)).any())  # the flag every rank all-reduces (one process here)

    def sha1() -> str:
        h = hashlib.sha1()
        for t in tensors:
            h.update(t.detach().cpu().view(torch.uint8).numpy().data)
        return h.hexdigest()

    copy_dst = torch.empty_like(flat)
    fns = {
        "copy": lambda: copy_dst.copy_(flat),
        "sum": lambda: torch.stack([t.sum() for t in tensors]).sum().item(),
        "fingerprint": lambda: combine(grouped_digests(tensors)).item(),
        "class_sums": lambda: [class_parts(words(t)) for t in tensors],  # timed up to a device sync
        "nonfinite_ddp": nonfinite_ddp,
        "nonfinite_tensor": lambda: bool(any_nonfinite(tensors)),
        "sha1_host": sha1,
        "isfinite_loop": lambda: all(torch.isfinite(t).all().item() for t in tensors),
    }  # fmt: skip
    if hasattr(torch, "hash_tensor"):
        fns["hash_tensor"] = lambda: torch.stack([torch.hash_tensor(t) for t in tensors]).sum().item()
    del device
    return fns


def run(sizes: list[int], device: torch.device, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for total in sizes:
        for layout in ("large", "small"):
            for dtype in (torch.float32, torch.bfloat16):
                tensors = make_tensors(total, layout, dtype, device)
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                times = interleaved(candidates(tensors), repeats, device)
                base = summary(times["sum"])["median"]
                for name, samples in times.items():
                    s = summary(samples)
                    rows.append({
                        "params": total, "layout": layout, "tensors": len(tensors), "dtype": str(dtype).split(".")[-1],
                        "method": name, "seconds": s, "gb_per_s": nbytes / s["median"] / 1e9,
                        "vs_sum": base / s["median"],
                    })  # fmt: skip
                del tensors
    return rows


# Host fingerprint path against an earlier revision (``python -m benchmarks.kernels --host``).
HOST_MIXES: dict[str, tuple[int, int, int, torch.dtype]] = {  # name: (tensors, smallest, largest elements, dtype)
    "1000 x 100 fp32": (1000, 100, 100, torch.float32),
    "1000 x 1000 fp32": (1000, 1000, 1000, torch.float32),
    "1000 x 1000 bf16": (1000, 1000, 1000, torch.bfloat16),
    "1000 x 2000 fp32": (1000, 2000, 2000, torch.float32),
    "1000 x 3000 fp32": (1000, 3000, 3000, torch.float32),
    "1000 x 3000 bf16": (1000, 3000, 3000, torch.bfloat16),
    "1000 x 10k fp32": (1000, 10_000, 10_000, torch.float32),
    "1000 x 10k bf16": (1000, 10_000, 10_000, torch.bfloat16),
    "1000 x 2..8k fp32": (1000, 2, 8000, torch.float32),  # every size different, half of them odd
    "200 x 300 fp32": (200, 300, 300, torch.float32),
    "100 x 4000 bf16": (100, 4000, 4000, torch.bfloat16),
    "10 x 1M fp32": (10, 1_000_000, 1_000_000, torch.float32),
    "2 x 10M bf16": (2, 10_000_000, 10_000_000, torch.bfloat16),
}


def host_mix(name: str) -> list[torch.Tensor]:
    """The tensors of ``HOST_MIXES[name]`` (sizes spread evenly from smallest to largest), or
    "GPT 4 x 256": a 4-layer GPT-style decoder's parameters (d = 256, vocabulary 1000)."""
    g = torch.Generator().manual_seed(0)
    if name == "GPT 4 x 256":
        d = 256
        layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
        shapes = [(1000, d)] + 4 * layer
        return [torch.randn(s, generator=g) for s in shapes]
    count, lo, hi, dtype = HOST_MIXES[name]
    return [torch.randn(lo + (hi - lo) * i // count, generator=g).to(dtype) for i in range(count)]


def _revision_module(rev: str) -> Any:
    """``sdc_core/checks/fingerprint.py`` as of git revision ``rev``, imported under its own name."""
    import importlib.util
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{rev}:sdc_core/checks/fingerprint.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / f"fingerprint_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _fingerprint(mod: Any, tensors: list[torch.Tensor]) -> int:
    digests = mod.grouped_digests(tensors)  # before 2026-12-06 a (digests, function) pair
    return mod.combine(digests[0] if isinstance(digests, tuple) else digests).item()


def host(baselines: list[str], repeats: int) -> list[dict[str, Any]]:
    """CPU seconds (``time.process_time``: this process only, so other load on a shared machine
    inflates it far less than wall time) of ``combine(grouped_digests(...))``, this tree's and
    each baseline revision's, and of one plain ``sum`` per tensor (the memory-read limit), in
    alternating rounds over the same tensors: minimum and median per mix, and the ratios."""
    import time

    from sdc_core.checks import fingerprint
    versions = {"now": fingerprint, **{rev: _revision_module(rev) for rev in baselines}}
    rows = []
    for name in [*HOST_MIXES, "GPT 4 x 256"]:
        tensors = host_mix(name)
        fns = {v: partial(_fingerprint, mod, tensors) for v, mod in versions.items()}
        fns["sum"] = lambda ts=tensors: torch.stack([t.sum() for t in ts]).sum().item()
        times: dict[str, list[float]] = {v: [] for v in fns}
        for rnd in range(repeats + 1):
            for v, fn in fns.items():
                t0 = time.process_time()
                fn()
                if rnd:  # round 0 warms the caches
                    times[v].append(time.process_time() - t0)
        row: dict[str, Any] = {"mix": name, "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors)}
        for v, samples in times.items():
            row[v] = {"min": min(samples), "median": summary(samples)["median"]}
        for rev in [*baselines, "sum"]:
            row[f"now_vs_{rev}"] = {q: row["now"][q] / row[rev][q] for q in ("min", "median")}
        rows.append(row)
        cols = "  ".join(f"{v} {1e3 * row[v]['min']:7.2f} / {1e3 * row[v]['median']:7.2f} ms" for v in fns)
        ratios = "  ".join(f"now/{rev} {row[f'now_vs_{rev}']['min']:.2f} / {row[f'now_vs_{rev}']['median']:.2f}"
                           for rev in [*baselines, "sum"])  # fmt: skip
        print(f"{name:18} {cols}  {ratios}", flush=True)
    return rows


_DDP_MODEL = [(2048, 64), (2048,), (2048, 2048), (2048,), (1, 2048), (1,)]  # benchmarks.ddp_lightning.Model
NONFINITE_MIXES = {  # name: shapes, dtype
    "DDP benchmark model (6 tensors, 4.3M)": (_DDP_MODEL, torch.float32),
    "the same in bf16": (_DDP_MODEL, torch.bfloat16),
    "1000 x 1000 fp32": ([(1000,)] * 1000, torch.float32),
    "100 x 100k fp32": ([(100_000,)] * 100, torch.float32),
}


def nonfinite_reads(repeats: int) -> list[dict[str, Any]]:
    """CPU seconds (``time.process_time``, this process, one thread) of one read of a gradient set
    by the non-finite check: ``peaks`` (now: ``aminmax`` and a multi-tensor inf-norm on the CPU),
    ``inf_norm`` (the read it replaced, ``_foreach_norm(ord=inf)``, a scalar loop on the CPU) and
    ``sum`` (one ``sum`` per tensor, the memory-read floor), in alternating rounds; minimum and
    median, and the ratios to ``sum``.
    A DDP step makes one such read (the local gradients)."""
    import time

    fns_of = {
        "peaks": peaks,
        "inf_norm": lambda ts: torch.stack(torch._foreach_norm(ts, float("inf"))),
        "sum": lambda ts: torch.stack([t.sum() for t in ts]),
    }
    rows = []
    for name, (shapes, dtype) in NONFINITE_MIXES.items():
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        times: dict[str, list[float]] = {v: [] for v in fns_of}
        for rnd in range(repeats + 1):
            for v, fn in fns_of.items():
                t0 = time.process_time()
                fn(tensors)
                if rnd:
                    times[v].append(time.process_time() - t0)
        row: dict[str, Any] = {"mix": name, "tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors)}
        for v, samples in times.items():
            row[v] = {"min": min(samples), "median": summary(samples)["median"]}
        row["vs_sum"] = {v: row[v]["median"] / row["sum"]["median"] for v in fns_of}
        rows.append(row)
        cols = "  ".join(f"{v} {1e3 * row[v]['min']:6.2f} / {1e3 * row[v]['median']:6.2f} ms" for v in fns_of)
        print(f"{name:38} {cols}  (median / sum: peaks {row['vs_sum']['peaks']:.2f}, "
              f"inf_norm {row['vs_sum']['inf_norm']:.2f})", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="The host fingerprint path's CPU time per call, against a revision")
    parser.add_argument("--host", action="store_true", help="time the host fingerprint path (the default mode)")
    parser.add_argument("--nonfinite", action="store_true", help="time the non-finite check's CPU read instead")
    parser.add_argument("--baseline", default="", help="git revisions to compare with, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (DDP ranks on a small host run 1)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("CPU time per call, min / median (one thread unless --threads)")
    if args.nonfinite:
        result = nonfinite_reads(args.repeats)
    else:
        result = host([rev for rev in args.baseline.split(",") if rev], args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "baseline": args.baseline, "rows": result}, f, indent=1)
