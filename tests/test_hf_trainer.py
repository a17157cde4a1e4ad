"""Hugging Face Trainer: ``SDCTrainerCallback`` on a tiny GPT-2, 3 gloo CPU ranks under real torchrun.

One launch runs a Trainer without the callback, a clean one with it (MLflow file store and
TensorBoard as its ``report_to`` trackers, read back here) and three faults.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun, worker_env

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_trainer_scenarios.py")
SCENARIOS = ["bad_settings", "plain", "clean", "weights", "nan", "activation"]
MORE = ["smoothing", "save", "resume", "resume_corrupted", "epoch_flip", "compiled"]  # a second launch, -m slow
STEPS = 4


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory.mktemp("hf"), SCENARIOS)


@pytest.fixture(scope="module")
def hf_more(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory.mktemp("hf_more"), MORE)


def _launch(out: Path, scenarios: list[str], *options: str) -> Path:
    env = worker_env() | {
        "MLFLOW_TRACKING_URI": f"file:{out / 'mlruns'}",
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "ACCELERATE_SDC_CONFIG_FILE": "/dev/null",
        "HF_HUB_OFFLINE": "1",
    }
    torchrun(SCRIPT, out, scenarios, 3, *options, timeout=600, env=env)
    return out


def same_error(out: Path, scenario: str) -> dict[str, Any]:
    errors = [r["error"] for r in results(out, scenario, 3)]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    return errors[0]


def test_clean_trainer_run_is_bit_identical_to_one_without_the_callback(hf: Path) -> None:
    plain, clean = results(hf, "plain", 3), results(hf, "clean", 3)
    assert len({r["weights"] for r in plain + clean}) == 1
    for r in clean:
        assert r["error"] is None and r["global_step"] == STEPS
        checks = r["state"]["checks"]
        assert checks["ring_replay"]["runs"] == STEPS  # every step audited, the loss x3 scaling replayed
        assert checks["nonfinite_gradient"]["runs"] == STEPS
        assert checks["weight_fingerprint"]["runs"] == STEPS + 1  # and the final weights, compared at the end
        assert checks["count_updates"]["runs"] == STEPS  # a check of one's own, given as checks=[...]
        assert all(c["failures"] == 0 for c in checks.values())
        # runs right after DefaultFlowCallback, before the trackers (they close runs in on_train_end)
        assert r["order"][:3] == ["DefaultFlowCallback", "SDCTrainerCallback", "MLflowCallback"]
        assert r["log_steps"] == [1, 2, 3, 4]  # every logging_steps, one point per step


@pytest.mark.slow  # a second launch: the default run stays under 10 minutes
def test_label_smoothing_replays_the_labels_compute_loss_pops(hf_more: Path) -> None:
    for r in results(hf_more, "smoothing", 3):
        assert r["error"] is None
        assert r["state"]["checks"]["ring_replay"]["runs"] == STEPS
        assert r["state"]["checks"]["ring_replay"]["max_diff"] == 0.0  # bit-exact on CPU


@pytest.mark.slow  # a second launch: the default run stays under 10 minutes
def test_a_compiled_trainer_model_is_checked(hf_more: Path) -> None:
    """``TrainingArguments(torch_compile=True)``: the callback attaches to the compiled DDP model (it was refused)
    and every check runs, bit-exact on CPU."""
    for r in results(hf_more, "compiled", 3):
        assert r["error"] is None and r["global_step"] == STEPS
        checks = r["state"]["checks"]
        assert checks["ring_replay"]["runs"] == STEPS and checks["ring_replay"]["max_diff"] == 0.0, checks
        assert checks["weight_fingerprint"]["failures"] == 0 and checks["nonfinite_gradient"]["runs"] == STEPS


@pytest.mark.slow  # a second launch: the default run stays under 10 minutes
def test_counters_travel_in_trainer_checkpoints(hf_more: Path) -> None:
    hf = hf_more
    saved = json.loads((hf / "save" / "checkpoint-2" / "trainer_state.json").read_text())
    counters = saved["stateful_callbacks"]["SDCTrainerCallback"]["attributes"]["sdc_state"]
    assert counters["step"] == 2 and counters["checks"]["ring_replay"]["runs"] == 2
    for r in results(hf, "resume", 3):  # resumed at step 2 from that checkpoint, trained to 4
        assert r["error"] is None and r["state"]["step"] == STEPS
        assert r["state"]["checks"]["ring_replay"]["runs"] == STEPS  # 2 saved + 2 after the resume
    # the fingerprint in trainer_state.json: `sdc verify-checkpoint` matches the folder's files (the
    # GPT-2's lm_head.weight, tied to the embedding, is not in model.safetensors); resuming from a copy
    # altered by `sdc corrupt-checkpoint` raises on every rank, naming both names of the tied tensor
    from sdc_core.cli import main as sdc

    assert sdc(["verify-checkpoint", str(hf / "save" / "checkpoint-2")]) == 0
    # a model too large for one file (save_pretrained's max_shard_size): its shards are matched together
    import shutil

    from transformers import GPT2LMHeadModel

    sharded = hf / "sharded"
    shutil.copytree(hf / "save" / "checkpoint-2", sharded)
    (sharded / "model.safetensors").unlink()
    GPT2LMHeadModel.from_pretrained(hf / "save" / "checkpoint-2").save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert sdc(["verify-checkpoint", str(sharded)]) == 0
    assert sdc(["verify-checkpoint", str(hf / "corrupted")]) == 1
    err = same_error(hf, "resume_corrupted")
    assert err["type"] == "FingerprintMismatchError"
    assert err["details"]["checkpoint_changed_tensors"] == ["model/lm_head.weight", "model/transformer.wte.weight"]


@pytest.mark.parametrize(
    ("scenario", "error_type", "rank", "step"),
    [
        ("weights", "FingerprintMismatchError", 2, 1),
        ("nan", "NonFiniteGradientError", 1, 1),
        ("activation", "ReplayMismatchError", 0, 2),
    ],
)
def test_trainer_faults_are_named_and_recorded_under_output_dir(
    hf: Path, scenario: str, error_type: str, rank: int, step: int
) -> None:
    err = same_error(hf, scenario)
    assert (err["type"], err["rank"], err["step"]) == (error_type, rank, step)
    (incident,) = (hf / scenario / "sdc" / "incidents").glob("*.json")
    assert json.loads(incident.read_text())["error"]["rank"] == rank


def test_metrics_reach_mlflow_and_tensorboard_without_duplicate_points(
    hf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17+ for a file: store
    client = MlflowClient(tracking_uri=f"file:{hf / 'mlruns'}")
    (run,) = client.search_runs(experiment_ids=["0"])
    history = client.get_metric_history(run.info.run_id, "sdc/ring_replay/runs")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert history[-1].value == STEPS
    fingerprints = client.get_metric_history(run.info.run_id, "sdc/weight_fingerprint/runs")
    assert [m.step for m in fingerprints] == [1, 2, 3, 4] and fingerprints[-1].value == STEPS + 1  # by finish
    assert run.info.status == "FINISHED"  # the final point was logged before MLflow closed the run

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (hf / "clean").rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    scalars = acc.Scalars("train/sdc/ring_replay/failures")  # the Trainer's TensorBoard prefix
    assert [e.step for e in scalars] == [1, 2, 3, 4] and scalars[-1].value == 0


def test_importing_accelerate_sdc_does_not_need_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None  # as if not installed\n"
        "import accelerate_sdc, accelerate_sdc.hooks, accelerate_sdc.cli\n"
        "try:\n    import accelerate_sdc.transformers\nexcept ImportError as err:\n    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "transformers" in proc.stdout  # only the Trainer module says it needs the extra


def test_callback_rejects_bad_settings_at_construction(hf: Path) -> None:
    message = results(hf, "bad_settings", 3)[0]["message"]
    assert "'replay_rtol' (keyword arguments)" in message


@pytest.mark.slow
def test_trainer_bf16_clean_run_and_activation_fault(tmp_path: Path) -> None:
    _launch(tmp_path, ["plain", "clean", "activation"], "--bf16")
    plain, clean = results(tmp_path, "plain", 3), results(tmp_path, "clean", 3)
    assert len({r["weights"] for r in plain + clean}) == 1
    assert all(r["error"] is None and r["state"]["checks"]["ring_replay"]["runs"] == STEPS for r in clean)
    err = same_error(tmp_path, "activation")
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 0, 2)


@pytest.mark.slow  # a second launch: the default run stays under 10 minutes
def test_a_save_decided_at_the_epoch_end_compares_the_replicas_first(hf_more: Path) -> None:
    err = same_error(hf_more, "epoch_flip")
    assert err["type"] == "FingerprintMismatchError" and err["rank"] == 2
    assert all(r["checkpoints"] == [] for r in results(hf_more, "epoch_flip", 3))  # nothing written from a bad replica


def test_a_check_that_is_not_one_is_refused_at_construction() -> None:
    from accelerate_sdc.transformers import SDCTrainerCallback

    with pytest.raises(TypeError, match=r"^not a check \(object\): subclass sdc_core.checks.contract.StepCheck$"):
        SDCTrainerCallback(checks=[object()])
