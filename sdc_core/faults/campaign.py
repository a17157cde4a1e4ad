"""Fault-injection campaigns: how much each check catches, and how often it cries wolf.

Plans (seeded bit flips per site and bit class plus clean runs: ``plan``; faults inside matrix products:
``plan_matmul``; errors of known size: ``plan_sizes``), the model, data and faults of every run, the classification of
runs and the summaries. Outcome per injection: detected (attributed: it named the injected rank), masked (not detected,
final weights within 1e-6 relative of the clean run's) or silent (not detected, and they differ). Knows no framework."""

from __future__ import annotations

import collections
import itertools
import math
import random
from collections.abc import Iterator
from typing import Any

import torch

from sdc_core.faults.campaign_runner import OPTIMIZERS, SITES
from sdc_core.faults.checkpoint import BIT_CLASSES, bits_of_class
from sdc_core.faults.inject import MATMUL_PHASES, Fault

COMPUTE_SITES = ("activation", "gradient", "matmul_output")  # transient compute faults: one wrong value in one step
MODULES = ("l1", "l2", "l3")  # the campaign model's layers (``Linear(16, 64)``, ``(64, 64)``, ``(64, 1)``)
PARAMS = ("l1.weight", "l1.bias", "l2.weight", "l2.bias", "l3.weight", "l3.bias")
MATMUL_TARGETS = {"forward": MODULES, "input_grad": ("l2", "l3"), "weight_grad": MODULES}  # l1's input needs no grad
WORLD = 3
BATCH = 16
CKPT_STEP = 5
STUDY_FRACTION = 0.01
HETERO_LOG2_RANGE = 2.0  # heterogeneous batches: each rank's batch of each step scaled by 2^U(-2, 2)
SPIKE_FACTOR = 1e3  # a genuine spike: one batch's targets scaled by this (its gradient about 2^10 larger)
ADAM_LR = 3e-3
SGD_LR, SGD_MOMENTUM = 0.05, 0.9  # trains the model about as far as Adam at 3e-3 does, stably, in 12 to 40 steps
SIZES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4)  # the relative errors of ``plan_sizes``: one per decade
LATE_STEP = 20  # ``plan_sizes`` injects in steps 2 .. 19 ("0-19") or LATE_STEP .. steps - 2 ("20+")
STEP_RANGES = ("0-19", "20+")
SIZES_MIN_STEPS = LATE_STEP + 2  # a late fault needs a step of its own and the next one to be named in
_NO_FAULT = {"bit_class": "-", "rank": -1, "step": -1}  # the fault fields of a clean run's spec
_BY = {"nonfinite": "nonfinite_gradient", "replay": "ring_replay", "fingerprint": "weight_fingerprint"}


def _target(site: str, turn: int, rng: random.Random) -> dict[str, Any]:
    """What an in-memory fault at ``site`` hits (a matmul fault: the ``turn``-th phase, then a layer)."""
    if site == "activation":
        return {"target": rng.choice(MODULES)}
    if site == "matmul_output":
        phase = MATMUL_PHASES[turn % len(MATMUL_PHASES)]
        return {"phase": phase, "target": rng.choice(MATMUL_TARGETS[phase])}
    return {"target": rng.choice(PARAMS)}


