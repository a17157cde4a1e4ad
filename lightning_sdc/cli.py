"""``sdc``: checkpoint alteration, checkpoint verification and fault-injection campaigns.

sdc corrupt-checkpoint CKPT -o OUT [--target weights|optimizer|all] [--pattern REGEX]
    [--count N | --fraction F] [--bit-class sign|exponent_top|exponent|mantissa | --bits 3,30]
    [--seed S] [--in-place]
sdc verify-checkpoint CKPT          exit 0: clean, 1: changed tensors, 2: no fingerprint stored
sdc campaign [--injections N] [--clean N] [--out DIR] [--workers W] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sdc_core.checkpoint import BIT_CLASSES, Corruption, corrupt_file, verify


def _corrupt(args: argparse.Namespace) -> int:
    spec = Corruption(
        target=args.target,
        pattern=args.pattern,
        count=None if args.fraction is not None else args.count,
        fraction=args.fraction,
        bit_class=None if args.bits else args.bit_class,
        bits=tuple(int(b) for b in args.bits.split(",")) if args.bits else None,
        seed=args.seed,
    )
    log = corrupt_file(args.ckpt, args.output, spec, in_place=args.in_place)
    for flip in log["flips"]:
        print(f"{flip['tensor']}[{flip['index']}] bit {flip['bit']}: {flip['old']!r} -> {flip['new']!r}")
    print(f"{len(log['flips'])} bits flipped; wrote {log['output']} and {log['output']}.flips.json")
    return 0


def _verify(args: argparse.Namespace) -> int:
    result = verify(args.ckpt)
    if args.json:
        print(json.dumps(result, indent=1))
    elif result["status"] == "clean":
        print(f"{args.ckpt}: clean ({result['tensors']} tensors match the fingerprint stored when it was written)")
    elif result["status"] == "corrupted":
        print(f"{args.ckpt}: CORRUPTED: {len(result['changed'])} tensors changed since it was written:")
        for name in result["changed"][:50]:
            print(f"  {name}")
    else:
        print(f"{args.ckpt}: no SDC fingerprint stored (written without WeightFingerprintCheck)")
    return {"clean": 0, "corrupted": 1}.get(result["status"], 2)


def _campaign(args: argparse.Namespace) -> int:
    from lightning_sdc.campaign import run_campaign

    run_campaign(args.out, injections=args.injections, clean=args.clean, workers=args.workers, seed=args.seed,
                 steps=args.steps, study=args.study, doc=args.doc)  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    from sdc_core.incidents import load_incidents, summarise

    rows = summarise(load_incidents(args.dirs))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no SDC incidents found")
        return 0
    print(f"{'host':24} {'device':36} {'incidents':>9} {'named':>5}  {'checks':40} first seen -> last seen")
    for r in rows:
        print(f"{r['host']:24} {r['device']:36} {r['incidents']:>9} {r['named']:>5}  {','.join(r['checks']):40} "
              f"{r['first_seen']} -> {r['last_seen']}")  # fmt: skip
    return 0


def _exclude(args: argparse.Namespace) -> int:
    from sdc_core.incidents import exclude_hosts, load_incidents

    hosts = exclude_hosts(load_incidents(args.dirs))
    if hosts:
        print(",".join(hosts) if args.format == "slurm" else "\n".join(hosts))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sdc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corrupt-checkpoint", help="flip bits in a saved checkpoint (checkpoint alteration)")
    c.add_argument("ckpt", type=Path, help="Lightning .ckpt, torch.save state dict, or Accelerate save_state folder")
    c.add_argument("-o", "--output", type=Path, help="where to write the altered copy")
    c.add_argument("--in-place", action="store_true", help="overwrite the input (never the default)")
    c.add_argument("--target", choices=["weights", "optimizer", "all"], default="weights")
    c.add_argument("--pattern", help="regular expression on tensor names (e.g. 'layer\\.3\\.')")
    c.add_argument("--count", type=int, default=1, help="number of flipped entries (default 1)")
    c.add_argument("--fraction", type=float, help="fraction of the target's entries to flip (instead of --count)")
    c.add_argument("--bit-class", choices=BIT_CLASSES, default="exponent_top")
    c.add_argument("--bits", help="explicit bit positions, comma separated (instead of --bit-class)")
    c.add_argument("--seed", type=int, default=0)
    v = sub.add_parser("verify-checkpoint", help="compare a checkpoint with the fingerprint stored when written")
    v.add_argument("ckpt", type=Path)
    v.add_argument("--json", action="store_true")
    k = sub.add_parser("campaign", help="fault-injection campaign over short multi-process trainings")
    k.add_argument("--injections", type=int, default=200)
    k.add_argument("--clean", type=int, default=20)
    k.add_argument("--out", type=Path, default=Path("sdc-campaign"))
    k.add_argument("--workers", type=int, default=1, help="trainings at once (each uses 3 processes)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--steps", type=int, default=12)
    k.add_argument("--study", type=int, default=0, help="also run N checkpoint-alteration study runs per group")
    k.add_argument("--doc", type=Path, help="also write a coverage page (markdown, with its plot and CSV beside it)")
    r = sub.add_parser("report", help="summarise SDC incidents across runs")
    r.add_argument("dirs", nargs="+", type=Path)
    r.add_argument("--json", action="store_true")
    e = sub.add_parser("exclude-list", help="hosts to take out, in a form schedulers take")
    e.add_argument("dirs", nargs="+", type=Path)
    e.add_argument("--format", choices=["slurm", "lines"], default="slurm",
                   help="slurm: comma separated, for --exclude; lines: one hostname a line")  # fmt: skip
    args = parser.parse_args(argv)
    commands = {"corrupt-checkpoint": _corrupt, "verify-checkpoint": _verify, "campaign": _campaign,
                "report": _report, "exclude-list": _exclude}  # fmt: skip
    try:
        return commands[args.command](args)
    except ValueError as err:
        print(f"sdc {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
