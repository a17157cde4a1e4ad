"""The loop every multi-process scenario script ends with: run the named scenarios in order, each
rank writing its result as JSON for the test to read back."""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse(default_only: str | None = None, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> Any:
    """``--out`` (created) and ``--only`` (comma-separated; required without a default), plus the
    script's own options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", required=default_only is None, default=default_only)
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def run_each(names: str, run: Callable[[str], Any], out: Path, rank: int,
             after_each: Callable[[], None] | None = None) -> None:  # fmt: skip
    """Run the comma-separated scenarios; ``<out>/<name>.rank<rank>.json`` gets each result (an
    unexpected exception is a result too: ``{"crash": traceback}``). Stops at the first crash:
    the next scenario's collectives would wait for a rank that left."""
    for name in names.split(","):
        try:
            result = run(name)
        except Exception:
            result = {"crash": traceback.format_exc()}
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result, default=repr))
        if after_each is not None:
            after_each()
        if "crash" in result:
            raise SystemExit(f"scenario {name} crashed on rank {rank}:\n{result['crash']}")


def main_for(scenarios: dict[str, Callable[[Path], Any]]) -> None:
    """``main`` of a torchrun script whose scenarios take the output folder."""
    args = parse(",".join(scenarios))
    run_each(args.only, lambda name: scenarios[name](args.out), args.out, int(os.environ["RANK"]))


def fresh(acc: Any, seed: int) -> None:
    """Seed every RNG, and forget what earlier scenarios prepared in this shared ``Accelerator``
    (one model, optimizer and hook set per scenario; Accelerate keeps them in private registries)."""
    from accelerate.utils import set_seed

    set_seed(seed)
    for registry in (acc._custom_objects, acc._models, acc._optimizers, acc._dataloaders, acc._schedulers):
        registry.clear()


def cpu_ddp_trainer(*, timeout_s: float = 90, ddp: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """The ``lightning.pytorch.Trainer`` the scenarios fit: CPU, this node's ranks as devices
    (``LOCAL_WORLD_SIZE``), ``DDPStrategy(timeout=timeout_s seconds, **ddp)``, no logger, progress
    bar, model summary or checkpointing; ``overrides`` are any other Trainer arguments or replace these
    (a ``strategy`` given replaces the ``DDPStrategy``)."""
    from datetime import timedelta

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    if "strategy" not in overrides:
        overrides["strategy"] = DDPStrategy(timeout=timedelta(seconds=timeout_s), **(ddp or {}))
    if "devices" not in overrides:
        overrides["devices"] = int(os.environ["LOCAL_WORLD_SIZE"])
    common = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
              "enable_checkpointing": False}  # fmt: skip
    return L.Trainer(**(common | overrides))
