"""Accelerate: real ``accelerate launch`` (3 gloo CPU ranks) and ``accelerate-sdc`` runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import ROOT, results, worker_env

SCRIPT = Path(__file__).with_name("accelerate_scenarios.py")
BIN = Path(sys.executable).parent
LAUNCH_A = [
    "settings",
    "clean",
    "audit_off",
    "audit_on",
    "nonfinite",
    "fingerprint",
    "replay",
    "heal",
    "screen",
    "compiled",
    "compiled_replay",
    "save",
    "resume",
]


def run(cmd: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc


def must(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        pytest.fail(f"{proc.args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def cli(*args: str) -> list[str]:
    exe = shutil.which("accelerate-sdc", path=str(BIN)) or "accelerate-sdc"
    return [exe, *args]


def same_error(out: Path, scenario: str, error_type: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    assert errors[0]["type"] == error_type
    return errors[0]


@pytest.fixture(scope="module")
def launch_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain ``accelerate launch``: settings from `accelerate-sdc config` plus an environment override."""
    out = tmp_path_factory.mktemp("acc_a")
    env = worker_env() | {"HF_HOME": str(out / "hf"), "ACCELERATE_USE_CPU": "1"}
    env.pop("ACCELERATE_SDC_CONFIG_FILE", None)
    must(run(cli("config", "--default", "--replay_every_n_steps", "3", "--overflow_patience", "4"), env))
    env["ACCELERATE_SDC_FINGERPRINT_EVERY_N_STEPS"] = "2"
    cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3", str(SCRIPT),
           "--out", str(out), "--accumulate", "2", "--only", ",".join(LAUNCH_A)]  # fmt: skip
    must(run(cmd, env))
    return out


def test_settings_come_from_config_workflow_then_environment(launch_a: Path) -> None:
    written = yaml.safe_load((launch_a / "hf" / "accelerate" / "sdc_config.yaml").read_text())
    assert written["replay_every_n_steps"] == 3 and written["overflow_patience"] == 4
    for r in results(launch_a, "settings", 3):
        s = r["settings"]
        assert (s["replay_every_n_steps"], s["overflow_patience"], s["fingerprint_every_n_steps"]) == (3, 4, 2)
        assert r["sources"]["replay_every_n_steps"].startswith("config file")
        assert (
            r["sources"]["fingerprint_every_n_steps"] == "environment variable ACCELERATE_SDC_FINGERPRINT_EVERY_N_STEPS"
        )


def test_clean_run_with_accumulation_raises_nothing(launch_a: Path) -> None:
    per_rank = results(launch_a, "clean", 3)
    for r in per_rank:
        assert r["error"] is None and r["step"] == 6
        checks = r["state"]["checks"]
        # the fingerprint: after each of the 6 updates, plus the final weights in finish()
        assert checks["ring_replay"]["runs"] == 3 and checks["weight_fingerprint"]["runs"] == 6 + 1
        assert all(c["failures"] == 0 for c in checks.values())
    assert len({r["weights"] for r in per_rank}) == 1


def test_the_every_step_screen_names_a_wrong_gradient_on_an_unaudited_step(launch_a: Path) -> None:
    """At the settings the config gives (the replay every 3 steps, 2 micro-batches a step), a
    wrong local gradient on rank 2 at step 4 is flagged by the screen, confirmed by the partner's
    recomputation of both micro-batches and named during the next step (the verdict is read one
    step later at the defaults)."""
    err = same_error(launch_a, "screen", "ReplayMismatchError")
    assert (err["step"], err["rank"]) == (4, 2) and err["details"]["source"] == "gradient_screen", err
    assert all(r["step"] == 5 for r in results(launch_a, "screen", 3))  # step 4's update made, step 5's not


def test_replay_has_no_side_effect(launch_a: Path) -> None:
    off, on = results(launch_a, "audit_off", 3)[0], results(launch_a, "audit_on", 3)[0]
    assert on["state"]["checks"]["ring_replay"]["runs"] == 6
    assert off["weights"] == on["weights"]


def test_each_check_names_the_faulty_rank(launch_a: Path) -> None:
    err = same_error(launch_a, "nonfinite", "NonFiniteGradientError")
    assert (err["rank"], err["step"], err["details"]["parameters"]) == (1, 2, {"1": ["stem.weight"]})
    err = same_error(launch_a, "fingerprint", "FingerprintMismatchError")
    assert (err["rank"], err["step"]) == (2, 3)
    err = same_error(launch_a, "replay", "ReplayMismatchError")
    assert (err["rank"], err["step"]) == (0, 2)


