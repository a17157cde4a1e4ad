"""A verdict reaches the trackers as what it is: TensorBoard text and an MLflow tag with the incident
file as an artifact (Lightning DDP, 3 CPU ranks, a weight bit flip on rank 1), read back from the
real event file and the real MLflow file store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import worker_env

SCRIPT = '''
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_sdc import Fault, FaultInjector, SDCError, WeightFingerprintCheck

out = Path(sys.argv[1])


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(256, 8)
loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=16)
loggers = [TensorBoardLogger(out / "tb", name="run"), MLFlowLogger(tracking_uri=(out / "mlruns").as_uri())]
trainer = L.Trainer(accelerator="cpu", devices=3, strategy="ddp", max_steps=6, logger=loggers, default_root_dir=out,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    callbacks=[WeightFingerprintCheck(every_n_steps=1)] + ([] if sys.argv[2] == "clean" else [
                               FaultInjector([Fault("weight_bit_flip", rank=1, step=2, target="net.2.weight", index=3,
                                                    bit=22)])]))
try:
    trainer.fit(Regressor(), loader)
except SDCError as err:
    if trainer.is_global_zero:
        print("VERDICT", err.check, err.rank)
'''


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    (tmp_path / "run.py").write_text(SCRIPT)
    env = worker_env()
    env["MLFLOW_ALLOW_FILE_STORE"] = "true"
    return subprocess.run([sys.executable, "run.py", str(tmp_path), mode], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _texts(tmp_path: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    return [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(f"{tag}/text_summary")]


def _mlflow_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17+: a file store is read on request only
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, run


@pytest.mark.slow
def test_a_clean_run_ends_with_its_summary_in_tensorboard_and_mlflow(tmp_path: Path, monkeypatch) -> None:
    proc = _run(tmp_path, "clean")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (text,) = _texts(tmp_path, "sdc/summary")
    assert text.startswith("sdc-checks: 6 steps checked by") and text.endswith("no SDC found")
    _, run = _mlflow_run(tmp_path, monkeypatch)
    assert run.data.tags["sdc.summary"] == text


@pytest.mark.slow
def test_a_verdict_is_tensorboard_text_and_an_mlflow_tag_and_artifact(tmp_path: Path, monkeypatch) -> None:
    proc = _run(tmp_path, "fault")
    assert "VERDICT weight_fingerprint 1" in proc.stdout, proc.stderr[-4000:]
    (incident,) = list((tmp_path / "tb").rglob("sdc/incidents/*.json"))  # the run folder is the first logger's
    texts = _texts(tmp_path, "sdc/incident")
    assert len(texts) == 1 and "SDC check 'weight_fingerprint' failed" in texts[0] and incident.name in texts[0]
    client, run = _mlflow_run(tmp_path, monkeypatch)
    assert "SDC check 'weight_fingerprint' failed" in run.data.tags["sdc.incident"]
    (artifact,) = client.list_artifacts(run.info.run_id, "sdc_incidents")
    assert Path(artifact.path).name == incident.name
