"""Lightning Fabric: ``lightning_sdc.fabric.SDCHooks`` with 3 gloo CPU ranks under real torchrun."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun, worker_env

SCRIPT = Path(__file__).with_name("fabric_scenarios.py")
SCENARIOS = ["clean", "audit_off", "audit_on", "nonfinite", "fingerprint", "replay", "heal", "skip", "clip", "save",
             "resume", "resume_corrupted"]  # fmt: skip


def launch(out: Path, scenarios: list[str], *options: str) -> Path:
    env = worker_env() | {"ACCELERATE_SDC_CONFIG_FILE": "/dev/null"}
    torchrun(SCRIPT, out, scenarios, 3, *options, timeout=600, env=env)
    return out


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("fabric"), SCENARIOS)


def same_error(out: Path, scenario: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    return errors[0]


def test_clean_fabric_run_with_accumulation_trains_as_without_the_audit(fab: Path) -> None:
    runs = {name: results(fab, name, 3) for name in ("clean", "audit_off", "audit_on")}
    assert len({r["weights"] for rs in runs.values() for r in rs}) == 1
    for r in runs["clean"]:
        assert r["error"] is None and r["step"] == 6 and r["step_restored"]
        checks = r["state"]["checks"]
        assert (checks["ring_replay"]["runs"], checks["weight_fingerprint"]["runs"]) == (3, 7)  # 6 + final
        assert all(c["failures"] == 0 for c in checks.values())
    assert results(fab, "audit_on", 3)[0]["state"]["checks"]["ring_replay"]["runs"] == 6


@pytest.mark.parametrize(
    ("scenario", "error_type", "rank", "step"),
    [
        ("nonfinite", "NonFiniteGradientError", 1, 2),
        ("fingerprint", "FingerprintMismatchError", 2, 3),
        ("replay", "ReplayMismatchError", 0, 2),
        # fabric.clip_gradients raises a plain RuntimeError on NaN: the verdict naming the rank leaves instead
        ("clip", "NonFiniteGradientError", 1, 2),
    ],
)
def test_fabric_faults_are_named(fab: Path, scenario: str, error_type: str, rank: int, step: int) -> None:
    err = same_error(fab, scenario)
    assert (err["type"], err["rank"], err["step"]) == (error_type, rank, step)
    (incident,) = (fab / scenario / "sdc" / "incidents").glob("*.json")
    assert json.loads(incident.read_text())["policy"] == "raise"


def test_fabric_heal_and_skip_step_leave_identical_replicas(fab: Path) -> None:
    for name, key, extra in (("heal", "weight_fingerprint", "heals"), ("skip", "nonfinite_gradient", "skipped_steps")):
        per_rank = results(fab, name, 3)
        assert len({r["weights"] for r in per_rank}) == 1
        for r in per_rank:
            assert r["error"] is None and r["step"] == 6
            assert r["state"]["checks"][key]["extra"][extra] == 1


def test_fabric_save_and_load_carry_the_counters(fab: Path) -> None:
    saved = results(fab, "save", 3)[0]["state"]
    for r in results(fab, "resume", 3):
        assert r["error"] is None and r["state"]["step"] == 6
        assert r["state"]["checks"]["ring_replay"]["runs"] == saved["checks"]["ring_replay"]["runs"] + 3
    # the file altered by `sdc corrupt-checkpoint`: every rank's fabric.load raises, naming the tensor
    flips = json.loads((fab / "state_corrupted.ckpt.flips.json").read_text())["flips"]
    err = same_error(fab, "resume_corrupted")
    assert err["type"] == "FingerprintMismatchError" and flips[0]["tensor"] in err["message"]
    assert err["details"]["checkpoint_changed_tensors"] == [flips[0]["tensor"]]


def test_fabric_metrics_one_point_per_step(fab: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (fab / "tb").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    # the clean scenario runs first and logs every step: the point of step s is written once, with
    # the fingerprints of the s updates before it resolved; the final one (step 6) by finish(),
    # which also compares the final weights (7 comparisons)
    points = acc.Scalars("sdc/weight_fingerprint/runs")[:6]
    assert [(e.step, e.value) for e in points] == [(s, s) for s in range(1, 6)] + [(6, 7)]


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["replayable", "forward"])
def test_fabric_bf16_mixed_replays_as_fabric_ran_it(tmp_path: Path, capture: str) -> None:
    """bf16-mixed casts the inputs to bfloat16 in the Fabric module: the replay must too."""
    out = launch(tmp_path, ["audit_off", "audit_on", "replay"], "--precision", "bf16-mixed", "--capture", capture)
    off, on = results(out, "audit_off", 3), results(out, "audit_on", 3)
    assert len({r["weights"] for r in off + on}) == 1
    assert all(r["error"] is None and r["state"]["checks"]["ring_replay"]["runs"] == 6 for r in on)
    err = same_error(out, "replay")
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 0, 2)


def test_fabric_pre_save_hook_runs_once_after_detach_and_reattach(tmp_path: Path) -> None:
    """The seam wraps ``fabric.save`` once: hooks removed and added again (detach, attach) run once per save."""
    import torch
    from lightning.fabric import Fabric

    from lightning_sdc.fabric import FabricFramework

    fabric = Fabric(accelerator="cpu", devices=1)
    seam = FabricFramework(fabric)
    calls: list[Any] = []
    seam.before_checkpoint(lambda *args: calls.append("first")).remove()
    seam.before_checkpoint(lambda *args: calls.append("second"))
    fabric.save(tmp_path / "state.ckpt", {"model": torch.nn.Linear(2, 2)})
    assert calls == ["second"]
