"""Running a campaign: its specs in ``torch.distributed.run`` launches of ``WORLD`` ranks of the
runner's worker module (``main``), each spec trained as often as its site needs and classified
into one row; ``run_campaign``, ``run_sizes_campaign`` and ``run_matmul_campaign`` plan, run, report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdc_core.faults.campaign import (
    CKPT_STEP,
    COMPUTE_SITES,
    SITES,
    WORLD,
    clean_outcome,
    fault_for,
    matmul_outcome,
    matmul_summary,
    outcome,
    plan,
    plan_matmul,
    plan_sizes,
    sizes_outcome,
    sizes_summary,
)
from sdc_core.faults.campaign_matmul_report import write_matmul_doc
from sdc_core.faults.campaign_report import make_folder, report, write_doc, write_results
from sdc_core.faults.campaign_runner import CAMPAIGN_DIR_ENV, OPTIMIZERS, CampaignRunner, find_runner
from sdc_core.faults.checkpoint import Corruption, corrupt_file
from sdc_core.io.checkpoints import FINGERPRINT_KEY
from sdc_core.io.safe_files import OutputError, atomic_write_text, load_torch


class CampaignFailed(RuntimeError):
    """A campaign training failed (its log names why)."""


@dataclass(frozen=True)
class _Launch:
    """One launch's trainings: each spec's row from the runs its site needs (the same trainings in
    the same order on every rank; rank 0 alone writes files)."""

    runner: CampaignRunner
    steps: int
    out: Path
    base: Path  # the checkpoint written at CKPT_STEP that checkpoint faults alter
    reference: dict[str, Any]  # the clean run
    rank: int
    optimizer: str = "adam"  # every training of the launch (``campaign_runner.OPTIMIZERS``)

    def fit(self, checks: bool = False, **kwargs: Any) -> dict[str, Any]:
        return self.runner.fit(self.steps, checks, optimizer=self.optimizer, **kwargs)

    def row(self, spec: dict[str, Any]) -> dict[str, Any]:
        site = spec["site"]
        if site == "clean":
            return self._clean(spec)
        if site == "matmul_clean":
            detect = self.fit(check_set="defaults+matmul")
            row = outcome(spec, self.reference, detect, self.reference)
            row["outcome"] = "false_alarm" if detect["error"] else "clean"
            return row
        if site in ("checkpoint", "study"):
            return self._checkpoint(spec)
        fault = fault_for(spec, self.runner.target_prefix)
        effect = self.fit(fault=fault)  # without checks: did it change the result?
        if site == "matmul":
            defaults = self.fit(fault=fault, check_set="defaults")
            with_matmul = self.fit(fault=fault, check_set="defaults+matmul")
            return matmul_outcome(spec, effect, defaults, with_matmul, self.reference)
        if "rel_error" in spec:  # an error of known size: at the defaults only
            return sizes_outcome(spec, effect, self.fit(fault=fault, check_set="defaults"), self.reference)
        detect = self.fit(checks=True, fault=fault)  # all three every step: what they can see
        return outcome(spec, effect, detect, self.reference, self.fit(fault=fault, check_set="defaults"))

    def _clean(self, spec: dict[str, Any]) -> dict[str, Any]:
        effect = self.fit(data=spec)
        detect = self.fit(checks=True, data=spec)
        defaults = self.fit(check_set="defaults", data=spec)
        row = outcome(spec, effect, detect, self.reference, defaults)
        row["outcome"] = clean_outcome(detect["error"], row)
        row["defaults_outcome"] = clean_outcome(defaults["error"], row)
        return row

    def _checkpoint(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Bits flipped in the base checkpoint (by rank 0, with and without its stored fingerprint),
        then every rank resumes from it: without checks, every step (also without the fingerprint),
        and (``checkpoint`` alone) at the defaults."""
        bad, bare = self.out / f"{spec['id']}.ckpt", self.out / f"{spec['id']}-bare.ckpt"
        if self.rank == 0:
            amount = {"fraction": spec["fraction"], "count": None} if "fraction" in spec else {"count": 1}
            corrupt_file(self.base, bad, Corruption(target=spec["target"], bit_class=spec["bit_class"],
                                                    seed=spec["seed"], **amount))  # fmt: skip
            stripped = load_torch(bad)
            stripped.pop(FINGERPRINT_KEY, None)
            torch.save(stripped, bare)
        dist.barrier()
        effect = self.fit(ckpt_path=str(bad))
        detect = self.fit(checks=True, ckpt_path=str(bad))
        runtime = self.fit(checks=True, ckpt_path=str(bare))
        at_defaults = spec["site"] == "checkpoint"  # the study measures the checkpoint, not the checks
        defaults = self.fit(check_set="defaults", ckpt_path=str(bad)) if at_defaults else None
        row = outcome(spec, effect, detect, self.reference, defaults)
        log = Path(f"{bad}.flips.json")
        flips = json.loads(log.read_text())["flips"] if self.rank == 0 else []
        row.update(runtime_detected_by=runtime["error"]["check"] if runtime["error"] else "",
                   runtime_crash=runtime["crash"] or "", effect_crash=effect["crash"] or "",
                   tensor=flips[0]["tensor"] if flips else "")  # fmt: skip
        dist.barrier()
        if self.rank == 0:
            for f in (bad, bare, log):
                f.unlink(missing_ok=True)
        return row


