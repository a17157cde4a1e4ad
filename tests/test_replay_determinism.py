"""The ring replay audit and nondeterministic kernels: real ``torchrun`` (3 gloo CPU ranks),
``Trainer(strategy="ddp")``, one launch for the scenarios of ``determinism_scenarios.py``.

(a) With deterministic kernels (the default) the audited micro-batch and its replays are exact;
(b) with the opt-out, or a kernel torch has no deterministic version of, intermittent noise
gives no verdict over many audits; (c) a real fault is still named, with its rank, in every mode.
Plus unit tests of the deterministic window (one process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import results, torchrun

from sdc_core.replay.determinism import DeterministicWindow, deterministic
from sdc_core.replay.ring import ReplayConfig, RingReplay

WORLD = 3
SCRIPT = Path(__file__).with_name("determinism_scenarios.py")
SCENARIOS = ["det_clean", "off_clean", "fallback_clean", "off_exact", "det_fault", "off_fault", "fallback_fault",
             "bf16_attention"]  # fmt: skip


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("determinism")
    torchrun(SCRIPT, path, SCENARIOS, WORLD, timeout=600)
    return path


def clean(out: Path, scenario: str, steps: int) -> list[dict[str, Any]]:
    rows = results(out, scenario, WORLD)
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["global_step"] == steps and r["stats"]["runs"] == steps and r["stats"]["failures"] == 0
        assert r["deterministic_after"] is False  # the user's setting is back after every audit
    return rows


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_deterministic_kernels_make_the_replay_exact(out: Path) -> None:
    rows = clean(out, "det_clean", 6)
    assert all(r["mode"] == "strict" for r in rows)
    assert rows[0]["stats"]["extra"]["tolerance"] == 0.0  # bit for bit, calibrated in strict mode
    assert rows[0]["stats"]["max_diff"] == 0.0
    assert all(r["noisy_calls"] == 0 for r in rows)  # every step is audited: the owners' forwards ran inside


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_opt_out_noise_gives_no_false_verdict(out: Path) -> None:
    rows = clean(out, "off_clean", 16)
    assert all(r["mode"] == "off" for r in rows)
    assert all(r["noisy_calls"] > 0 for r in rows)  # the owners' forwards really were noisy
    extra = rows[0]["stats"]["extra"]
    assert 0 < extra["tolerance"] <= 1e-3 and rows[0]["stats"]["max_diff"] > 0


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_kernel_without_deterministic_version_falls_back_without_false_verdict(out: Path) -> None:
    rows = clean(out, "fallback_clean", 12)
    assert all(r["mode"] == "warn_only" for r in rows)  # the probe under warn_only=False failed on every rank
    assert rows[0]["stats"]["max_diff"] > 0 and rows[0]["stats"]["extra"]["tolerance"] <= 1e-3
    assert all(r["noisy_calls"] > 0 for r in rows)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_bit_equality_without_determinism_is_refused_not_blamed(out: Path) -> None:
    errors = [r["error"] for r in results(out, "off_exact", WORLD)]
    assert errors[0] is not None and all(e == errors[0] for e in errors)
    assert errors[0]["type"] == "ReplayUnavailableError", errors[0]
    assert "not evidence of a faulty device" in errors[0]["message"]


@pytest.mark.parametrize(("scenario", "rank", "step", "mode"),
                         [("det_fault", 1, 3, "strict"), ("off_fault", 2, 5, "off"),
                          ("fallback_fault", 0, 2, "warn_only")])  # fmt: skip
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_real_fault_is_named_in_every_mode(out: Path, scenario: str, rank: int, step: int, mode: str) -> None:
    errors = [r["error"] for r in results(out, scenario, WORLD)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    err = errors[0]
    assert err["type"] == "ReplayMismatchError", err
    assert (err["rank"], err["step"], err["suspects"]) == (rank, step, [rank])
    assert err["details"]["deterministic"] == mode


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_bf16_mixed_on_cpu_replays_bit_for_bit_with_dropout_and_attention(out: Path) -> None:
    """The replay runs the forward under the precision's autocast and the backward outside it, as
    Lightning does; a backward inside autocast gave other gradients on CPU (a false alarm)."""
    rows = clean(out, "bf16_attention", 4)
    assert all(r["stats"]["max_diff"] == 0.0 for r in rows)  # exact=True: bit for bit


# -- one process ---------------------------------------------------------------------------------


def test_window_switches_on_and_restores_the_callers_settings() -> None:
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              det.fill_uninitialized_memory)  # fmt: skip
    w = DeterministicWindow()
    w.enter(strict=False)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    w.enter(strict=True)  # idempotent: the settings saved first are the ones restored
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    w.exit()
    w.exit()
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
            det.fill_uninitialized_memory) == before  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic(True, strict=True):
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        with deterministic(False):
            assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_begin_arms_the_window_and_audit_disarm_and_idle_steps_close_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RingReplay, "active", property(lambda self: True))
    core = RingReplay(ReplayConfig(every_n_steps=2))
    assert core.arm(0)
    core.record(torch.zeros(1), 0)
    assert torch.are_deterministic_algorithms_enabled()  # the owner's forward and backward run inside
    assert core.audit(1, torch.nn.Linear(1, 1), lambda b, i: b.sum()) is False  # not this step: nothing
    assert not torch.are_deterministic_algorithms_enabled()
    core.arm(2)
    core.record(torch.zeros(1), 0)
    core.disarm()
    assert not torch.are_deterministic_algorithms_enabled()
    core.arm(2)
    core.record(torch.zeros(1), 0)
    assert not core.arm(3) and not torch.are_deterministic_algorithms_enabled()
    off = RingReplay(ReplayConfig(every_n_steps=1, deterministic=False))
    off.arm(0)
    off.record(torch.zeros(1), 0)
    assert not torch.are_deterministic_algorithms_enabled() and off.mode == "off"


def test_deterministic_option_is_validated() -> None:
    assert ReplayConfig().deterministic is True
    with pytest.raises(ValueError, match="deterministic"):
        ReplayConfig(deterministic="yes")  # type: ignore[arg-type]
