"""An SDC verdict in a tracker as what it is, beside the ``sdc/<check>/failures`` counter's jump:
TensorBoard text, an MLflow tag and the incident file as an artifact, a W&B alert and summary entry;
and the run's closing line the same way (``log_summary``).

The adapters map their framework's tracker objects to ``log_incident``'s targets (Lightning's
loggers, Accelerate's trackers). Runs on the main process only (where trackers live), never raises
and runs no collective: a tracker that fails only warns, so the verdict still reaches every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sdc_core.errors import SDCError

TAG = "sdc.incident"  # the MLflow tag; TensorBoard's text tag and the W&B summary key are "sdc/incident"
_MLFLOW_TAG_LIMIT = 5000  # characters MLflow keeps in a tag value


def incident_text(error: SDCError, path: str | Path | None) -> str:
    """The verdict's one line, then where its incident file is."""
    return f"{error} (incident: {path})" if path else str(error)


def _send(targets: Iterable[tuple[str, Any]], what: str, send: Callable[[str, Any], None]) -> None:
    """``send(kind, target)`` for each target; a tracker that fails only warns (never the run)."""
    for kind, target in targets:
        try:
            send(kind, target)
        except Exception as err:
            warnings.warn(f"SDC {what} not logged to {kind}: {type(err).__name__}: {err}", RuntimeWarning,
                          stacklevel=3)  # fmt: skip


def _mlflow_tag(target: tuple[Any, Any], key: str, text: str) -> None:
    client, run_id = target
    client.set_tag(*((run_id,) if run_id is not None else ()), key, text[:_MLFLOW_TAG_LIMIT])


def log_incident(targets: Iterable[tuple[str, Any]], error: SDCError, path: str | Path | None, step: int) -> None:
    """Send the verdict to each ``(kind, target)``: ``("tensorboard", SummaryWriter)``,
    ``("mlflow", (client, run_id))`` with an ``MlflowClient`` (or ``(mlflow, None)``: the module and
    its active run), ``("wandb", run)``. Unknown kinds are passed over."""
    text = incident_text(error, path)

    def send(kind: str, target: Any) -> None:
        if kind == "tensorboard":
            target.add_text("sdc/incident", text, step)
            target.flush()
        elif kind == "mlflow":
            _mlflow_tag(target, TAG, text)
            if path:
                client, run_id = target
                where = (run_id,) if run_id is not None else ()
                client.log_artifact(*where, str(path), artifact_path="sdc_incidents")
        elif kind == "wandb":
            target.summary["sdc/incident"] = text
            target.alert(title=f"SDC verdict: {error.check} at step {error.step}", text=text)

    _send(targets, "incident", send)


def log_summary(targets: Iterable[tuple[str, Any]], line: str, step: int) -> None:
    """The run's closing line (``ops.summary``) to each target of ``log_incident``: TensorBoard text
    ``sdc/summary``, the MLflow tag ``sdc.summary``, the W&B summary entry ``sdc/summary``."""

    def send(kind: str, target: Any) -> None:
        if kind == "tensorboard":
            target.add_text("sdc/summary", line, step)
            target.flush()
        elif kind == "mlflow":
            _mlflow_tag(target, "sdc.summary", line)
        elif kind == "wandb":
            target.summary["sdc/summary"] = line

    _send(targets, "summary", send)


__all__ = ["TAG", "incident_text", "log_incident", "log_summary"]
