"""In-process Lightning runs: one device, argument validation, checkpoints, LightningCLI."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from ddp_scenarios import Net, loader
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy

from lightning_sdc import (
    Fault,
    FaultInjector,
    MatmulChecksumCheck,
    NonFiniteGradientCheck,
    NonFiniteGradientError,
    RingReplayAudit,
    SDCError,
    StepCheckCallback,
    WeightFingerprintCheck,
)
from sdc_core.driver.settings import SDCSettings
from sdc_core.schema import describe, settings_of


def trainer(tmp_path: Path, callbacks: list, steps: int = 4, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_single_process_gradient_check_catches_nan(tmp_path: Path) -> None:
    fault = Fault("nonfinite_gradient", rank=0, step=2, target="body.bias", index=1)
    t = trainer(tmp_path, [NonFiniteGradientCheck(), FaultInjector([fault])])
    with pytest.raises(NonFiniteGradientError) as info:
        t.fit(Net(), loader())
    err = info.value
    assert isinstance(err, SDCError) and isinstance(err, RuntimeError)
    assert (err.step, err.rank, err.suspects) == (2, None, (0,))  # one process names no rank
    assert err.details["pattern"] == "single_process"
    assert err.details["parameters"] == {0: ["body.bias"]}


def test_single_process_skip_step_keeps_weights_finite(tmp_path: Path) -> None:
    check = NonFiniteGradientCheck(on_failure="skip_step")
    fault = Fault("nonfinite_gradient", rank=0, step=1, target="head.weight")
    model = Net()
    with pytest.warns(RuntimeWarning, match="nonfinite_gradient"):
        trainer(tmp_path, [check, FaultInjector([fault])]).fit(model, loader())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert check.state_dict()["extra"]["skipped_steps"] == 1


@pytest.mark.parametrize("callback", [WeightFingerprintCheck, RingReplayAudit])
def test_replica_checks_say_once_they_are_inactive(tmp_path: Path, callback: type) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [callback()]).fit(Net(), loader())
    inactive = [w for w in caught if "inactive" in str(w.message)]
    assert len(inactive) == 1 and callback.__name__ in str(inactive[0].message)


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: NonFiniteGradientCheck(on_failure="explode"), "on_failure"),
        (lambda: NonFiniteGradientCheck(overflow_patience=0), "overflow_patience"),
        (lambda: RingReplayAudit(every_n_steps=0), "every_n_steps"),
        (lambda: RingReplayAudit(rtol=2.0), "rtol"),
        (lambda: RingReplayAudit(exact="yes"), "exact"),
        (lambda: WeightFingerprintCheck(every_n_steps="1"), "every_n_steps"),
        (lambda: WeightFingerprintCheck(include_buffers=1), "include_buffers"),
        (lambda: FaultInjector([{"kind": "cosmic_ray", "rank": 0}]), "kind"),
    ],
)
def test_bad_arguments_fail_at_construction(make, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        make()


def test_lightning_cli_bad_value_names_the_callback_first(tmp_path: Path) -> None:
    """jsonargparse wraps a callback's error in a union-type message: ours comes first and names
    the callback and the argument."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  callbacks:\n"
        "    - class_path: lightning_sdc.RingReplayAudit\n      init_args: {every_n_steps: 0}\n"
    )
    with pytest.raises(Exception) as info:
        LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    errors = str(info.value).split("Errors:", 1)[-1].lstrip()
    assert errors.startswith("- RingReplayAudit: every_n_steps must be an integer >= 1, got 0"), errors


def test_unsupported_strategy_is_named(tmp_path: Path) -> None:
    t = trainer(tmp_path, [])
    t._accelerator_connector.strategy = FSDPStrategy()  # FSDP cannot run on CPU; the guard is what we test
    with pytest.raises(ValueError, match="FSDPStrategy"):
        WeightFingerprintCheck().setup(t, Net(), "fit")


def test_manual_optimization_needs_a_replay_step(tmp_path: Path) -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="sdc_replay_step"):
        trainer(tmp_path, [RingReplayAudit()]).fit(Manual(), loader())


