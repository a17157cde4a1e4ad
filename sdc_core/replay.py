"""Ring replay audit: replicas recompute each other's micro-batches and compare.

Contract: on every ``every_n_steps``-th optimizer step, rank ``r`` sends the micro-batches of
that step (inputs, RNG state, its loss and a digest of its LOCAL gradients, taken in the
communication hook before the all-reduce) to its partner ``partners[r]``: a rank on another node
when there are several, else the next rank. The partner recomputes loss and gradients with the
same weights and RNG state and compares. Every rank then learns which (owner, replayer) pairs
disagree and reaches the same attribution:

* a rank whose own result and whose replay of another rank both disagree is the faulty one;
* a single disagreeing pair is settled by a third rank (a referee on yet another node where
  possible) replaying the disputed batch: the side it agrees with is healthy;
* with two ranks no third opinion exists: ``rank`` is None and both are suspects.

The replay has no side effect: it runs the unwrapped module on detached parameter aliases and
cloned buffers (``.grad``, optimizer, buffers, DDP untouched), restores the CPU and CUDA RNG
state, and never logs. A run with the audit on trains bit-identically to one with it off.

Comparison: ``exact=True`` demands bit equality of the loss and of every parameter's gradient
fingerprint. Otherwise each of loss, per-parameter gradient norm and per-parameter gradient sum
(the latter relative to ``sqrt(numel) * norm``, its Cauchy-Schwarz bound) must agree within
``rtol`` (default 1e-3), with ``atol`` (default 1e-6) as the floor of the denominators. On CPU
fp32 and bf16 the replay is bit-exact; on GPUs, kernels with atomics (e.g. embedding backward,
``index_add``) differ run to run by about 1e-6 relative in fp32 and 1e-3 in bf16, below the
default. Differences smaller than ``rtol`` are not seen: that is the price of no false alarms.

Cost: on audited steps, one extra forward and backward of the partner's micro-batches, the batch
transfer (point to point, never gathered), a per-parameter digest of the local gradients, and one
all-gather of two float64 per rank. Other steps pay nothing. The referee round runs only when a
pair disagrees.

Limits: training code that draws from Python's ``random`` or NumPy's RNG, reads global state, or
mutates its batch in place is not replayed faithfully: define a side-effect free replay step
(``sdc_replay_step`` in Lightning) or use ``exact=False``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.fingerprint import tensor_digest
from sdc_core.gradients import GradientTap
from sdc_core.stats import CheckStats
from sdc_core.topology import (
    TRANSFER_ERROR,
    Topology,
    all_gather_objects,
    all_gather_tensor,
    exchange,
    is_distributed,
)


@dataclass(frozen=True)
class ReplayConfig:
    """Settings of the ring replay audit (validated on construction).

    Args:
        every_n_steps: audit every n-th optimizer step (steps 0, n, 2n, ...; >= 1).
        exact: demand bit equality instead of tolerances.
        rtol: relative tolerance of loss, gradient norms and sums (> 0, < 1).
        atol: absolute floor of the denominators (>= 0).
        on_failure: ``"raise"`` (default) or ``"skip_step"``: when the faulty rank is named and
            its fault proves transient (re-running the disagreeing computation gives a different
            result), every rank drops the step instead; a persistent fault still raises.
    """

    every_n_steps: int = 100
    exact: bool = False
    rtol: float = 1e-3
    atol: float = 1e-6
    on_failure: str = "raise"

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "skip_step", "rollback"):
            raise ValueError(f"on_failure must be 'raise', 'skip_step' or 'rollback', got {self.on_failure!r}")
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be True or False, got {self.exact!r}")
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, int | float) or not 0 < self.rtol < 1:
            raise ValueError(f"rtol must be a number in (0, 1), got {self.rtol!r}")
        if isinstance(self.atol, bool) or not isinstance(self.atol, int | float) or not 0 <= self.atol < math.inf:
            raise ValueError(f"atol must be a finite number >= 0, got {self.atol!r}")


@dataclass
class Digest:
    """What one computation of a step's micro-batches produced, in comparable form."""

    loss: float
    sums: torch.Tensor  # float64 [P]: per-parameter gradient sum
    norms: torch.Tensor  # float64 [P]: per-parameter gradient L2 norm
    fps: torch.Tensor  # int64 [P]: per-parameter exact gradient fingerprint
    numels: torch.Tensor  # float64 [P]