def _injection(i: int, sites: tuple[str, ...], steps: int, rng: random.Random) -> dict[str, Any]:
    """The ``i``-th injection of a plan over ``sites``: its site and bit class in turn, the rest drawn."""
    site, bit_class = sites[i % len(sites)], BIT_CLASSES[(i // len(sites)) % len(BIT_CLASSES)]
    spec = {"id": f"inj{i:04d}", "site": site, "bit_class": bit_class, "rank": rng.randrange(WORLD),
            "step": rng.randrange(2, steps - 3), "index": rng.randrange(10_000),
            "bit": rng.choice(bits_of_class(torch.float32, bit_class)), "seed": rng.randrange(2**31)}  # fmt: skip
    if site != "checkpoint":
        return spec | _target(site, i // len(sites), rng)  # every matmul phase x bit class in 12
    # on disk, every rank loads the same bits; both targets for every bit class
    spec["target"] = "weights" if i // (len(sites) * len(BIT_CLASSES)) % 2 == 0 else "optimizer"
    spec["step"], spec["rank"] = CKPT_STEP, -1
    return spec


def plan(injections: int, clean: int, seed: int, steps: int, study: int = 0, hard: int = 0,
         sites: tuple[str, ...] = SITES) -> list[dict[str, Any]]:  # fmt: skip
    """Seeded specs: ``sites`` and bit classes in turn, rank, step, tensor, element and bit at random;
    ``clean`` clean runs with other data orders; ``hard`` clean runs of each hard kind (heterogeneous
    batches, a genuine loss spike); ``study`` checkpoint-alteration runs per target and bit class."""
    if not sites or any(site not in SITES for site in sites):
        raise ValueError(f"sites must be some of {SITES}, got {sites!r}")
    rng = random.Random(seed)
    specs = [_injection(i, sites, steps, rng) for i in range(injections)]
    specs += [{"id": f"clean{i:03d}", "site": "clean", "variant": "order", "order": i + 1, **_NO_FAULT}
              for i in range(clean)]  # fmt: skip
    # checkpoint alteration as in the SBAC-PAD 2022 study: 1% of the entries
    specs += [{"id": f"study-{target}-{bit_class}-{i}", "site": "study", "target": target, "bit_class": bit_class,
               "rank": -1, "step": CKPT_STEP, "fraction": STUDY_FRACTION, "seed": rng.randrange(2**31)}
              for i in range(study) for target in ("weights", "optimizer") for bit_class in BIT_CLASSES]  # fmt: skip
    for i in range(hard):  # clean runs that a screen may flag
        specs.append({"id": f"hard-hetero{i:03d}", "site": "clean", "variant": "hetero", **_NO_FAULT,
                      "seed": rng.randrange(2**31)})  # fmt: skip
        specs.append({"id": f"hard-spike{i:03d}", "site": "clean", "variant": "spike", **_NO_FAULT,
                      "spike_rank": i % WORLD, "spike_step": 1 + i % (steps - 2)})  # fmt: skip
    return specs


def plan_matmul(per_class: int, clean: int, seed: int, steps: int) -> list[dict[str, Any]]:
    """Seeded faults inside matrix products: ``per_class`` per phase and bit class at steps 1 ..
    steps - 2 (the replay at its default cadence audits step 0 only), plus ``clean`` clean runs."""
    rng = random.Random(seed)
    specs = [{"id": f"mm-{phase}-{bit_class}-{i}", "site": "matmul", "phase": phase, "bit_class": bit_class,
              "rank": rng.randrange(WORLD), "step": rng.randrange(1, steps - 1),
              "target": rng.choice(MATMUL_TARGETS[phase]), "index": rng.randrange(10_000),
              "bit": rng.choice(bits_of_class(torch.float32, bit_class))}
             for phase in MATMUL_PHASES for bit_class in BIT_CLASSES for i in range(per_class)]  # fmt: skip
    return specs + [{"id": f"mm-clean{i:03d}", "site": "matmul_clean", **_NO_FAULT} for i in range(clean)]


def plan_sizes(per_cell: int, seed: int, steps: int, sites: tuple[str, ...] = COMPUTE_SITES) -> list[dict[str, Any]]:
    """Seeded faults of known size: per site of ``sites``, relative error e of ``SIZES`` and step
    range, ``per_cell`` injections multiplying one element by ``1 + e``. Raises ``ValueError`` for
    ``per_cell < 1``, ``steps < SIZES_MIN_STEPS`` or a site not in ``COMPUTE_SITES``."""
    if per_cell < 1 or steps < SIZES_MIN_STEPS:
        raise ValueError(f"--sizes needs at least 1 run per cell and --steps >= {SIZES_MIN_STEPS} (a fault at step "
                         f"{LATE_STEP} or later, and the next step), got {per_cell} and {steps}")  # fmt: skip
    if not sites or any(site not in COMPUTE_SITES for site in sites):
        raise ValueError(f"--sizes injects at some of {','.join(COMPUTE_SITES)}, got --sites {','.join(sites)}")
    rng = random.Random(seed)
    ranges = tuple(zip(STEP_RANGES, ((2, LATE_STEP), (LATE_STEP, steps - 1)), strict=True))
    return [{"id": f"size-{site}-{size:.0e}-{when}-{i:03d}", "site": site, "bit_class": "scale", "rel_error": size,
             "factor": 1.0 + size, "step_range": when, "rank": rng.randrange(WORLD), "step": rng.randrange(first, stop),
             "index": rng.randrange(10_000)} | _target(site, i, rng)
            for site in sites for size in SIZES for when, (first, stop) in ranges for i in range(per_cell)]  # fmt: skip


class CampaignModel(torch.nn.Module):
    """The small model every campaign run trains, whatever the runner: the layers ``MODULES``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """The optimizer of a campaign run: Adam (an element's update bounded to about the learning
    rate, whatever one gradient says) or SGD with momentum (one wrong gradient moves in proportion)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR)
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def base_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The reference samples (2048 inputs of width 16, targets); final losses use the first 512."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 16, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True)).sin()


def training_data(spec: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data a run trains on: ``base_data()``, or for a clean spec another order (``order``),
    every rank's batch of every step scaled by its own factor (``hetero``) or one batch's targets
    times ``SPIKE_FACTOR`` (``spike``). The runner's unshuffled DistributedSampler puts sample i
    in rank ``i % WORLD``'s batch of step ``i // WORLD // BATCH``."""
    x, y = base_data()
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


def fault_for(spec: dict[str, Any], prefix: str = "") -> Fault:
    """The ``Fault`` of an in-memory injection spec, its target under ``prefix``; a spec without
    ``bit`` (``plan_sizes``) scales its element by ``factor``."""
    site, bit = spec["site"], spec.get("bit")
    where = {"rank": spec["rank"], "step": spec["step"], "target": prefix + spec["target"], "index": spec["index"],
             "bit": bit, "factor": float(spec.get("factor", 1.5))}  # fmt: skip
    if site in ("matmul", "matmul_output"):
        return Fault("matmul_output", mode="once", phase=spec["phase"], **where)
    if site == "activation":
        return Fault("module_output", mode="once", **where)
    if site == "gradient" and bit is None:
        return Fault("gradient_scale", **where)
    kind = {"gradient": "gradient_bit_flip", "weights": "weight_bit_flip", "optimizer": "optimizer_state"}[site]
    return Fault(kind, state_key="exp_avg_sq" if spec["bit_class"] == "mantissa" else "exp_avg", **where)


def _effect(spec: dict[str, Any], effect: dict, reference: dict, keys: tuple[str, ...]) -> dict[str, Any]:
    """A row's fields from the run without checks (``effect``): ``keys`` of its spec, whether it changed
    the final weights (more than 1e-6 relative to ``reference``, or crashed), diverged (crashed, or a
    final loss non-finite or twice the clean run's) or ended non-finite."""
    w, ref = effect["weights"], reference["weights"]
    finite = bool(torch.isfinite(w).all())
    rel = float((w - ref).norm() / ref.norm()) if finite else math.inf
    crash, loss = bool(effect.get("crash")), effect["loss"]
    return {**{k: spec.get(k) for k in keys}, "changed": rel > 1e-6 or crash, "weight_rel_diff": rel,
            "final_loss": loss, "clean_loss": reference["loss"],
            "diverged": not math.isfinite(loss) or loss > 2 * reference["loss"] or crash,
            "nonfinite": not finite or not math.isfinite(loss) or crash, "crash": effect.get("crash") or ""}


def _latency(err: dict[str, Any] | None, spec: dict[str, Any]) -> int | None:
    """Steps from the spec's fault to the step the error named (None: no error, or no fault step)."""
    return err["step"] - spec["step"] if err and spec.get("step", -1) >= 0 else None


def _verdict(prefix: str, run: dict, spec: dict[str, Any]) -> dict[str, Any]:
    """One check set's verdict on a run as row fields ``<prefix>_*`` (``by``: ``gradient_screen`` for
    a replay verdict the screen escalated), and the run's counters."""
    err = run["error"]
    source = (err.get("details") or {}).get("source", "") if err else ""
    return {
        f"{prefix}_by": ("gradient_screen" if source == "gradient_screen" else err["check"]) if err else "",
        f"{prefix}_rank": err["rank"] if err else None,
        f"{prefix}_suspects": list(err.get("suspects") or []) if err else [],
        f"{prefix}_latency": _latency(err, spec),
        f"{prefix}_crash": run.get("crash") or "",
        **{f"{prefix}_{k}": v for k, v in run.get("counters", {}).items()},
    }  # fmt: skip


def outcome(spec: dict[str, Any], effect: dict, detect: dict, reference: dict,
            defaults: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One run's row: the effect, what the checks every step said (``detect``) and, when given,
    what the checks at their defaults said (``defaults_*``)."""
    row = _effect(spec, effect, reference, ("id", "site", "phase", "variant", "bit_class", "rank", "step", "target",
                                            "bit", "index"))  # fmt: skip
    err = detect["error"]
    changed = row["weight_rel_diff"] > 1e-6  # a crash without checks alone is no silent change
    row.update(detected_by=err["check"] if err else "", named_rank=err["rank"] if err else None,
               attributed=bool(err) and err["rank"] == spec.get("rank"), latency=_latency(err, spec),
               outcome="detected" if err else "crashed" if detect.get("crash") else "silent" if changed else "masked",
               crash=detect.get("crash") or row["crash"])  # fmt: skip
    if defaults is not None:
        row.update(_verdict("defaults", defaults, spec))
    return row


def sizes_outcome(spec: dict[str, Any], effect: dict, defaults: dict, reference: dict) -> dict[str, Any]:
    """One injection of ``plan_sizes``: its effect and the defaults' verdict (as in ``outcome``)."""
    keys = ("id", "site", "phase", "bit_class", "rel_error", "factor", "step_range", "rank", "step", "target", "bit",
            "index")  # fmt: skip
    return _effect(spec, effect, reference, keys) | _verdict("defaults", defaults, spec)


def matmul_outcome(spec: dict[str, Any], effect: dict, defaults: dict, matmul: dict,
                   reference: dict) -> dict[str, Any]:  # fmt: skip
    """One matmul injection: its effect and each check set's verdict."""
    row = _effect(spec, effect, reference, ("id", "site", "phase", "bit_class", "rank", "step", "target", "bit",
                                            "index"))  # fmt: skip
    for name, run in (("defaults", defaults), ("matmul", matmul)):
        err = run["error"]
        row.update({f"{name}_by": err["check"] if err else "", f"{name}_rank": err["rank"] if err else None,
                    f"{name}_latency": _latency(err, spec), f"{name}_crash": run.get("crash") or ""})
    return row


def loss_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The spread of the final losses of the reference and the clean runs with other data orders:
    how much a final loss moves without any fault."""
    ref = next((r["clean_loss"] for r in rows if "clean_loss" in r), math.nan)
    orders = [r["final_loss"] for r in rows if r["site"] == "clean" and r.get("variant", "order") == "order"]
    losses = [v for v in (ref, *orders) if math.isfinite(v)]
    return {"clean_loss": ref, "runs": len(losses), "spread": max(losses) - min(losses) if losses else 0.0,
            "min": min(losses, default=math.nan), "max": max(losses, default=math.nan)}  # fmt: skip


def accuses(rank: int | None, suspects: list[int] | None) -> bool:
    """Whether a verdict blames a device: it names a rank, or some but not all ranks as suspects
    (a verdict on every rank, ordinary divergence, blames none)."""
    return rank is not None or 0 < len(suspects or []) < WORLD


def clean_outcome(error: dict[str, Any] | None, row: dict[str, Any]) -> str:
    """A clean run's outcome under one check set: ``clean`` (no verdict), ``divergence`` (non-finite
    without checks too, and the verdict blamed no device) or ``false_alarm``."""
    if not error:
        return "clean"
    if row["nonfinite"] and not accuses(error.get("rank"), error.get("suspects")):
        return "divergence"
    return "false_alarm"


def within_one_step(r: dict[str, Any]) -> bool:
    """Whether the checks at their defaults named the row's fault in its step or the next."""
    return bool(r.get("defaults_by")) and r.get("defaults_latency") is not None and 0 <= r["defaults_latency"] <= 1


def _cells(rows: list[dict[str, Any]], **axes: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], list[dict]]]:
    """``((value, ...), rows)`` per non-empty cell of the row fields ``axes`` and their values."""
    for values in itertools.product(*axes.values()):
        rs = [r for r in rows if all(r.get(k) == v for k, v in zip(axes, values, strict=True))]
        if rs:
            yield values, rs


def _median(values: list[Any]) -> Any:
    """The upper median of ``values``, or None when there are none."""
    return sorted(values)[len(values) // 2] if values else None


def _site_tables(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per site and bit class, two tables: with the checks every step, and at their defaults."""
    table, defaults = [], []
    for (site, bit_class), rs in _cells(rows, site=SITES, bit_class=BIT_CLASSES):
        det = [r for r in rs if r["outcome"] == "detected"]
        table.append({
            "site": site, "bit_class": bit_class, "injections": len(rs), "changed": sum(r["changed"] for r in rs),
            "detected": len(det), **{k: sum(r["outcome"] == k for r in rs) for k in ("masked", "silent", "crashed")},
            "harmful": sum(bool(r.get("harmful")) for r in rs),
            **{f"by_{k}": sum(r["detected_by"] == check for r in rs) for k, check in _BY.items()},
            "attributed": sum(r["attributed"] for r in det),
            "median_latency": _median([r["latency"] for r in det if r["latency"] is not None]),
            "diverged": sum(r["diverged"] for r in rs),
        })  # fmt: skip
        det = [r for r in rs if r.get("defaults_by")]
        harm = [r for r in rs if r.get("harmful")]
        local = site != "checkpoint"  # a checkpoint has no rank: every replica loads the same file
        defaults.append({
            "site": site, "bit_class": bit_class, "injections": len(rs), "harmful": len(harm),
            "detected": len(det), "harmful_detected": sum(bool(r.get("defaults_by")) for r in harm),
            "harmful_within_1": sum(within_one_step(r) for r in harm),
            "harmful_silent": sum(not r.get("defaults_by") for r in harm),
            "right_rank": sum(r["defaults_rank"] == r["rank"] for r in det) if local else None,
            "screen_flagged": sum(r.get("defaults_screen_hits", 0) > 0 for r in rs),
            "screen_cleared": int(sum(r.get("defaults_screen_cleared", 0) for r in rs)),
            "by": dict(sorted(collections.Counter(r["defaults_by"] for r in det).items())),
        })  # fmt: skip
    return table, defaults


def _clean_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of clean run: false alarms and accusations, divergences, the screen's hits."""
    out = []
    for variant in ("order", "hetero", "spike"):
        rs = [r for r in rows if r["site"] == "clean" and r.get("variant", "order") == variant]
        if not rs:
            continue
        out.append({
            "variant": variant, "runs": len(rs),
            "false_alarms_every_step": sum(r["outcome"] == "false_alarm" for r in rs),
            "false_alarms": sum(r.get("defaults_outcome") == "false_alarm" for r in rs),
            "false_accusations": sum(accuses(r.get("defaults_rank"), r.get("defaults_suspects")) for r in rs),
            "divergences": sum(r.get("defaults_outcome") == "divergence" for r in rs),
            "screen_flagged": sum(r.get("defaults_screen_hits", 0) > 0 for r in rs),
            "screen_hits": int(sum(r.get("defaults_screen_hits", 0) for r in rs)),
            "screen_cleared": int(sum(r.get("defaults_screen_cleared", 0) for r in rs)),
            "screen_unconfirmed": int(sum(r.get("defaults_screen_unconfirmed", 0) for r in rs)),
        })  # fmt: skip
    return out


def defaults_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers at the defaults."""
    comp = [r for r in rows if r["site"] in COMPUTE_SITES]
    harm = [r for r in comp if r.get("harmful")]
    within = [r for r in harm if within_one_step(r)]
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
        "divergences": sum(c["divergences"] for c in clean),
        "missed_compute": [{k: r.get(k) for k in ("id", "site", "phase", "bit_class", "rank", "step", "target", "bit",
                                                  "final_loss", "clean_loss", "nonfinite", "defaults_by",
                                                  "defaults_latency", "defaults_screen_hits")}
                           for r in harm if r not in within],
    }  # fmt: skip


def study(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checkpoint alteration per target and bit class."""
    cells = _cells(rows, site=("study",), target=("weights", "optimizer"), bit_class=BIT_CLASSES)
    return [{
        "target": target, "bit_class": bit_class, "runs": len(rs), "changed": sum(r["changed"] for r in rs),
        "diverged": sum(r["diverged"] for r in rs),
        "crashed_on_resume": sum(bool(r.get("effect_crash")) for r in rs),
        "median_loss_ratio": _median([r["final_loss"] / r["clean_loss"] for r in rs
                                      if math.isfinite(r["final_loss"])]),
        "caught_on_load": sum(r["outcome"] == "detected" for r in rs),
        "caught_at_runtime_without_fingerprint": sum(bool(r.get("runtime_detected_by")) for r in rs),
    } for (_, target, bit_class), rs in cells]  # fmt: skip


def summarise(rows: list[dict[str, Any]], seed: int, steps: int, optimizer: str = "adam") -> dict[str, Any]:
    """The campaign's summary. Marks ``harmful`` on every injected row first: non-finite without
    checks, or a final loss worse than the clean run's by more than the clean runs' spread."""
    spread = loss_spread(rows)
    for r in rows:
        if r["site"] in SITES:
            worse = r["final_loss"] - r["clean_loss"] > spread["spread"]
            r["harmful"] = bool(r.get("nonfinite")) or not math.isfinite(r["final_loss"]) or worse
    table, defaults_table = _site_tables(rows)
    clean = [r for r in rows if r["site"] == "clean"]
    return {
        "seed": seed, "steps": steps, "optimizer": optimizer, "world_size": WORLD,
        "injections": sum(t["injections"] for t in table),
        "clean_runs": len(clean), "false_alarms": sum(r["outcome"] == "false_alarm" for r in clean),
        "table": table, "study": study(rows), "loss_spread": spread, "defaults_table": defaults_table,
        "clean_table": _clean_table(rows), "defaults": defaults_summary(rows),
    }  # fmt: skip


def named_within_one_step(r: dict[str, Any]) -> bool:
    """Whether the checks at their defaults named the row's own rank in its fault's step or the next."""
    return within_one_step(r) and r.get("defaults_rank") == r["rank"]


def sizes_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per site, relative error and step range of ``plan_sizes`` rows; ``finite``: neither the run
    without checks nor the non-finite check saw a NaN or Inf."""
    table = []
    for (site, size, when), rs in _cells(rows, site=COMPUTE_SITES, rel_error=SIZES, step_range=STEP_RANGES):
        finite = [r for r in rs if not r["nonfinite"] and r["defaults_by"] != "nonfinite_gradient"]
        table.append({
            "site": site, "rel_error": size, "steps": when, "injections": len(rs), "finite": len(finite),
            "changed": sum(r["changed"] for r in rs),
            "finite_named_within_1": sum(named_within_one_step(r) for r in finite),
            "detected": sum(bool(r["defaults_by"]) for r in rs),
            "screen_flagged": sum(r.get("defaults_screen_hits", 0) > 0 for r in rs),
        })  # fmt: skip
    return table


def matmul_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and bit class, for each check set: caught, in the fault's step, with its rank."""
    table = []
    for (_, phase, bit_class), rs in _cells(rows, site=("matmul",), phase=MATMUL_PHASES, bit_class=BIT_CLASSES):
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