def test_counters_resume_and_corrupted_state_is_refused(tmp_path: Path) -> None:
    check = NonFiniteGradientCheck()
    t = trainer(tmp_path, [check], steps=3)
    t.fit(Net(), loader())
    path = tmp_path / "a.ckpt"
    t.save_checkpoint(path)
    resumed = NonFiniteGradientCheck()
    trainer(tmp_path, [resumed], steps=5).fit(Net(), loader(), ckpt_path=path)
    assert resumed.state_dict()["runs"] == 5 and resumed.state_dict()["last_verified_step"] == 4

    ckpt = torch.load(path, weights_only=False)
    (key,) = [k for k in ckpt["callbacks"] if "NonFiniteGradientCheck" in k]
    ckpt["callbacks"][key] = {"runs": "many"}
    bad = tmp_path / "bad.ckpt"
    torch.save(ckpt, bad)
    before = bad.read_bytes()
    with pytest.raises(ValueError, match="corrupted SDC 'nonfinite_gradient' checkpoint state"):
        trainer(tmp_path, [NonFiniteGradientCheck()], steps=5).fit(Net(), loader(), ckpt_path=bad)
    assert bad.read_bytes() == before  # nothing lost: the file is untouched


def test_lightning_cli_yaml_configures_the_callbacks(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  callbacks:
    - class_path: lightning_sdc.NonFiniteGradientCheck
      init_args: {on_failure: skip_step, overflow_patience: 5}
    - class_path: lightning_sdc.RingReplayAudit
      init_args: {every_n_steps: 50, exact: true}
    - class_path: lightning_sdc.WeightFingerprintCheck
      init_args: {every_n_steps: 7, include_optimizer_state: true}
"""
    )
    cli = LightningCLI(Net, run=False, args=["--config", str(config)], save_config_callback=None)
    by_type = {type(cb).__name__: cb for cb in cli.trainer.callbacks}
    assert by_type["NonFiniteGradientCheck"]._core.config.on_failure == "skip_step"
    assert by_type["NonFiniteGradientCheck"]._core.config.overflow_patience == 5
    assert by_type["RingReplayAudit"]._core.config.every_n_steps == 50
    assert by_type["RingReplayAudit"]._core.config.exact is True
    assert by_type["WeightFingerprintCheck"]._core.config.every_n_steps == 7
    assert by_type["WeightFingerprintCheck"]._core.config.include_optimizer_state is True


@pytest.mark.parametrize("callback", [NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck,
                                      MatmulChecksumCheck], ids=lambda c: c.__name__)  # fmt: skip
def test_lightning_cli_help_shows_each_argument_doc_from_the_schema(
    callback: type, capsys: pytest.CaptureFixture[str]
) -> None:
    """The callbacks' ``Args:`` are built from the settings schema at import: jsonargparse reads them
    (docstring-parser) and ``--help`` shows each argument's doc, whitespace aside (argparse wraps)."""
    with pytest.raises(SystemExit):
        LightningCLI(Net, run=False, args=["--trainer.callbacks.help", f"lightning_sdc.{callback.__name__}"])
    text = "".join(capsys.readouterr().out.split())
    own = {f.name: f for f in dataclasses.fields(SDCSettings)}  # the arguments that are no config setting
    docs = {**own, "screen": own["gradient_screen"], **settings_of(type(callback()._core.config))}
    params = list(inspect.signature(callback.__init__).parameters)[1:]
    for name in params:
        assert f"--trainer.callbacks.{name}" in text, name
        assert "".join(describe(docs[name]).split()) in text, name


def test_step_check_callback_refuses_what_is_not_a_check_in_one_line() -> None:
    with pytest.raises(TypeError, match=r"^not a check \(dict\): subclass sdc_core.checks.contract.StepCheck$"):
        StepCheckCallback({"check": "mine"})


def test_a_check_of_ones_own_drops_an_update_and_is_told_the_weights_did_not_change(tmp_path: Path) -> None:
    from test_check_contract import Recorder  # returns True before the update of step 1: that update is dropped

    recorder, model = Recorder(fail_at=3), Net()
    with pytest.raises(SDCError, match="the recorder's verdict"):
        trainer(tmp_path, [StepCheckCallback(recorder)], steps=5).fit(model, loader())
    updates = [e for e in recorder.seen if e[0] in ("after_update", "not_updated")]
    assert updates == [("after_update", 0), ("not_updated", 1), ("after_update", 2)], recorder.seen
    assert recorder.seen[-1] == ("before_update", 3)  # its verdict before the update of step 3 stopped the fit
