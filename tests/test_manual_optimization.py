"""Lightning manual optimization with two optimizers (a GAN-style step), the three SDC callbacks at
their defaults, 3 gloo CPU ranks under real torchrun (``tests/gan_scenarios.py``).

What is covered (``RingReplayAudit`` docstring): the gradient check and the fingerprint see every
optimizer's step; the replay audits the batch's first optimizer step (``sdc_replay_step`` returns
its loss); ``trainer.global_step``, what ``every_n_steps`` counts, advances once per optimizer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun

SCRIPT = Path(__file__).with_name("gan_scenarios.py")
STEPS = 8  # 4 batches, two optimizer steps each


def launch(out: Path, scenarios: str) -> Path:
    torchrun(SCRIPT, out, scenarios, 3, timeout=600)
    return out


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("gan"), "clean,nan_generator,activation")


def same_error(out: Path, scenario: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    return errors[0]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_clean_gan_run_raises_nothing_and_audits_every_batch(gan: Path) -> None:
    rows = results(gan, "clean", 3)
    assert len({r["weights"] for r in rows}) == 1
    for r in rows:
        assert r["error"] is None and r["global_step"] == STEPS
        checks = r["checks"]
        assert checks["NonFiniteGradientCheck"]["runs"] == STEPS  # both optimizers' steps
        assert checks["RingReplayAudit"]["runs"] == 4  # the first optimizer step of each batch (steps 0, 2, 4, 6)
        assert checks["RingReplayAudit"]["max_diff"] == 0.0
        assert checks["WeightFingerprintCheck"]["runs"] == 5  # after each batch, and the final weights
        assert all(c["failures"] == 0 for c in checks.values())


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_nan_in_one_ranks_generator_gradient_is_named(gan: Path) -> None:
    err = same_error(gan, "nan_generator")
    assert (err["type"], err["rank"], err["step"]) == ("NonFiniteGradientError", 1, 2)
    assert err["details"]["parameters"] == {"1": ["generator.0.weight"]}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_wrong_generator_output_is_named_by_the_replay_of_the_first_step(gan: Path) -> None:
    err = same_error(gan, "activation")
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 0, 2)


@pytest.mark.slow
def test_defaults_discriminator_nan_and_missing_replay_step(tmp_path: Path) -> None:
    out = launch(tmp_path, "plain,default,nan_discriminator,no_replay_step")
    plain, default = results(out, "plain", 3), results(out, "default", 3)
    assert len({r["weights"] for r in plain + default}) == 1  # the checks change nothing in training
    for r in default:  # every_n_steps=100: only the first batch's first step is audited
        assert r["error"] is None and r["checks"]["RingReplayAudit"]["runs"] == 1
    err = same_error(out, "nan_discriminator")  # the second optimizer's step of batch 1
    assert (err["type"], err["rank"], err["step"]) == ("NonFiniteGradientError", 2, 3)
    err = same_error(out, "no_replay_step")
    assert err["type"] == "ValueError" and "sdc_replay_step" in err["message"]
    assert "first optimizer step" in err["message"]  # it says what would be replayed
