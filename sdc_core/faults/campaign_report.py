"""A campaign's outputs: ``results.csv``, ``results.json`` and the plot in the campaign folder (``report``), and its
part of the coverage page (``write_doc``; the rest of the page kept). Numbers are computed, never typed."""

from __future__ import annotations

import collections
import csv
import io
import json
import math
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdc_core.checks.screen import ScreenConfig
from sdc_core.faults.campaign import (
    BIT_CLASSES,
    CKPT_STEP,
    COMPUTE_SITES,
    HETERO_LOG2_RANGE,
    SITES,
    SPIKE_FACTOR,
    STUDY_FRACTION,
    summarise,
    within_one_step,
)
from sdc_core.io.safe_files import OutputError, atomic_write, atomic_write_text

SECTION = ("<!-- matmul-campaign -->", "<!-- /matmul-campaign -->")
CAMPAIGN_SECTION = ("<!-- campaign -->", "<!-- /campaign -->")  # what ``sdc campaign --doc`` writes
_GENERATED = ("# Detection coverage, measured", "## Summary", "## At the defaults", "## What goes undetected",
              "## Checkpoint alteration")  # the headings of a page written before the campaign's markers  # fmt: skip
_TABLE_COLUMNS = ["site", "bit_class", "injections", "changed", "harmful", "detected", "masked", "silent",
                  "crashed", "by_nonfinite", "by_replay", "by_fingerprint", "attributed", "median_latency",
                  "diverged"]  # fmt: skip


def md_table(head: list[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """A markdown table: its header ``head``, then a line per row of cells (None shown as ``-``)."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows)]  # fmt: skip


def make_folder(folder: Path, what: str) -> None:
    """Create ``folder`` and its parents; ``OutputError`` naming ``what`` when that fails."""
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {folder} is a file, not a folder; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {what} {folder}: {err.strerror or err}") from None


def report(rows: list[dict[str, Any]], out: Path, seed: int, steps: int, optimizer: str = "adam") -> dict[str, Any]:
    """Write results.csv/json, the PNG plot; print the table; return the summary."""
    summary = summarise(rows, seed, steps, optimizer)
    for row in summary["study"]:
        print("study:", row)
    write_results(rows, summary, out, [h for h in _TABLE_COLUMNS if h != "harmful"])
    print(f"clean runs: {summary['clean_runs']}, false alarms: {summary['false_alarms']}")
    print("at the defaults:", json.dumps({k: v for k, v in summary["defaults"].items() if k != "missed_compute"}))
    plot(summary["table"], out / "detection.png")
    return summary


def write_results(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path, head: list[str]) -> None:
    """``results.csv`` (a row per run, the rows' fields sorted as columns) and ``results.json``
    (summary and rows) in ``out``, atomically; then print the columns ``head`` of the summary's table."""
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=sorted({k for r in rows for k in r}))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out / "results.csv", text.getvalue())
    atomic_write_text(out / "results.json", json.dumps({"summary": summary, "runs": rows}, indent=1))
    print(" ".join(f"{h:>14}" for h in head))
    for t in summary["table"]:
        print(" ".join(f"{t[h]!s:>14}" for h in head))


def plot(table: list[dict[str, Any]], path: Path) -> None:
    """Detection rate by site and bit class; without matplotlib warns instead."""
    try:
        import matplotlib
    except ImportError:
        warnings.warn("matplotlib is not installed: no detection plot (pip install matplotlib); the tables and "
                      "the coverage page are written without it", UserWarning, stacklevel=2)  # fmt: skip
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6))
    width = 0.2
    cells = {(t["site"], t["bit_class"]): t for t in reversed(table)}  # the first row of each cell
    for j, bit_class in enumerate(BIT_CLASSES):
        found = [cells.get((site, bit_class)) for site in SITES]
        rates = [100 * t["detected"] / t["injections"] if t and t["injections"] else 0 for t in found]
        ax.bar([i + (j - 1.5) * width for i in range(len(SITES))], rates, width, label=bit_class)
    ax.set_xticks(range(len(SITES)), SITES)
    ax.set_ylabel("detected (% of injections)")
    ax.set_ylim(0, 105)
    ax.set_title("SDC checks: detection rate by fault site and bit class")
    ax.legend(title="bit class", fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)


