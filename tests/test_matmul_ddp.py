"""The matrix-product checksum check in real DDP training: ``torchrun`` with 3 gloo CPU ranks and
``Trainer(accelerator="cpu", devices=3, strategy="ddp")`` (tests/matmul_scenarios.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import results, torchrun

WORLD = 3
SCENARIOS = ["mm_off", "mm_clean", "mm_clean_bf16", "mm_forward", "mm_input_grad", "mm_weight_grad",
             "mm_forward_unchecked"]  # fmt: skip


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matmul3")
    script = Path(__file__).with_name("matmul_scenarios.py")
    torchrun(script, path, SCENARIOS, WORLD)
    return path


@pytest.mark.parametrize("scenario,module,phase,product", [
    ("mm_forward", "body", "forward", "output"),
    ("mm_input_grad", "head", "backward", "input_gradient"),
    ("mm_weight_grad", "body", "backward", "weight_gradient"),
])  # fmt: skip
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_wrong_product_on_rank_1_raises_on_every_rank(out: Path, scenario: str, module: str, phase: str,
                                                        product: str) -> None:  # fmt: skip
    per_rank = results(out, scenario, WORLD)
    errors = [r["error"] for r in per_rank]
    assert all(e is not None for e in errors) and all(e == errors[0] for e in errors), errors
    err = errors[0]
    assert (err["type"], err["check"], err["step"], err["rank"], err["suspects"]) == (
        "ChecksumMismatchError", "matmul_checksum", 3, 1, [1])  # fmt: skip
    assert (err["details"]["module"], err["details"]["phase"], err["details"]["product"]) == (module, phase, product)
    assert err["hosts"]["1"] and "rank 1" in err["message"] and module in err["message"]
    assert {r["global_step"] for r in per_rank} == {4}  # raised in the next step, before its update
    fired = [f for r in per_rank for f in r["fired"]]
    assert len(fired) == 1 and fired[0]["step"] == 3


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_without_the_check_the_same_fault_goes_unseen(out: Path) -> None:
    """The default checks miss a finite wrong product at a step the replay does not audit."""
    per_rank = results(out, "mm_forward_unchecked", WORLD)
    assert all(r["error"] is None for r in per_rank)
    assert [len(r["fired"]) for r in per_rank] == [0, 1, 0]
    assert len({r["weights"] for r in per_rank}) == 1  # the all-reduce spread the error to every replica


@pytest.mark.parametrize("scenario", ["mm_clean", "mm_clean_bf16"])
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_clean_runs_raise_nothing(out: Path, scenario: str) -> None:
    for r in results(out, scenario, WORLD):
        assert r["error"] is None
        state = r["states"]["MatmulChecksumCheck"]
        assert state["runs"] == 8 and state["failures"] == 0 and state["last_verified_step"] == 7


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_clean_training_is_bit_identical_with_the_check(out: Path) -> None:
    off, on = results(out, "mm_off", WORLD), results(out, "mm_clean", WORLD)
    assert [r["weights"] for r in off] == [r["weights"] for r in on]
    assert len({r["weights"] for r in on}) == 1