def _sum_norm(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and L2 norm of a gradient, reduced in float32 (no float64 copy of the gradient; owner
    and replayer reduce identically, so equal gradients give equal digests) and returned as
    float64 scalars for the comparison."""
    g = g.detach()
    g = g if g.dtype in (torch.float32, torch.float64) else g.float()
    return g.sum().double(), torch.linalg.vector_norm(g).double()


def _grad_fingerprint(g: torch.Tensor) -> torch.Tensor:
    """Exact fingerprint of a gradient with -0.0 read as +0.0 (kernels differ in the sign of
    an exact zero, e.g. the gradient row of a unit ReLU switched off; the value is the same)."""
    return tensor_digest(g.detach() + 0.0)


def _digest_row(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(sum, norm, exact fingerprint, numel)`` of one gradient, on its device (no sync)."""
    gs, gn = _sum_norm(g)
    return gs, gn, _grad_fingerprint(g), g.numel()


def _assemble(names: Sequence[str], rows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
              loss: float) -> Digest:  # fmt: skip
    """A ``Digest`` in ``names`` order; a parameter without a row (no gradient) counts as zeros."""
    zero64, zero_fp = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    picked = [rows.get(n) for n in names]

    def column(i: int, zero: torch.Tensor) -> torch.Tensor:
        return torch.stack([r[i].cpu() if r else zero for r in picked]) if picked else zero.new_zeros(0)

    return Digest(
        loss=float(loss),
        sums=column(0, zero64),
        norms=column(1, zero64),
        fps=column(2, zero_fp),
        numels=torch.tensor([r[3] if r else 0 for r in picked], dtype=torch.float64),
    )


def grad_digest(names: Sequence[str], grads: dict[str, torch.Tensor], loss: float) -> Digest:
    """Digest of gradients keyed by parameter name (a missing gradient counts as zeros)."""
    return _assemble(names, {n: _digest_row(g) for n, g in grads.items() if g is not None}, loss)


def compare(a: Digest, b: Digest, config: ReplayConfig, names: Sequence[str]) -> tuple[bool, float, str]:
    """``(mismatch, largest relative difference, where)`` between two digests of the same work."""
    if a.sums.shape != b.sums.shape:
        return True, math.inf, "parameter count"
    floor = max(config.atol, 1e-300)
    loss_diff = (
        0.0
        if a.loss == b.loss or (math.isnan(a.loss) and math.isnan(b.loss))
        else (abs(a.loss - b.loss) / max(abs(a.loss), abs(b.loss), floor))
    )
    if math.isnan(loss_diff):
        loss_diff = math.inf
    norm_den = torch.maximum(torch.maximum(a.norms, b.norms), torch.tensor(floor, dtype=torch.float64))
    norm_diff = (a.norms - b.norms).abs() / norm_den
    sum_den = torch.maximum(norm_den * a.numels.clamp(min=1).sqrt(), torch.tensor(floor, dtype=torch.float64))
    sum_diff = (a.sums - b.sums).abs() / sum_den
    per_param = torch.maximum(norm_diff, sum_diff).nan_to_num(nan=math.inf)
    per_param = torch.where(a.fps == b.fps, torch.zeros_like(per_param), per_param)  # bit-identical
    worst_param = int(per_param.argmax()) if per_param.numel() else -1
    grad_diff = float(per_param[worst_param]) if worst_param >= 0 else 0.0
    diff, where = (loss_diff, "loss") if loss_diff >= grad_diff else (grad_diff, names[worst_param])
    if config.exact:
        fp_bad = (a.fps != b.fps).nonzero().flatten().tolist()
        loss_bad = loss_diff != 0.0
        if fp_bad or loss_bad:
            where = "loss" if loss_bad else names[fp_bad[0]]
            return True, diff, where
        return False, diff, where
    return diff > config.rtol, diff, where


@dataclass
class MicroBatch:
    """One micro-batch as the owner ran it: inputs, index and RNG state before its step."""

    batch: Any
    batch_idx: int
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None = None


def capture_rng(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU RNG state and, for a CUDA ``device``, that device's RNG state."""
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return torch.get_rng_state(), cuda


StepFn = Callable[[Any, int], torch.Tensor]


def replay_gradients(
    module: nn.Module,
    names: Sequence[str],
    micro_batches: Iterable[MicroBatch],
    step_fn: StepFn,
    to_device: Callable[[Any], Any] = lambda b: b,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Recompute the summed loss and gradients of ``micro_batches`` without any side effect.

    ``step_fn(batch, batch_idx)`` returns the loss exactly as the owner back-propagated it
    (normalised for accumulation, scaled by a GradScaler). The module runs on detached aliases of
    its parameters and clones of its buffers; the RNG state is set per micro-batch and restored.
    """
    params = dict(module.named_parameters())
    aliases = {n: params[n].detach().requires_grad_() for n in names}
    swapped: dict[str, torch.Tensor] = dict(aliases)
    swapped.update({n: b.clone() for n, b in module.named_buffers()})
    device = next((p.device for p in params.values()), torch.device("cpu"))
    saved_cpu, saved_cuda = capture_rng(device)
    total_loss = 0.0
    total: dict[str, torch.Tensor] = {}
    try:
        for mb in micro_batches:
            torch.set_rng_state(mb.cpu_rng.clone())
            if mb.cuda_rng is not None and device.type == "cuda":
                torch.cuda.set_rng_state(mb.cuda_rng.clone(), device)
            batch = to_device(mb.batch)
            with _reparametrize_module(module, swapped, tie_weights=True), context():
                loss = step_fn(batch, mb.batch_idx)
            grads = torch.autograd.grad(loss, list(aliases.values()), allow_unused=True)
            total_loss += float(loss.detach().double())
            for n, g in zip(aliases, grads, strict=True):
                if g is not None:
                    total[n] = g if n not in total else total[n] + g
    finally:
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda, device)
    return total_loss, total


def explain(
    world: int, partners: Sequence[int], mismatching: Iterable[tuple[int, int]]
) -> tuple[set[int], list[tuple[int, int]]]:
    """First attribution pass over disagreeing ``(owner, replayer)`` pairs.

    Returns ``(culprits, disputed)``: ranks that disagree both as owner and as replayer, and the
    pairs no culprit explains, which need a referee.
    """
    pairs = set(mismatching)
    owners_bad = {o for o, _ in pairs}
    replayers_bad = {q for _, q in pairs}
    culprits = owners_bad & replayers_bad if world > 2 else set()
    disputed = sorted((o, q) for o, q in pairs if o not in culprits and q not in culprits)
    return culprits, disputed


def pick_referee(owner: int, replayer: int, world: int, node_of: Sequence[int], busy: set[int]) -> int | None:
    """A third rank for a disputed pair: outside the pair, preferably not involved in any
    disagreement and on a node of its own. None when ``world < 3``."""
    candidates = [(replayer + k) % world for k in range(1, world)]
    candidates = [r for r in candidates if r not in (owner, replayer)]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r in busy, node_of[r] in (node_of[owner], node_of[replayer])))


def settle(
    world: int,
    culprits: set[int],
    disputed: Sequence[tuple[int, int]],
    referee_says: dict[tuple[int, int], tuple[bool, bool]],
) -> tuple[int | None, tuple[int, ...], dict[str, Any]]:
    """Final attribution: ``(rank, suspects, notes)``.

    ``referee_says[(owner, replayer)] = (agrees_with_owner, agrees_with_replayer)``.
    """
    suspects = set(culprits)
    notes: dict[str, Any] = {}
    for o, q in disputed:
        verdict = referee_says.get((o, q))
        if verdict is None:
            suspects.update((o, q))
            notes[f"{o}->{q}"] = "no referee"
            continue
        with_owner, with_replayer = verdict
        if with_owner and not with_replayer:
            suspects.add(q)
            notes[f"{o}->{q}"] = "referee agrees with the owner: the replayer is faulty"
        elif with_replayer and not with_owner:
            suspects.add(o)
            notes[f"{o}->{q}"] = "referee agrees with the replayer: the owner is faulty"
        else:
            suspects.update((o, q))
            notes[f"{o}->{q}"] = "referee agrees with " + ("both" if with_owner else "neither")
    ordered = tuple(sorted(suspects))
    return (ordered[0] if len(ordered) == 1 and world > 2 else None), ordered, notes


@dataclass
class RingReplay:
    """Framework-neutral ring replay audit.

    Adapter calls, per optimizer step: ``arm(step)`` (is this step audited?), ``record(...)``
    and ``record_loss(...)`` per micro-batch, then ``audit(...)`` after backward and before the
    update, on every rank.
    """

    config: ReplayConfig = field(default_factory=ReplayConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("ring_replay"))
    topology: Topology | None = None
    names: list[str] = field(default_factory=list)
    _armed_step: int | None = None
    _micro: list[MicroBatch] = field(default_factory=list)
    _loss: float = 0.0
    _local: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    _tap: GradientTap | None = None
    last_error: ReplayMismatchError | None = None

    @property
    def active(self) -> bool:
        return is_distributed()

    def attach(self, tap: GradientTap, names: Sequence[str]) -> None:
        """Digest local gradients from the tap on audited steps; ``names``: trainable params."""
        self._tap = tap
        self.names = list(names)
        tap.consumers.append(self._consume)

    def arm(self, step: int) -> bool:
        """Called at each micro-batch start; True when this step's micro-batches are audited."""
        due = self.active and step % self.config.every_n_steps == 0
        if not due:
            self._armed_step = None
            return False
        if self._armed_step != step:
            self._armed_step, self._micro, self._loss, self._local = step, [], 0.0, {}
        return True

    def disarm(self) -> None:
        """Drop the micro-batches recorded for the armed step: it is not audited (every rank alike),
        e.g. because another check already dropped that optimizer step."""
        self._armed_step, self._micro, self._loss, self._local = None, [], 0.0, {}

    @property
    def armed(self) -> bool:
        """True between ``arm`` of an audited step and its ``audit``."""
        return self._armed_step is not None

    @property
    def recorded(self) -> int:
        """Micro-batches recorded for the armed step so far."""
        return len(self._micro)

    def record(self, batch: Any, batch_idx: int, device: torch.device | None = None) -> None:
        """Remember an audited micro-batch and the RNG state it starts from."""
        cpu, cuda = capture_rng(device)
        self._micro.append(MicroBatch(batch, batch_idx, cpu, cuda))

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the owner back-propagates for the current audited micro-batch."""
        if self._armed_step is not None:
            self._loss += float(loss.detach().double())

    def _consume(self, bucket: Any) -> None:
        if self._armed_step is None or self._tap is None:
            return
        for n, g in zip(self._tap.bucket_names(bucket), bucket.gradients(), strict=True):
            self._local[n] = _digest_row(g)

    def _own_digest(self) -> Digest:
        return _assemble(self.names, self._local, self._loss)

    def audit(
        self,
        step: int,
        module: nn.Module,
        step_fn: StepFn,
        to_device: Callable[[Any], Any] = lambda b: b,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Run the audit of ``step`` if it was armed (every rank alike); raise on a verdict.

        Returns True when the optimizer step must be skipped (``on_failure="skip_step"`` and a
        transient fault)."""
        if self._armed_step != step:
            return False
        t0 = time.perf_counter()
        topo = self.topology or Topology.gather()
        world, me = topo.world_size, topo.rank
        partners = topo.partners()
        inverse = [0] * world
        for o, q in enumerate(partners):
            inverse[q] = o
        own = self._own_digest()
        micro, self._micro, self._armed_step = self._micro, [], None

        def replay(batches: list[MicroBatch]) -> Digest:
            loss, grads = replay_gradients(module, self.names, batches, step_fn, to_device, context)
            return grad_digest(self.names, grads, loss)

        def replay_payload(payload: dict[str, Any]) -> Digest:
            if TRANSFER_ERROR in payload:
                raise RuntimeError(payload[TRANSFER_ERROR])
            return replay(payload["micro"])

        received = exchange({partners[me]: {"micro": micro, "digest": own}}, [inverse[me]])[inverse[me]]
        failure = ""
        try:
            mine = replay_payload(received)
            mismatch, diff, where = compare(received["digest"], mine, self.config, self.names)
        except Exception as err:  # decided together below: no rank may be left in a collective
            failure = f"{type(err).__name__}: {err}"
            mine, mismatch, diff, where = None, False, 0.0, ""
        row = torch.tensor([float(mismatch), diff, float(bool(failure))], dtype=torch.float64)
        table = all_gather_tensor(row).tolist()
        if any(failed for _, _, failed in table):
            failures = all_gather_objects(failure)
            raise ReplayUnavailableError(
                f"RingReplayAudit could not replay at step {step}: "
                + "; ".join(f"rank {r} replaying rank {inverse[r]}: {f}" for r, f in enumerate(failures) if f)
                + ". Define a side-effect free `sdc_replay_step(batch, batch_idx)` (Lightning) or a `loss_fn`, "
                "or turn the audit off."
            )
        self.stats.runs += 1
        worst = max((d for _, d, _ in table if not math.isnan(d)), default=0.0)
        if math.isfinite(worst):
            self.stats.max_diff = max(self.stats.max_diff, worst)
        mismatching = [(inverse[q], q) for q, (bad, _, _) in enumerate(table) if bad]
        if not mismatching:
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return False

        # Rare path: attribute, with a referee round for pairs no culprit explains.
        wheres = all_gather_objects(where)
        culprits, disputed = explain(world, partners, mismatching)
        node_of = [f.node_rank for f in topo.ranks]
        busy = {r for pair in mismatching for r in pair}
        referees = {pair: pick_referee(*pair, world, node_of, busy) for pair in disputed}
        sends: dict[int, Any] = {}
        recv_from: list[int] = []
        for (o, q), t in referees.items():
            if t is None:
                continue
            if me == o:
                sends.setdefault(t, {}).update(micro=micro, digest=own)
            if me == q:
                # the replayer's result travels to the referee too (a different destination
                # from the owner's: referee t is neither o nor q)
                sends.setdefault(t, {}).update(replay=mine)
            if me == t:
                recv_from += [r for r in (o, q) if r not in recv_from]
        sends = {d: v for d, v in sends.items() if d != me}
        got = exchange(sends, recv_from) if referees else {}
        my_rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        for (o, q), t in referees.items():
            if t != me:
                continue
            try:  # a referee that cannot replay gives no ruling: the pair stays suspect
                ref = replay_payload(got[o])
                agrees_owner = not compare(got[o]["digest"], ref, self.config, self.names)[0]
                agrees_replayer = not compare(got[q]["replay"], ref, self.config, self.names)[0]
            except Exception:
                continue
            my_rulings[(o, q)] = (agrees_owner, agrees_replayer)
        rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        for part in all_gather_objects(my_rulings):
            rulings.update(part)
        rank, suspects, notes = settle(world, culprits, disputed, rulings)
        classification = None
        if rank is not None:  # the suspect re-runs what disagreed: does it reproduce its result?
            mine_again = None
            if me == rank:
                as_owner = (rank, partners[rank]) in mismatching
                try:
                    again = replay(micro) if as_owner else replay_payload(received)
                    before = own if as_owner else mine
                    same = before is not None and not compare(before, again, self.config, self.names)[0]
                    mine_again = "persistent" if same else "transient"
                except Exception as err:
                    mine_again = f"unknown ({type(err).__name__})"
            classification = all_gather_objects(mine_again)[rank]
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        details = {
            "mismatching_pairs": [list(p) for p in mismatching],
            "differences": {inverse[q]: table[q][1] for q in range(world) if table[q][0]},
            "where": {inverse[q]: wheres[q] for q in range(world) if table[q][0]},
            "partners": list(partners),
            "referees": {f"{o}->{q}": t for (o, q), t in referees.items()},
            "rulings": notes,
            "exact": self.config.exact,
            "rtol": self.config.rtol,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": world,
            "classification": classification,
        }
        if rank is not None:
            reason = (
                f"its results disagree with its partners' replays "
                f"(largest difference {worst:.3g} in {wheres[partners[rank]]}; the fault is {classification})"
            )
        elif world == 2:
            reason = "the two replicas disagree on a replayed batch; a third replica is needed to tell which is wrong"
        else:
            reason = f"{len(mismatching)} replay pairs disagree and the faulty rank could not be singled out"
        skip = self.config.on_failure == "skip_step" and classification == "transient"
        if skip:
            details["action"] = "step skipped on every rank"
        self.last_error = ReplayMismatchError(
            step=step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason
        )
        if not skip:
            raise self.last_error
        self.stats.bump("skipped_steps")
        return True
