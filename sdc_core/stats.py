"""Counters each check keeps, logged under ``sdc/<check>/...`` and saved in checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CheckStats:
    """Running counters of one check, identical on every rank except the time spent (which
    ``state_dict`` leaves out, so a checkpoint written by rank 0 restores every rank)."""

    check: str
    runs: int = 0
    failures: int = 0
    last_verified_step: int = -1
    max_diff: float = 0.0
    time_s: float = 0.0
    timed_calls: int = 0
    extra: dict[str, float] | None = None

    def add_time(self, seconds: float) -> None:
        self.time_s += seconds
        self.timed_calls += 1

    def bump(self, name: str, by: float = 1.0) -> None:
        """Increase a check-specific counter (e.g. skipped steps)."""
        if self.extra is None:
            self.extra = {}
        self.extra[name] = self.extra.get(name, 0.0) + by

    def metrics(self) -> dict[str, float]:
        """Flat ``sdc/<check>/<name>`` metrics for a logger."""
        prefix = f"sdc/{self.check}/"
        out = {
            prefix + "runs": float(self.runs),
            prefix + "failures": float(self.failures),
            prefix + "last_verified_step": float(self.last_verified_step),
            prefix + "time_ms_total": 1000.0 * self.time_s,
            prefix + "time_ms_mean": 1000.0 * self.time_s / max(self.timed_calls, 1),
        }
        if self.check == "ring_replay":
            out[prefix + "max_diff"] = self.max_diff
        return out | {prefix + k: float(v) for k, v in (self.extra or {}).items()}

    def state_dict(self) -> dict[str, Any]:
        counters = {name: getattr(self, name) for name in ("runs", "failures", "last_verified_step", "max_diff")}
        return {**counters, "extra": dict(self.extra or {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters; raises ``ValueError`` naming the key on a malformed state."""
        try:
            counts = [int(state[name]) for name in ("runs", "failures", "last_verified_step")]
            max_diff = float(state.get("max_diff", 0.0))
            extra = {str(k): float(v) for k, v in dict(state.get("extra", {})).items()}
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"corrupted SDC '{self.check}' checkpoint state: {err!r} in {state!r}") from err
        self.runs, self.failures, self.last_verified_step = counts
        self.max_diff, self.extra = max_diff, extra
