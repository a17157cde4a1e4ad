"""Fault-injection campaigns: how much each check catches, and how often it cries wolf.

``sdc campaign`` plans seeded injections over five fault sites (forward activation, local
gradient, weights after a step, optimizer state, saved checkpoint) and four bit classes (sign,
top exponent bit, other exponent bits, mantissa), plus clean runs. Each injection runs twice as a
short Lightning DDP training on 3 CPU ranks: once without checks, to see whether the fault
changed the result at all, and once with all three checks, to see which check caught it, whether
the faulty rank was named, and how many steps later. Outcome per injection:

* detected: a check raised (attributed: it named the injected rank);
* masked: not detected, and the final weights equal the clean run's within ``1e-6`` relative;
* silent: not detected, and the final weights differ: the harm the checks missed.

Checkpoint injections flip bits in a checkpoint written mid-run, then resume on every rank. They
also run a third time with the checkpoint's stored fingerprint removed, to show what the run-time
checks alone catch (every replica loads the same bits, so only non-finite values are visible).

``python -m lightning_sdc.campaign matmul`` runs the compute-fault campaign of the matrix-product
checksum check (``run_matmul_campaign``): a bit flipped in one element of a product's output
inside a layer (forward output, input gradient or weight gradient) of one rank, at a step the
replay does not audit at its default cadence, each trained three times: without checks, with the
default checks, and with the defaults plus ``MatmulChecksumCheck``.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import math
import os
import random
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

SITES = ("activation", "gradient", "matmul_output", "weights", "optimizer", "checkpoint")
COMPUTE_SITES = ("activation", "gradient", "matmul_output")  # transient compute faults: one wrong value in one step
BIT_CLASSES = ("sign", "exponent_top", "exponent", "mantissa")
MODULES = ("l1", "l2", "l3")
PARAMS = ("l1.weight", "l1.bias", "l2.weight", "l2.bias", "l3.weight", "l3.bias")
WORLD = 3
BATCH = 16
CKPT_STEP = 5
STUDY_FRACTION = 0.01


class CampaignFailed(RuntimeError):
    """A campaign training failed (its log names why)."""


def plan(injections: int, clean: int, seed: int, steps: int, study: int = 0, hard: int = 0,
         sites: tuple[str, ...] = SITES) -> list[dict[str, Any]]:  # fmt: skip
    """Seeded specs: sites and bit classes in turn, rank, step, tensor, element and bit at random;
    ``clean`` clean runs, each with another data order (the spread of their final losses is what
    ``harmful`` is measured against); ``hard`` clean runs of each hard kind (heterogeneous batches,
    a genuine loss spike) for false alarms. ``sites``: the fault sites to take in turn (all)."""
    if not sites or any(site not in SITES for site in sites):
        raise ValueError(f"sites must be some of {SITES}, got {sites!r}")
    from sdc_core.faults.checkpoint import bits_of_class

    rng = random.Random(seed)
    specs = []
    for i in range(injections):
        site, bit_class = sites[i % len(sites)], BIT_CLASSES[(i // len(sites)) % len(BIT_CLASSES)]
        spec = {"id": f"inj{i:04d}", "site": site, "bit_class": bit_class, "rank": rng.randrange(WORLD),
                "step": rng.randrange(2, steps - 3), "index": rng.randrange(10_000),
                "bit": rng.choice(bits_of_class(torch.float32, bit_class)), "seed": rng.randrange(2**31)}  # fmt: skip
        if site == "activation":
            spec["target"] = rng.choice(MODULES)
        elif site == "matmul_output":  # one element of a product inside a Linear: its output, or a gradient it returns
            spec["phase"] = MATMUL_PHASES[(i // len(sites)) % len(MATMUL_PHASES)]  # every phase x bit class in 12
            spec["target"] = rng.choice(MATMUL_TARGETS[spec["phase"]])
        elif site == "checkpoint":  # both targets for every bit class
            spec["target"] = "weights" if i // (len(sites) * len(BIT_CLASSES)) % 2 == 0 else "optimizer"
            spec["step"], spec["rank"] = CKPT_STEP, -1  # on disk: every rank loads the same bits
        else:
            spec["target"] = rng.choice(PARAMS)
        specs.append(spec)
    specs += [{"id": f"clean{i:03d}", "site": "clean", "variant": "order", "order": i + 1, "bit_class": "-",
               "rank": -1, "step": -1} for i in range(clean)]  # fmt: skip
    for i in range(study):  # checkpoint alteration as in the SBAC-PAD 2022 study: 1% of the entries
        for target in ("weights", "optimizer"):
            for bit_class in BIT_CLASSES:
                specs.append({"id": f"study-{target}-{bit_class}-{i}", "site": "study", "target": target,
                              "bit_class": bit_class, "rank": -1, "step": CKPT_STEP, "fraction": STUDY_FRACTION,
                              "seed": rng.randrange(2**31)})  # fmt: skip
    for i in range(hard):  # clean runs that a screen may flag: heterogeneous batches, a genuine spike
        specs.append({"id": f"hard-hetero{i:03d}", "site": "clean", "variant": "hetero", "bit_class": "-", "rank": -1,
                      "step": -1, "seed": rng.randrange(2**31)})  # fmt: skip
        specs.append({"id": f"hard-spike{i:03d}", "site": "clean", "variant": "spike", "bit_class": "-", "rank": -1,
                      "step": -1, "spike_rank": i % WORLD, "spike_step": 1 + i % (steps - 2)})  # fmt: skip
    return specs


# ---------------------------------------------------------------------------------------------- worker


class CampaignModel(nn.Module):
    """The small model every campaign run trains (ships with the package)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def _lightning_module() -> Any:
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CampaignModel()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    return Module


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True)).sin()


HETERO_LOG2_RANGE = 2.0  # heterogeneous batches: each rank's batch of each step scaled by 2^U(-2, 2)
SPIKE_FACTOR = 1e3  # a genuine spike: one batch's targets scaled by this (its gradient about 2^10 larger)


def _training_data(spec: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data a run trains on: ``_data()``, or for a clean spec another order (``order``),
    heterogeneous batches (``hetero``: every rank's batch of every step, inputs and targets, scaled
    by its own factor, so the ranks' gradients differ by up to 2^8 at a step) or a genuine spike
    (``spike``: the targets of one batch, rank ``spike_rank`` at ``spike_step``, scaled by
    ``SPIKE_FACTOR``: a huge gradient on any rank that computes that batch). Lightning's
    DistributedSampler without shuffling gives rank r the samples r, r + 3, ...: sample i is in rank
    ``i % WORLD``'s batch of step ``i // WORLD // BATCH``."""
    x, y = _data()
    spec = spec or {}
    variant = spec.get("variant", "")
    if variant == "order" and spec.get("order", 0):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(int(spec["order"])))
        x, y = x[perm], y[perm]
    elif variant == "hetero":
        cell = torch.arange(len(x)) % WORLD + WORLD * (torch.arange(len(x)) // WORLD // BATCH)
        g = torch.Generator().manual_seed(int(spec["seed"]))
        scale = 2.0 ** ((torch.rand(int(cell.max()) + 1, generator=g) * 2 - 1) * HETERO_LOG2_RANGE)
        x, y = x * scale[cell, None], y * scale[cell, None]
    elif variant == "spike":
        i = WORLD * (BATCH * int(spec["spike_step"]) + torch.arange(BATCH)) + int(spec["spike_rank"])
        y = y.clone()
        y[i] *= SPIKE_FACTOR
    return x, y


def _fault(spec: dict[str, Any]) -> Any:
    from sdc_core.faults.inject import Fault

    prefix = "model."
    site = spec["site"]
    if site == "activation":
        return Fault("module_output", rank=spec["rank"], step=spec["step"], target=prefix + spec["target"],
                     index=spec["index"], bit=spec["bit"], mode="once")  # fmt: skip
    kind = {"gradient": "gradient_bit_flip", "weights": "weight_bit_flip", "optimizer": "optimizer_state"}[site]
    return Fault(kind, rank=spec["rank"], step=spec["step"], target=prefix + spec["target"], index=spec["index"],
                 bit=spec["bit"], state_key="exp_avg_sq" if spec["bit_class"] == "mantissa" else "exp_avg")  # fmt: skip


def _fit(steps: int, checks: bool, fault: Any = None, ckpt_path: str | None = None, save: str | None = None,
         check_set: str | None = None, data: dict[str, Any] | None = None) -> dict:  # fmt: skip
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sdc import FaultInjector, NonFiniteGradientCheck, RingReplayAudit, SDCError, WeightFingerprintCheck

    L.seed_everything(0, verbose=False)
    callbacks: list[Any] = []
    if check_set is not None:  # the checks at their defaults (replay every 100 steps), with the matmul check or not
        from lightning_sdc import MatmulChecksumCheck

        callbacks += [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()]
        if check_set == "defaults+matmul":
            callbacks.append(MatmulChecksumCheck())
    elif checks:
        # the replay audits every step here: the campaign measures what each check can see; at a
        # cadence of n a transient compute fault is audited with probability 1/n
        callbacks += [NonFiniteGradientCheck(), RingReplayAudit(every_n_steps=1), WeightFingerprintCheck()]
    elif save:
        callbacks.append(WeightFingerprintCheck(every_n_steps=10**6))  # stores the fingerprint in the checkpoint
    if fault is not None:
        callbacks.append(FaultInjector([fault]))
    x, y = _training_data(data)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=DDPStrategy(timeout=timedelta(seconds=120)),
                        max_steps=steps, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=os.environ.get("SDC_CAMPAIGN_DIR", "."))  # incidents land there  # fmt: skip
    module = _lightning_module()()
    error = crash = None
    try:
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16), ckpt_path=ckpt_path)
    except SDCError as err:
        error = err.to_dict()
    except Exception as err:  # a loud failure of training itself (same on every rank: same bits loaded)
        crash = f"{type(err).__name__}: {err}"[:300]
    if save and error is None:
        trainer.save_checkpoint(save)
    x, y = _data()  # the final loss on the same samples for every run
    with torch.no_grad():
        weights = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        loss = float(nn.functional.mse_loss(module(x[:512]), y[:512]))
    return {"error": error, "crash": crash, "weights": weights, "loss": loss, "counters": _counters(callbacks)}


