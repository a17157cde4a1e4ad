"""An SDC verdict, and the run's closing line, in the trackers: TensorBoard text, an MLflow tag (and the incident file
as an artifact), a W&B alert and summary entry. Main process only; never raises and runs no collective: a tracker that
fails only warns, so the verdict still reaches every rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sdc_core.errors import SDCError

TAG = "sdc.incident"  # the MLflow tag; TensorBoard's text tag and the W&B summary key are "sdc/incident"
_MLFLOW_TAG_LIMIT = 5000  # characters MLflow keeps in a tag value


def _send(targets: Iterable[tuple[str, Any]], what: str, text: str, step: int,
          more: Callable[[str, Any], None] | None = None) -> None:  # fmt: skip
    """``text`` under ``sdc/<what>`` (TensorBoard text, W&B summary; MLflow tag ``sdc.<what>``) in each
    target, then ``more(kind, target)``."""
    for kind, target in targets:
        try:
            if kind == "tensorboard":
                target.add_text(f"sdc/{what}", text, step)
                target.flush()
            elif kind == "mlflow":
                _mlflow(target, "set_tag", f"sdc.{what}", text[:_MLFLOW_TAG_LIMIT])
            elif kind == "wandb":
                target.summary[f"sdc/{what}"] = text
            if more is not None:
                more(kind, target)
        except Exception as err:
            warnings.warn(f"SDC {what} not logged to {kind}: {type(err).__name__}: {err}", RuntimeWarning,
                          stacklevel=3)  # fmt: skip


def _mlflow(target: tuple[Any, Any], method: str, *args: Any, **kwargs: Any) -> None:
    """``client.<method>(run_id, ...)``; ``(mlflow, None)``: the module's, on its active run."""
    client, run_id = target
    getattr(client, method)(*((run_id,) if run_id is not None else ()), *args, **kwargs)


def log_incident(targets: Iterable[tuple[str, Any]], error: SDCError, path: str | Path | None, step: int) -> None:
    """Send the verdict to each ``(kind, target)``: ``("tensorboard", SummaryWriter)``, ``("mlflow",
    (client, run_id))`` (or ``(mlflow, None)``: its active run), ``("wandb", run)``; others are passed over."""
    text = f"{error} (incident: {path})" if path else str(error)

    def more(kind: str, target: Any) -> None:
        if kind == "mlflow" and path:
            _mlflow(target, "log_artifact", str(path), artifact_path="sdc_incidents")
        elif kind == "wandb":
            target.alert(title=f"SDC verdict: {error.check} at step {error.step}", text=text)

    _send(targets, "incident", text, step, more)


def log_summary(targets: Iterable[tuple[str, Any]], line: str, step: int) -> None:
    """The run's closing line (``ops.summary``) to each target of ``log_incident``, under ``sdc/summary``."""
    _send(targets, "summary", line, step)


__all__ = ["TAG", "log_incident", "log_summary"]
