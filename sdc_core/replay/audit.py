"""One audited step of the ring replay: the exchange, the replays, the comparison and the trust rounds.

Every rank runs the step's ``StepAudit`` together, entering the same collectives in the same order on every path (a
failed replay is caught and decided after the next gather). Before any rank is named, both sides of every disagreeing
pair re-run what they computed: a difference within that noise accuses no one."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from sdc_core.dist.topology import Topology, all_gather_objects, all_gather_tensor, owners_of
from sdc_core.errors import ReplayMismatchError
from sdc_core.replay.attribution import (
    describe,
    every_pair_message,
    failed_message,
    received_batches,
    replay_partners,
    send_payload,
    unreproducible_message,
)
from sdc_core.replay.calibration import AuditSettings, Calibration
from sdc_core.replay.compare import AUTO_MARGIN, Digest, compare_raw, disagree
from sdc_core.replay.determinism import deterministic
from sdc_core.replay.state import MicroBatch
from sdc_core.stats import CheckStats

Pair = tuple[int, int]  # (owner, replayer)
Comparison = tuple[bool, float, str]  # (bit-identical, largest relative difference, where)
_SAME: Comparison = (True, 0.0, "")
T = TypeVar("T")


@dataclass
class StepAudit:
    """One audited step on this rank, with what it learns on the way (``table``, ``noise``, ``error``).

    ``recompute`` re-runs micro-batches side-effect free; ``exchange`` and ``unreplayable`` act on every
    rank alike; ``names()`` gives the parameter labels at each comparison."""

    step: int
    topo: Topology
    config: AuditSettings
    stats: CheckStats
    calibration: Calibration
    names: Callable[[], Sequence[str]]
    groups: list[tuple[int, ...]] | None
    collective_reruns: bool  # a replay runs collectives (sharded models): every rank replays in every round
    advice: str
    micro: list[MicroBatch]
    own: Digest
    failure: str  # what already failed on this rank (capturing its state), decided with the first gather
    recompute: Callable[[list[MicroBatch]], Digest]
    exchange: Callable[[dict[int, Any], list[int]], dict[int, Any]]
    unreplayable: Callable[[str], bool]
    t0: float = field(default_factory=time.perf_counter)
    received: dict[str, Any] = field(default_factory=dict)  # the owner's payload
    batches: list[MicroBatch] = field(default_factory=list)  # its micro-batches, prepared (collective_reruns)
    mine: Digest | None = None  # this rank's replay of its owner's micro-batches
    mine_self: Comparison = _SAME  # this rank's re-run of its own micro-batches against its own result
    table: list[list[float]] = field(default_factory=list)  # per replayer: its row of ``_replay_round``
    noise: list[float] | None = None  # per rank: what its own re-runs show (on a disagreement)
    mismatching: list[Pair] = field(default_factory=list)  # the pairs that disagree
    every_pair: bool | None = None  # every pair disagrees (3+ replicas): whether at the first audit, else None
    error: ReplayMismatchError | None = None
    world: int = field(init=False)
    me: int = field(init=False)
    partners: tuple[int, ...] = field(init=False)
    inverse: list[int] = field(init=False)
    rings: int = field(init=False)  # the length of each replay cycle
    lenient: bool = field(init=False)
    atol: float = field(init=False)
    rtol: float = field(init=False)

    def __post_init__(self) -> None:
        self.world, self.me = self.topo.world_size, self.topo.rank
        self.partners = replay_partners(self.topo, self.groups)
        self.inverse = owners_of(self.partners)
        self.rings = len(self.groups) if self.groups else self.world
        self.lenient = self.calibration.lenient(self.config)
        self.atol, self.rtol = float(self.config.atol), float(self.config.rtol)

    @property
    def tolerance(self) -> float:
        return self.calibration.tolerance(self.config)

    @property
    def self_bound(self) -> float:
        """How far a rank's re-run of its own work may differ (lenient: noise up to rtol is no failure)."""
        return self.rtol if self.lenient else self.tolerance

    def replay(self, batches: list[MicroBatch], strict: bool | None = None) -> Digest:
        """Re-run ``batches`` in the replays' determinism mode, digested."""
        on = self.calibration.strict(self.config) if strict is None else strict
        with deterministic(self.config.deterministic, on):
            return self.recompute(batches)

    def prepare(self, payload: dict[str, Any]) -> list[MicroBatch]:
        """The owner's micro-batches; collective re-runs reduce at the owner's backwards, which must be this rank's."""
        batches = received_batches(payload, [mb.state for mb in self.micro])
        if self.collective_reruns and [b.reduced for b in batches] != [b.reduced for b in self.micro]:
            raise RuntimeError("its owner's gradients were reduce-scattered at other micro-batches than its own")
        return batches

    def replay_payload(self, payload: dict[str, Any]) -> Digest:
        return self.replay(self.prepare(payload))

    def replay_owner(self) -> Digest:
        """This rank's replay of its owner's micro-batches (``batches`` already prepared with collective re-runs)."""
        return self.replay(self.batches) if self.collective_reruns else self.replay_payload(self.received)

    def compare(self, a: Digest, b: Digest) -> Comparison:
        return compare_raw(a, b, self.names(), self.atol)

    def self_round(self) -> tuple[Comparison, str]:
        """This rank's re-run of its own micro-batches against its own result, and what failed."""
        again, err = attempt(lambda: self.replay(self.micro))
        return (self.compare(self.own, again) if again is not None else _SAME), err

    def tol_for(self, *ranks: int) -> float:
        """The tolerance between ``ranks``: lenient, at least ``AUTO_MARGIN`` times their noise (at most ``rtol``)."""
        tol = self.tolerance
        if not self.lenient or self.noise is None:
            return tol
        return max(tol, min(self.rtol, AUTO_MARGIN * max(self.noise[r] for r in ranks)))

    def judge(self) -> tuple[list[Pair], list[int]]:
        """The disagreeing pairs, and the ranks whose own re-run differs from their own result."""
        t, inverse = self.table, self.inverse
        pairs = [(inverse[q], q) for q, r in enumerate(t) if disagree(bool(r[0]), r[1], self.tol_for(inverse[q], q))]
        return pairs, [q for q, r in enumerate(t) if r[3] and disagree(bool(r[4]), r[5], self.self_bound)]

    def differs(self, a: Digest, b: Digest, *ranks: int, scale: float = 0.0) -> bool:
        """Whether ``a`` and ``b`` disagree; lenient, 1/``AUTO_MARGIN`` of ``scale`` (the disagreement judged,
        at most ``rtol``) is noise, so a referee's noisy replay sides with the result it is near to."""
        exact, diff, _ = self.compare(a, b)
        floor = min(self.rtol, scale / AUTO_MARGIN) if self.lenient and math.isfinite(scale) else 0.0
        return disagree(exact, diff, max(self.tol_for(*ranks), floor))

    def done(self) -> None:
        self.stats.add_time(time.perf_counter() - self.t0)

    def failed(self, failures: Sequence[str]) -> bool:
        """Some rank's replay failed (``failures``: every rank's text, gathered): not replayable."""
        self.done()
        return self.unreplayable(failed_message(self.step, failures, self.inverse, self.advice))

    def run(self) -> bool | None:
        """The audit up to the referee round (every rank alike): its result, or None when pairs still
        disagree after confirmation (``attribute_step`` decides then)."""
        first, calibrating, probe = self.calibration.plan(self.config)
        early = self._replay_round(calibrating, probe)
        if early is not None:
            return early
        if calibrating:  # a same-device calibration round of the current mode
            self.calibration.rounds += 1
            self.calibration.calibrate([_noise(r[4], r[5]) for r in self.table], self.config, self.stats)
        self.stats.runs += 1
        self.mismatching, unreproducible = self.judge()
        shaky: list[int] = []  # exact comparisons: ranks of disagreeing pairs that disagree with themselves
        if self.mismatching:  # confirm before accusing: both sides of every pair re-run what they computed
            confirmed = self._confirm(calibrating)
            if isinstance(confirmed, bool):
                return confirmed
            unreproducible, shaky = confirmed
        return self._trust(first, unreproducible, shaky)

    def _replay_round(self, calibrating: bool, probe: bool) -> bool | None:
        """The exchange, the replays and the gather of ``table`` (per rank: the replay's exact and difference,
        failed, self re-run taken, its exact and difference, probe passed); the result if some rank failed."""
        me, failure = self.me, self.failure
        payload, why = send_payload(self.micro, self.own)
        failure = failure or why
        self.received = self.exchange({self.partners[me]: payload}, [self.inverse[me]])[self.inverse[me]]
        if self.collective_reruns:  # replays are collective: every rank must be able to start one, or none does
            batches, prep_failure = attempt(lambda: self.prepare(self.received))
            self.batches, failure = batches or [], failure or prep_failure
            if any_rank(bool(failure)):
                return self.failed(all_gather_objects(failure))
        self.mine, replay_failure = attempt(self.replay_owner)
        failure = failure or replay_failure
        cross = self.compare(self.received["digest"], self.mine) if self.mine is not None else _SAME
        if calibrating:
            self.mine_self, self_failure = self.self_round()
            if self_failure and not failure:
                failure = f"re-running its own micro-batches: {self_failure}"
        # the probe: can the step run under warn_only=False (deterministic attention backward too)?
        strict_ok = probe and attempt(lambda: self.replay(self.micro, strict=True))[0] is not None
        row = [float(cross[0]), cross[1], float(bool(failure)), float(calibrating), float(self.mine_self[0]),
               self.mine_self[1], float(strict_ok)]  # fmt: skip
        self.table = all_gather_tensor(torch.tensor(row, dtype=torch.float64)).tolist()
        if probe:
            self.calibration.probed = all(r[6] for r in self.table)
        if any(r[2] for r in self.table):
            return self.failed(all_gather_objects(failure))
        return None

    def _confirm(self, calibrating: bool) -> bool | tuple[list[int], list[int]]:
        """Both sides of every disagreeing pair re-run what they computed (one gather). Returns the audit's
        result when some rank failed, else ``(unreproducible, shaky)``."""
        self.stats.bump("confirmations")
        self_failure = ""
        if not calibrating:
            self.mine_self, self_failure = self.self_round()
        # the replayer re-runs its replay: noise on its side shows as a difference with itself
        again, rerun_failure = attempt(self.replay_owner)
        rerun = self.compare(self.mine, again) if again is not None and self.mine is not None else _SAME
        srow = [float(self.mine_self[0]), self.mine_self[1], float(bool(self_failure or rerun_failure)),
                float(rerun[0]), rerun[1]]  # fmt: skip
        stable = all_gather_tensor(torch.tensor(srow, dtype=torch.float64)).tolist()
        if any(r[2] for r in stable):
            what = f"re-running its own micro-batches: {self_failure}" if self_failure else ""
            what = what or (f"re-running its replay: {rerun_failure}" if rerun_failure else "")
            return self.failed(all_gather_objects(what))
        for q, (s_exact, s_diff, *_rest) in enumerate(stable):
            self.table[q][3:6] = [1.0, s_exact, s_diff]
        noise = self.noise = [max(_noise(r[0], r[1]), _noise(r[3], r[4])) for r in stable]
        self.stats.extra = {**(self.stats.extra or {}), "max_noise": max(noise)}
        before = set(self.mismatching)
        self.mismatching, unreproducible = self.judge()
        explained = sorted(before - set(self.mismatching))
        if explained:  # the pair's own re-runs differ as much: no accusation, and no tolerance widened by one look
            self.stats.bump("disagreements_explained_by_noise")
            self._unexplained(explained, noise)
        shaky: list[int] = []
        if self.config.exact is True:  # bit equality demanded: a noisy pair is no proof
            shaky = sorted({r for pair in self.mismatching for r in pair if noise[r] > 0})
        return unreproducible, shaky

    def _unexplained(self, explained: list[Pair], noise: list[float]) -> None:
        """Record each rank whose re-run differed (``unexplained_differences``); its noise is one sighting
        (``Calibration.noise_seen``), so a transient fault buys no tolerance."""
        levels = {r: noise[r] for pair in explained for r in pair if noise[r] > 0}
        for rank, level in sorted(levels.items()):
            self.stats.bump("unexplained_differences")
            self.stats.extra = {**(self.stats.extra or {}), "last_unexplained_rank": float(rank),
                                "last_unexplained_step": float(self.step), "last_unexplained_diff": level}  # fmt: skip
        self.calibration.noise_seen(self.step, levels, self.config, self.stats)

    def _trust(self, first: bool, unreproducible: list[int], shaky: list[int]) -> bool | None:
        """What the comparisons allow: not replayable, verified, or pairs left to the referees."""
        table, noise, mismatching = self.table, self.noise, self.mismatching
        worst = max((r[1] for r in table if not math.isnan(r[1])), default=0.0)
        if math.isfinite(worst):
            self.stats.max_diff = max(self.stats.max_diff, worst)
        if len(unreproducible) >= 2 or shaky:
            refused = sorted(set(unreproducible) | set(shaky))
            wheres = all_gather_objects(self.mine_self[2])
            self.done()
            worst_self = max(max(table[q][5], noise[q] if noise else 0.0) for q in refused)
            return self.unreplayable(unreproducible_message(
                self.step, refused, worst_self, wheres, self.self_bound, self.config.exact, self.advice))  # fmt: skip
        # every pair disagreeing at the first audit of two replicas: the replay does not compute what the
        # owners did (once pairs have agreed, it is a fault); with three or more, referees tell
        every_pair = bool(mismatching) and len(mismatching) == self.world
        if every_pair and self.rings < 3 and first and not self.calibration.agreed:
            self.done()
            return self.unreplayable(every_pair_message(self.step, self.topo, first, self.advice))
        if not mismatching:
            self.calibration.pairs_agreed(all(r[0] for r in table), self.stats)
            if unreproducible:  # verified by the partner; the one rank's re-run differed: note it
                self.stats.bump("self_replay_mismatches")
            self.stats.last_verified_step = self.step
            self.done()
            return False
        self.every_pair = first if every_pair and self.rings >= 3 else None
        return None


def attempt(fn: Callable[[], T]) -> tuple[T | None, str]:
    """``(fn(), "")``, or ``(None, what it raised)``: failures are decided together, after the next gather."""
    try:
        return fn(), ""
    except Exception as err:
        return None, describe(err)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (one all-gather of one float64 per rank)."""
    return any(all_gather_tensor(torch.tensor([float(flag)], dtype=torch.float64)).flatten().tolist())


def _noise(exact: float, diff: float) -> float:
    """A same-device difference: 0 when bit-identical, else at least a tiny positive value."""
    return 0.0 if exact else (diff if diff > 0 else 1e-12)
