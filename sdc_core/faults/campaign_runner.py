"""What a fault-injection campaign asks of a framework (its runner), and how ``sdc campaign``
finds one: the entry point group ``sdc_checks.campaign_runners`` (``sdc-checks[lightning]``
declares ``lightning``). Imports no torch, so ``sdc campaign --help`` answers at once; the
planning, running and reports are ``campaign``, ``campaign_run`` and ``campaign_report``."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

RUNNER_GROUP = "sdc_checks.campaign_runners"
CAMPAIGN_DIR_ENV = "SDC_CAMPAIGN_DIR"  # the campaign folder, set for every launch: a run's incidents land there
# The fault sites a campaign injects at (here, not in ``campaign``, so ``sdc campaign --sites`` is
# checked without torch).
SITES = ("activation", "gradient", "matmul_output", "weights", "optimizer", "checkpoint")
# The optimizers a campaign trains with (``campaign.make_optimizer``; ``sdc campaign --optimizer``):
# Adam, the default, or plain SGD with momentum, where one wrong gradient moves a weight in proportion.
OPTIMIZERS = ("adam", "sgd")


class Fit(Protocol):
    """One training of the campaign's model, run on every rank of a worker's launch.

    ``steps`` optimizer steps on ``campaign.training_data(data)`` (``data``: a clean spec, or
    None for the reference data) from the same seed, resumed from ``ckpt_path`` when given.
    Checks: ``checks`` all three with the replay every step; ``check_set`` ``"defaults"`` or
    ``"defaults+matmul"`` the callbacks at their default arguments (without or with the
    matrix-product check); neither: none. ``save``: a checkpoint written there at the end (with
    the fingerprint stored: without checks, the fingerprint's alone). ``fault``: a ``Fault`` to
    inject, or None. ``optimizer``: one of ``OPTIMIZERS``, built by ``campaign.make_optimizer``.

    Returns the run record: ``error`` (the ``SDCError.to_dict()`` of a verdict, else None),
    ``crash`` (a training that failed for another reason, one line, else None), ``weights`` (the
    final parameters, flat), ``loss`` (the final loss on the first 512 samples of
    ``campaign.base_data()``) and ``counters``, what the checks counted, the same on every rank
    (floats; those of the checks the run had): the gradient screen's ``screen_hits`` and
    ``screen_band`` / ``screen_nonfinite`` / ``screen_malformed`` (why it flagged), the replay's
    ``replay_audits`` and ``screen_escalations`` / ``screen_cleared`` / ``screen_unconfirmed`` /
    ``screen_confirmed`` (what became of the screen's hits). Its run folder (incidents) is the
    campaign folder, ``os.environ[CAMPAIGN_DIR_ENV]`` (``"."`` without it)."""

    def __call__(self, steps: int, checks: bool, fault: Any = None, ckpt_path: str | None = None,
                 save: str | None = None, check_set: str | None = None,
                 data: dict[str, Any] | None = None, optimizer: str = "adam") -> dict[str, Any]: ...  # fmt: skip


@dataclass(frozen=True)
class CampaignRunner:
    """A framework's runner of campaigns.

    ``worker_module``: run as ``python -m worker_module --worker SPECS --out DIR --steps N`` on
    ``campaign.WORLD`` ranks under ``torch.distributed.run``, it runs the specs of SPECS
    (``campaign_run.main(runner)`` does it). ``fit``: the training (``Fit``). ``target_prefix``:
    where the campaign's model sits in what ``fit`` trains (fault targets are ``prefix + name``)."""

    name: str
    worker_module: str
    fit: Fit
    target_prefix: str = ""


def counters(replay_stats: Any = None, screen_stats: Any = None) -> dict[str, float]:
    """The ``counters`` of a run record (``Fit``) from the ``CheckStats`` of its ring replay and its
    gradient screen (None: the run had no such check)."""
    out: dict[str, float] = {}
    if replay_stats is not None:
        out["replay_audits"] = float(replay_stats.runs)
        for name in ("screen_escalations", "screen_cleared", "screen_unconfirmed", "screen_confirmed"):
            out[name] = float((replay_stats.extra or {}).get(name, 0.0))
    if screen_stats is not None:
        extra = screen_stats.extra or {}
        out["screen_hits"] = float(extra.get("hits", 0.0))
        for reason in ("band", "nonfinite", "malformed"):  # why the screen flagged (a rank, once per step)
            out[f"screen_{reason}"] = float(extra.get(f"{reason}_suspects", 0.0))
    return out


def find_runner() -> CampaignRunner:
    """The installed runner (the first by name of the entry point group ``RUNNER_GROUP``).

    Raises ``ImportError`` (one line naming the extra to install) when none is installed, or
    the adapter's own one line when its framework is missing."""
    found = sorted(entry_points(group=RUNNER_GROUP), key=lambda ep: ep.name)
    if not found:
        raise ImportError("sdc campaign needs a framework to train with, and none is installed: "
                          "pip install 'sdc-checks[lightning]'")
    return found[0].load()
