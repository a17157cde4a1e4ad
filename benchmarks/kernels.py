"""Kernel throughput: fingerprint and non-finite check against the alternatives.

For each parameter set (total size, large or 1,000+ small tensors, fp32 or bf16) the candidates
run in alternating rounds over the same tensors and report GB/s and the ratio to a plain ``sum``
(the memory-read limit):

* ``sum``: one ``sum`` per tensor, stacked, one host read at the end;
* ``fingerprint``: ``combine(grouped_digests(...))`` as the weight fingerprint check runs it;
* ``class_sums``: only the first stage of the digest, the (r, m) sums of the 64-bit words (no
  weighting): the floor under ``fingerprint`` with torch's own kernels;
* ``nonfinite_ddp``: what the non-finite check runs under DDP: the local gradients' largest
  magnitudes at the end of backward (``_foreach_norm``: a few multi-tensor kernels per dtype),
  then the verdict's read of the reduced gradients (the same, here over the same tensors) and
  its one host read;
* ``nonfinite_tensor``: one ``aminmax`` per tensor, the check's single-process (``.grad``) path;
* ``sha1_host``: SHA-1 of the bytes copied to the host (Megatron-LM's cross-replica check);
* ``hash_tensor``: ``torch.hash_tensor`` (xor) per tensor;
* ``isfinite_loop``: ``torch.isfinite(g).all().item()`` per tensor, the loop people write;
* ``copy``: one device-to-device copy of the same bytes (the device's copy bandwidth).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from benchmarks.common import interleaved, summary
from sdc_core.fingerprint import class_parts, combine, grouped_digests, words
from sdc_core.gradients import any_nonfinite, any_nonfinite_multi


def make_tensors(total: int, layout: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    count = 1000 if layout == "small" else max(1, total // 10_000_000)
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(total // count, generator=g).to(device=device, dtype=dtype) for _ in range(count)]


def candidates(tensors: list[torch.Tensor]) -> dict[str, Any]:
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1) for t in tensors])

    def nonfinite_ddp() -> bool:
        torch.stack(torch._foreach_norm(tensors, float("inf")))  # the local read at the end of backward
        return bool(any_nonfinite_multi(tensors))  # the verdict on the reduced gradients

    def sha1() -> str:
        h = hashlib.sha1()
        for t in tensors:
            h.update(t.detach().cpu().view(torch.uint8).numpy().data)
        return h.hexdigest()

    copy_dst = torch.empty_like(flat)
    fns = {
        "copy": lambda: copy_dst.copy_(flat),
        "sum": lambda: torch.stack([t.sum() for t in tensors]).sum().item(),
        "fingerprint": lambda: combine(grouped_digests(tensors)[0]).item(),
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
