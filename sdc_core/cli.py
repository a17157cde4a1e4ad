"""sdc: checkpoint verification and alteration, incident reports, and fault-injection campaigns (sdc campaign trains
with the runner a framework adapter installs: sdc_core.faults.campaign_runner).

sdc verify-checkpoint CKPT [--json] [--trust-pickle]
sdc corrupt-checkpoint CKPT (-o OUT | --in-place) [--target weights|optimizer|all] [--pattern REGEX]
    [--count N | --fraction F] [--bit-class sign|exponent_top|exponent|mantissa | --bits 3,30]
    [--seed S] [--trust-pickle]
sdc report DIR_OR_FILE... [--json] [--strict]
sdc exclude-list DIR_OR_FILE... [--format slurm|lines|reason] [--strict]
sdc node-name   the node this process runs on, as the checks record it (SLURMD_NODENAME, NODE_NAME or host)
sdc campaign [--injections N] [--clean N] [--hard N] [--out DIR] [--workers W] [--seed S] [--study N] [--doc FILE]
             [--steps N] [--sites S,...] [--optimizer adam|sgd] [--sizes N]
sdc run -- COMMAND [ARG ...]   run a launch command; exit 86 when the job ended on an SDC verdict,
    0 on success, the command's own code otherwise (see sdc_core.ops.launch)

Exit codes (every command):
  0  done; verify-checkpoint: clean
  1  verify-checkpoint: tensors changed since the file was written (or its fingerprint is damaged);
     campaign: a training failed
  2  usage: a bad option or argument (the message names it)
  3  verify-checkpoint: no SDC fingerprint stored (nothing to compare with)
  4  a file or folder cannot be read (missing, not a checkpoint, damaged, or it would need
     unpickling: see --trust-pickle), or an output cannot be written
  70 internal error (a bug: please report it; SDC_DEBUG=1 shows the traceback)

Files are read with torch.load(weights_only=True): a checkpoint cannot run code while it is read.
--trust-pickle unpickles in full, for a legacy file you wrote yourself. Outputs are written
atomically and never over an input unless --in-place says so."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdc_core.io.safe_files import OutputError, UnreadableError

EXIT_OK = 0
EXIT_CHANGED = 1
EXIT_USAGE = 2
EXIT_NO_FINGERPRINT = 3
EXIT_UNREADABLE = 4
EXIT_INTERNAL = 70
DEBUG_ENV = "SDC_DEBUG"


@dataclass(frozen=True)
class Command:
    """One ``sdc`` subcommand: ``add_arguments(parser)`` and ``run(args) -> exit code``, or
    ``delegate``, ``"module:function"`` taking the remaining argv and returning an exit code,
    imported only when the command runs (so ``sdc --help`` never imports a framework)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    run: Callable[[argparse.Namespace], int] | None = None
    delegate: str | None = None


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add (or replace) a subcommand of ``sdc``."""
    COMMANDS[command.name] = command
    return command


class _Parser(argparse.ArgumentParser):
    """No abbreviated options; a usage error is one line naming the command and what to do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(err: BaseException | str) -> str:
    return " ".join(str(err).split())


def run_guarded(prog: str, body: Callable[[], int]) -> int:
    """Run ``body`` and turn every failure into one line on stderr and its exit code (never a
    traceback, unless ``SDC_DEBUG=1``); warnings become one line each too."""

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"{prog}: warning: {one_line(message)}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        try:
            return body()
        except (UnreadableError, OutputError) as err:
            code, text = EXIT_UNREADABLE, str(err)
        except ValueError as err:
            code, text = EXIT_USAGE, str(err)
        except OSError as err:
            code, text = EXIT_UNREADABLE, f"{err.filename or ''}: {err.strerror or err}".lstrip(": ")
        except KeyboardInterrupt:
            code, text = 130, "interrupted"
        except Exception as err:
            if os.environ.get(DEBUG_ENV):
                raise
            code = EXIT_INTERNAL
            text = f"internal error {type(err).__name__}: {err} (a bug: please report it; {DEBUG_ENV}=1 shows where)"
    print(f"{prog}: error: {one_line(text)}", file=sys.stderr)
    return code