def write_doc(out: Path, doc: Path, command: str) -> None:
    """Write the coverage page, its CSV and plot beside it from a campaign folder, atomically."""
    make_folder(doc.parent, "--doc's folder")
    png = doc.with_suffix(".png")
    plotted = (out / "detection.png").is_file()
    if plotted:
        atomic_write(png, lambda f: f.write((out / "detection.png").read_bytes()))
    atomic_write(doc.with_suffix(".csv"), lambda f: f.write((out / "results.csv").read_bytes()))
    text = markdown(json.loads((out / "results.json").read_text()), command, png.name if plotted else None)
    atomic_write_text(doc, with_campaign(doc.read_text() if doc.is_file() else "", text))


def section(text: str) -> str:
    """The matmul campaign's section of a coverage page (markers included), or ""."""
    start, end = text.find(SECTION[0]), text.find(SECTION[1])
    return text[start : end + len(SECTION[1])] if 0 <= start < end else ""


def with_section(text: str, part: str) -> str:
    """``text`` with its matmul section replaced by ``part`` (appended when it has none)."""
    if not part:
        return text
    old = section(text)
    return text.replace(old, part) if old else text.rstrip("\n") + "\n\n" + part + "\n"


def with_campaign(text: str, part: str) -> str:
    """The coverage page ``text`` with the campaign's part replaced by ``part``: between its markers, else (a page from
    before them) from the top to the first section it does not write. Every other section stays where it is."""
    start, end = text.find(CAMPAIGN_SECTION[0]), text.find(CAMPAIGN_SECTION[1])
    if 0 <= start < end:
        return text[:start] + part + text[end + len(CAMPAIGN_SECTION[1]) :]
    if not text.startswith(_GENERATED[0]):
        return part + "\n" + ("\n" + text if text.strip() else "")
    heading = next((m for m in re.finditer(r"^#.*", text, re.MULTILINE) if not m[0].startswith(_GENERATED)), None)
    cut = heading.start() if heading else len(text)
    if 0 <= text.find(SECTION[0]) < cut:
        cut = text.find(SECTION[0])
    return part + "\n\n" + text[cut:]


def markdown(results: dict[str, Any], command: str, plot_path: str | None) -> str:
    """docs/coverage.md from a campaign's results.json (numbers computed, never typed)."""
    summ, runs = results["summary"], results["runs"]
    defaults = [*_defaults_table(summ), *_clean_runs_table(summ), *_defaults_headline(summ["defaults"]), "",
                *_why_defaults(summ, runs), ""] if "defaults" in summ else []  # a results.json before the defaults
    return "\n".join([CAMPAIGN_SECTION[0], *_coverage_table(summ, command, plot_path), *_every_step_summary(summ, runs),
                      *defaults, *_undetected(runs), *_study_markdown(summ), CAMPAIGN_SECTION[1]])  # fmt: skip


def _coverage_table(summ: dict[str, Any], command: str, plot_path: str | None) -> list[str]:
    """The page's title, what was measured and how, the plot and the table per site and bit class."""
    table = summ["table"]
    head = [h for h in _TABLE_COLUMNS if all(h in t for t in table)]
    lines = [
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
    ]
    return lines + md_table(head, ([t[h] for h in head] for t in table))