def _counters(callbacks: list[Any]) -> dict[str, float]:
    """What the screen and the replay counted in a run (the same on every rank): the screen's hits
    and the replay's escalations of them, cleared, unconfirmed and confirmed, and its audits."""
    from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit

    out: dict[str, float] = {}
    for cb in callbacks:
        if isinstance(cb, RingReplayAudit):
            stats = cb._core.stats
            out["replay_audits"] = float(stats.runs)
            for name in ("screen_escalations", "screen_cleared", "screen_unconfirmed", "screen_confirmed"):
                out[name] = float((stats.extra or {}).get(name, 0.0))
        elif isinstance(cb, NonFiniteGradientCheck) and getattr(cb, "_screen", None) is not None:
            extra = cb._screen.stats.extra or {}
            out["screen_hits"] = float(extra.get("hits", 0.0))
            for reason in ("band", "nonfinite", "malformed"):  # why the screen flagged (a rank, once per step)
                out[f"screen_{reason}"] = float(extra.get(f"{reason}_suspects", 0.0))
    return out


def _verdict(prefix: str, run: dict, spec: dict[str, Any]) -> dict[str, Any]:
    """One check set's verdict on a run, as row fields ``<prefix>_*``: which check raised (``by``;
    ``gradient_screen`` for a replay verdict the screen escalated), the rank and suspects named, the
    steps from the fault to the error, a crash, and the screen's and replay's counters."""
    err = run["error"]
    source = (err.get("details") or {}).get("source", "") if err else ""
    return {
        f"{prefix}_by": ("gradient_screen" if source == "gradient_screen" else err["check"]) if err else "",
        f"{prefix}_rank": err["rank"] if err else None,
        f"{prefix}_suspects": list(err.get("suspects") or []) if err else [],
        f"{prefix}_latency": (err["step"] - spec["step"]) if err and spec.get("step", -1) >= 0 else None,
        f"{prefix}_crash": run.get("crash") or "",
        **{f"{prefix}_{k}": v for k, v in run.get("counters", {}).items()},
    }  # fmt: skip


def _outcome(spec: dict[str, Any], effect: dict, detect: dict, reference: dict,
             defaults: dict | None = None) -> dict[str, Any]:  # fmt: skip
    w, ref = effect["weights"], reference["weights"]
    finite = bool(torch.isfinite(w).all())
    rel = float((w - ref).norm() / ref.norm()) if finite else math.inf
    changed = rel > 1e-6
    err = detect["error"]
    keys = ("id", "site", "phase", "variant", "bit_class", "rank", "step", "target", "bit", "index")
    row = {**{k: spec.get(k) for k in keys},
           "changed": changed, "weight_rel_diff": rel, "final_loss": effect["loss"], "clean_loss": reference["loss"],
           "diverged": (not math.isfinite(effect["loss"])) or effect["loss"] > 2 * reference["loss"],
           "detected_by": err["check"] if err else "", "named_rank": err["rank"] if err else None,
           "attributed": bool(err) and err["rank"] == spec.get("rank"),
           "latency": (err["step"] - spec["step"]) if err and spec.get("step", -1) >= 0 else None}  # fmt: skip
    row["outcome"] = "detected" if err else "crashed" if detect.get("crash") else "silent" if changed else "masked"
    row["crash"] = detect.get("crash") or effect.get("crash") or ""
    row["changed"] = changed or bool(effect.get("crash"))
    row["diverged"] = row["diverged"] or bool(effect.get("crash"))
    row["nonfinite"] = not finite or not math.isfinite(effect["loss"]) or bool(effect.get("crash"))
    if defaults is not None:
        row.update(_verdict("defaults", defaults, spec))
    return row


MATMUL_PHASES = ("forward", "input_grad", "weight_grad")
MATMUL_TARGETS = {"forward": MODULES, "input_grad": ("l2", "l3"), "weight_grad": MODULES}  # l1's input needs no grad
SECTION = ("<!-- matmul-campaign -->", "<!-- /matmul-campaign -->")
CAMPAIGN_SECTION = ("<!-- campaign -->", "<!-- /campaign -->")  # what ``sdc campaign --doc`` writes


def plan_matmul(per_class: int, clean: int, seed: int, steps: int) -> list[dict[str, Any]]:
    """Seeded compute faults inside matrix products: ``per_class`` per phase and bit class, at a
    random rank, layer, element and bit of the class, at steps 1 .. steps - 2 (the replay audits
    step 0 only at its default cadence); plus ``clean`` clean runs with the matmul check."""
    from sdc_core.faults.checkpoint import bits_of_class

    rng = random.Random(seed)
    specs = [{"id": f"mm-{phase}-{bit_class}-{i}", "site": "matmul", "phase": phase, "bit_class": bit_class,
              "rank": rng.randrange(WORLD), "step": rng.randrange(1, steps - 1),
              "target": rng.choice(MATMUL_TARGETS[phase]), "index": rng.randrange(10_000),
              "bit": rng.choice(bits_of_class(torch.float32, bit_class))}
             for phase in MATMUL_PHASES for bit_class in BIT_CLASSES for i in range(per_class)]  # fmt: skip
    specs += [{"id": f"mm-clean{i:03d}", "site": "matmul_clean", "bit_class": "-", "rank": -1, "step": -1}
              for i in range(clean)]  # fmt: skip
    return specs


def _matmul_fault(spec: dict[str, Any]) -> Any:
    from sdc_core.faults.inject import Fault

    return Fault("matmul_output", rank=spec["rank"], step=spec["step"], target="model." + spec["target"],
                 index=spec["index"], bit=spec["bit"], mode="once", phase=spec["phase"])  # fmt: skip


