"""The every-step gradient screen on raw DDP (gloo, no framework): run with torchrun, 3 or 4 ranks.

A small transformer classifier on heterogeneous batches: each rank draws, each step, either a
short-sequence batch (16 sequences of 4-12 tokens) or a long-sequence one (4 of 48-96 tokens),
token-budget style, with imbalanced labels (60/20/10/7/3%), dropout, AdamW and a linear
learning-rate warm-up over the first 20 steps. The screen reads what the non-finite check reads
(``want_magnitudes``) and every rank writes every step's verdict.

Scenarios: ``clean`` (60 steps, no fault), ``faults`` (50 steps, clean up to step 29; the top
exponent bit of one element of ``enc.linear1``'s weight gradient as its product returns it, rank 1,
step 30; a gradient exponent flip on rank 2 at step 45), ``rates`` (many clean steps; every ``--every``-th step one
random fault of every kind and bit class on a random rank, measured against a clean re-run of the
same step, the weights restored after it)."""

from __future__ import annotations

import copy
import os
import random
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from scenario_runner import parse, run_each
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_core.checks import screen as screen_module
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteConfig, NonFiniteGradient
from sdc_core.checks.screen import GradientScreen, ScreenConfig, ring_neighbours
from sdc_core.dist.topology import Topology
from sdc_core.faults.checkpoint import bits_of_class
from sdc_core.faults.inject import Fault, FaultInjector
from sdc_core.ops import process_exit

VOCAB, CLASSES, WIDTH = 256, 5, 32
PRIORS = torch.tensor([0.6, 0.2, 0.1, 0.07, 0.03])
WARMUP = 20


class Classifier(nn.Module):
    """Embedding, one transformer encoder layer (padding mask), masked mean pool, linear head; returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.enc = nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.enc(self.embed(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (h * keep).sum(1) / keep.sum(1)
        return nn.functional.cross_entropy(self.head(pooled), labels)


def batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: short or long sequences, imbalanced labels, a label token
    planted in 80% of the sequences (learnable)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    long = bool(torch.rand((), generator=g) < 0.5)
    n, lo, hi = (4, 48, 96) if long else (16, 4, 12)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    tokens = torch.zeros(n, hi, dtype=torch.long)
    labels = torch.multinomial(PRIORS, n, replacement=True, generator=g)
    for i, length in enumerate(lengths.tolist()):
        tokens[i, :length] = torch.randint(CLASSES + 1, VOCAB, (length,), generator=g)
        if torch.rand((), generator=g) < 0.8:
            tokens[i, int(torch.randint(0, length, (), generator=g))] = 1 + labels[i]
    return tokens, labels


class Run:
    """One DDP training with the non-finite check and the screen on the gradient tap."""

    def __init__(self, seed: int, lr: float = 3e-3, config: ScreenConfig | None = None) -> None:
        torch.manual_seed(0)
        self.seed, self.rank = seed, dist.get_rank()
        self.net = Classifier()
        self.ddp = DDP(self.net)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / WARMUP))
        topo = Topology.gather()
        names = {id(p): n for n, p in self.net.named_parameters()}
        self.nonfinite = NonFiniteGradient(config=NonFiniteConfig(on_failure="warn"), topology=topo)
        self.nonfinite.attach(GradientTap.attach(self.ddp, names))
        self.screen = GradientScreen(config, topo)
        self.screen.attach(self.nonfinite)
        self.injector: FaultInjector | None = None
        self.losses: list[float] = []
        self.rows: dict[int, list[list[float]]] = {}  # every judged step's gathered rows (to re-run the band offline)
        judge = self.screen.judge

        def recorded(step: int, rows: torch.Tensor) -> Any:
            self.rows[step] = rows.tolist() if isinstance(rows, torch.Tensor) else [list(r) for r in rows]
            return judge(step, rows)

        self.screen.judge = recorded  # type: ignore[method-assign]
        self.gathered: list[int] = []  # steps whose rows were all gathered (neighbourhoods: only when one stood out)
        verdict = self.screen._verdict

        def gathered(step: int, table: list[list[float]], *args: Any, **kwargs: Any) -> Any:
            self.gathered.append(step)
            return verdict(step, table, *args, **kwargs)

        self.screen._verdict = gathered  # type: ignore[method-assign]

    def backward(self, step: int, observe: bool = True) -> torch.Tensor:
        """Forward and backward of ``step`` (under the injector, if any); ``observe``: hand the
        magnitudes and the loss to the screen. Returns the detached loss."""
        if self.injector is not None:
            self.injector.set_step(step)
        tokens, labels = batch(self.seed, self.rank, step)
        loss = self.ddp(tokens, labels)
        loss.backward()
        magnitudes = self.nonfinite.take_magnitudes()
        if observe:
            self.screen.observe(step, magnitudes, loss)
        return loss.detach()

    def update(self, step: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.nonfinite.verdict(step, self.net.named_parameters())
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self.net.parameters() if p.grad is not None])


def _result(res: Any) -> dict[str, Any]:
    return {"step": res.step, "ranks": list(res.ranks), "details": {str(r): d for r, d in res.details.items()},
            "calibrated": res.calibrated, "margin": res.margin}  # fmt: skip


def train(steps: int, seed: int, faults: list[Fault]) -> dict[str, Any]:
    """``steps`` steps; each step's verdict taken one step later (the deferred read), the last one at once."""
    run = Run(seed)
    if faults:
        run.injector = FaultInjector(faults)
        run.injector.install(run.net, run.rank)
    results = []
    t0 = time.perf_counter()
    for step in range(steps):
        loss = run.backward(step)
        run.update(step)
        run.losses.append(float(loss))
        if step > 0:
            results.append(_result(run.screen.suspects(step - 1)))
    results.append(_result(run.screen.suspects(steps - 1)))
    bands, calibrated = run.screen.bands()
    return {"results": results, "losses": run.losses, "bands": bands.tolist(), "calibrated": calibrated.tolist(),
            "names": run.screen.names, "stats": run.screen.stats.metrics(), "seconds": time.perf_counter() - t0,
            "fired": run.injector.fired if run.injector else [], "rows": run.rows, "gathered": run.gathered,
            "neighbourhoods": bool(ring_neighbours(run.screen.topology)[1])}  # fmt: skip


