"""The every-step screen in real DDP (3 gloo ranks under torchrun, ``screen_scenarios.py``): a small
transformer on heterogeneous batches (short and long sequences, token-budget batch sizes,
imbalanced labels) with dropout and a learning-rate warm-up."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import results, torchrun

SCRIPT = Path(__file__).with_name("screen_scenarios.py")
WORLD = 3


def flags(result: dict) -> dict[int, list[int]]:
    return {r["step"]: r["ranks"] for r in result["results"] if r["ranks"]}


@pytest.mark.slow  # a 3-rank launch (about 10 s); the default run keeps the screen end to end in test_screen_escalation
def test_a_clean_stretch_never_flags_and_faults_name_their_rank_at_their_step(tmp_path: Path) -> None:
    """One launch, 50 steps: steps 0-29 clean (the warm-up included) and no flag, then a fault on
    rank 1 at step 30 and one on rank 2 at step 45, each named at its step, and no other flag."""
    torchrun(SCRIPT, tmp_path, "faults", WORLD, timeout=300)
    faulty = results(tmp_path, "faults", WORLD)
    assert all(r["results"] == faulty[0]["results"] for r in faulty)  # every rank the same verdicts
    assert [r["step"] for r in faulty[0]["results"]] == list(range(50))
    rows = faulty[0]["rows"]  # each judged step's gathered rows: every rank's own, in the reused buffers
    assert all(row[0] == int(step) and row[1] == len(row) - 2 for step, table in rows.items() for row in table)
    assert len(rows) == 50 and all(len(table) == WORLD for table in rows.values())
    assert flags(faulty[0]) == {30: [1], 45: [2]}, faulty[0]["results"]
    at30, at45 = (faulty[0]["results"][s]["details"] for s in (30, 45))
    assert at30["1"]["reason"] == "band" and at45["2"]["reason"] == "band"
    assert "enc.linear2.weight" in at45["2"]["value"]
    assert faulty[1]["stats"]["sdc/gradient_screen/hits"] == 2.0
    assert all(r["losses"][-1] < r["losses"][0] for r in faulty)  # it trains


def test_in_neighbourhoods_a_fault_is_named_at_its_step_and_every_row_gathered_only_then(tmp_path: Path) -> None:
    """A larger world's way, on 4 gloo ranks (neighbourhoods of 2 instead of 8, forced): each rank
    judges its own row with its two ring predecessors', one all_reduce says whether any window stood
    out, and only then are every rank's rows gathered and judged. The same 50 steps as above: the
    faults on rank 1 at step 30 and rank 2 at step 45 are named at their steps, on every rank alike,
    and the full gather ran on those two steps only."""
    world = 4
    torchrun(SCRIPT, tmp_path, "faults", world, "--neighbours", "2", timeout=300)
    out = results(tmp_path, "faults", world)
    assert all(r["neighbourhoods"] for r in out)
    assert all(r["results"] == out[0]["results"] for r in out)  # every rank the same verdicts
    assert [r["step"] for r in out[0]["results"]] == list(range(50))
    assert flags(out[0]) == {30: [1], 45: [2]}, out[0]["results"]
    assert all(r["gathered"] == [30, 45] for r in out), [r["gathered"] for r in out]
    assert out[0]["stats"]["sdc/gradient_screen/neighbourhood_flags"] == 2.0
    assert all(r["losses"][-1] < r["losses"][0] for r in out)  # it trains


@pytest.mark.slow  # a 3-rank launch; the default run has the early band's unit test
def test_a_fault_in_the_first_steps_is_named_at_its_step(tmp_path: Path) -> None:
    """12 steps, a finite x 1e5 error in one element of a weight gradient on rank 1 at step 7, long
    before any value has calibrated its own band: the groups' pooled early band (under the initial
    2^10, which would have missed it) names rank 1 at step 7, every rank alike, and nothing else."""
    torchrun(SCRIPT, tmp_path, "early", WORLD, timeout=300)
    out = results(tmp_path, "early", WORLD)
    assert all(r["results"] == out[0]["results"] for r in out)
    assert flags(out[0]) == {7: [1]}, out[0]["results"]
    hit = out[0]["results"][7]
    assert not hit["calibrated"] and "enc.linear1.weight" in hit["details"]["1"]["value"]
    assert 5.0 <= hit["details"]["1"]["band"] < hit["details"]["1"]["excess"] < 10.0, hit  # the initial band: missed


@pytest.mark.slow
def test_a_clean_run_never_flags(tmp_path: Path) -> None:
    """60 clean steps, every rank the same verdicts, no flag."""
    torchrun(SCRIPT, tmp_path, "clean", WORLD, timeout=300)
    clean = results(tmp_path, "clean", WORLD)
    assert all(r["results"] == clean[0]["results"] for r in clean)
    assert len(clean[0]["results"]) == 60 and flags(clean[0]) == {}
    assert clean[0]["losses"][-1] < clean[0]["losses"][0]


@pytest.mark.slow
def test_rates(tmp_path: Path) -> None:
    """Many clean steps and one random fault every third step (every site and bit class): no
    wrong rank is ever named; every non-finite effect and at least 9 in 10 faults that dominate
    their step's gradient (relative change >= 1) are flagged at their step on their rank; clean
    steps flag rarely."""
    torchrun(SCRIPT, tmp_path, "rates", WORLD, "--steps", "600", "--every", "3", timeout=900)
    out = results(tmp_path, "rates", WORLD)[0]
    clean = out["clean"]
    false_flags = sum(bool(r["ranks"]) for r in clean)
    assert false_flags <= len(clean) // 100, [r for r in clean if r["ranks"]]
    big: list[dict] = []
    for inj in out["injections"]:
        assert inj["ranks"] in ([], [inj["rank"]]), inj  # never a wrong rank
        if inj["rel_change"] == "nonfinite":
            assert inj["ranks"] == [inj["rank"]], inj  # every non-finite effect, at its step
        elif inj["rel_change"] >= 1.0:
            big.append(inj)
    # a dominant finite fault can stay under its band (an exponent flip of x256 under a band of 2^8-2^10):
    # the measured rate is 35/36 (docs/coverage.md); at least 9 in 10 here
    caught = sum(inj["ranks"] == [inj["rank"]] for inj in big)
    assert caught >= 0.9 * len(big), [inj for inj in big if inj["ranks"] != [inj["rank"]]]