def worker(runner: CampaignRunner, specs_file: Path, out: Path, steps: int, optimizer: str = "adam") -> None:
    """Run a launch's specs on this rank; rank 0 writes one JSON line per spec."""
    specs = json.loads(specs_file.read_text())
    reference = runner.fit(steps, checks=False, optimizer=optimizer)
    base = out / f"base-{specs_file.stem}.ckpt"
    if any(s["site"] in ("checkpoint", "study") for s in specs):
        runner.fit(CKPT_STEP, checks=False, save=str(base), optimizer=optimizer)
    launch = _Launch(runner, steps, out, base, reference, int(os.environ["RANK"]), optimizer)
    results = out / f"{specs_file.stem}.jsonl"
    for spec in specs:
        t0 = time.perf_counter()
        row = launch.row(spec)
        row["seconds"] = time.perf_counter() - t0
        if launch.rank == 0:
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")


def run_specs(specs: list[dict[str, Any]], out: Path, workers: int, steps: int,
              runner: CampaignRunner | None = None, optimizer: str = "adam") -> list[dict[str, Any]]:  # fmt: skip
    """Run ``specs`` in ``workers`` launches of ``runner`` (the installed one by default); every spec's row, by id."""
    runner = runner or find_runner()
    atomic_write_text(out / "plan.json", json.dumps(specs, indent=1))
    chunks = [specs[i::workers] for i in range(workers)]
    results = [out / f"chunk{i}.jsonl" for i in range(workers)]
    procs = []
    for i, chunk in enumerate(chunks):
        if not chunk:
            continue
        f = out / f"chunk{i}.json"
        atomic_write_text(f, json.dumps(chunk))
        results[i].unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone" if workers == 1 else "--nnodes=1",
               f"--nproc-per-node={WORLD}", "-m", runner.worker_module, "--worker", str(f), "--out", str(out),
               "--steps", str(steps), "--optimizer", optimizer]  # fmt: skip
        if workers > 1:
            cmd[4:4] = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{29600 + i}", f"--rdzv-id=campaign{i}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{CAMPAIGN_DIR_ENV: str(out)})
        log = (out / f"chunk{i}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

    def lines() -> list[str]:
        return [line for f in results if f.exists() for line in f.read_text().splitlines()]

    t0 = time.perf_counter()
    while any(p.poll() is None for p in procs):  # a progress bar: runs done, and the time left
        done = len(lines())
        filled, elapsed = 30 * done // max(len(specs), 1), time.perf_counter() - t0
        eta = f"~{elapsed / done * (len(specs) - done) / 60:.1f} min left" if done else f"{elapsed:.0f} s, starting"
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{len(specs)} runs, {eta} ")
        sys.stderr.flush()
        time.sleep(1)
    sys.stderr.write("\n")
    if any(p.returncode for p in procs):
        raise CampaignFailed(f"a campaign training failed; see {out}/chunk*.log")
    return sorted((json.loads(line) for line in lines()), key=lambda r: r["id"])


def run_campaign(out: Path, injections: int = 200, clean: int = 20, workers: int = 1, seed: int = 0, steps: int = 12,
                 study: int = 0, doc: Path | None = None, hard: int = 0, sites: tuple[str, ...] = SITES,
                 runner: CampaignRunner | None = None, optimizer: str = "adam") -> dict[str, Any]:  # fmt: skip
    """``sdc campaign``: plan, run, aggregate and report; returns the summary.

    Raises ``ValueError`` for a bad number or an optimizer the plan cannot use (only Adam has the
    optimizer state faults alter; the page describes Adam), ``OutputError`` when ``out`` or ``doc``
    cannot be written (before any training), ``CampaignFailed`` when a training fails."""
    if injections < 0 or clean < 0 or workers < 1 or steps < 8 or study < 0 or hard < 0:
        raise ValueError("need injections >= 0, clean >= 0, workers >= 1, steps >= 8, study >= 0 and hard >= 0")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer != "adam" and ("optimizer" in sites or study or doc is not None):
        raise ValueError(f"--optimizer {optimizer} takes no optimizer-state faults (--sites without optimizer), "
                         "no --study and no --doc (the page describes Adam); its rows are in --out")  # fmt: skip
    out, doc = Path(out), None if doc is None else Path(doc)
    make_folder(out, "--out")
    if doc is not None:
        if doc.is_dir():
            raise OutputError(f"--doc {doc} is a folder; give a markdown file name")
        make_folder(doc.parent, "--doc's folder")
    specs = plan(injections, clean, seed, steps, study, hard, tuple(sites))
    rows = run_specs(specs, out, workers, steps, runner, optimizer)
    summary = report(rows, out, seed=seed, steps=steps, optimizer=optimizer)
    if doc is not None:
        only = "" if tuple(sites) == SITES else f" --sites {','.join(sites)}"
        write_doc(out, doc, f"sdc campaign --injections {injections} --clean {clean} --hard {hard} --study {study} "
                            f"--seed {seed} --steps {steps}{only} --out {out} --doc {doc}")  # fmt: skip
    return summary


def run_sizes_campaign(out: Path, per_cell: int, workers: int = 1, seed: int = 0, steps: int = 40,
                       sites: tuple[str, ...] = COMPUTE_SITES, runner: CampaignRunner | None = None,
                       optimizer: str = "adam") -> list[dict[str, Any]]:  # fmt: skip
    """``sdc campaign --sizes``: ``campaign.plan_sizes``, each injection trained without checks and
    at the defaults (``2 x 54 x per_cell`` trainings on all three sites); returns the summary table.

    Raises ``ValueError`` for a bad number, site or optimizer (before anything is written),
    ``OutputError`` when ``out`` cannot be written, ``CampaignFailed`` when a training fails."""
    if workers < 1:
        raise ValueError(f"need workers >= 1, got {workers}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    specs = plan_sizes(per_cell, seed, steps, tuple(sites))
    out = Path(out)
    make_folder(out, "--out")
    rows = run_specs(specs, out, workers, steps, runner, optimizer)
    table = sizes_summary(rows)
    write_results(rows, {"seed": seed, "steps": steps, "optimizer": optimizer, "world_size": WORLD,
                         "per_cell": per_cell, "table": table},
                  out, ["site", "rel_error", "steps", "injections", "finite", "finite_named_within_1", "changed",
                        "detected", "screen_flagged"])  # fmt: skip
    return table


def run_matmul_campaign(out: Path, per_class: int = 3, clean: int = 3, workers: int = 1, seed: int = 0,
                        steps: int = 12, runner: CampaignRunner | None = None) -> dict[str, Any]:  # fmt: skip
    """The matmul checksum check's campaign: plan, run, summarise into ``out/matmul-results.json``."""
    if per_class < 1 or clean < 0 or workers < 1 or steps < 8:
        raise ValueError("need per_class >= 1, clean >= 0, workers >= 1 and steps >= 8")
    runner = runner or find_runner()
    out = Path(out)
    make_folder(out, "--out")
    rows = run_specs(plan_matmul(per_class, clean, seed, steps), out, workers, steps, runner)
    command = (f"python -m {runner.worker_module} matmul --per-class {per_class} --clean {clean} --seed {seed} "
               f"--steps {steps} --out {out}")
    summary = {"seed": seed, "steps": steps, "world_size": WORLD, "command": command, **matmul_summary(rows)}
    atomic_write_text(out / "matmul-results.json", json.dumps({"summary": summary, "runs": rows}, indent=1))
    for t in summary["table"]:
        print(json.dumps(t))
    print(f"clean runs: {summary['clean_runs']}, false alarms: {summary['false_alarms']}")
    return summary


def main(runner: CampaignRunner, argv: list[str] | None = None) -> None:
    """``python -m <runner.worker_module>``: ``--worker SPECS ...`` runs one launch's specs on a
    rank; ``matmul [...]`` runs the matmul campaign."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["matmul"]:
        parser = argparse.ArgumentParser(prog=f"python -m {runner.worker_module} matmul")
        parser.add_argument("--out", type=Path, default=Path("sdc-campaign-matmul"))
        parser.add_argument("--per-class", type=int, default=3, help="injections per phase and bit class")
        for flag, default in (("--clean", 3), ("--workers", 1), ("--seed", 0), ("--steps", 12)):
            parser.add_argument(flag, type=int, default=default)
        parser.add_argument("--doc", type=Path, help="write the campaign's section of this coverage page")
        parser.add_argument("--clean-runs", type=Path, help="with --doc: the long clean runs' JSON to show too")
        parser.add_argument("--doc-only", action="store_true", help="only re-render the section from --out")
        a = parser.parse_args(argv[1:])
        if not a.doc_only:
            run_matmul_campaign(a.out, a.per_class, a.clean, a.workers, a.seed, a.steps, runner=runner)
        if a.doc is not None:
            write_matmul_doc(a.out, a.doc, a.clean_runs)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    args = parser.parse_args(argv)
    worker(runner, args.worker, args.out, args.steps, args.optimizer)
