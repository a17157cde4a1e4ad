"""The Triton digest's launch shape: classes per program (``BLOCK``) and warps, against a flat ``sum``.

``python -m benchmarks.digest_blocks --out FILE`` on a CUDA device with Triton. For each set of
tensors (one 10M-element tensor, ten of them, one of 100M, and the parameter shapes of GPT-style
decoders of about 110M and 1.27B parameters, fp32) and each (BLOCK, num_warps), it times
``_triton_digest.digests`` (the kernel and its scan; CUDA events, median of ``--reps``) and checks that the
digests equal those of the shipped launch (``_triton_digest.BLOCK`` and ``.WARPS``): the
block size only changes how the classes are split between programs, and their partial sums are
added with wrapping integer addition, exact in any order. GB/s are bytes read per second; the
flat ``sum`` over one buffer of the same bytes is the memory-read limit. The JSON is rewritten
after each set, and the run stops starting new configurations after ``--budget`` seconds.

``--dry-run`` runs the same loop on the CPU with the torch digest in place of the kernel (what a
test can run without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sdc_core.checks import _triton_digest as td
from sdc_core.checks.digest import _SEEDS, class_shape, grouped_digests


def gpt_shapes(width: int, layers: int, vocab: int = 32000) -> list[int]:
    """Element counts of a GPT-style decoder's parameters (embedding, per layer: qkv, projection,
    MLP up and down with their biases, two norms)."""
    per_layer = [3 * width * width, 3 * width, width * width, width, 4 * width * width, 4 * width,
                 4 * width * width, width, width, width, width, width]  # fmt: skip
    return [vocab * width, *per_layer * layers, width, width]


SETS: dict[str, list[int]] = {
    "1 x 10M": [10_000_000],
    "10 x 10M": [10_000_000] * 10,
    "1 x 100M": [100_000_000],
    "gpt 110M": gpt_shapes(768, 12),
    "gpt 1.27B": gpt_shapes(2048, 24),
}
BLOCKS = (128, 256, 512, 1024, 2048)
WARPS = (1, 2, 4, 8)
INNER = 10  # calls per CUDA timing sample
SHIPPED = (td.BLOCK, td.WARPS)  # the launch shape the fingerprint uses


def launch(tensors: list[torch.Tensor], block: int, warps: int) -> Callable[[], torch.Tensor]:
    """The digests of ``tensors`` as the fingerprint computes them (``_triton_digest.digests``, its
    cached tables included), with ``block`` classes per program and ``warps`` warps."""
    device = tensors[0].device
    ptrs, sizes = tuple(t.data_ptr() for t in tensors), tuple(t.nbytes >> 3 for t in tensors)
    return lambda: td.digests(device, ptrs, sizes, class_shape, _SEEDS[:2], block=block, warps=warps)


def timed(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median seconds per call of ``fn`` (on a GPU: CUDA events around ``INNER`` calls queued back to
    back; elsewhere wall time of one call), after one warm call."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(INNER):  # queued back to back: the device's time, not the launches'
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000 / INNER)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(sizes: list[int], device: torch.device, reps: int, dry: bool, spent: Callable[[], bool]) -> dict[str, Any]:
    """One set's flat-sum speed and each (BLOCK, warps) configuration's speed and digests."""
    g = torch.Generator(device="cpu").manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(device) for n in sizes]
    nbytes = sum(t.nbytes for t in tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat_gbps = nbytes / timed(flat.sum, reps, device) / 1e9
    del flat
    reference = grouped_digests(tensors).clone() if dry else launch(tensors, *SHIPPED)().clone()
    configs: dict[str, Any] = {}
    for block in BLOCKS:
        for warps in WARPS:
            key = f"{block}/{warps}"
            if spent():
                configs[key] = "not run: budget spent"
                continue
            try:
                fn = (lambda: grouped_digests(tensors)) if dry else launch(tensors, block, warps)
                same = bool(torch.equal(fn(), reference))
                gbps = nbytes / timed(fn, reps, device) / 1e9
                configs[key] = {"gbps": gbps, "same_digests": same, "vs_flat_sum": gbps / flat_gbps}
            except Exception as err:  # a shape that does not compile is a result too
                configs[key] = f"failed: {type(err).__name__}: {str(err)[:200]}"
    return {"tensors": len(tensors), "bytes": nbytes, "flat_sum_gbps": flat_gbps, "configs": configs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds after which no new configuration starts")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sets, the torch digest for the kernel")
    args = parser.parse_args(argv)
    began = time.monotonic()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry and (td.triton is None or not torch.cuda.is_available()):
        raise SystemExit("digest_blocks: needs a CUDA device and Triton (or --dry-run)")
    sets = {"tiny": [1000, 70_000], "tiny x3": [5000] * 3} if dry else SETS
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)",
                              "torch": torch.__version__, "shipped": list(SHIPPED), "sets": {}}  # fmt: skip
    for name, sizes in sets.items():
        row = measure(sizes, device, args.reps, dry, lambda: time.monotonic() - began > args.budget)
        configs = row["configs"]
        result["sets"][name] = row
        args.out.write_text(json.dumps(result, indent=1))
        ok = {k: v for k, v in configs.items() if isinstance(v, dict)}
        best = max(ok, key=lambda k: ok[k]["gbps"]) if ok else None
        shipped = ok.get("{}/{}".format(*SHIPPED))
        print(f"{name:10} flat sum {row['flat_sum_gbps']:8.1f} GB/s | shipped "
              f"{shipped['gbps'] if shipped else float('nan'):8.1f} | best {best} "
              f"{ok[best]['gbps'] if best else float('nan'):8.1f} | all same digests: "
              f"{all(v['same_digests'] for v in ok.values())}", flush=True)  # fmt: skip
        for key, v in configs.items():
            print(f"   {key:9} " + (f"{v['gbps']:8.1f} GB/s {v['vs_flat_sum']:5.2f}x same={v['same_digests']}"
                                    if isinstance(v, dict) else str(v)), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
