"""``accelerate-sdc``: the SDC settings in the accelerate configuration workflow.

accelerate-sdc config [--default] [--config_file F] [--<setting> VALUE ...]
    Like ``accelerate config``: asks for each setting (or takes flags; ``--default`` takes the
    defaults without asking) and writes them beside accelerate's own config
    (``<accelerate config dir>/sdc_config.yaml``), where ``SDCHooks`` finds them at run time.
    It only replaces a file of SDC settings: an accelerate config (or any other file) named by
    ``--config_file`` is left unchanged (exit 2). Exit 4: the file cannot be written.

accelerate-sdc launch [--config_file F] [accelerate launch arguments] script.py [args]
    ``accelerate launch`` for an accelerate config YAML with an ``sdc:`` section: hands
    accelerate a copy without that section and passes the settings to every process as
    ``ACCELERATE_SDC_*`` variables (variables you set yourself still win). Exits 86
    (``SDC_EXIT_CODE``) when the job ended on an SDC verdict, like ``sdc run``; accelerate's own code otherwise."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import yaml

from sdc_core.driver.settings_help import SETTINGS  # --help: the settings' own docs, without importing torch
from sdc_core.io.safe_files import OutputError
from sdc_core.ops.launch import run_command

# `accelerate_sdc.config` (the schema, and torch through the checks' configs) is imported by the
# commands that run, not by --help.


def _config(args: argparse.Namespace) -> int:
    from accelerate_sdc import config
    from sdc_core.driver.settings import coerce, field_doc  # prompts: the settings' own docs
    path = Path(args.config_file) if args.config_file else config.default_file()
    _check_owned(path)
    given = {f.name: getattr(args, f.name) for f in fields(config.SDCSettings) if getattr(args, f.name) is not None}
    values: dict[str, object] = {}
    interactive = not args.default and not given and sys.stdin.isatty()
    for f in fields(config.SDCSettings):
        if f.name in given:
            values[f.name] = coerce(f.name, given[f.name], f"option --{f.name}")
        elif interactive:
            try:
                answer = input(f"{field_doc(f.name)} [{f.default}]: ").strip()
            except EOFError:
                raise config.SDCConfigError("no answer (end of input); pass --default or --<setting> options") from None
            values[f.name] = coerce(f.name, answer, "your answer") if answer else f.default
        else:
            values[f.name] = f.default
    settings = _validated(values, f"accelerate-sdc config ({path})")
    from sdc_core.io.safe_files import atomic_write_text
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create folder {path.parent}: {err.strerror or err}") from None
    atomic_write_text(path, yaml.safe_dump(settings, sort_keys=False))
    print(f"SDC settings written to {path}")
    return 0


def _check_owned(path: Path) -> None:
    """Raise unless ``path`` is missing, empty, or a file of SDC settings only (what this
    command writes): it never replaces a file it does not own, such as an accelerate config."""
    from accelerate.commands.config.config_args import default_json_config_file, default_yaml_config_file

    from accelerate_sdc import config
    if path.is_dir():
        raise config.SDCConfigError(f"--config_file {path} is a folder; give a file name")
    accelerate_files = (default_yaml_config_file, default_json_config_file)  # what `accelerate config` writes
    if path.expanduser().resolve() in {Path(f).expanduser().resolve() for f in accelerate_files}:
        raise config.SDCConfigError(
            f"{path} is accelerate's own config file, which `accelerate launch` reads and which must not hold SDC "
            f"settings; left unchanged. Leave out --config_file (the settings go to {config.default_file()})")
    if not path.exists():
        return
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = ...
    known = {f.name for f in fields(config.SDCSettings)}
    if data is None or (isinstance(data, dict) and {str(k) for k in data} <= known):
        return
    what = (f"it holds {', '.join(sorted(map(str, data))[:4])}: an accelerate config?" if isinstance(data, dict)
            else "it is not a YAML mapping of SDC settings")  # fmt: skip
    raise config.SDCConfigError(
        f"{path} is not an SDC settings file ({what}); left unchanged. Write the SDC settings to another "
        "--config_file, or add them by hand to an `sdc:` section of an accelerate config (for accelerate-sdc launch)")


def _validated(values: dict[str, object], source: str) -> dict[str, object]:
    """Run the same checks ``SDCHooks`` runs, on ``values`` alone (no variable or file), reporting ``source``."""
    from sdc_core.driver.settings import SDCConfigError, resolve
    try:
        settings, _ = resolve(**values)  # the plain route's sources: keywords only
    except SDCConfigError as err:
        raise SDCConfigError(str(err).replace("keyword arguments", source)) from None
    return settings.to_dict()


def _launch(rest: list[str]) -> int:
    from accelerate_sdc import config
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config_file", "--config-file", dest="config_file")
    known, passthrough = parser.parse_known_args(rest)
    if not known.config_file:
        from accelerate.commands.config.config_args import default_config_file
        known.config_file = default_config_file if os.path.isfile(default_config_file) else None
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    env = dict(os.environ)
    tmp_path = None
    if known.config_file:
        path = Path(known.config_file)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise config.SDCConfigError(f"cannot read accelerate config file {path}: {err}") from None
        if isinstance(data, dict) and "sdc" in data:
            sdc = config.read_file(path)  # names the key and the file on a bad value
            _validated(sdc, f"config file {path}, section sdc")
            for key, value in sdc.items():
                env.setdefault(config.ENV_PREFIX + key.upper(), str(value))
            data = {k: v for k, v in data.items() if k != "sdc"}
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, prefix="accelerate-") as tmp:
                yaml.safe_dump(data, tmp)
            tmp_path = tmp.name
            cmd += ["--config_file", tmp_path]
        else:
            cmd += ["--config_file", str(path)]
    try:
        return run_command(cmd + passthrough, env=env)  # exit 86 (SDC_EXIT_CODE) on an SDC verdict
    finally:
        if tmp_path:
            os.unlink(tmp_path)


def _without_accelerate(command: str) -> bool:
    """True, with the one-line advice printed, when Accelerate is not installed (``--help`` does not need it)."""
    from sdc_core._lazy import require
    try:
        require("accelerate", "accelerate", "accelerate-sdc " + command)
    except ImportError as err:
        print(f"accelerate-sdc {command}: error: {err}", file=sys.stderr)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        if _without_accelerate("launch"):
            return 2
        try:
            return _launch(argv[1:])
        except ValueError as err:  # SDCConfigError, or a bad SDC_EXIT_CODE
            print(f"accelerate-sdc launch: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="accelerate-sdc", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="write the SDC settings beside accelerate's config", allow_abbrev=False)
    cfg.add_argument("--default", action="store_true", help="take the defaults without asking")
    cfg.add_argument("--config_file", "--config-file", help="where to write (default: accelerate's config dir)")
    for name, default, doc in SETTINGS:
        cfg.add_argument(f"--{name}", help=f"{doc} (default {default})")
    sub.add_parser("launch", help="accelerate launch, for a config file with an sdc: section")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a misspelled setting: named, with the closest one (the hook set's own suggestion)
        from sdc_core.driver.settings import suggest
        flags = ["--default", "--config_file", *(f"--{name}" for name, _, _ in SETTINGS)]
        bad = unknown[0].split("=")[0]
        print(f"accelerate-sdc {args.command}: error: unknown option {bad!r}{suggest(bad, flags)} "
              f"(see accelerate-sdc {args.command} --help)", file=sys.stderr)  # fmt: skip
        return 2
    if _without_accelerate("config"):
        return 2
    from sdc_core.cli import run_guarded
    return run_guarded("accelerate-sdc config", lambda: _config(args))  # 2: a bad value, 4: cannot write


if __name__ == "__main__":
    sys.exit(main())