def clean(out: Any) -> dict[str, Any]:
    return train(60, seed=1, faults=[])


def faults(out: Any) -> dict[str, Any]:
    """50 steps: 0-29 clean (the warm-up included), a fault on rank 1 at step 30 and on rank 2 at 45."""
    return train(50, seed=1, faults=[
        Fault(kind="matmul_output", rank=1, step=30, target="enc.linear1", index=7, bit=30, phase="weight_grad",
              mode="once"),
        Fault(kind="gradient_bit_flip", rank=2, step=45, target="enc.linear2.weight", index=11, bit=30),
    ])  # fmt: skip


def early(out: Any) -> dict[str, Any]:
    """12 steps (inside the warm-up, before any value's own band has calibrated): one finite x 1e5
    error in the weight gradient of ``enc.linear1`` on rank 1 at step 7 (element 7 is small at that
    step: x 1e5 moves its group's peak by about 2^8, x 1e4 by 2^4.6)."""
    return train(12, seed=1, faults=[
        Fault(kind="matmul_output", rank=1, step=7, target="enc.linear1", index=7, factor=1e5, phase="weight_grad",
              mode="once"),
    ])  # fmt: skip


BIT_CLASSES = ("sign", "exponent_top", "exponent", "mantissa")
SITES = ("activation", "gradient", "matmul_forward", "matmul_input_grad", "matmul_weight_grad")
LINEARS = ("enc.linear1", "enc.linear2", "head")


def random_fault(rng: random.Random, step: int, world: int, site: str, bit_class: str, params: list[str]) -> Fault:
    bit = rng.choice(bits_of_class(torch.float32, bit_class))
    rank, index = rng.randrange(world), rng.randrange(1 << 20)
    if site == "activation":
        return Fault(kind="module_output", rank=rank, step=step, target=rng.choice(("enc.linear1", "enc.dropout",
                     "enc.norm1", "enc.norm2", "head")), index=index, bit=bit, mode="once")  # fmt: skip
    if site == "gradient":
        return Fault(kind="gradient_bit_flip", rank=rank, step=step, target=rng.choice(params), index=index, bit=bit)
    phase = site.removeprefix("matmul_")
    return Fault(kind="matmul_output", rank=rank, step=step, target=rng.choice(LINEARS), index=index, bit=bit,
                 phase=phase, mode="once")  # fmt: skip


