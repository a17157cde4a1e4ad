"""``sdc campaign``: the fault-injection campaign, which trains with Lightning.

The ``sdc`` console script is ``sdc_core.cli:main`` (the commands that know no framework live
there); it hands ``sdc campaign ...`` to ``campaign_main``.

sdc campaign [--injections N] [--clean N] [--hard N] [--out DIR] [--workers W] [--seed S] [--steps N]
    [--sites S,...] [--study N] [--doc FILE]
Exit codes: 0 done, 1 a training failed (see the chunk logs), 2 a bad option, 4 an output that
cannot be written (``--out`` an existing file, an unwritable ``--doc``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdc_core.cli import EXIT_CHANGED, EXIT_OK, parser_for


def _at_least(low: int) -> type:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse  # type: ignore[return-value]


SITES = ("activation", "gradient", "matmul_output", "weights", "optimizer", "checkpoint")  # campaign.SITES (no torch)


def _sites(text: str) -> tuple[str, ...]:
    sites = tuple(s.strip() for s in text.split(",") if s.strip())
    if not sites or any(s not in SITES for s in sites):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SITES)}, got {text!r}")
    return sites


def campaign_parser() -> argparse.ArgumentParser:
    k = parser_for("sdc campaign", "fault-injection campaign over short multi-process Lightning trainings")
    k.add_argument("--injections", type=_at_least(0), default=200)
    k.add_argument("--clean", type=_at_least(0), default=20, help="clean runs, each with another data order")
    k.add_argument("--hard", type=_at_least(0), default=0,
                   help="also N clean runs of heterogeneous batches and N with a genuine loss spike")  # fmt: skip
    k.add_argument("--out", type=Path, default=Path("sdc-campaign"), help="campaign folder (created)")
    k.add_argument("--workers", type=_at_least(1), default=1, help="trainings at once (each uses 3 processes)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--steps", type=_at_least(8), default=12)
    k.add_argument("--sites", type=_sites, default=None,
                   help="fault sites to inject, comma-separated (default: all of activation, gradient, "
                   "matmul_output, weights, optimizer, checkpoint)")  # fmt: skip
    k.add_argument("--study", type=_at_least(0), default=0,
                   help="also run N checkpoint-alteration study runs per group")  # fmt: skip
    k.add_argument("--doc", type=Path, help="also write a coverage page (markdown; its CSV and, with matplotlib, "
                   "its plot beside it)")  # fmt: skip
    return k


def campaign_main(argv: list[str]) -> int:
    """Parse ``sdc campaign`` arguments and run it; returns the exit code (errors are raised for
    ``sdc_core.cli.run_guarded`` to print)."""
    try:
        args = campaign_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    from lightning_sdc.campaign import CampaignFailed, run_campaign

    try:
        run_campaign(args.out, injections=args.injections, clean=args.clean, workers=args.workers, seed=args.seed,
                     steps=args.steps, study=args.study, doc=args.doc, hard=args.hard,
                     sites=args.sites or SITES)  # fmt: skip
    except CampaignFailed as err:
        print(f"sdc campaign: error: {err}", file=sys.stderr)
        return EXIT_CHANGED
    return EXIT_OK