def _every_step_summary(summ: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """What the table's columns mean, and its summary."""
    injected = [r for r in runs if r["site"] in SITES]
    silent = [r for r in injected if r["outcome"] == "silent"]
    changed = [r for r in injected if r["changed"]]
    caught_changed = [r for r in changed if r["outcome"] == "detected"]
    attributed = [r for r in injected if r["outcome"] == "detected" and r["site"] != "checkpoint"]
    return [
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
    ]


def _undetected(runs: list[dict[str, Any]]) -> list[str]:
    """What goes undetected, and why (the silent runs' largest change computed)."""
    silent = [r for r in runs if r["site"] in SITES and r["outcome"] == "silent"]
    return [
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
    ]


def _study_markdown(summ: dict[str, Any]) -> list[str]:
    """The checkpoint-alteration study: model weights against optimizer state, per bit class."""
    div = {t: sum(s["diverged"] for s in summ["study"] if s["target"] == t) for t in ("weights", "optimizer")}
    runs_t = {t: sum(s["runs"] for s in summ["study"] if s["target"] == t) for t in ("weights", "optimizer")}
    verdict = "agree with" if div["weights"] > div["optimizer"] else "do not clearly reproduce"
    return [
        "## Checkpoint alteration: model weights against optimizer state",
        "",
        f"As in the SBAC-PAD 2022 checkpoint-alteration study of DDP and Horovod training: flip bits in "
        f"{100 * STUDY_FRACTION:.0f}% of the entries of the model weights or of the optimizer state of a "
        f"checkpoint written at step {CKPT_STEP}, resume on every rank, train to the end and compare the final "
        "loss with the clean run.",
        "",
        *md_table(["target", "bit class", "runs", "changed", "diverged", "crashed on resume",
                   "median final loss / clean", "caught on load", "caught at run time without the stored fingerprint"],
                  ([s["target"], s["bit_class"], s["runs"], s["changed"], s["diverged"], s["crashed_on_resume"],
                    None if s["median_loss_ratio"] is None else f"{s['median_loss_ratio']:.3g}", s["caught_on_load"],
                    s["caught_at_runtime_without_fingerprint"]] for s in summ["study"])),
        "",
        f"Diverged runs: weights {div['weights']}/{runs_t['weights']}, optimizer state "
        f"{div['optimizer']}/{runs_t['optimizer']}. Our data {verdict} the paper's finding that the model weights "
        "are more sensitive than the optimizer state. The optimizer here is Adam: a sign flip in `exp_avg_sq` "
        "(which sits under a square root) or in the `step` counter turns into NaN or a crash, so for sign flips "
        "the optimizer state is the more fragile part; for exponent and mantissa flips the two behave alike at "
        "this scale, and flips of the top exponent bit ruin either. Every altered checkpoint was caught on resume "
        "by the fingerprint stored when it was written (`sdc verify-checkpoint` gives the same verdict offline).",
    ]


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else f"{part}/{whole}"


def _defaults_table(summ: dict[str, Any]) -> list[str]:
    """What the third training measures, ``harmful``, and its table per site and bit class."""
    spread = summ["loss_spread"]
    head = ["site", "bit_class", "injections", "harmful", "detected", "harmful_detected", "harmful_within_1",
            "harmful_silent", "right_rank", "screen_flagged", "screen_cleared", "by"]  # fmt: skip
    return [
        "## At the defaults: caught in the step it happens?",
        "",
        "The same injections, trained a third time with the callbacks at their default arguments: "
        "`NonFiniteGradientCheck()` (with its every-step gradient screen, `screen=True`), `RingReplayAudit()` "
        f"(every 100 steps: of these {summ['steps']} steps only step 0 is audited; every fault here is injected "
        "later) and `WeightFingerprintCheck()` (every step). A screen hit is escalated to the flagged rank's "
        "ring partner, which recomputes its micro-batches one step later, on the weights after the update; only a "
        'hit the partner confirms raises (`ReplayMismatchError`, `details["source"] == "gradient_screen"`, column '
        "`by`: `gradient_screen`).",
        "",
        f"**Harmful** = the run without checks crashed, or its weights or final loss are non-finite, or its "
        f"final loss is worse than the clean run's ({spread['clean_loss']:.4g}) by more than the spread of the "
        f"final losses of {spread['runs']} clean runs with other data orders (the reference order included: "
        f"{spread['min']:.4g} to {spread['max']:.4g}, spread {spread['spread']:.3g}).",
        "",
        *md_table(head, ([", ".join(f"{k} {v}" for k, v in t[h].items()) or "-" if h == "by" else t[h] for h in head]
                         for t in summ["defaults_table"])),
        "",
        "Columns: `detected` = a check raised at the defaults (any injection, harmful or not); `harmful_detected`, "
        "`harmful_within_1` = of the harmful ones, detected at all, and with the error naming the fault's step or "
        "the next (weight and optimizer faults happen after an update: the fingerprint of that update names them); "
        "`harmful_silent` = harmful and not detected; `right_rank` = detections that named the injected rank "
        "alone; `screen_flagged` = runs where the screen flagged a rank at least once; `screen_cleared` = screen "
        "hits the partner's recomputation reproduced (no verdict, `sdc/ring_replay/screen_cleared`); `by` = what "
        "raised first.",
    ]


def _clean_runs_table(summ: dict[str, Any]) -> list[str]:
    """False alarms and the screen's hits per kind of clean run, at the defaults."""
    return [
        "",
        "Clean runs at the defaults (false alarms; `order` = another data order, `hetero` = every rank's batch of "
        f"every step scaled by its own factor 2^U(-{HETERO_LOG2_RANGE:g}, {HETERO_LOG2_RANGE:g}), inputs and targets, "
        f"`spike` = one rank's batch of one step with its targets x{SPIKE_FACTOR:g}, a genuine loss spike that any "
        "rank computing that batch reproduces):",
        "",
        *md_table(["clean runs", "runs", "false alarms, replay every step", "false alarms at the defaults",
                   "false accusations at the defaults", "diverged by themselves, stopped blaming no device",
                   "runs the screen flagged", "screen hits", "cleared by the replay", "unconfirmed"],
                  ([c["variant"], c["runs"], c["false_alarms_every_step"], c["false_alarms"], c["false_accusations"],
                    c.get("divergences", 0), c["screen_flagged"], c["screen_hits"], c["screen_cleared"],
                    c["screen_unconfirmed"]] for c in summ["clean_table"])),
    ]


def _defaults_headline(d: dict[str, Any]) -> list[str]:
    """The headline numbers at the defaults, and each harmful compute fault not caught within one step."""
    missed = d["missed_compute"]
    kinds = collections.Counter(f"{m['site']}{' ' + m['phase'] if m.get('phase') else ''} {m['bit_class']}"
                                for m in missed)  # fmt: skip
    lines = [
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
        f"{d['clean_runs']}** at the defaults"
        + (f"; {d['divergences']} diverged by themselves (non-finite without checks too) and were stopped with a "
           "verdict blaming no device." if d.get("divergences") else "."),
    ]
    if missed:
        each = []
        for m in missed:
            ratio = m["final_loss"] / m["clean_loss"] if math.isfinite(m["final_loss"]) else math.inf
            each.append([m["id"], m["site"], m.get("phase") or "-", m["bit_class"], m["bit"], m["target"], m["rank"],
                         m["step"], f"{ratio:.3g}", int(m.get("defaults_screen_hits") or 0),
                         f"{m['defaults_by']}, {m['defaults_latency']}" if m["defaults_by"] else "-"])  # fmt: skip
        lines += ["", "Harmful compute faults not caught within one step at the defaults, by kind: "
                  + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ". Each:", "",
                  *md_table(["id", "site", "phase", "bit class", "bit", "target", "rank", "step", "final loss / clean",
                             "screen hits", "caught by, latency"], each)]  # fmt: skip
    return lines


def _why_defaults(summ: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """What the defaults miss among the transient compute faults, and why (numbers computed)."""
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
    changed_caught = [r for r in changed if within_one_step(r)]
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
        f"of the same step; until a value has {screen.calibration_samples} healthy deviations the band is "
        f"2^{screen.initial_band:g} (the groups' values: a band from all groups pooled, once that pool has "
        f"about 100), later calibrated, at least 2^{screen.min_band:g}. Lower "
        "exponent bits (x2 to x2^64 for one element, or a shrink) and mantissa bits, and a grown element that "
        "stays under its group's largest, stay inside it. Band hits on compute faults here: "
        f"{len(flagged)} runs, {len(band_caught)} confirmed by the partner and raised.",
    ]
    if dropped:  # a non-finite loss from finite gradients is escalated; what stays is a hit nobody confirmed
        lines.append(
            f"- **A non-finite value the screen flagged and nothing raised** ({len(dropped)} runs here; the replay "
            f"every step caught {sum(r['outcome'] == 'detected' and r['latency'] == 0 for r in dropped)} of them "
            "in their step): the screen named the rank `nonfinite` (`sdc/gradient_screen/nonfinite_suspects`), "
            "but no check raised: the partner's recomputation did not confirm the hit "
            "(`sdc/ring_replay/screen_unconfirmed`), or the non-finite check's verdict was not read before the run "
            "ended.")
    return lines