def _matmul_outcome(spec: dict[str, Any], effect: dict, defaults: dict, matmul: dict,
                    reference: dict) -> dict[str, Any]:  # fmt: skip
    """One matmul injection: did it change the result, and what each check set said (which check,
    which rank, how many steps after the fault the error named)."""
    w, ref = effect["weights"], reference["weights"]
    rel = float((w - ref).norm() / ref.norm()) if bool(torch.isfinite(w).all()) else math.inf
    row = {k: spec.get(k) for k in ("id", "site", "phase", "bit_class", "rank", "step", "target", "bit", "index")}
    row.update(changed=rel > 1e-6 or bool(effect.get("crash")), weight_rel_diff=rel,
               diverged=(not math.isfinite(effect["loss"])) or effect["loss"] > 2 * reference["loss"]
               or bool(effect.get("crash")))  # fmt: skip
    for name, run in (("defaults", defaults), ("matmul", matmul)):
        err = run["error"]
        row[f"{name}_by"] = err["check"] if err else ""
        row[f"{name}_rank"] = err["rank"] if err else None
        row[f"{name}_latency"] = err["step"] - spec["step"] if err else None
        row[f"{name}_crash"] = run.get("crash") or ""
    return row


def matmul_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and bit class: injections, changed, and for each check set how many were caught
    naming the fault's own step, by which check, with the injected rank."""
    table = []
    for phase in MATMUL_PHASES:
        for bit_class in BIT_CLASSES:
            rs = [r for r in rows if r["site"] == "matmul" and r["phase"] == phase and r["bit_class"] == bit_class]
            if not rs:
                continue
            entry: dict[str, Any] = {"phase": phase, "bit_class": bit_class, "injections": len(rs),
                                     "changed": sum(r["changed"] for r in rs)}  # fmt: skip
            for name in ("defaults", "matmul"):
                caught = [r for r in rs if r[f"{name}_by"]]
                entry[f"{name}_caught"] = len(caught)
                entry[f"{name}_same_step"] = sum(r[f"{name}_latency"] == 0 for r in caught)
                entry[f"{name}_right_rank"] = sum(r[f"{name}_rank"] == r["rank"] for r in caught)
                entry[f"{name}_silent"] = sum(r["changed"] and not r[f"{name}_by"] for r in rs)
                entry[f"{name}_by"] = dict(sorted(collections.Counter(r[f"{name}_by"] for r in caught).items()))
            table.append(entry)
    clean = [r for r in rows if r["site"] == "matmul_clean"]
    return {"table": table, "clean_runs": len(clean), "false_alarms": sum(r["outcome"] == "false_alarm" for r in clean)}