def test_a_compiled_model_is_checked(launch_a: Path) -> None:
    """The prepared model compiled (what ``Accelerator(dynamo_backend=...)`` does; it was refused): every check runs
    on a clean run, and a wrong output of rank 0 is named by the replay."""
    clean = results(launch_a, "compiled", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    assert clean[0]["state"]["checks"]["ring_replay"]["runs"] >= 5, clean[0]["state"]["checks"]
    err = same_error(launch_a, "compiled_replay", "ReplayMismatchError")
    assert (err["rank"], err["step"]) == (0, 2), err["message"]


def test_state_survives_save_and_load_state(launch_a: Path) -> None:
    saved = results(launch_a, "save", 3)[0]["state"]
    for r in results(launch_a, "resume", 3):
        assert r["error"] is None
        # resumed at step 3, ran to step 6: the counters continued
        assert r["state"]["step"] == 6
        assert r["state"]["checks"]["ring_replay"]["runs"] == saved["checks"]["ring_replay"]["runs"] + 3


def test_results_reach_the_tensorboard_tracker(launch_a: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (launch_a / "tb").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for check in ("nonfinite_gradient", "ring_replay", "weight_fingerprint"):
        assert {f"sdc/{check}/runs", f"sdc/{check}/failures", f"sdc/{check}/time_ms_total"} <= tags
    assert "sdc/ring_replay/max_diff" in tags
    # the failing scenarios logged their failure before raising
    assert max(e.value for e in acc.Scalars("sdc/weight_fingerprint/failures")) == 1


@pytest.fixture(scope="module")
def launch_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``accelerate-sdc launch`` with an accelerate config holding an ``sdc:`` section, bf16, fp16 comm hook."""
    out = tmp_path_factory.mktemp("acc_b")
    config = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 3,
        "num_machines": 1, "machine_rank": 0, "mixed_precision": "bf16", "use_cpu": True,
        "sdc": {"replay_every_n_steps": 1, "replay_rtol": 0.01, "log_every_n_steps": 1},
    }  # fmt: skip
    (out / "accelerate.yaml").write_text(yaml.safe_dump(config))
    env = worker_env() | {"HF_HOME": str(out / "hf"), "ACCELERATE_USE_CPU": "1"}  # gloo ranks on CPU
    cmd = cli("launch", "--config_file", str(out / "accelerate.yaml"), str(SCRIPT), "--out", str(out),
              "--fp16-hook", "--only", "nonfinite_late,settings,clean,nonfinite")  # fmt: skip
    must(run(cmd, env))
    return out


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_sdc_section_travels_through_accelerate_sdc_launch(launch_b: Path) -> None:
    for r in results(launch_b, "settings", 3):
        assert r["settings"]["replay_every_n_steps"] == 1 and r["settings"]["replay_rtol"] == 0.01
        assert r["sources"]["replay_rtol"] == "environment variable ACCELERATE_SDC_REPLAY_RTOL"


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_bf16_and_user_comm_hook_compose_without_false_alarm(launch_b: Path) -> None:
    for r in results(launch_b, "clean", 3):
        assert r["error"] is None and r["tap_inner"] == "fp16_compress_hook"
        assert r["state"]["checks"]["ring_replay"]["runs"] == 3  # the scenario's keyword: every 2 steps
    err = same_error(launch_b, "nonfinite", "NonFiniteGradientError")
    assert err["rank"] == 1


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_hooks_created_after_prepare_keep_the_comm_hook_accelerate_registered(launch_b: Path) -> None:
    """First scenario of the launch: ``prepare`` registers the fp16 hook itself, ``SDCHooks`` comes
    after it, keeps that hook and still names the rank."""
    for r in results(launch_b, "nonfinite_late", 3):
        assert r["registered_by_prepare"] == ["fp16_compress_hook"]  # Accelerate registered it
        assert r["tap_inner"] == "fp16_compress_hook" and r["comm_hooks"] == 1  # kept, not registered twice
    err = same_error(launch_b, "nonfinite_late", "NonFiniteGradientError")
    assert err["rank"] == 2 and err["step"] == 3


def test_plain_accelerate_launch_rejects_the_sdc_section_but_unchanged_config_works(tmp_path: Path) -> None:
    config = {"distributed_type": "MULTI_CPU", "num_processes": 1, "use_cpu": True, "sdc": {"replay_rtol": 0.01}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run([str(BIN / "accelerate"), "launch", "--config_file", str(path), str(SCRIPT)], worker_env())
    assert proc.returncode != 0 and "unknown keys" in proc.stderr + proc.stdout


def test_single_process_checks_local_gradients_and_says_replicas_are_needed(tmp_path: Path) -> None:
    env = worker_env() | {"ACCELERATE_USE_CPU": "1", "ACCELERATE_SDC_CONFIG_FILE": os.devnull}
    must(run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "single"], env))
    (r,) = results(tmp_path, "single", 1)
    assert r["error"]["type"] == "NonFiniteGradientError" and r["error"]["rank"] is None  # no witness
    assert r["error"]["details"]["pattern"] == "single_process"
    assert len(r["inactive"]) == 2  # replay and fingerprint each said so once


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("file", "'replay_rtol' (config file"),
        ("env", "ACCELERATE_SDC_FINGERPRINT_EVERY_N_STEPS"),
        ("launch", "section sdc"),
    ],
)
def test_bad_values_name_key_and_source(tmp_path: Path, where: str, message: str) -> None:
    env = worker_env() | {"ACCELERATE_SDC_CONFIG_FILE": str(tmp_path / "sdc.yaml")}
    (tmp_path / "sdc.yaml").write_text(yaml.safe_dump({"replay_rtol": 0.5 if where != "file" else 7}))
    if where == "launch":
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump({"num_processes": 1, "sdc": {"replay_rtol": "lots"}}))
        proc = run(cli("launch", "--config_file", str(tmp_path / "acc.yaml"), str(SCRIPT)), env)
    else:
        if where == "env":
            env["ACCELERATE_SDC_FINGERPRINT_EVERY_N_STEPS"] = "often"
        code = "from accelerate_sdc.config import resolve; resolve()"
        proc = run([sys.executable, "-c", code], env)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def test_keywords_override_environment_override_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate_sdc.config import resolve

    (tmp_path / "sdc.yaml").write_text(json.dumps({"replay_every_n_steps": 10, "replay_exact": True, "max_names": 2}))
    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", str(tmp_path / "sdc.yaml"))
    monkeypatch.setenv("ACCELERATE_SDC_REPLAY_EVERY_N_STEPS", "20")
    monkeypatch.setenv("ACCELERATE_SDC_MAX_NAMES", "3")
    settings, sources = resolve(max_names=4)
    assert (settings.replay_exact, settings.replay_every_n_steps, settings.max_names) == (True, 20, 4)
    assert sources["max_names"] == "keyword arguments"
    assert settings.replay().every_n_steps == 20 and settings.fingerprint().every_n_steps == 1
    assert resolve(replay_every_n_steps=0)[0].replay() is None  # 0 turns a cadence off


def test_corrupt_checkpoint_reads_and_writes_accelerate_folders(launch_a: Path, tmp_path: Path) -> None:
    from sdc_core.cli import main as sdc
    from sdc_core.io.checkpoints import Checkpoint

    src, out = launch_a / "state", tmp_path / "state_bad"
    before = {f.name: f.read_bytes() for f in src.iterdir() if f.is_file()}
    assert sdc(["corrupt-checkpoint", str(src), "-o", str(out), "--target", "all", "--count", "3", "--seed", "2"]) == 0
    assert {f.name: f.read_bytes() for f in src.iterdir() if f.is_file()} == before  # input untouched
    flips = json.loads((tmp_path / "state_bad.flips.json").read_text())["flips"]
    original = {n: t for n, _, t in Checkpoint.load(src).tensors()}
    altered = {n: t for n, _, t in Checkpoint.load(out).tensors()}
    changed = {n for n in original if not torch.equal(original[n], altered[n])}
    assert changed == {f["tensor"] for f in flips}
    for f in flips:
        assert float(altered[f["tensor"]].reshape(-1)[f["index"]]) == pytest.approx(f["new"], nan_ok=True)


def test_heal_with_accelerate_restores_identical_replicas(launch_a: Path) -> None:
    per_rank = results(launch_a, "heal", 3)
    for r in per_rank:
        assert r["error"] is None and r["step"] == 6
        assert r["state"]["checks"]["weight_fingerprint"]["extra"]["heals"] == 1
    assert len({r["weights"] for r in per_rank}) == 1
    incidents = sorted((launch_a / "tb").glob("sdc/incidents/*.json"))
    policies = {json.loads(p.read_text())["policy"] for p in incidents}
    assert "heal" in policies and "raise" in policies
