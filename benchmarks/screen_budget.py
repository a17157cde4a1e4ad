"""The every-step screen's false-alarm budget, checked against a healthy run's own rows.

    python -m torch.distributed.run --standalone --nproc-per-node=3 tests/screen_scenarios.py \\
        --out /tmp/long --only long --steps 400 --seed 2
    python -m benchmarks.screen_budget --rows /tmp/long/long.rank0.json --out benchmarks/results/screen-budget.json

The screen's band is the larger of the bulk rule (median + z x 1.4826 x MAD of the healthy
positive deviations) and the quantile of an exponential tail fitted to them that keeps the
world's hits under one a day at one step a second (``screen_rule.tail_bands``). This script takes
every judged step's rows of a healthy run (the screen scenarios' ``long`` run writes them), fits
the tail on the first half of the steps after the warm-up, and checks the fit on the second half:
at thresholds inside the data, the exceedances the fit predicts per rank-step against those
counted. Then, per world size, the band each value gets and the hits a day the fit predicts with
it (where the fit asks for more than ``max_band``, the band stays there and the prediction says
what that costs)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from sdc_core.checks.screen_rule import (
    ScreenConfig,
    bulk_bands,
    deviations,
    predicted_hits_per_day,
    read_rows,
    reference,
    tail_bands,
    tail_fit,
)

WORLDS = (3, 1024, 16384, 100000)
THRESHOLDS = (2.0, 2.5, 3.0, 3.5)  # inside the fitted tails (above every u) and the data


def healthy_deviations(rows: dict[str, list[list[float]]], names: list[str], first: int) -> list[torch.Tensor]:
    """Per judged step from ``first`` on, the ranks' level-corrected deviations (ranks x values),
    the positive ones capped at ``max_band`` and NaN elsewhere, as the band's history keeps them."""
    width, cap = len(names) - 1, ScreenConfig().max_band
    out = []
    for step in sorted(rows, key=int):
        if int(step) < first:
            continue
        _, judged, _, _ = read_rows(rows[step], width)
        ref = reference(judged)
        d = torch.tensor([deviations(x, ref) for x in judged], dtype=torch.float64)
        out.append(torch.where(d > 0, d.clamp(max=cap), math.nan))
    return out


def budget(history: torch.Tensor, held_out: torch.Tensor) -> dict[str, Any]:
    """The fit on ``history`` checked on ``held_out``, and the bands and predictions per world."""
    cfg = ScreenConfig()
    u, scale, p_u = tail_fit(history)
    flat = held_out.reshape(-1, held_out.shape[-1])
    check = []
    for t in THRESHOLDS:
        predicted = float(torch.nansum(p_u * torch.exp(-(torch.fmax(torch.tensor(t), u) - u) / scale)))
        counted = float((flat > t).sum()) / flat.shape[0]  # NaN compares False
        check.append({"threshold": t, "predicted_per_rank_step": predicted, "counted_per_rank_step": counted})
    bulk = bulk_bands(history, cfg)
    worlds = {}
    for world in WORLDS:
        tail = tail_bands(history, world)
        band = torch.fmax(bulk, tail).clamp(cfg.min_band, cfg.max_band)
        worlds[str(world)] = {"tail_band": tail.tolist(), "band": band.tolist(),
                              "at_max_band": int((torch.fmax(bulk, tail) > cfg.max_band).sum()),
                              "predicted_hits_per_day": predicted_hits_per_day(history, band, world)}  # fmt: skip
    return {"bulk_band": bulk.tolist(), "tail": {"u": u.tolist(), "scale": scale.tolist(), "p_u": p_u.tolist()},
            "held_out_check": check, "worlds": worlds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, required=True, help="a screen scenario's result (its 'rows' and 'names')")
    parser.add_argument("--warmup", type=int, default=20, help="judged steps left out at the start (default 20)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run = json.loads(args.rows.read_text())
    steps = healthy_deviations(run["rows"], run["names"], args.warmup)
    if len(steps) < 40:
        parser.error(f"{args.rows} holds {len(steps)} judged steps after the warm-up; the check needs at least 40")
    half = len(steps) // 2
    report = {"rows": str(args.rows), "ranks": steps[0].shape[0], "steps": len(steps), "names": run["names"],
              "torch": torch.__version__, **budget(torch.stack(steps[:half]), torch.stack(steps[half:]))}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out)
    for c in report["held_out_check"]:
        print(f"deviation > 2^{c['threshold']}: predicted {c['predicted_per_rank_step']:.3g} a rank-step, "
              f"counted {c['counted_per_rank_step']:.3g}")
    for world, w in report["worlds"].items():
        print(f"W={world}: bands {min(w['band']):.1f}-{max(w['band']):.1f}, {w['at_max_band']} at max_band, "
              f"predicted {w['predicted_hits_per_day']:.3g} hits a day")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