def run_matmul_campaign(out: Path, per_class: int = 3, clean: int = 3, workers: int = 1, seed: int = 0,
                        steps: int = 12, doc: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """The compute-fault campaign of the matmul checksum check: plan, run, summarise (``out`` gets
    ``matmul-results.json``); with ``doc``, its section of the coverage page is written (the rest of
    the page is left as it is). Returns the summary."""
    from sdc_core.io.safe_files import atomic_write_text

    if per_class < 1 or clean < 0 or workers < 1 or steps < 8:
        raise ValueError("need per_class >= 1, clean >= 0, workers >= 1 and steps >= 8")
    out = Path(out)
    _make_folder(out, "--out")
    rows = _run_specs(plan_matmul(per_class, clean, seed, steps), out, workers, steps)
    command = (f"python -m lightning_sdc.campaign matmul --per-class {per_class} --clean {clean} --seed {seed} "
               f"--steps {steps} --out {out}" + (f" --doc {doc}" if doc is not None else ""))  # fmt: skip
    summary = {"seed": seed, "steps": steps, "world_size": WORLD, "command": command, **matmul_summary(rows)}
    atomic_write_text(out / "matmul-results.json", json.dumps({"summary": summary, "runs": rows}, indent=1))
    for t in summary["table"]:
        print(json.dumps(t))
    print(f"clean runs: {summary['clean_runs']}, false alarms: {summary['false_alarms']}")
    if doc is not None:
        write_matmul_doc(out, Path(doc))
    return summary


def write_matmul_doc(out: Path, doc: Path, clean_runs: Path | None = None) -> None:
    """Write (or replace) the matmul campaign's section of the coverage page ``doc`` from the
    campaign folder ``out`` (and, if given, the JSON of ``python -m benchmarks.matmul
    --clean-steps N --out FILE``); the rest of the page stays as it is. Atomic."""
    from sdc_core.io.safe_files import atomic_write_text

    results = json.loads((Path(out) / "matmul-results.json").read_text())
    long_runs = json.loads(Path(clean_runs).read_text()) if clean_runs is not None else None
    text = matmul_markdown(results["summary"], results["runs"], results["summary"].get("command", ""), long_runs)
    atomic_write_text(doc, with_section(doc.read_text() if doc.is_file() else "", text))


def section(text: str) -> str:
    """The matmul campaign's section of a coverage page (markers included), or ""."""
    start, end = text.find(SECTION[0]), text.find(SECTION[1])
    return text[start : end + len(SECTION[1])] if 0 <= start < end else ""


def with_section(text: str, part: str) -> str:
    """``text`` with its matmul section replaced by ``part`` (appended when it has none)."""
    old = section(text)
    if not part:
        return text
    if old:
        return text.replace(old, part)
    return text.rstrip("\n") + "\n\n" + part + "\n"


def matmul_markdown(summary: dict[str, Any], rows: list[dict[str, Any]], command: str,
                    long_runs: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The coverage page's section on compute faults inside matrix products (numbers computed)."""
    head = ["phase", "bit_class", "injections", "changed", "defaults: caught", "defaults: same step",
            "defaults: silent", "with matmul: caught", "with matmul: same step", "with matmul: right rank",
            "with matmul: silent", "with matmul: by"]  # fmt: skip
    lines = [
        SECTION[0],
        "## Compute faults inside matrix products (`MatmulChecksumCheck`)",
        "",
        f"A bit flipped in one element of a matrix product computed by one rank, inside the layer (the forward "
        f"output, or in the backward the input or the weight gradient as the product's autograd node returns "
        f"them), at a step the replay does not audit at its default cadence (every 100 steps: only step 0 "
        f"here). Each injection trains {summary['steps']} steps on {summary['world_size']} CPU ranks three times: "
        "without checks (did it change the result?), with the default checks (non-finite gradients, replay every "
        "100 steps, fingerprint every step), and with the defaults plus `MatmulChecksumCheck()`.",
        "",
        f"```bash\n{command}\n```",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for t in summary["table"]:
        by = ", ".join(f"{k} {v}" for k, v in t["matmul_by"].items()) or "-"
        lines.append(f"| {t['phase']} | {t['bit_class']} | {t['injections']} | {t['changed']} | "
                     f"{t['defaults_caught']} | {t['defaults_same_step']} | {t['defaults_silent']} | "
                     f"{t['matmul_caught']} | {t['matmul_same_step']} | {t['matmul_right_rank']} | "
                     f"{t['matmul_silent']} | {by} |")  # fmt: skip
    injected = [r for r in rows if r["site"] == "matmul"]
    changed = [r for r in injected if r["changed"]]
    tot = {name: sum(bool(r[f"{name}_by"]) and r[f"{name}_latency"] == 0 and r[f"{name}_rank"] == r["rank"]
                     for r in changed) for name in ("defaults", "matmul")}  # fmt: skip
    missed = [r for r in changed if not r["matmul_by"]]
    lines += [
        "",
        "Columns: `changed` = the fault moved the final weights (more than 1e-6 relative) or crashed the run; "
        "`caught` = a check raised; `same step` = the error named the step of the fault (it is raised before the "
        "update of the next step); `right rank` = it named the injected rank; `silent` = changed but not caught; "
        "`by` = which check raised first. `caught` can exceed `changed`: the check sees a wrong product whether or "
        "not it moved the final weights measurably.",
        "",
        f"Of {len(changed)} injections that changed the result, the default checks caught {tot['defaults']} in "
        f"their step with the right rank, the defaults plus the matmul check {tot['matmul']}. Clean runs with the "
        f"check: {summary['false_alarms']} false alarms in {summary['clean_runs']}.",
        "",
        "What the check sees: a wrong element whose error exceeds the rounding bound of its block "
        "(`sdc_core.checks.matmul`). "
        "Sign flips, exponent flips and flips of the upper mantissa bits of elements of typical size are far "
        "above it in fp32; flips of the low mantissa bits change an element by less than 2^-10 of its value and "
        "stay under it" + (f" ({len(missed)} changed the result here without being caught: "
                           + ", ".join(sorted({f"{r['phase']} {r['bit_class']} bit {r['bit']}" for r in missed}))
                           + ")" if missed else "") + ".",
        "",
        *visible_sizes_table(),
        *_long_runs_table(long_runs),
        SECTION[1],
    ]
    return "\n".join(lines)


def _long_runs_table(data: dict[str, Any] | None) -> list[str]:
    if not data:
        return []
    runs = data["clean_runs"]
    lines = [
        "",
        f"Long clean runs (`python -m benchmarks.matmul --clean-steps {runs[0]['steps']}`: a transformer of width "
        f"{runs[0]['width']} trained on {data['device']} with the check on every step, each verdict read before the "
        "update): alarms, and the largest residual seen relative to its bound (1 would alarm).",
        "",
        "| precision | steps | alarms | largest ratio: output | input gradient | weight gradient |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        peak = r["largest_ratio"]
        lines.append(f"| {r['precision']} | {r['steps']} | {r['alarms']} | {peak['output']:.2g} | "
                     f"{peak['input_gradient']:.2g} | {peak['weight_gradient']:.2g} |")  # fmt: skip
    return lines


def visible_sizes_table(widths: tuple[int, ...] = (64, 256, 1024, 4096)) -> list[str]:
    """Markdown: the error of one element always caught, relative to the row's largest element
    (the weight gradient: to the gradient's largest), per width and precision, with the default
    blocks of 32 and with whole rows (``sdc_core.checks.matmul.visible_error_sizes``; computed here)."""
    from sdc_core.checks.matmul_bound import visible_error_sizes

    lines = [
        "Fault sizes always caught (the stated threshold: a wrong element at least this far from the right value "
        "raises), relative to the largest element of its row (weight gradient: of the whole gradient), for a "
        "`Linear(width, width)` at its default initialisation fed unit-variance rows and output gradients, "
        "median over rows; `rows` = `block=0`:",
        "",
        "| width | precision | output (blocks of 32) | input gradient | weight gradient | output (rows) | "
        "input gradient (rows) | weight gradient (rows) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for width in widths:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            b = visible_error_sizes(width, dtype, rows=256)
            r = visible_error_sizes(width, dtype, rows=256, block=0)

            def cell(v: float) -> str:
                return f"{v:.3g}x" if math.isfinite(v) else "none guaranteed"

            lines.append(f"| {width} | {name} | {cell(b['output_vs_max'])} | {cell(b['input_gradient_vs_max'])} | "
                         f"{cell(b['weight_gradient_vs_max'])} | {cell(r['output_vs_max'])} | "
                         f"{cell(r['input_gradient_vs_max'])} | {cell(r['weight_gradient_vs_max'])} |")  # fmt: skip
    lines += [
        "",
        "The bound is a worst case (rounding errors all of one sign), so it grows with the reduction length K as "
        "K^1.5 relative to a typical element and, per checksum, with the block: smaller blocks see smaller errors "
        "and cost thin extra products (docs/performance.md). In bf16 and fp16 the rounding of the output itself "
        "dominates. Errors below these sizes may still be caught (the clean residuals sit far below the bound: "
        "the campaign's clean runs and the long clean runs below), but only these are guaranteed.",
    ]
    return lines


def worker(specs_file: Path, out: Path, steps: int) -> None:
    """Run specs under torchrun (3 ranks); rank 0 writes one JSON line per spec."""
    import torch.distributed as dist

    from sdc_core.faults.checkpoint import Corruption, corrupt_file
    from sdc_core.io.checkpoints import FINGERPRINT_KEY
    from sdc_core.io.safe_files import load_torch

    specs = json.loads(specs_file.read_text())
    reference = _fit(steps, checks=False)
    rank = int(os.environ["RANK"])
    base = out / f"base-{specs_file.stem}.ckpt"
    if any(s["site"] in ("checkpoint", "study") for s in specs):
        _fit(CKPT_STEP, checks=False, save=str(base))
    results = out / f"{specs_file.stem}.jsonl"
    for spec in specs:
        t0 = time.perf_counter()
        if spec["site"] == "clean":  # another data order or a hard batch: without checks, every step, defaults
            effect = _fit(steps, checks=False, data=spec)
            detect = _fit(steps, checks=True, data=spec)
            defaults = _fit(steps, checks=False, check_set="defaults", data=spec)
            row = _outcome(spec, effect, detect, reference, defaults)
            row["outcome"] = "false_alarm" if detect["error"] else "clean"
            row["defaults_outcome"] = "false_alarm" if defaults["error"] else "clean"
        elif spec["site"] == "matmul_clean":
            detect = _fit(steps, checks=False, check_set="defaults+matmul")
            row = _outcome(spec, reference, detect, reference)
            row["outcome"] = "false_alarm" if detect["error"] else "clean"
        elif spec["site"] == "matmul":
            fault = _matmul_fault(spec)
            effect = _fit(steps, checks=False, fault=fault)
            defaults = _fit(steps, checks=False, fault=fault, check_set="defaults")
            with_matmul = _fit(steps, checks=False, fault=fault, check_set="defaults+matmul")
            row = _matmul_outcome(spec, effect, defaults, with_matmul, reference)
        elif spec["site"] in ("checkpoint", "study"):
            bad = out / f"{spec['id']}.ckpt"
            bare = out / f"{spec['id']}-bare.ckpt"
            if rank == 0:
                amount = {"fraction": spec["fraction"], "count": None} if "fraction" in spec else {"count": 1}
                spec_c = Corruption(target=spec["target"], bit_class=spec["bit_class"], seed=spec["seed"], **amount)
                corrupt_file(base, bad, spec_c)
                stripped = load_torch(bad)
                stripped.pop(FINGERPRINT_KEY, None)
                torch.save(stripped, bare)
            dist.barrier()
            effect = _fit(steps, checks=False, ckpt_path=str(bad))
            detect = _fit(steps, checks=True, ckpt_path=str(bad))
            runtime = _fit(steps, checks=True, ckpt_path=str(bare))
            at_defaults = spec["site"] == "checkpoint"  # the study measures the checkpoint, not the checks
            defaults = _fit(steps, checks=False, check_set="defaults", ckpt_path=str(bad)) if at_defaults else None
            row = _outcome(spec, effect, detect, reference, defaults)
            row["runtime_detected_by"] = runtime["error"]["check"] if runtime["error"] else ""
            row["runtime_crash"] = runtime["crash"] or ""
            row["effect_crash"] = effect["crash"] or ""
            flips = json.loads(Path(f"{bad}.flips.json").read_text())["flips"] if rank == 0 else []
            row["tensor"] = flips[0]["tensor"] if flips else ""
            dist.barrier()
            if rank == 0:
                for f in (bad, bare, Path(f"{bad}.flips.json")):
                    f.unlink(missing_ok=True)
        else:  # without checks (the effect), all three every step (what they can see), at their defaults
            fault = _matmul_fault(spec) if spec["site"] == "matmul_output" else _fault(spec)
            effect, detect = _fit(steps, checks=False, fault=fault), _fit(steps, checks=True, fault=fault)
            defaults = _fit(steps, checks=False, fault=fault, check_set="defaults")
            row = _outcome(spec, effect, detect, reference, defaults)
        row["seconds"] = time.perf_counter() - t0
        if rank == 0:
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------- driver


def _progress(done: int, total: int, t0: float) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    elapsed = time.perf_counter() - t0
    eta = f"~{elapsed / done * (total - done) / 60:.1f} min left" if done else f"{elapsed:.0f} s, starting"
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} runs, {eta} ")
    sys.stderr.flush()


def run_campaign(out: Path, injections: int = 200, clean: int = 20, workers: int = 1, seed: int = 0, steps: int = 12,
                 study: int = 0, doc: Path | None = None, hard: int = 0,
                 sites: tuple[str, ...] = SITES) -> dict[str, Any]:  # fmt: skip
    """Plan, run (``workers`` trainings at once), aggregate and report; returns the summary.

    Raises ``ValueError`` for a bad number, ``OutputError`` when ``out`` or ``doc`` cannot be
    written (checked before any training), ``CampaignFailed`` when a training fails."""
    if injections < 0 or clean < 0 or workers < 1 or steps < 8 or study < 0 or hard < 0:
        raise ValueError("need injections >= 0, clean >= 0, workers >= 1, steps >= 8, study >= 0 and hard >= 0")
    out, doc = Path(out), None if doc is None else Path(doc)
    _make_folder(out, "--out")
    if doc is not None:
        if doc.is_dir():
            from sdc_core.io.safe_files import OutputError

            raise OutputError(f"--doc {doc} is a folder; give a markdown file name")
        _make_folder(doc.parent, "--doc's folder")
    specs = plan(injections, clean, seed, steps, study, hard, tuple(sites))
    rows = _run_specs(specs, out, workers, steps)
    summary = report(rows, out, seed=seed, steps=steps)
    if doc is not None:
        only = "" if tuple(sites) == SITES else f" --sites {','.join(sites)}"
        write_doc(out, doc, f"sdc campaign --injections {injections} --clean {clean} --hard {hard} --study {study} "
                            f"--seed {seed} --steps {steps}{only} --out {out} --doc {doc}")  # fmt: skip
    return summary


def _run_specs(specs: list[dict[str, Any]], out: Path, workers: int, steps: int) -> list[dict[str, Any]]:
    """Run ``specs`` in ``workers`` torchrun launches of 3 ranks; every spec's result row, by id."""
    from sdc_core.io.safe_files import atomic_write_text

    atomic_write_text(out / "plan.json", json.dumps(specs, indent=1))
    chunks = [specs[i::workers] for i in range(workers)]
    procs = []
    for i, chunk in enumerate(chunks):
        if not chunk:
            continue
        f = out / f"chunk{i}.json"
        atomic_write_text(f, json.dumps(chunk))
        (out / f"chunk{i}.jsonl").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone" if workers == 1 else "--nnodes=1",
               f"--nproc-per-node={WORLD}", "-m", "lightning_sdc.campaign", "--worker", str(f), "--out", str(out),
               "--steps", str(steps)]  # fmt: skip
        if workers > 1:
            cmd[4:4] = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{29600 + i}", f"--rdzv-id=campaign{i}"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SDC_CAMPAIGN_DIR=str(out))
        log = (out / f"chunk{i}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    t0 = time.perf_counter()
    while any(p.poll() is None for p in procs):
        done = sum(len((out / f"chunk{i}.jsonl").read_text().splitlines()) if (out / f"chunk{i}.jsonl").exists() else 0
                   for i in range(len(chunks)))  # fmt: skip
        _progress(done, len(specs), t0)
        time.sleep(1)
    sys.stderr.write("\n")
    if any(p.returncode for p in procs):
        raise CampaignFailed(f"a campaign training failed; see {out}/chunk*.log")
    rows = [json.loads(line) for i in range(len(chunks)) if (out / f"chunk{i}.jsonl").exists()
            for line in (out / f"chunk{i}.jsonl").read_text().splitlines()]  # fmt: skip
    rows.sort(key=lambda r: r["id"])
    return rows


def _make_folder(folder: Path, what: str) -> None:
    from sdc_core.io.safe_files import OutputError

    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {folder} is a file, not a folder; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {what} {folder}: {err.strerror or err}") from None


def write_doc(out: Path, doc: Path, command: str) -> None:
    """Write the coverage page (and its CSV and, when plotted, its plot beside it) from a
    campaign folder; every file atomically."""
    from sdc_core.io.safe_files import atomic_write, atomic_write_text

    _make_folder(doc.parent, "--doc's folder")
    png = doc.with_suffix(".png")
    plotted = (out / "detection.png").is_file()
    if plotted:
        atomic_write(png, lambda f: f.write((out / "detection.png").read_bytes()))
    atomic_write(doc.with_suffix(".csv"), lambda f: f.write((out / "results.csv").read_bytes()))
    text = markdown(json.loads((out / "results.json").read_text()), command, png.name if plotted else None)
    atomic_write_text(doc, with_campaign(doc.read_text() if doc.is_file() else "", text))


_GENERATED = ("# Detection coverage, measured", "## Summary", "## At the defaults", "## What goes undetected",
              "## Checkpoint alteration")  # the headings of a page written before the campaign's markers  # fmt: skip


def with_campaign(text: str, part: str) -> str:
    """The coverage page ``text`` with the campaign's part replaced by ``part``: between its
    markers; on a page from before the markers, from the top to the first section the campaign
    does not write (``_GENERATED``); on an empty page ``part`` alone. Every other section (the
    matmul campaign's, the hand-written ones) stays where it is."""
    start, end = text.find(CAMPAIGN_SECTION[0]), text.find(CAMPAIGN_SECTION[1])
    if 0 <= start < end:
        return text[:start] + part + text[end + len(CAMPAIGN_SECTION[1]) :]
    if not text.startswith(_GENERATED[0]):
        return part + "\n" + ("\n" + text if text.strip() else "")
    cut, at = len(text), 0
    while (at := text.find("\n#", at + 1)) >= 0:
        line = text[at + 1 : text.find("\n", at + 1) if text.find("\n", at + 1) >= 0 else len(text)]
        if not line.startswith(_GENERATED):
            cut = at + 1
            break
    if 0 <= text.find(SECTION[0]) < cut:
        cut = text.find(SECTION[0])
    return part + "\n\n" + text[cut:]


def _table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["site"] in SITES:
            groups.setdefault((r["site"], r["bit_class"]), []).append(r)
    table = []
    for (site, bit_class), rs in sorted(
        groups.items(), key=lambda kv: (SITES.index(kv[0][0]), BIT_CLASSES.index(kv[0][1]))
    ):
        det = [r for r in rs if r["outcome"] == "detected"]
        lat = sorted(r["latency"] for r in det if r["latency"] is not None)
        table.append({
            "site": site, "bit_class": bit_class, "injections": len(rs), "changed": sum(r["changed"] for r in rs),
            "detected": len(det), "masked": sum(r["outcome"] == "masked" for r in rs),
            "silent": sum(r["outcome"] == "silent" for r in rs),
            "crashed": sum(r["outcome"] == "crashed" for r in rs),
            "harmful": sum(bool(r.get("harmful")) for r in rs),
            "by_nonfinite": sum(r["detected_by"] == "nonfinite_gradient" for r in rs),
            "by_replay": sum(r["detected_by"] == "ring_replay" for r in rs),
            "by_fingerprint": sum(r["detected_by"] == "weight_fingerprint" for r in rs),
            "attributed": sum(r["attributed"] for r in det),
            "median_latency": lat[len(lat) // 2] if lat else None,
            "diverged": sum(r["diverged"] for r in rs),
        })  # fmt: skip
    return table


def loss_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The final losses of the clean runs with other data orders and the reference order: their
    spread (largest less smallest) is how much a final loss moves without any fault."""
    ref = next((r["clean_loss"] for r in rows if "clean_loss" in r), math.nan)
    orders = [r["final_loss"] for r in rows if r["site"] == "clean" and r.get("variant", "order") == "order"]
    losses = [v for v in (ref, *orders) if math.isfinite(v)]
    return {"clean_loss": ref, "runs": len(losses), "spread": max(losses) - min(losses) if losses else 0.0,
            "min": min(losses, default=math.nan), "max": max(losses, default=math.nan)}  # fmt: skip


def mark_harmful(rows: list[dict[str, Any]], spread: float) -> None:
    """``harmful`` on every injected row: the run without checks diverged (crashed, or non-finite
    weights or loss) or its final loss is worse than the clean run's by more than ``spread``."""
    for r in rows:
        if r["site"] in SITES:
            loss = r["final_loss"]
            r["harmful"] = bool(r.get("nonfinite")) or not math.isfinite(loss) or loss - r["clean_loss"] > spread


def _within_one_step(r: dict[str, Any]) -> bool:
    return bool(r.get("defaults_by")) and r.get("defaults_latency") is not None and 0 <= r["defaults_latency"] <= 1


def _defaults_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per site and bit class, at the callbacks' default arguments: harmful injections, detections
    (all, and of the harmful ones: any, within one step), the rank named, what raised, and the
    screen hits the replay cleared."""
    table = []
    for site in SITES:
        for bit_class in BIT_CLASSES:
            rs = [r for r in rows if r["site"] == site and r["bit_class"] == bit_class]
            if not rs:
                continue
            det = [r for r in rs if r.get("defaults_by")]
            harm = [r for r in rs if r.get("harmful")]
            local = site != "checkpoint"  # a checkpoint has no rank: every replica loads the same file
            table.append({
                "site": site, "bit_class": bit_class, "injections": len(rs), "harmful": len(harm),
                "detected": len(det), "harmful_detected": sum(bool(r.get("defaults_by")) for r in harm),
                "harmful_within_1": sum(_within_one_step(r) for r in harm),
                "harmful_silent": sum(not r.get("defaults_by") for r in harm),
                "right_rank": sum(r["defaults_rank"] == r["rank"] for r in det) if local else None,
                "screen_flagged": sum(r.get("defaults_screen_hits", 0) > 0 for r in rs),
                "screen_cleared": int(sum(r.get("defaults_screen_cleared", 0) for r in rs)),
                "by": dict(sorted(collections.Counter(r["defaults_by"] for r in det).items())),
            })  # fmt: skip
    return table


def _clean_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of clean run: false alarms with the replay every step and at the defaults, false
    accusations at the defaults (a verdict naming a rank), the screen's hits and what the replay did."""
    out = []
    for variant in ("order", "hetero", "spike"):
        rs = [r for r in rows if r["site"] == "clean" and r.get("variant", "order") == variant]
        if not rs:
            continue
        out.append({
            "variant": variant, "runs": len(rs),
            "false_alarms_every_step": sum(r["outcome"] == "false_alarm" for r in rs),
            "false_alarms": sum(r.get("defaults_outcome") == "false_alarm" for r in rs),
            "false_accusations": sum(r.get("defaults_outcome") == "false_alarm"
                                     and (r.get("defaults_rank") is not None or bool(r.get("defaults_suspects")))
                                     for r in rs),
            "screen_flagged": sum(r.get("defaults_screen_hits", 0) > 0 for r in rs),
            "screen_hits": int(sum(r.get("defaults_screen_hits", 0) for r in rs)),
            "screen_cleared": int(sum(r.get("defaults_screen_cleared", 0) for r in rs)),
            "screen_unconfirmed": int(sum(r.get("defaults_screen_unconfirmed", 0) for r in rs)),
        })  # fmt: skip
    return out


def defaults_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers at the defaults: harmful transient compute faults detected within one
    step with the right rank, every rank-local detection's rank, and false alarms in clean runs."""
    comp = [r for r in rows if r["site"] in COMPUTE_SITES]
    harm = [r for r in comp if r.get("harmful")]
    within = [r for r in harm if _within_one_step(r)]
    local = [r for r in rows if r["site"] in SITES and r["site"] != "checkpoint" and r.get("defaults_by")]
    clean = _clean_table(rows)
    return {
        "compute_injections": len(comp), "compute_harmful": len(harm),
        "compute_harmful_detected": sum(bool(r.get("defaults_by")) for r in harm),
        "compute_harmful_within_1": len(within),
        "compute_harmful_within_1_right_rank": sum(r["defaults_rank"] == r["rank"] for r in within),
        "compute_detected": sum(bool(r.get("defaults_by")) for r in comp),
        "rank_local_detections": len(local), "right_rank": sum(r["defaults_rank"] == r["rank"] for r in local),
        "harmful": sum(bool(r.get("harmful")) for r in rows if r["site"] in SITES),
        "harmful_detected": sum(bool(r.get("harmful")) and bool(r.get("defaults_by")) for r in rows
                                if r["site"] in SITES),
        "clean_runs": sum(c["runs"] for c in clean), "false_alarms": sum(c["false_alarms"] for c in clean),
        "false_accusations": sum(c["false_accusations"] for c in clean),
        "missed_compute": [{k: r.get(k) for k in ("id", "site", "phase", "bit_class", "rank", "step", "target", "bit",
                                                  "final_loss", "clean_loss", "nonfinite", "defaults_by",
                                                  "defaults_latency", "defaults_screen_hits")}
                           for r in harm if r not in within],
    }  # fmt: skip


def report(rows: list[dict[str, Any]], out: Path, seed: int, steps: int) -> dict[str, Any]:
    """Write results.csv/json, the PNG plot; print the table; return the summary."""
    spread = loss_spread(rows)
    mark_harmful(rows, spread["spread"])
    table = _table(rows)
    clean = [r for r in rows if r["site"] == "clean"]
    summary = {
        "seed": seed, "steps": steps, "world_size": WORLD, "injections": sum(t["injections"] for t in table),
        "clean_runs": len(clean), "false_alarms": sum(r["outcome"] == "false_alarm" for r in clean),
        "table": table, "study": study(rows), "loss_spread": spread, "defaults_table": _defaults_table(rows),
        "clean_table": _clean_table(rows), "defaults": defaults_summary(rows),
    }  # fmt: skip
    from sdc_core.io.safe_files import atomic_write_text

    for row in summary["study"]:
        print("study:", row)
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=sorted({k for r in rows for k in r}))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "results.csv", text.getvalue())
    atomic_write_text(out / "results.json", json.dumps({"summary": summary, "runs": rows}, indent=1))
    head = ["site", "bit_class", "injections", "changed", "detected", "masked", "silent", "crashed", "by_nonfinite",
            "by_replay", "by_fingerprint", "attributed", "median_latency", "diverged"]  # fmt: skip
    print(" ".join(f"{h:>14}" for h in head))
    for t in table:
        print(" ".join(f"{t[h]!s:>14}" for h in head))
    print(f"clean runs: {len(clean)}, false alarms: {summary['false_alarms']}")
    print("at the defaults:", json.dumps({k: v for k, v in summary["defaults"].items() if k != "missed_compute"}))
    plot(table, out / "detection.png")
    return summary


def study(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checkpoint alteration (1% of the entries flipped, then resume): model weights against
    optimizer state, per bit class."""
    out = []
    for target in ("weights", "optimizer"):
        for bit_class in BIT_CLASSES:
            rs = [r for r in rows if r["site"] == "study" and r["target"] == target and r["bit_class"] == bit_class]
            if not rs:
                continue
            finite = [r["final_loss"] / r["clean_loss"] for r in rs if math.isfinite(r["final_loss"])]
            out.append({
                "target": target, "bit_class": bit_class, "runs": len(rs), "changed": sum(r["changed"] for r in rs),
                "diverged": sum(r["diverged"] for r in rs),
                "crashed_on_resume": sum(bool(r.get("effect_crash")) for r in rs),
                "median_loss_ratio": sorted(finite)[len(finite) // 2] if finite else None,
                "caught_on_load": sum(r["outcome"] == "detected" for r in rs),
                "caught_at_runtime_without_fingerprint": sum(bool(r.get("runtime_detected_by")) for r in rs),
            })  # fmt: skip
    return out


def plot(table: list[dict[str, Any]], path: Path) -> bool:
    """Grouped bars: detection rate by bit class, one group per fault site. Without matplotlib
    (an optional dependency: ``pip install sdc-checks[plot]``) warns and draws nothing; returns
    whether it drew."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn("matplotlib is not installed: no detection plot (pip install matplotlib); the tables and "
                      "the coverage page are written without it", UserWarning, stacklevel=2)  # fmt: skip
        return False
    from sdc_core.io.safe_files import atomic_write

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6))
    width = 0.2
    for j, bit_class in enumerate(BIT_CLASSES):
        rates = []
        for site in SITES:
            t = next((t for t in table if t["site"] == site and t["bit_class"] == bit_class), None)
            rates.append(100 * t["detected"] / t["injections"] if t and t["injections"] else 0)
        ax.bar([i + (j - 1.5) * width for i in range(len(SITES))], rates, width, label=bit_class)
    ax.set_xticks(range(len(SITES)), SITES)
    ax.set_ylabel("detected (% of injections)")
    ax.set_ylim(0, 105)
    ax.set_title("SDC checks: detection rate by fault site and bit class")
    ax.legend(title="bit class", fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
    return True


def _main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["matmul"]:  # the compute-fault campaign of the matmul checksum check (its driver)
        parser = argparse.ArgumentParser(prog="python -m lightning_sdc.campaign matmul")
        parser.add_argument("--out", type=Path, default=Path("sdc-campaign-matmul"))
        parser.add_argument("--per-class", type=int, default=3, help="injections per phase and bit class")
        parser.add_argument("--clean", type=int, default=3)
        parser.add_argument("--workers", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--steps", type=int, default=12)
        parser.add_argument("--doc", type=Path, help="write the campaign's section of this coverage page")
        parser.add_argument("--clean-runs", type=Path, help="with --doc: the long clean runs' JSON to show too")
        parser.add_argument("--doc-only", action="store_true", help="only re-render the section from --out")
        a = parser.parse_args(argv[1:])
        if not a.doc_only:
            run_matmul_campaign(a.out, a.per_class, a.clean, a.workers, a.seed, a.steps)
        if a.doc is not None:
            write_matmul_doc(a.out, a.doc, a.clean_runs)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    worker(args.worker, args.out, args.steps)


if __name__ == "__main__":
    _main()


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else f"{part}/{whole}"


def defaults_markdown(summ: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """The coverage page's section on the callbacks at their default arguments (numbers computed)."""
    if "defaults" not in summ:  # a results.json from before the defaults column
        return []
    d, spread = summ["defaults"], summ["loss_spread"]
    head = ["site", "bit_class", "injections", "harmful", "detected", "harmful_detected", "harmful_within_1",
            "harmful_silent", "right_rank", "screen_flagged", "screen_cleared", "by"]  # fmt: skip
    lines = [
        "## At the defaults: caught in the step it happens?",
        "",
        "The same injections, trained a third time with the callbacks at their default arguments: "
        "`NonFiniteGradientCheck()` (with its every-step gradient screen, `screen=True`), `RingReplayAudit()` "
        f"(every 100 steps: of these {summ['steps']} steps only step 0 is audited; every fault here is injected "
        "later) and `WeightFingerprintCheck()` (every step). A screen hit is escalated to the flagged rank's "
        "ring partner, which recomputes its micro-batches in the same step; only a hit the partner confirms "
        'raises (`ReplayMismatchError`, `details["source"] == "gradient_screen"`, column `by`: '
        "`gradient_screen`).",
        "",
        f"**Harmful** = the run without checks crashed, or its weights or final loss are non-finite, or its "
        f"final loss is worse than the clean run's ({spread['clean_loss']:.4g}) by more than the spread of the "
        f"final losses of {spread['runs']} clean runs with other data orders (the reference order included: "
        f"{spread['min']:.4g} to {spread['max']:.4g}, spread {spread['spread']:.3g}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for t in summ["defaults_table"]:
        cells = [", ".join(f"{k} {v}" for k, v in t[h].items()) or "-" if h == "by" else
                 "-" if t[h] is None else str(t[h]) for h in head]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Columns: `detected` = a check raised at the defaults (any injection, harmful or not); `harmful_detected`, "
        "`harmful_within_1` = of the harmful ones, detected at all, and with the error naming the fault's step or "
        "the next (weight and optimizer faults happen after an update: the fingerprint of that update names them); "
        "`harmful_silent` = harmful and not detected; `right_rank` = detections that named the injected rank "
        "alone; `screen_flagged` = runs where the screen flagged a rank at least once; `screen_cleared` = screen "
        "hits the partner's recomputation reproduced (no verdict, `sdc/ring_replay/screen_cleared`); `by` = what "
        "raised first.",
        "",
        "Clean runs at the defaults (false alarms; `order` = another data order, `hetero` = every rank's batch of "
        f"every step scaled by its own factor 2^U(-{HETERO_LOG2_RANGE:g}, {HETERO_LOG2_RANGE:g}), inputs and targets, "
        f"`spike` = one rank's batch of one step with its targets x{SPIKE_FACTOR:g}, a genuine loss spike that any "
        "rank computing that batch reproduces):",
        "",
        "| clean runs | runs | false alarms, replay every step | false alarms at the defaults | false accusations "
        "at the defaults | runs the screen flagged | screen hits | cleared by the replay | unconfirmed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summ["clean_table"]:
        lines.append(f"| {c['variant']} | {c['runs']} | {c['false_alarms_every_step']} | {c['false_alarms']} | "
                     f"{c['false_accusations']} | {c['screen_flagged']} | {c['screen_hits']} | {c['screen_cleared']} "
                     f"| {c['screen_unconfirmed']} |")  # fmt: skip
    missed = d["missed_compute"]
    kinds = collections.Counter(f"{m['site']}{' ' + m['phase'] if m.get('phase') else ''} {m['bit_class']}"
                                for m in missed)  # fmt: skip
    lines += [
        "",
        "### Summary at the defaults",
        "",
        f"- **Harmful transient compute faults** ({', '.join(COMPUTE_SITES)}): detected within one step "
        f"{_pct(d['compute_harmful_within_1'], d['compute_harmful'])}, with the injected rank named in "
        f"{d['compute_harmful_within_1_right_rank']} of those; detected at all "
        f"{_pct(d['compute_harmful_detected'], d['compute_harmful'])}. Target: at least 95% within one step.",
        f"- Every harmful injection (all sites): detected {_pct(d['harmful_detected'], d['harmful'])}.",
        f"- Right rank: {d['right_rank']} of {d['rank_local_detections']} rank-local detections at the defaults "
        "named the injected rank.",
        f"- Clean runs: **{d['false_alarms']} false alarms, {d['false_accusations']} false accusations in "
        f"{d['clean_runs']}** at the defaults.",
    ]
    if missed:
        lines += ["", "Harmful compute faults not caught within one step at the defaults, by kind: "
                  + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ". Each:", "",
                  "| id | site | phase | bit class | bit | target | rank | step | final loss / clean | screen hits | "
                  "caught by, latency |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in missed:
            ratio = m["final_loss"] / m["clean_loss"] if math.isfinite(m["final_loss"]) else math.inf
            caught = f"{m['defaults_by']}, {m['defaults_latency']}" if m["defaults_by"] else "-"
            lines.append(f"| {m['id']} | {m['site']} | {m.get('phase') or '-'} | {m['bit_class']} | {m['bit']} | "
                         f"{m['target']} | {m['rank']} | {m['step']} | {ratio:.3g} | "
                         f"{int(m.get('defaults_screen_hits') or 0)} | {caught} |")  # fmt: skip
    lines += ["", *_why_defaults(summ, runs), ""]
    return lines


def _why_defaults(summ: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """What the defaults miss among the transient compute faults, and why (numbers computed)."""
    from sdc_core.checks.screen import ScreenConfig

    screen = ScreenConfig()
    comp = [r for r in runs if r["site"] in COMPUTE_SITES]
    spread = summ["loss_spread"]["spread"]
    finite = [r for r in comp if not r.get("nonfinite") and math.isfinite(r["final_loss"])]
    worst = max(finite, key=lambda r: r["final_loss"] - r["clean_loss"], default=None)
    sign = [r for r in comp if r["bit_class"] == "sign"]
    dropped = [r for r in comp if r.get("defaults_screen_nonfinite", 0) > 0 and not r.get("defaults_by")]
    flagged = [r for r in comp if r.get("defaults_screen_band", 0) > 0]
    band_caught = [r for r in flagged if r.get("defaults_by") == "gradient_screen"]
    changed = [r for r in comp if r["changed"]]
    changed_caught = [r for r in changed if _within_one_step(r)]
    every = [r for r in changed if r["outcome"] == "detected"]
    lines = [
        "### What the defaults miss among transient compute faults, and why",
        "",
        f"- **Harm needs more than one step here.** {len(comp)} transient compute faults; the largest final-loss "
        "increase of a run that stayed finite was "
        + (f"{worst['final_loss'] - worst['clean_loss']:.3g} ({worst['site']} {worst['bit_class']} bit "
           f"{worst['bit']})" if worst else "-")
        + f", against a spread of {spread:.3g} between data orders. Adam bounds each element's update to a few "
        "learning rates whatever one gradient says, so one wrong gradient in a short run moves the final loss "
        "less than another data order does; its lasting effect (a huge second moment that freezes the "
        "parameter) needs a longer training to show. Of the faults that changed the final weights at all, the "
        f"defaults caught {_pct(len(changed_caught), len(changed))} within one step (the replay every step: "
        f"{_pct(len(every), len(changed))}).",
        f"- **Sign flips** ({len(sign)} here, {sum(bool(r.get('defaults_by')) for r in sign)} caught at the "
        "defaults): the screen compares the largest magnitude of each group of gradients; a flipped sign leaves "
        "every magnitude as it was. Only the replay sees them, on the steps it audits (one in 100).",
        f"- **Growth below the band**: the screen flags a value that grew more than the band over the ranks' median "
        f"of the same step; until a value has {screen.calibration_samples} healthy deviations (longer than these "
        f"runs) the band is 2^{screen.initial_band:g}, later calibrated, at least 2^{screen.min_band:g}. Lower "
        "exponent bits (x2 to x2^64 for one element, or a shrink) and mantissa bits, and a grown element that "
        "stays under its group's largest, stay inside it. Band hits on compute faults here: "
        f"{len(flagged)} runs, {len(band_caught)} confirmed by the partner and raised.",
        f"- **A loss that overflows while the gradients stay finite** ({len(dropped)} runs here; the replay every "
        f"step caught {sum(r['outcome'] == 'detected' and r['latency'] == 0 for r in dropped)} of them in their "
        "step): the top exponent bit of one output of the last layer makes the "
        "rank's loss infinite; the screen flags the rank as `nonfinite`, but only `band` hits are escalated to "
        "the partner and the non-finite check reads the gradients, which are finite: the hit is counted "
        "(`sdc/gradient_screen/nonfinite_suspects`) and nothing is raised.",
    ]
    return lines


def markdown(results: dict[str, Any], command: str, plot_path: str | None) -> str:
    """docs/coverage.md from a campaign's results.json (numbers computed, never typed)."""
    summ, runs = results["summary"], results["runs"]
    table = summ["table"]
    head = ["site", "bit_class", "injections", "changed", "harmful", "detected", "masked", "silent", "crashed",
            "by_nonfinite", "by_replay", "by_fingerprint", "attributed", "median_latency", "diverged"]  # fmt: skip
    head = [h for h in head if all(h in t for t in table)]
    lines = [
        CAMPAIGN_SECTION[0],
        "# Detection coverage, measured",
        "",
        "What the checks catch and how often they cry wolf, from a seeded fault-injection campaign: short "
        f"Lightning DDP trainings on {summ['world_size']} CPU ranks ({summ['steps']} optimizer steps, the small "
        "model in `lightning_sdc/campaign.py`), each with one injected fault, plus clean runs. Every injection "
        "runs without checks (did it change the result? was it harmful?), with all three checks (which one "
        "caught it, was the right rank named, how many steps later) and with the three checks at their default "
        "arguments (next section but one). The replay audit runs every step in the second run to measure what "
        "it can see; at a cadence of n it audits a transient compute fault with probability 1/n.",
        "",
        "Produced by:",
        "",
        f"```bash\n{command}\n```",
        "",
        f"{summ['injections']} injections, {summ['clean_runs']} clean runs, **{summ['false_alarms']} false alarms**.",
        "",
        *([f"![detection rate by fault site and bit class]({plot_path})", ""] if plot_path else []),
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join("-" if t[h] is None else str(t[h]) for h in head) + " |" for t in table]
    injected = [r for r in runs if r["site"] in SITES]
    silent = [r for r in injected if r["outcome"] == "silent"]
    changed = [r for r in injected if r["changed"]]
    caught_changed = [r for r in changed if r["outcome"] == "detected"]
    attributed = [r for r in injected if r["outcome"] == "detected" and r["site"] != "checkpoint"]
    lines += [
        "",
        "Columns: `changed` = the fault moved the final weights by more than 1e-6 relative to the clean run; "
        "`detected` = a check raised (`by_*` says which raised first); `masked` = not detected and no change; "
        "`silent` = not detected although the result changed; `crashed` = training itself failed loudly (an "
        "exception outside the checks) before any check spoke; `attributed` = the error named the injected rank "
        "(checkpoint faults have no rank: every replica loads the same file); `median_latency` = steps from the "
        "fault to the error; `diverged` = the run without checks crashed, or its final loss is non-finite or twice "
        "the clean run's.",
        "",
        "## Summary",
        "",
        f"- Of the {len(changed)} injections that changed the result, {len(caught_changed)} were detected "
        f"({100 * len(caught_changed) / max(len(changed), 1):.0f}%); {len(silent)} were silent.",
        f"- Of {len(attributed)} detected rank-local faults, "
        f"{sum(r['attributed'] for r in attributed)} named the injected rank.",
        f"- Clean runs: {summ['false_alarms']} false alarms in {summ['clean_runs']}.",
        "",
        *defaults_markdown(summ, runs),
        "## What goes undetected, and why",
        "",
        "- **Small-magnitude compute faults** ("
        + (f"{len(silent)} silent runs here; the largest moved the final weights by "
           f"{max(r['weight_rel_diff'] for r in silent):.1e} relative" if silent else "none silent here")
        + "): sign or low exponent/mantissa "
        "flips of small activation or gradient elements change the step's loss and per-parameter gradient norm and "
        "sum by less than the replay's tolerance. With `exact=\"auto\"` (the default) a run whose replays prove "
        "bit-exact at the first audit (CPU here) is compared exactly and such faults are seen; where replays are "
        "not bit-reproducible (GPU kernels with atomics) the tolerance comes from the measured noise floor, at "
        "most `rtol=1e-3`, and faults below it pass.",
        "- **Masked faults**: a flipped activation behind a ReLU that was off, a mantissa flip absorbed by "
        "rounding. They change nothing and nothing needs to catch them.",
        "- **Unaudited steps**: a transient compute fault on a step the replay does not audit leaves no trace "
        "the other checks can see unless it produces NaN/Inf (non-finite check) or reaches only one replica's "
        "weights (fingerprint).",
        "- **Corruption every replica shares**: a checkpoint corrupted before its fingerprint was taken (in "
        "memory, or written without `WeightFingerprintCheck`), or bad data fed to every rank, leaves the replicas "
        "identical: replay and fingerprint agree with the corrupted state; only non-finite values surface "
        "(column `caught_at_runtime_without_fingerprint` below).",
        "- **Exactness on the other side**: the fingerprint is exact, so it also flags replicas that drifted "
        "by one unit in the last place (e.g. a mantissa flip in one rank's optimizer state): that is real "
        "divergence of the replicas, reported even when the effect on the loss is negligible.",
        "",
        "## Checkpoint alteration: model weights against optimizer state",
        "",
        f"As in the SBAC-PAD 2022 checkpoint-alteration study of DDP and Horovod training: flip bits in "
        f"{100 * STUDY_FRACTION:.0f}% of the entries of the model weights or of the optimizer state of a "
        f"checkpoint written at step {CKPT_STEP}, resume on every rank, train to the end and compare the final "
        "loss with the clean run.",
        "",
        "| target | bit class | runs | changed | diverged | crashed on resume | median final loss / clean | "
        "caught on load | caught at run time without the stored fingerprint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summ["study"]:
        ratio = "-" if s["median_loss_ratio"] is None else f"{s['median_loss_ratio']:.3g}"
        lines.append(f"| {s['target']} | {s['bit_class']} | {s['runs']} | {s['changed']} | {s['diverged']} | "
                     f"{s['crashed_on_resume']} | {ratio} | "
                     f"{s['caught_on_load']} | {s['caught_at_runtime_without_fingerprint']} |")  # fmt: skip
    by_target = {t: [s for s in summ["study"] if s["target"] == t] for t in ("weights", "optimizer")}
    div = {t: sum(s["diverged"] for s in v) for t, v in by_target.items()}
    runs_t = {t: sum(s["runs"] for s in v) for t, v in by_target.items()}
    verdict = "agree with" if div["weights"] > div["optimizer"] else "do not clearly reproduce"
    lines += [
        "",
        f"Diverged runs: weights {div['weights']}/{runs_t['weights']}, optimizer state "
        f"{div['optimizer']}/{runs_t['optimizer']}. Our data {verdict} the paper's finding that the model weights "
        "are more sensitive than the optimizer state. The optimizer here is Adam: a sign flip in `exp_avg_sq` "
        "(which sits under a square root) or in the `step` counter turns into NaN or a crash, so for sign flips "
        "the optimizer state is the more fragile part; for exponent and mantissa flips the two behave alike at "
        "this scale, and flips of the top exponent bit ruin either. Every altered checkpoint was caught on resume "
        "by the fingerprint stored when it was written (`sdc verify-checkpoint` gives the same verdict offline).",
        CAMPAIGN_SECTION[1],
    ]
    return "\n".join(lines)
