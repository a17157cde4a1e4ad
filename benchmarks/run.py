"""Entry point: ``python -m benchmarks [--quick] [--device cpu|cuda] [--out FILE]``.

Sections (``--sections``): ``kernels`` (fingerprint and non-finite check against the
alternatives), ``step`` (a small transformer's step with each check, one process), ``ddp``
(Lightning DDP on 3 CPU ranks: step time, the audited step, traffic), ``accelerate`` (the same
for an Accelerate loop with ``SDCHooks``) and ``traffic`` (bytes and collectives per rank per step
for world sizes 2, 4 and 8, and the formula). Prints tables and
writes everything as JSON. ``--quick`` runs the smallest sizes only (what the test suite runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import kernels, step

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, steps: int, rounds: int, replay_every: int, configs: str,
             module: str = "benchmarks.ddp_lightning", extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT),
                   ACCELERATE_SDC_CONFIG_FILE=os.devnull)  # the SDCHooks defaults, not a user config  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", module, "--out", str(out), "--steps", str(steps),
               "--rounds", str(rounds), "--replay-every", str(replay_every), "--configs", configs, *extra]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"DDP benchmark failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def formula(world: int, batch_bytes: int, tensors: int) -> dict[str, float]:
    """Bytes each rank sends per step with the default cadences (fingerprint every step, replay
    every 100): 16 B (fingerprint) on every step (the gradient verdict rides on DDP's own
    all-reduce: 0 B); on an audited step also 8 B + the payload (batch, 32 B per parameter tensor
    of digest, ~5 KiB CPU RNG state, ~3 KiB of serialisation) to its partner, and 24 B into an
    all-gather that delivers 24 * world B to each rank."""
    payload = 8 + batch_bytes + 32 * tensors + 5056 + 3000
    return {
        "clean_step_sent": 16,
        "clean_step_collectives": 1,
        "audited_step_sent": 16 + payload + 24,
        "audited_step_received_allgather": 24 * world,
        "mean_sent_per_step_default_cadence": 16 + (payload + 24) / 100,
    }


def print_kernels(rows: list[dict[str, Any]]) -> None:
    print("\n== kernels: GB/s and ratio to a plain sum (median) ==")
    print(f"{'params':>11} {'layout':6} {'dtype':9} {'method':17} {'GB/s':>8} {'x sum':>7}")
    for r in rows:
        where = f"{r['params']:>11,} {r['layout']:6} {r['dtype']:9}"
        print(f"{where} {r['method']:17} {r['gb_per_s']:8.2f} {r['vs_sum']:7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smallest sizes only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sections", default="kernels,step,ddp,accelerate,traffic")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "performance.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sections = args.sections.split(",")
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
        },
        "quick": args.quick,
    }  # fmt: skip
    if "kernels" in sections:
        sizes = [1_000_000] if args.quick else [1_000_000, 10_000_000, 100_000_000]
        result["kernels"] = kernels.run(sizes, device, repeats=2 if args.quick else 7)
        print_kernels(result["kernels"])
    if "step" in sections:
        kw = {"batch": 2, "seq": 8} if args.quick else {}
        result["step"] = step.run(device, steps=5 if args.quick else 40, **kw)
        s = result["step"]
        print(f"\n== transformer step ({s['params']:,} params, {s['tensors']} tensors), one process ==")
        for name, sec in s["seconds"].items():
            print(
                f"{name:22} {1000 * sec['median']:9.2f} ms  (min {1000 * sec['min']:.2f}, max {1000 * sec['max']:.2f})"
            )
        print("check work / step time:", {k: f"{100 * v:.2f}%" for k, v in s["work_vs_step"].items()})
        print("step time difference:  ", {k: f"{100 * v:+.2f}%" for k, v in s["overhead"].items()})
    if "ddp" in sections and not args.quick:
        result["ddp"] = torchrun(3, 30, 3, 10, "none,nonfinite,fingerprint,defaults,fingerprint_every_10,audit_often")
        d = result["ddp"]
        print("\n== Lightning DDP, 3 CPU ranks ==")
        for name, sec in d["step_seconds"].items():
            print(f"{name:12} {1000 * sec['median']:8.1f} ms  ({100 * d['overhead'][name]:+.1f}%)")
        print(f"audited step / normal step: {d['audited_step_vs_normal']:.2f}")
        # the same checks against 8x the work per step: their cost is per parameter, the step's per sample
        result["ddp_large_batch"] = torchrun(3, 20, 5, 10, "none,defaults", extra=("--batch", "1024"))
        big = result["ddp_large_batch"]
        print(f"batch 1024: defaults {100 * big['overhead']['defaults']:+.1f}%")
    if "accelerate" in sections and not args.quick:
        result["accelerate"] = torchrun(3, 30, 3, 10, "none,nonfinite,fingerprint,defaults,audit_often",
                                        module="benchmarks.ddp_accelerate")  # fmt: skip
        d = result["accelerate"]
        print("\n== Accelerate DDP, 3 CPU ranks ==")
        for name, sec in d["step_seconds"].items():
            print(f"{name:12} {1000 * sec['median']:8.1f} ms  ({100 * d['overhead'][name]:+.1f}%)")
        print(f"audited step / normal step: {d['audited_step_vs_normal']:.2f}")
    if "traffic" in sections and not args.quick:
        result["traffic"] = {}
        for world in (2, 3, 4, 8):
            t = result["ddp"] if world == 3 and "ddp" in result else torchrun(world, 12, 1, 5, "none,audit_often")
            result["traffic"][world] = {"clean": t["clean_step_traffic"], "audited": t["audited_step_traffic"]}
        from benchmarks.ddp_lightning import BATCH

        batch_bytes = BATCH * 65 * 4
        result["traffic_formula"] = {w: formula(w, batch_bytes, 6) for w in (2, 3, 4, 8, 1024)}
        print("\n== traffic per rank per step (measured: calls / bytes sent) ==")
        for world, t in result["traffic"].items():
            print(f"world {world}: clean {t['clean']}, audited {t['audited']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists() and set(sections) != {"kernels", "step", "ddp", "accelerate", "traffic"}:
        merged = json.loads(args.out.read_text())  # a partial run updates its sections only
        merged.update(result)
        result = merged
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