def rates(out: Any, steps: int, every: int, seed: int) -> dict[str, Any]:
    """Clean steps, and every ``every``-th step (after the warm-up) one injection: the step run
    clean first (the reference gradient; no screen), then again with the fault from the same RNG
    state and weights (screened, verdict read before the update), then the weights, optimizer
    and schedule restored and the step skipped."""
    run = Run(seed)
    rng = random.Random(seed)
    world = dist.get_world_size()
    params = [n for n, p in run.net.named_parameters() if p.requires_grad]
    clean_rows, rows, plan = [], [], 0
    t0 = time.perf_counter()
    for step in range(steps):
        if step < WARMUP + 10 or step % every:
            run.backward(step)
            res = run.screen.suspects(step)
            run.update(step)
            clean_rows.append(_result(res))
            continue
        site, bit_class = SITES[plan % len(SITES)], BIT_CLASSES[(plan // len(SITES)) % len(BIT_CLASSES)]
        plan += 1
        fault = random_fault(rng, step, world, site, bit_class, params)
        saved = (copy.deepcopy(run.net.state_dict()), copy.deepcopy(run.opt.state_dict()),
                 copy.deepcopy(run.sched.state_dict()), torch.get_rng_state())  # fmt: skip
        run.backward(step, observe=False)
        reference = run.flat_grad().clone()
        run.opt.zero_grad(set_to_none=True)
        run.nonfinite.verdict(step, run.net.named_parameters())  # drop the reference's local evidence
        torch.set_rng_state(saved[3])
        run.injector = FaultInjector([fault])
        run.injector.install(run.net, run.rank)
        run.backward(step)
        run.injector.remove()
        fired, run.injector = run.injector.fired, None
        wrong = run.flat_grad()
        res = run.screen.suspects(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.nonfinite.verdict(step, run.net.named_parameters())
            run.nonfinite.resolve()
        diff = (wrong.double() - reference.double()).norm() / reference.double().norm()
        run.opt.zero_grad(set_to_none=True)
        run.net.load_state_dict(saved[0])
        run.opt.load_state_dict(saved[1])
        run.sched.load_state_dict(saved[2])
        fired_all = [None] * world
        dist.all_gather_object(fired_all, fired)
        rows.append({"step": step, "site": site, "bit_class": bit_class, "bit": fault.bit, "rank": fault.rank,
                     "target": fault.target, "fired": [f for fs in fired_all for f in fs],
                     "rel_change": float(diff) if torch.isfinite(diff) else "nonfinite", **_result(res)})  # fmt: skip
    return {"clean": clean_rows, "injections": rows, "seconds": time.perf_counter() - t0, "rows": run.rows,
            "stats": run.screen.stats.metrics(), "bands": run.screen.bands()[0].tolist()}  # fmt: skip


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--steps", type=int, default=400)
        p.add_argument("--every", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--neighbours", type=int, default=0,
                       help="compare rows in neighbourhoods of this many ranks (a larger world's way), not all")

    args = parse("faults", extra)
    if args.neighbours:
        screen_module.ALL_ROWS_UP_TO, screen_module.NEIGHBOURS = 1, args.neighbours
    dist.init_process_group("gloo")
    process_exit.arm()  # as every adapter does on attach: no gloo thread may still need Python at exit (an abort)
    torch.set_num_threads(1)
    scenarios = {"clean": clean, "faults": faults, "early": early,
                 "rates": lambda out: rates(out, args.steps, args.every, args.seed),
                 "long": lambda out: train(args.steps, args.seed, [])}  # fmt: skip
    try:
        run_each(args.only, lambda name: scenarios[name](args.out), args.out, int(os.environ["RANK"]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
