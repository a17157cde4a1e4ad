"""LightningCLI validates the SDC callbacks' settings from a YAML file with their own types: a value
outside a setting's choices is refused by the CLI, naming the key and the choices, before any
callback is built; a misspelled key is refused naming it; good values reach the checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import worker_env

SCRIPT = '''
import lightning.pytorch as L
import torch
from lightning.pytorch.cli import LightningCLI


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


cli = LightningCLI(Tiny, run=False, save_config_callback=None)
for cb in cli.trainer.callbacks:
    core = getattr(cb, "_core", None)
    if core is not None:
        print("BUILT", type(cb).__name__, core.config)
'''

HEAD = "trainer:\n  accelerator: cpu\n  logger: false\n  enable_progress_bar: false\n  callbacks:\n"


def _cli(tmp_path: Path, callbacks: str) -> subprocess.CompletedProcess:
    (tmp_path / "cli.py").write_text(SCRIPT)
    (tmp_path / "config.yaml").write_text(HEAD + callbacks)
    return subprocess.run([sys.executable, "cli.py", "--config", "config.yaml"], cwd=tmp_path, env=worker_env(),
                          capture_output=True, text=True, timeout=180)  # fmt: skip


@pytest.mark.parametrize(("callback", "key", "value", "choices"), [
    ("RingReplayAudit", "exact", "maybe", "Literal['auto']"),
    # the same refusal for the other checks' choices: one LightningCLI process each (slow)
    pytest.param("RingReplayAudit", "on_failure", "heal", "Literal['raise', 'skip_step', 'rollback']",
                 marks=pytest.mark.slow),
    pytest.param("WeightFingerprintCheck", "on_failure", "skip_step", "Literal['raise', 'heal', 'rollback']",
                 marks=pytest.mark.slow),
    pytest.param("NonFiniteGradientCheck", "on_failure", "ignore", "Literal['raise', 'skip_step', 'warn', 'rollback']",
                 marks=pytest.mark.slow),
])  # fmt: skip
def test_a_value_outside_the_choices_is_refused_by_the_cli(tmp_path: Path, callback: str, key: str, value: str,
                                                           choices: str) -> None:  # fmt: skip
    proc = _cli(tmp_path, f"    - class_path: lightning_sdc.{callback}\n      init_args:\n        {key}: {value}\n")
    assert proc.returncode != 0
    assert f'Parser key "{key}"' in proc.stderr and choices in proc.stderr
    assert f"Given value: {value}" in proc.stderr or f"Got value: {value}" in proc.stderr
    assert "BUILT" not in proc.stdout and "Traceback" not in proc.stderr  # refused before the callback is built


def test_a_misspelled_key_is_refused_by_name_and_good_values_reach_the_check(tmp_path: Path) -> None:
    proc = _cli(tmp_path, "    - class_path: lightning_sdc.RingReplayAudit\n      init_args:\n        every_n_step: 5\n"
                )  # fmt: skip
    assert proc.returncode != 0 and "Option 'every_n_step' is not accepted" in proc.stderr
    proc = _cli(tmp_path, "    - class_path: lightning_sdc.RingReplayAudit\n      init_args:\n        exact: true\n"
                          "        on_failure: skip_step\n        every_n_steps: 5\n")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact=True" in proc.stdout and "on_failure='skip_step'" in proc.stdout and "every_n_steps=5" in proc.stdout
