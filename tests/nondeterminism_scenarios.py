"""Many short clean runs on kernels that are nondeterministic as GPU atomics are: run under ``torchrun``.

``torchrun --nproc-per-node 3 tests/nondeterminism_scenarios.py --out DIR --only some:every,... [--runs 30]
[--device cuda]`` trains a small embedding-bag regressor in a plain DDP loop through ``sdc_core.SDCHooks`` (every
check on), ``--runs`` times per scenario, each run a fresh model, DDP wrapper and hook set. Its
pooling is a scatter-add with 32 duplicate indices per output row whose summation order is drawn,
when the kernel is noisy, from a generator seeded by ``os.urandom``: nothing the replay captures
or restores can repeat it (what atomics do on a GPU when contention varies).

A scenario is ``<kernel>:<setting>[:<fault>][@<runs>]``:

* kernels: ``every`` (noisy on every call), ``some`` (on about one call in four), ``batches``
  (on every call for the batches whose tokens collide, never for the others), ``capable``
  (``some``, with an exact path under ``torch.use_deterministic_algorithms``), ``incapable``
  (``some``, and no deterministic path: it raises under ``warn_only=False`` as torch's own
  kernels do), ``user_capable`` / ``user_incapable`` (the user's script turns deterministic
  algorithms on, the latter with ``warn_only=True``), ``exact`` (no noise at all);
* settings: ``defaults`` (``SDCHooks()`` as shipped: the replay audits step 0 of each run) and
  ``every`` (the replay on every step);
* faults (one run, replay every step): ``flip`` (an exponent bit (x4) of rank 1's ``head.weight`` after
  step 2), ``activation`` (rank 2's ``head`` output, one element times 3, from step 2 on),
  ``backward`` (rank 0's ``head`` weight gradient, one element times 3, once at step 2); and over
  12 steps: ``transient`` (rank 1's ``body`` output, one element x (1 + 1e-3), once at step 3: below
  ``rtol``) and ``ratchet`` (that, then the same on rank 2 in every forward from step 8).

Each rank writes ``DIR/<scenario>.rank<r>.json``: per run the error (``to_dict()``, or the type
and message of a ``ReplayUnavailableError``) and the replay's counters.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import run_each

from sdc_core import Fault, FaultInjector, ReplayUnavailableError, SDCError, SDCHooks

STEPS = 5
VOCAB, DIM, LENGTH, BATCH = 16, 16, 32, 8
NOISE = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


class Pool(torch.autograd.Function):
    """``out[b] = sum_i src[b * LENGTH + i]``, summed in an order ``order`` chooses; the
    backward (a gather) is exact."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, index: torch.Tensor, rows: int, noisy: bool) -> torch.Tensor:
        order = torch.randperm(index.numel(), generator=NOISE) if noisy else torch.arange(index.numel())
        order = order.to(index.device)
        ctx.save_for_backward(index)
        return src.new_zeros(rows, src.shape[1]).index_add_(0, index[order], src[order])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


class NoisyPool(nn.Module):
    """The scatter-add pooling, nondeterministic as ``kernel`` says."""

    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.noisy_calls = 0

    def noisy(self, tokens: torch.Tensor) -> bool:
        kind = self.kernel.removeprefix("user_")
        if kind == "exact":
            return False
        if kind == "batches":
            return int(tokens[0, 0]) % 2 == 0  # the batches whose tokens collide (data-dependent)
        if torch.are_deterministic_algorithms_enabled() and kind in ("capable", "incapable"):
            if kind == "capable":
                return False
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError("NoisyPool does not have a deterministic implementation, but you set "
                                   "'torch.use_deterministic_algorithms(True)'")  # fmt: skip
        return kind == "every" or bool(torch.rand((), generator=NOISE) < 0.25)

    def forward(self, vectors: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        noisy = self.noisy(tokens)
        self.noisy_calls += int(noisy)
        index = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(tokens.shape[1])
        return Pool.apply(vectors.reshape(-1, vectors.shape[-1]), index, tokens.shape[0], noisy)


class Net(nn.Module):
    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pool = NoisyPool(kernel)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(self.pool(self.emb(tokens), tokens) / LENGTH))
        return nn.functional.mse_loss(self.head(h), y)


DEVICE = [torch.device("cpu")]


def batch(run: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * run + 10 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
    return tokens.to(DEVICE[0]), torch.randn(BATCH, 1, generator=g).to(DEVICE[0])


FAULTS = {
    "flip": Fault("weight_bit_flip", rank=1, step=2, target="head.weight", index=3, bit=24),
    "activation": Fault("module_output", rank=2, step=2, target="head", index=1, factor=3.0),
    "backward": Fault("matmul_output", rank=0, step=2, target="head", phase="weight_grad", index=2, factor=3.0,
                      mode="once"),
}  # fmt: skip
SMALL = {"target": "body", "index": 1, "factor": 1.0 + 1e-3}  # one activation element x (1 + 1e-3): under rtol
SERIES = {  # issue 52: a transient sub-rtol fault must buy no tolerance that hides a later fault of its size
    "transient": [Fault("module_output", rank=1, step=3, mode="once", **SMALL)],
    "ratchet": [Fault("module_output", rank=1, step=3, mode="once", **SMALL),
                Fault("module_output", rank=2, step=8, **SMALL)],
}  # fmt: skip
SERIES_STEPS = 12


def one_run(kernel: str, setting: str, run: int, fault: str | None, out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    if kernel.startswith("user_"):
        torch.use_deterministic_algorithms(True, warn_only=kernel == "user_incapable")
    torch.manual_seed(run)  # the same initial weights on every rank
    net = Net(kernel).to(DEVICE[0])
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    settings = {"replay_every_n_steps": 1} if setting == "every" else {}
    hooks = SDCHooks(run_dir=out / "runs", **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.attach(model, optimizer)
    faults = SERIES.get(fault or "", [FAULTS[fault]] if fault in FAULTS else [])
    injector = FaultInjector(faults)
    injector.install(net, rank)
    error: dict[str, Any] | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(SERIES_STEPS if fault in SERIES else STEPS):
                injector.set_step(step)
                loss = model(*batch(run, step, rank))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                injector.after_step(step, net, [optimizer])
            hooks.finish()
    except SDCError as err:
        error = err.to_dict()
    except ReplayUnavailableError as err:
        error = {"type": type(err).__name__, "message": str(err)}
    finally:
        torch.use_deterministic_algorithms(False)
    replay = hooks.replay.stats.state_dict() if hooks.replay is not None else None
    hooks.detach()
    injector.remove()
    return {"error": error, "replay": replay, "noisy_calls": net.pool.noisy_calls, "fired": injector.fired}


def scenario(name: str, runs: int, out: Path) -> dict[str, Any]:
    name, _, count = name.partition("@")  # "<kernel>:<setting>@8": 8 runs instead of --runs
    runs = int(count) if count else runs
    kernel, setting, *fault = name.split(":")
    results = [one_run(kernel, setting, r, fault[0] if fault else None, out) for r in range(1 if fault else runs)]
    return {"runs": results}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", required=True)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on cuda:0 (gloo)")
    args = parser.parse_args()
    DEVICE[0] = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        run_each(args.only, lambda name: scenario(name, args.runs, args.out), args.out, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
