"""What the ring replay's audits have learnt: the tolerance ``exact="auto"`` measured (never lowered, never above
``rtol``) and whether the step runs under strict determinism. Every update is computed from all-gathered values, so
every rank holds the same. Cost: host arithmetic on a few numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sdc_core.replay.compare import AUTO_MARGIN, Tolerances
from sdc_core.stats import CheckStats

NOISE_SIGHTINGS_KEPT = 256  # the largest noise sightings kept (``noise_seen``); older, smaller ones drop out
CALIBRATION_ROUNDS = 3  # exact="auto" without strict determinism: same-device rounds before the tolerance settles


class AuditSettings(Tolerances, Protocol):
    """What the audit reads of its configuration (``sdc_core.replay.ring.ReplayConfig`` has it)."""

    @property
    def deterministic(self) -> bool: ...
    @property
    def on_failure(self) -> str: ...


@dataclass
class Calibration:
    """The audits' learnt state (every rank alike); ``config`` is passed in, as it may be replaced."""

    measured: float | None = None  # the tolerance exact="auto" measured; None: no round yet
    rounds: int = 0  # same-device calibration rounds in the current mode
    agreed: bool = False  # some audit of this process found the replay pairs agreeing
    exact_audits: int = 0  # audits in the current mode whose every pair agreed bit for bit
    proven_strict: bool | None = None  # None: not probed yet; True: the step runs under warn_only=False
    probed: bool | None = None  # the probe's result, applied when its audit ends
    sightings: list[tuple[float, int, int]] = field(default_factory=list)  # (noise, audit step, rank)

    @staticmethod
    def lenient(config: AuditSettings) -> bool:
        """``exact="auto"``: measured noise is tolerated, up to ``rtol`` (``True == "auto"`` is False)."""
        return config.exact == "auto"

    def tolerance(self, config: AuditSettings) -> float:
        """The tolerance comparisons use now (0: bit equality)."""
        if config.exact is True:
            return 0.0
        return float(config.rtol) if config.exact is False else self.measured or 0.0

    def strict(self, config: AuditSettings) -> bool:
        """True once the step is known to run under deterministic algorithms without ``warn_only``."""
        return config.deterministic and self.proven_strict is True

    def mode(self, config: AuditSettings) -> str:
        """``"strict"``, ``"warn_only"`` (deterministic kernels where torch has them) or ``"off"``."""
        return "off" if not config.deterministic else "strict" if self.strict(config) else "warn_only"

    def plan(self, config: AuditSettings) -> tuple[bool, bool, bool]:
        """``(first, calibrating, probe)`` for an audit starting now, in the current mode."""
        # exact="auto" tolerates measured noise in every mode: one exact audit proves nothing
        needed = CALIBRATION_ROUNDS if self.lenient(config) and not self.strict(config) else 1
        return self.rounds == 0, self.rounds < needed, config.deterministic and self.proven_strict is None

    def calibrate(self, self_diffs: Sequence[float], config: AuditSettings, stats: CheckStats) -> None:
        """``exact="auto"``: the tolerance rises to ``AUTO_MARGIN`` times the lower median of the ranks' same-device
        differences (no single faulty rank can raise it; 0: bit for bit), at most ``rtol``; never lowered."""
        if not self.lenient(config):
            return
        ordered = sorted(self_diffs)
        floor = ordered[(len(ordered) - 1) // 2] if ordered else 0.0
        candidate = 0.0 if floor == 0 else min(float(config.rtol), AUTO_MARGIN * floor)
        self.measured = candidate if self.measured is None else max(self.measured, candidate)
        stats.extra = {**(stats.extra or {}), "tolerance": self.measured}

    def noise_seen(self, step: int, levels: dict[int, float], config: AuditSettings, stats: CheckStats) -> None:
        """Noise ``levels`` per rank seen at the audit of ``step``. The tolerance rises to the largest level seen
        on at least two ranks at two or more audits: one rank's differences never widen it."""
        found = self.sightings + [(float(v), int(step), int(r)) for r, v in sorted(levels.items()) if v > 0]
        self.sightings = sorted(found, reverse=True)[:NOISE_SIGHTINGS_KEPT]
        ranks: set[int] = set()
        steps: set[int] = set()
        for level, at, rank in self.sightings:  # largest first: the first level with enough evidence
            ranks.add(rank)
            steps.add(at)
            if len(ranks) >= 2 and len(steps) >= 2:
                self.calibrate([level], config, stats)
                return

    def pairs_agreed(self, bit_for_bit: bool, stats: CheckStats) -> None:
        """Every replay pair of an audit agreed (``bit_for_bit``: exactly, evidence never taken as proof)."""
        self.agreed = True
        if bit_for_bit:
            self.exact_audits += 1
            stats.extra = {**(stats.extra or {}), "exact_audits": float(self.exact_audits)}

    def settle_probe(self, config: AuditSettings, stats: CheckStats) -> None:
        """At the end of an audit: the probe's result sets the next mode; a proof of strictness recalibrates."""
        if self.probed is None:
            return
        self.proven_strict, self.probed = self.probed, None
        if self.proven_strict:  # deterministic attention backward and the like from now on: calibrate anew
            self.rounds, self.measured, self.exact_audits = 0, None, 0
        stats.extra = {**(stats.extra or {}), "strict_determinism": float(self.strict(config))}