def _checked(cast: Callable[[str], Any], expected: str, ok: Callable[[Any], bool], refused: str) -> Any:
    """An argparse type: ``cast(text)``, with a one-line message unless it parses and is ``ok``
    (``refused`` is formatted with ``text`` and ``value``)."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(refused.format(text=text, value=value))
        return value

    return parse


_bits = _checked(lambda text: tuple(int(b) for b in text.split(",")), "bit positions separated by commas",
                 lambda bits: all(0 <= b < 64 for b in bits), "bit positions must be in 0..63, got {text!r}")
_fraction = _checked(float, "a number", lambda value: 0 < value <= 1, "must be in (0, 1], got {text}")


def _at_least(low: int) -> Any:
    return _checked(int, "an integer", lambda value: value >= low, f"must be >= {low}, got {{value}}")


TRUST_HELP = ("unpickle in full: lets the file run code while it is read. Only for a legacy file you wrote "
              "yourself; files of this project load without it")  # fmt: skip


BIT_CLASSES = ("sign", "exponent_top", "exponent", "mantissa")  # as in checkpoint_faults (tested equal; no torch)


def _corrupt_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("ckpt", type=Path, help="Lightning .ckpt, torch.save state dict, or Accelerate save_state folder")
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--output", type=Path, help="where to write the altered copy (never the input)")
    where.add_argument("--in-place", action="store_true", help="overwrite the input (never the default)")
    c.add_argument("--target", choices=["weights", "optimizer", "all"], default="weights")
    c.add_argument("--pattern", help="regular expression on tensor names (e.g. 'layer\\.3\\.')")
    amount = c.add_mutually_exclusive_group()
    amount.add_argument("--count", type=_at_least(1), help="number of flipped entries (default 1)")
    amount.add_argument("--fraction", type=_fraction, help="fraction of the target's entries to flip")
    bits = c.add_mutually_exclusive_group()
    bits.add_argument("--bit-class", choices=BIT_CLASSES, help="which bits to flip (default exponent_top)")
    bits.add_argument("--bits", type=_bits, help="explicit bit positions, comma separated")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)


def _corrupt(args: argparse.Namespace) -> int:
    from sdc_core.faults.checkpoint import Corruption, corrupt_file
    spec = Corruption(
        target=args.target,
        pattern=args.pattern,
        count=None if args.fraction is not None else (args.count or 1),
        fraction=args.fraction,
        bit_class=None if args.bits else (args.bit_class or "exponent_top"),
        bits=args.bits,
        seed=args.seed,
    )
    log = corrupt_file(args.ckpt, args.output, spec, in_place=args.in_place, trust_pickle=args.trust_pickle)
    for flip in log["flips"]:
        print(f"{flip['tensor']}[{flip['index']}] bit {flip['bit']}: {flip['old']!r} -> {flip['new']!r}")
    print(f"{len(log['flips'])} bits flipped; wrote {log['output']} and {log['output']}.flips.json")
    return EXIT_OK


def _verify_arguments(v: argparse.ArgumentParser) -> None:
    v.add_argument("ckpt", type=Path, help="Lightning .ckpt, torch.save file (the fingerprint at the top level or "
                   "under the hook set's state, e.g. 'sdc'), Accelerate save_state or Trainer checkpoint folder")
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.add_argument("--trust-pickle", action="store_true", help=TRUST_HELP)


def _verify(args: argparse.Namespace) -> int:
    from sdc_core.io.checkpoints import verify
    try:
        result = verify(args.ckpt, trust_pickle=args.trust_pickle)
    except UnreadableError as err:
        if args.json:
            print(json.dumps({"status": "unreadable", "changed": [], "path": str(args.ckpt), "reason": str(err)}))
        raise
    if args.json:
        print(json.dumps(result, indent=1))
    elif result["status"] == "clean":
        where = f" {result['where']}" if result.get("where") not in (None, "at the top level") else ""
        print(f"{args.ckpt}: clean ({result['tensors']} tensors match the fingerprint stored{where} when it was "
              "written)")  # fmt: skip
    elif result["status"] == "corrupted":
        print(f"{args.ckpt}: CORRUPTED: {result['reason']}" + (":" if result["changed"] else ""))
        for name in result["changed"][:50]:
            print(f"  {name}")
    else:
        tail = "; nothing to compare with" if result["reason"].startswith("no SDC fingerprint") else ""
        print(f"{args.ckpt}: {result['reason']}{tail}")
    return {"clean": EXIT_OK, "corrupted": EXIT_CHANGED}.get(result["status"], EXIT_NO_FINGERPRINT)


def _incident_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR_OR_FILE",
                   help="run folders (incidents under */sdc/incidents/) or incident files")  # fmt: skip
    p.add_argument("--strict", action="store_true", help="exit 4 when a file had to be skipped")


def _load(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    from sdc_core.ops.incidents import read_incident_dicts
    skipped: list[str] = []
    incidents = read_incident_dicts(args.dirs, skipped=skipped)
    for line in skipped:
        print(f"sdc {args.command}: warning: skipped {one_line(line)}", file=sys.stderr)
    return incidents, skipped


def _report_arguments(r: argparse.ArgumentParser) -> None:
    _incident_arguments(r)
    r.add_argument("--json", action="store_true")


def _report(args: argparse.Namespace) -> int:
    from sdc_core.ops.incidents import summarise
    incidents, skipped = _load(args)
    rows = summarise(incidents)
    if args.json:
        print(json.dumps(rows, indent=1))
    elif not rows:
        print("no SDC incidents found")
    else:
        print(f"{'host':24} {'device':36} {'incidents':>9} {'named':>5}  {'checks':40} first seen -> last seen")
        for r in rows:
            print(f"{r['host']:24} {r['device']:36} {r['incidents']:>9} {r['named']:>5}  {','.join(r['checks']):40} "
                  f"{r['first_seen']} -> {r['last_seen']}")  # fmt: skip
    return EXIT_UNREADABLE if skipped and args.strict else EXIT_OK


def _node_name(args: argparse.Namespace) -> int:
    from sdc_core.dist.topology import node_name
    print(node_name())
    return EXIT_OK


def _exclude_arguments(e: argparse.ArgumentParser) -> None:
    _incident_arguments(e)
    e.add_argument("--format", choices=["slurm", "lines", "reason"], default="slurm",
                   help="slurm: comma separated, for --exclude; lines: one hostname a line; reason: one "
                        "line naming the check, step and node of each, for a drain reason")  # fmt: skip


def _exclude(args: argparse.Namespace) -> int:
    from sdc_core.ops.incidents import exclude_hosts, exclude_reason
    incidents, skipped = _load(args)
    hosts = exclude_hosts(incidents)
    if hosts and args.format == "reason":
        print(exclude_reason(incidents))
    elif hosts:
        print(",".join(hosts) if args.format == "slurm" else "\n".join(hosts))
    return EXIT_UNREADABLE if skipped and args.strict else EXIT_OK


def _sites(text: str) -> tuple[str, ...]:
    from sdc_core.faults.campaign_runner import SITES
    sites = tuple(s.strip() for s in text.split(",") if s.strip())
    if not sites or any(s not in SITES for s in sites):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SITES)}, got {text!r}")
    return sites


def campaign_parser() -> argparse.ArgumentParser:
    from sdc_core.faults.campaign_runner import OPTIMIZERS
    k = _Parser("sdc campaign", description="fault-injection campaign over short multi-process Lightning trainings")
    k.add_argument("--injections", type=_at_least(0), default=None, help="bit-flip injections (default 200)")
    k.add_argument("--clean", type=_at_least(0), default=None,
                   help="clean runs, each with another data order (default 20)")  # fmt: skip
    k.add_argument("--hard", type=_at_least(0), default=0,
                   help="also N clean runs of heterogeneous batches and N with a genuine loss spike")  # fmt: skip
    k.add_argument("--out", type=Path, default=Path("sdc-campaign"), help="campaign folder (created)")
    k.add_argument("--workers", type=_at_least(1), default=1, help="trainings at once (each uses 3 processes)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--steps", type=_at_least(8), default=None, help="optimizer steps per training (default 12; "
                   "40 with --sizes)")  # fmt: skip
    k.add_argument("--sites", type=_sites, default=None,
                   help="fault sites to inject, comma-separated (default: all of activation, gradient, "
                   "matmul_output, weights, optimizer, checkpoint)")  # fmt: skip
    k.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="train with Adam at 3e-3 (default) or SGD with momentum (lr 0.05, momentum 0.9; "
                   "no optimizer-state faults, no --study, no --doc)")  # fmt: skip
    k.add_argument("--study", type=_at_least(0), default=0,
                   help="also run N checkpoint-alteration study runs per group")  # fmt: skip
    k.add_argument("--doc", type=Path, help="also write a coverage page (markdown; its CSV and, with matplotlib, "
                   "its plot beside it)")  # fmt: skip
    k.add_argument("--sizes", type=_at_least(1), default=None, metavar="N",
                   help="instead of bit flips, errors of known size: N injections per compute site, relative error "
                   "e = 1e-4 .. 1e4 (one per decade) and step range (2-19, 20+), each multiplying one element by "
                   "1 + e, trained without checks and at the defaults (2 x 54 x N trainings; needs --steps >= 22; "
                   "rows in --out/results.csv)")  # fmt: skip
    return k


def campaign_main(argv: list[str]) -> int:
    """``sdc campaign``: find the installed runner first, so that without one even ``--help`` says
    what to install; then parse and run. Returns the exit code; errors are raised for ``main``."""
    from sdc_core.faults.campaign_runner import RUNNER_GROUP, SITES, find_runner
    try:
        runner = find_runner()
    except ImportError as err:
        raise _needs("campaign", RUNNER_GROUP, err) from None
    args = campaign_parser().parse_args(argv)  # its usage errors and --help exit as ``main`` expects
    from sdc_core.faults.campaign import COMPUTE_SITES
    from sdc_core.faults.campaign_run import CampaignFailed, run_campaign, run_sizes_campaign
    try:
        if args.sizes is not None:  # errors of known size: it plans its own injections and writes no page
            given = [f"--{name}" for name in ("injections", "clean", "hard", "study", "doc")
                     if getattr(args, name) not in (None, 0)]  # fmt: skip
            if given:
                raise ValueError(f"--sizes plans its own injections and has no clean runs, study or page: "
                                 f"drop {', '.join(given)}")  # fmt: skip
            run_sizes_campaign(args.out, args.sizes, workers=args.workers, seed=args.seed,
                               steps=40 if args.steps is None else args.steps, sites=args.sites or COMPUTE_SITES,
                               runner=runner, optimizer=args.optimizer)  # fmt: skip
            return EXIT_OK
        injections = 200 if args.injections is None else args.injections
        clean, steps = 20 if args.clean is None else args.clean, 12 if args.steps is None else args.steps
        run_campaign(args.out, injections=injections, clean=clean, workers=args.workers, seed=args.seed,
                     steps=steps, study=args.study, doc=args.doc, hard=args.hard, sites=args.sites or SITES,
                     runner=runner, optimizer=args.optimizer)  # fmt: skip
    except CampaignFailed as err:
        print(f"sdc campaign: error: {err}", file=sys.stderr)
        return EXIT_CHANGED
    return EXIT_OK


register(Command("verify-checkpoint", "compare a checkpoint with the fingerprint stored when it was written",
                 _verify_arguments, _verify))  # fmt: skip
register(Command("corrupt-checkpoint", "flip bits in a copy of a saved checkpoint (checkpoint alteration)",
                 _corrupt_arguments, _corrupt))  # fmt: skip
register(Command("report", "summarise SDC incidents across runs, per host and device", _report_arguments, _report))
register(Command("exclude-list", "hosts to take out, in a form schedulers take", _exclude_arguments, _exclude))
register(Command("node-name", "the node name the checks record for this process (SLURMD_NODENAME, NODE_NAME, host)",
                 run=_node_name))  # fmt: skip
register(Command("campaign", "fault-injection campaign over short Lightning DDP trainings (needs lightning)",
                 delegate="sdc_core.cli:campaign_main"))  # fmt: skip
register(Command("run", "sdc run -- COMMAND: exit 86 (SDC_EXIT_CODE) when the job ended on an SDC verdict",
                 delegate="sdc_core.ops.launch:main"))  # fmt: skip


def _needs(command: str, module: str, err: ImportError) -> ValueError:
    """The usage error of a command whose import failed: an adapter's one line naming the extra
    to install as it is, else what is missing."""
    if "pip install" in str(err):
        return ValueError(str(err))
    return ValueError(f"'sdc {command}' needs {err.name or module} (pip install it): {err}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sdc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, add_help=cmd.delegate is None)
        if cmd.add_arguments is not None:
            cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``sdc`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = COMMANDS.get(argv[0]) if argv else None
    if cmd is not None and cmd.delegate is not None:
        module, _, function = cmd.delegate.partition(":")

        def delegated() -> int:
            try:
                target = getattr(importlib.import_module(module), function)
            except ImportError as err:
                raise _needs(cmd.name, module, err) from None
            try:
                return int(target(argv[1:]) or 0)
            except SystemExit as exit_:  # a delegate that parses with plain argparse
                return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else EXIT_USAGE)

        return run_guarded(f"sdc {cmd.name}", delegated)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    command = COMMANDS[args.command]
    return run_guarded(f"sdc {args.command}", lambda: command.run(args))  # type: ignore[misc]


if __name__ == "__main__":
    sys.exit(main())
