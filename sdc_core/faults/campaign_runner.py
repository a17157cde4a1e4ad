"""What a fault-injection campaign asks of a framework (its runner), and how ``sdc campaign``
finds one (the entry point group ``RUNNER_GROUP``). Imports no torch: ``--help`` answers at once."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

RUNNER_GROUP = "sdc_checks.campaign_runners"
CAMPAIGN_DIR_ENV = "SDC_CAMPAIGN_DIR"  # the campaign folder, set for every launch: a run's incidents land there
SITES = ("activation", "gradient", "matmul_output", "weights", "optimizer", "checkpoint")  # fault sites
OPTIMIZERS = ("adam", "sgd")  # what a campaign trains with (``campaign.make_optimizer``)


class Fit(Protocol):
    """One training of the campaign's model, on every rank of a launch.

    ``steps`` optimizer steps on ``campaign.training_data(data)`` from the same seed, resumed from
    ``ckpt_path`` when given, with ``fault`` injected. Checks: ``checks``: all three, the replay
    every step; ``check_set`` ``"defaults"`` or ``"defaults+matmul"``: the callbacks at their
    defaults (with the matrix-product check); neither: none. ``save``: a checkpoint written at the
    end, with its fingerprint. Incidents go to ``os.environ[CAMPAIGN_DIR_ENV]`` (``"."`` without).

    Returns ``error`` (a verdict's ``SDCError.to_dict()`` or None), ``crash`` (another failure, one
    line, or None), ``weights`` (final parameters, flat), ``loss`` (final, on the first 512 samples
    of ``campaign.base_data()``) and ``counters`` (``counters``; the same on every rank)."""

    def __call__(self, steps: int, checks: bool, fault: Any = None, ckpt_path: str | None = None,
                 save: str | None = None, check_set: str | None = None,
                 data: dict[str, Any] | None = None, optimizer: str = "adam") -> dict[str, Any]: ...  # fmt: skip


@dataclass(frozen=True)
class CampaignRunner:
    """A framework's runner of campaigns: ``worker_module`` runs ``campaign_run.main(runner)`` on
    ``campaign.WORLD`` ranks; ``fit`` trains (``Fit``); fault targets are ``target_prefix + name``."""

    name: str
    worker_module: str
    fit: Fit
    target_prefix: str = ""


def counters(replay_stats: Any = None, screen_stats: Any = None) -> dict[str, float]:
    """A run record's ``counters`` (floats) from the ``CheckStats`` of its ring replay and gradient
    screen (None: the run had no such check): why the screen flagged, what became of its hits."""
    out: dict[str, float] = {}
    if replay_stats is not None:
        out["replay_audits"] = float(replay_stats.runs)
        for name in ("screen_escalations", "screen_cleared", "screen_unconfirmed", "screen_confirmed"):
            out[name] = float((replay_stats.extra or {}).get(name, 0.0))
    if screen_stats is not None:
        extra = screen_stats.extra or {}
        out["screen_hits"] = float(extra.get("hits", 0.0))
        for reason in ("band", "nonfinite", "malformed"):  # a rank flagged, once per step
            out[f"screen_{reason}"] = float(extra.get(f"{reason}_suspects", 0.0))
    return out


def find_runner() -> CampaignRunner:
    """The installed runner (the first by name in ``RUNNER_GROUP``). Raises ``ImportError`` (one
    line naming what to install) when none is installed, or its framework is missing."""
    found = sorted(entry_points(group=RUNNER_GROUP), key=lambda ep: ep.name)
    if not found:
        raise ImportError("sdc campaign needs a framework to train with, and none is installed: "
                          "pip install 'sdc-checks[lightning]'")
    return found[0].load()
