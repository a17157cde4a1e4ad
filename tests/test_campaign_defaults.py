"""The campaign's defaults column and its harmful outcome (``sdc_core.faults.campaign``): the plan,
the data of the hard clean runs as each rank's sampler deals it, the summary, and the coverage
page's campaign part written without touching the other sections; (slow) a tiny real campaign at
the defaults on 3 CPU ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from sdc_core.faults import campaign as c
from sdc_core.faults import campaign_report as cr
from sdc_core.faults import campaign_run as run


def _batches(x: torch.Tensor, rank: int, steps: int) -> list[torch.Tensor]:
    """What rank ``rank`` trains on in the campaign (Lightning's DistributedSampler, not shuffled)."""
    sampler = DistributedSampler(TensorDataset(x), num_replicas=c.WORLD, rank=rank, shuffle=False)
    order = list(sampler)
    return [x[order[c.BATCH * s : c.BATCH * (s + 1)]] for s in range(steps)]


def test_plan_has_every_site_clean_orders_and_hard_runs() -> None:
    specs = c.plan(injections=36, clean=3, seed=1, steps=12, hard=2)
    faults = [s for s in specs if s["site"] in c.SITES]
    assert {s["site"] for s in faults} == set(c.SITES) and len(faults) == 36
    products = [s for s in faults if s["site"] == "matmul_output"]
    assert {s["phase"] for s in products} == set(c.MATMUL_PHASES)
    assert all(s["target"] in c.MATMUL_TARGETS[s["phase"]] for s in products)
    assert all(2 <= s["step"] <= 8 for s in faults if s["site"] != "checkpoint")  # never step 0, the audited one
    clean = [s for s in specs if s["site"] == "clean"]
    assert [s["order"] for s in clean if s["variant"] == "order"] == [1, 2, 3]  # order 0 is the reference run
    assert sorted(s["variant"] for s in clean if s["variant"] != "order") == ["hetero", "hetero", "spike", "spike"]
    assert specs == c.plan(injections=36, clean=3, seed=1, steps=12, hard=2)
    compute = c.plan(injections=24, clean=0, seed=1, steps=40, sites=c.COMPUTE_SITES)  # --sites
    assert {s["site"] for s in compute} == set(c.COMPUTE_SITES) and len(compute) == 24
    assert {(s["site"], s["bit_class"]) for s in compute} == {(a, b) for a in c.COMPUTE_SITES for b in c.BIT_CLASSES}
    with pytest.raises(ValueError, match="sites must be"):
        c.plan(1, 0, 0, 12, sites=("wires",))
    from sdc_core.cli import campaign_parser

    assert campaign_parser().parse_args(["--sites", "gradient,matmul_output"]).sites == ("gradient", "matmul_output")


def test_sdc_campaign_finds_its_runner_through_the_entry_point(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    from lightning_sdc.campaign import RUNNER
    from sdc_core import cli
    from sdc_core.faults import campaign_runner

    runner = campaign_runner.find_runner()
    assert runner is RUNNER and runner.name == "lightning" and runner.worker_module == "lightning_sdc.campaign"
    monkeypatch.setattr(campaign_runner, "entry_points", lambda group: [])  # no framework's runner installed
    assert cli.main(["campaign", "--help"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err == ("sdc campaign: error: sdc campaign needs a framework to train with, and none is installed: "
                   "pip install 'sdc-checks[lightning]'")  # fmt: skip


def test_hard_clean_data_as_each_rank_trains_on_it() -> None:
    x0, y0 = c.base_data()
    x, y = c.training_data({"variant": "order", "order": 2})
    assert not torch.equal(x, x0)  # another order of the same samples
    assert torch.allclose(torch.sort(y0.reshape(-1)).values, torch.sort(y.reshape(-1)).values)
    assert torch.equal(c.training_data({"variant": "order", "order": 0})[0], x0)

    xh, _ = c.training_data({"variant": "hetero", "seed": 5})
    scales = []
    for rank in range(c.WORLD):
        for step, (got, base) in enumerate(zip(_batches(xh, rank, 12), _batches(x0, rank, 12), strict=True)):
            ratio = got / base
            assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio)), (rank, step)  # one factor a batch
            scales.append(math.log2(float(ratio.flatten()[0])))
    assert max(abs(s) for s in scales) <= c.HETERO_LOG2_RANGE and max(scales) - min(scales) > 2

    _, ys = c.training_data({"variant": "spike", "spike_rank": 2, "spike_step": 4})
    for rank in range(c.WORLD):
        for step, (got, base) in enumerate(zip(_batches(ys, rank, 12), _batches(y0, rank, 12), strict=True)):
            factor = c.SPIKE_FACTOR if (rank, step) == (2, 4) else 1.0
            assert torch.allclose(got, base * factor), (rank, step)


def _row(site: str, bit_class: str = "exponent_top", **kw: Any) -> dict[str, Any]:
    row = {"id": f"{site}-{len(kw)}", "site": site, "bit_class": bit_class, "rank": 1, "step": 4, "target": "l2",
           "bit": 30, "index": 0, "changed": True, "weight_rel_diff": 0.1, "final_loss": 1.0, "clean_loss": 1.0,
           "diverged": False, "nonfinite": False, "detected_by": "ring_replay", "named_rank": 1, "attributed": True,
           "latency": 0, "outcome": "detected", "crash": "", "defaults_by": "", "defaults_rank": None,
           "defaults_suspects": [], "defaults_latency": None, "defaults_screen_hits": 0.0,
           "defaults_screen_cleared": 0.0}  # fmt: skip
    row.update(kw)
    return row


def _rows() -> list[dict[str, Any]]:  # fmt: skip
    clean = [_row("clean", "-", id=f"clean{i}", variant="order", final_loss=1.0 + d, outcome="clean",
                  defaults_outcome="clean") for i, d in enumerate((0.02, -0.03))]  # fmt: skip
    clean.append(_row("clean", "-", id="hard-spike0", variant="spike", final_loss=9.0, outcome="clean",
                      defaults_outcome="clean", defaults_screen_hits=1.0, defaults_screen_cleared=1.0))  # fmt: skip
    clean.append(_row("clean", "-", id="hard-spike1", variant="spike", final_loss=math.nan, nonfinite=True,
                      outcome="divergence", defaults_outcome="divergence", defaults_by="nonfinite_gradient",
                      defaults_suspects=[0, 1, 2]))  # SGD blown up by the spike itself; every rank non-finite
    return [
        *clean,
        # harmful (worse by more than the spread 0.05), caught by the screen in its step on its rank
        _row("gradient", final_loss=1.2, defaults_by="gradient_screen", defaults_rank=1, defaults_latency=0,
             defaults_screen_hits=1.0),
        # harmful (non-finite), caught one step late by the fingerprint: within one step
        _row("activation", final_loss=math.nan, nonfinite=True, defaults_by="weight_fingerprint", defaults_rank=1,
             defaults_latency=1),
        _row("matmul_output", "sign", phase="forward", final_loss=1.3),  # harmful, missed
        _row("matmul_output", "mantissa", phase="weight_grad", final_loss=1.04),  # within the spread: not harmful
        _row("weights", final_loss=1.5, defaults_by="weight_fingerprint", defaults_rank=2, defaults_latency=0),
    ]


def test_harmful_against_the_spread_and_the_summary_at_the_defaults(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(cr, "plot", lambda table, path: False)  # drawn by the campaign tests (3 s here)
    rows = _rows()
    summary = cr.report(rows, tmp_path, seed=0, steps=12)
    assert summary["loss_spread"]["spread"] == pytest.approx(0.05) and summary["loss_spread"]["runs"] == 3
    harmful = {r["site"] + "/" + r["bit_class"]: r["harmful"] for r in rows if r["site"] in c.SITES}
    assert harmful == {"gradient/exponent_top": True, "activation/exponent_top": True, "matmul_output/sign": True,
                       "matmul_output/mantissa": False, "weights/exponent_top": True}  # fmt: skip
    d = summary["defaults"]
    assert (d["compute_harmful"], d["compute_harmful_within_1"], d["compute_harmful_within_1_right_rank"]) == (3, 2, 2)
    assert (d["rank_local_detections"], d["right_rank"]) == (3, 2)  # the weight fault named rank 2, not 1
    assert (d["clean_runs"], d["false_alarms"], d["false_accusations"], d["divergences"]) == (4, 0, 0, 1)
    assert [m["site"] for m in d["missed_compute"]] == ["matmul_output"]
    spike = next(t for t in summary["clean_table"] if t["variant"] == "spike")
    assert (spike["screen_flagged"], spike["screen_cleared"], spike["divergences"]) == (1, 1, 1)
    grad = next(t for t in summary["defaults_table"] if t["site"] == "gradient")
    assert grad["by"] == {"gradient_screen": 1} and grad["harmful_within_1"] == 1 and grad["right_rank"] == 1
    assert json.loads((tmp_path / "results.json").read_text())["summary"]["defaults"] == d


def test_a_clean_run_that_diverged_by_itself_is_no_false_alarm_unless_a_device_is_blamed() -> None:
    """A verdict on a clean run is a false alarm, and one blaming a device (a rank, or some but not
    all ranks: the hosts an incident excludes) a false accusation; a run that blew up by itself
    (non-finite without checks too) stopped by a verdict blaming none is a divergence."""
    blown, fine = {"nonfinite": True}, {"nonfinite": False}
    everyone = {"check": "nonfinite_gradient", "rank": None, "suspects": [0, 1, 2]}
    assert c.clean_outcome(None, blown) == "clean"
    assert c.clean_outcome(everyone, blown) == "divergence"
    assert c.clean_outcome(everyone, fine) == "false_alarm"  # no divergence without checks: a false alarm
    assert c.clean_outcome({**everyone, "suspects": [0, 2]}, blown) == "false_alarm"  # two hosts blamed
    assert c.clean_outcome({**everyone, "rank": 1, "suspects": [1]}, blown) == "false_alarm"
    assert not c.accuses(None, [0, 1, 2]) and not c.accuses(None, []) and c.accuses(None, [1]) and c.accuses(0, [])


def test_the_campaign_part_of_the_page_is_replaced_and_the_rest_kept(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(cr, "plot", lambda table, path: False)
    out = tmp_path / "camp"
    out.mkdir()
    cr.report(_rows(), out, seed=0, steps=12)
    doc = tmp_path / "coverage.md"
    legacy = ("# Detection coverage, measured\n\nold table\n\n## Summary\n\nold\n\n## Checkpoint alteration: x\n\n"
              "old study\n\n## Ring replay on GPUs\n\nhand-written\n\n" + cr.SECTION[0] + "\nmatmul\n" + cr.SECTION[1]
              + "\n\n## Every-step screen\n\nhand-written too\n")  # fmt: skip
    doc.write_text(legacy)
    cr.write_doc(out, doc, "sdc campaign ...")
    first = doc.read_text()
    assert "old table" not in first and "old study" not in first
    assert first.startswith(cr.CAMPAIGN_SECTION[0] + "\n# Detection coverage, measured")
    for kept in ("## Ring replay on GPUs\n\nhand-written", cr.SECTION[0] + "\nmatmul\n", "hand-written too"):
        assert kept in first
    assert "## At the defaults" in first and "| matmul_output | sign |" in first
    assert "0 false accusations in 4 at the defaults; 1 diverged by themselves" in first.replace("**", "")
    cr.write_doc(out, doc, "sdc campaign ...")  # rewritten in place, not appended twice
    assert doc.read_text() == first
    doc.write_text("")
    cr.write_doc(out, doc, "sdc campaign ...")
    assert doc.read_text().startswith(cr.CAMPAIGN_SECTION[0]) and cr.CAMPAIGN_SECTION[1] in doc.read_text()


def test_the_optimizer_option_reaches_every_training_and_the_runner_builds_it(tmp_path: Path, monkeypatch: Any) -> None:
    """``sdc campaign --optimizer sgd``: the command line, the worker's launch command, every
    training of the worker (the reference run included) and the Lightning module's optimizer."""
    from lightning_sdc.campaign import RUNNER, _module
    from sdc_core import cli
    from sdc_core.faults.campaign_runner import CampaignRunner

    got: dict[str, Any] = {}
    monkeypatch.setattr(run, "run_campaign", lambda out, **kw: got.update(kw))
    sites = ["--sites", "activation,gradient,matmul_output"]
    assert cli.main(["campaign", "--out", str(tmp_path / "a"), *sites, "--optimizer", "sgd"]) == cli.EXIT_OK
    assert got["optimizer"] == "sgd" and got["runner"] is RUNNER
    assert cli.campaign_parser().parse_args([]).optimizer == "adam"  # existing results do not change
    monkeypatch.undo()
    with pytest.raises(ValueError, match="optimizer-state faults"):  # SGD has no exp_avg / exp_avg_sq
        run.run_campaign(tmp_path / "b", injections=1, clean=0, optimizer="sgd")

    class Launched:  # the worker's launch (3 ranks): its command, run here on one rank below
        returncode = 0

        def __init__(self, cmd: list[str], **kw: Any) -> None:
            got["cmd"] = cmd

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(run.subprocess, "Popen", Launched)
    spec = {"id": "clean000", "site": "clean", "variant": "order", "order": 1, "bit_class": "-", "rank": -1,
            "step": -1}  # fmt: skip
    assert run.run_specs([spec], tmp_path, workers=1, steps=8, runner=RUNNER, optimizer="sgd") == []
    argv = got["cmd"][got["cmd"].index(RUNNER.worker_module) + 1 :]
    assert argv[argv.index("--optimizer") + 1] == "sgd"
    calls: list[tuple[int, str]] = []

    def fit(steps: int, checks: bool, optimizer: str = "adam", **kw: Any) -> dict[str, Any]:
        calls.append((steps, optimizer))
        return {"error": None, "crash": None, "weights": torch.ones(3), "loss": 0.5, "counters": {}}

    monkeypatch.setenv("RANK", "0")
    run.main(CampaignRunner(name="fake", worker_module="fake", fit=fit), argv)
    assert calls == [(8, "sgd")] * 4  # the reference run, then the clean spec's three trainings
    assert json.loads((tmp_path / "chunk0.jsonl").read_text())["outcome"] == "clean"

    sgd = _module("sgd").configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == c.SGD_MOMENTUM
    assert sgd.defaults["lr"] == c.SGD_LR and isinstance(_module().configure_optimizers(), torch.optim.Adam)
    with pytest.raises(ValueError, match="optimizer must be"):
        c.make_optimizer("lamb", torch.nn.Linear(2, 2).parameters())


@pytest.mark.slow  # a multi-process launch (about a minute on 2 cores)
def test_a_tiny_campaign_at_the_defaults(tmp_path: Path) -> None:
    """A top-exponent flip of one rank's weight gradient at an unaudited step is named by the
    screen, confirmed by the partner, in its step; a genuine spike is flagged and cleared."""
    specs = [
        {"id": "inj0000", "site": "gradient", "bit_class": "exponent_top", "rank": 1, "step": 3,
         "target": "l1.weight", "index": 7, "bit": 30, "seed": 0},
        {"id": "hard-spike000", "site": "clean", "variant": "spike", "bit_class": "-", "rank": -1, "step": -1,
         "spike_rank": 1, "spike_step": 2},  # flagged in the campaign (later spikes the level explains)
    ]  # fmt: skip
    rows = {r["id"]: r for r in run.run_specs(specs, tmp_path, workers=1, steps=8)}
    fault = rows["inj0000"]
    assert (fault["defaults_by"], fault["defaults_rank"], fault["defaults_latency"]) == ("gradient_screen", 1, 0)
    assert fault["defaults_replay_audits"] == 1  # step 0 only: the screen found it
    spike = rows["hard-spike000"]
    assert spike["defaults_outcome"] == "clean" and spike["outcome"] == "clean"
    assert spike["defaults_screen_band"] == 1 and spike["defaults_screen_cleared"] == 1  # reproduced: cleared
    assert spike["defaults_screen_confirmed"] == 0
