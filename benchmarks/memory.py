"""Peak tensor memory of a training step with the checks, against the same step without them.

Run under ``torchrun --nproc-per-node N python -m benchmarks.memory --out FILE`` (CPU, gloo;
``--device cuda``: every rank on the one GPU over gloo, peaks from the CUDA allocator).

Every configuration trains its own copy of a GPT-style decoder (many tensors, the largest a few
percent of the weights, as in real models) wrapped in ``DistributedDataParallel`` with AdamW, in
a plain loop through ``SDCHooks`` (the route every adapter shares): ``none`` (no hook set),
``defaults`` (``SDCHooks()``: a clean, unaudited step), ``audited`` (the replay audit on every
step: the partner's micro-batch re-run, the state capture, the transfers) and ``audited_matmul``
(the same with ``matmul_checksum``), and ``matmul`` (the defaults with ``matmul_checksum``, an
unaudited step). Steps of the configurations alternate. Per step it records
the peak of the tensor bytes allocated since the step began (its forward, backward, the checks
and the update; zero_grad sets gradients to None, so the step's own gradients count), and
reports per configuration the largest such peak over the measured steps (after ``--skip``
steps: the replay's first audits also re-run the rank's own micro-batch to calibrate, reported
apart as ``first_steps``), its excess over ``none`` and that excess as a share of the weights'
bytes (the goal for an audited step: at most 10%).

CPU: a dispatch mode counts every storage an operator returns, until it is freed (exact for
tensors made by torch operators; gloo's and DDP's internal buffers are outside it, the same in
every configuration). CUDA: ``torch.cuda.max_memory_allocated`` per step.
"""

from __future__ import annotations

import argparse
import json
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.gpu_step import GPT
from sdc_core.driver.hooks import SDCHooks

SETTINGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "defaults": {},
    "audited": {"replay_every_n_steps": 1},
    "matmul": {"matmul_checksum": True},
    "audited_matmul": {"replay_every_n_steps": 1, "matmul_checksum": True},
}
SPEC = (256, 8, 8, 2048)  # d_model, layers, heads, vocab: 7.4M parameters in 101 tensors, the largest 7%


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every new storage a torch operator returns while the mode is on, until
    the storage is freed; ``peak`` is the most held at once since ``reset``. A storage is counted
    once; outputs that share an input's storage (views, in-place and ``out=`` results) are not new,
    and storages made outside the mode are not counted. A counted storage resized in place
    (``UntypedStorage.resize_``, how the replay sets the step's own gradients aside) counts its
    new size from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}  # id of a counted storage -> the bytes it holds now
        self._resize: Any = None

    def reset(self) -> None:
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __enter__(self) -> LiveBytes:
        self._resize = vars(torch.UntypedStorage).get("resize_")  # None: the method torch's base class has
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: Any, nbytes: int) -> Any:
            out = original(storage, nbytes)
            key = id(storage)
            if key in tracker._seen:
                tracker.live += storage.nbytes() - tracker._seen[key]
                tracker._seen[key] = storage.nbytes()
                tracker.peak = max(tracker.peak, tracker.live)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        if self._resize is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._seen and storage.nbytes() and storage.data_ptr() not in inputs:
                    self._seen[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


class Run:
    """One configuration: a model copy, its optimizer and its hook set (or none)."""

    def __init__(self, config: str, device: torch.device, seq: int, bucket_view: bool = False,
                 spec: tuple[int, int, int, int] = SPEC) -> None:  # fmt: skip
        torch.manual_seed(0)
        model = GPT(*spec, seq=seq).to(device)
        self.weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        settings = SETTINGS[config]
        self.sdc = SDCHooks(**settings) if settings is not None else None
        if self.sdc is not None:
            self.sdc.attach(self.model, self.opt)
        self.peaks: list[int] = []

    def step(self, tokens: torch.Tensor, tracker: LiveBytes | None) -> None:
        device = tokens.device
        if tracker is not None:
            tracker.reset()
            base = tracker.live
        else:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        self.model(tokens).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if tracker is not None:
            self.peaks.append(tracker.peak - base)
        else:
            torch.cuda.synchronize(device)
            self.peaks.append(torch.cuda.max_memory_allocated(device) - base)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per configuration")
    parser.add_argument("--skip", type=int, default=3, help="steps per configuration before measuring")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", default=",".join(SETTINGS))
    parser.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    parser.add_argument("--spec", default=",".join(map(str, SPEC)), help="d_model,layers,heads,vocab")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    configs = args.configs.split(",")
    spec = tuple(int(v) for v in args.spec.split(","))
    if len(spec) != 4:
        parser.error(f"--spec needs d_model,layers,heads,vocab, got {args.spec!r}")
    runs = {c: Run(c, device, args.seq, args.bucket_view, spec) for c in configs}  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(dist.get_rank())
    tracker = LiveBytes() if device.type == "cpu" else None
    for i in range(args.skip + args.steps):
        tokens = torch.randint(0, spec[3], (args.batch, args.seq + 1), generator=g).to(device)
        for c in configs if i % 2 == 0 else configs[::-1]:
            if tracker is not None:
                with tracker:
                    runs[c].step(tokens, tracker)
            else:
                runs[c].step(tokens, None)
    for run in runs.values():
        if run.sdc is not None:
            run.sdc.finish()
    mine = torch.tensor([[max(run.peaks[args.skip :]), max(run.peaks[: args.skip] or [0])] for run in runs.values()],
                        dtype=torch.float64)  # fmt: skip
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the largest over the ranks
    weights = next(iter(runs.values())).weights
    if dist.get_rank() == 0:
        worst = dict(zip(configs, mine[:, 0].tolist(), strict=True))
        first = dict(zip(configs, mine[:, 1].tolist(), strict=True))
        result: dict[str, Any] = {
            "device": str(device),
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "spec": {"d_model": spec[0], "layers": spec[1], "heads": spec[2], "vocab": spec[3]},
            "params": weights // 4,
            "weight_bytes": weights,
            "batch": [args.batch, args.seq],
            "gradient_as_bucket_view": args.bucket_view,
            "steps": args.steps,
            "peak_step_bytes": worst,
            "first_steps_peak_bytes": first,
        }
        if "none" in worst:
            result["excess_bytes"] = {c: v - worst["none"] for c, v in worst.items()}
            result["excess_vs_weights"] = {c: (v - worst["none"]) / weights for c, v in worst.items()}
            result["first_steps_excess_vs_weights"] = {c: (v - first["none"]) / weights for c, v in first.items()}
        args.out.write_text(json.dumps(result, indent=1))
        for c in configs:
            extra = ""
            if "none" in worst:
                steady, early = result["excess_vs_weights"][c], result["first_steps_excess_vs_weights"][c]
                extra = f" {100 * steady:+.1f}% of the weights (first steps {100 * early:+.1f}%)"
            print(f"{c:16} peak {worst[c] / 2**20:8.2f} MiB{extra}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
