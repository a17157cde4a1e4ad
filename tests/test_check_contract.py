"""The check contract (``sdc_core.checks.contract``): a check of one's own is one ``StepCheck``
class and one registration (``SDCHooks.add_check``); the driver runs it through the phases in
the step's order and delivers what it raises like any verdict (incident, exit code, counters)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sdc_core import SDCHooks
from sdc_core.checks.contract import Check, Role, StepCheck, role_of
from sdc_core.errors import SDCError


class Recorder(StepCheck):
    """Records each phase with its step; raises a verdict before the update of ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__("recorder")
        self.fail_at = fail_at
        self.seen: list[tuple[str, int]] = []

    def after_backward(self, step: Any) -> None:
        self.seen.append(("after_backward", step.index))

    def before_update(self, step: Any) -> bool:
        self.seen.append(("before_update", step.index))
        self.stats.runs += 1
        if step.index == self.fail_at:
            self.stats.failures += 1
            raise SDCError(step=step.index, rank=0, suspects=[0], reason="the recorder's verdict")
        return step.index == 1  # drops the update of step 1

    def after_update(self, step: Any, updated: bool) -> None:
        self.seen.append(("after_update" if updated else "not_updated", step.index))

    def before_save(self, step: Any) -> None:
        self.seen.append(("before_save", step.index))

    def at_end(self, step: Any) -> None:
        self.seen.append(("at_end", step.index))


def _train(hooks: SDCHooks, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks.attach(model, opt)
    for _ in range(steps):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_a_registered_check_runs_through_the_phases_in_order(tmp_path: Path) -> None:
    check = Recorder()
    assert isinstance(check, Check) and role_of(check) is Role.STEP_CHECK
    hooks = SDCHooks(run_dir=tmp_path, replay_every_n_steps=0, fingerprint_every_n_steps=0).add_check(check)
    _train(hooks, 3)
    hooks.before_save()
    hooks.finish()
    per_step = [("after_backward", s) for s in range(3)]
    assert [e for e in check.seen if e[0] == "after_backward"] == per_step
    assert check.seen[:3] == [("after_backward", 0), ("before_update", 0), ("after_update", 0)]
    assert ("not_updated", 1) in check.seen  # its True dropped the update of step 1
    assert check.seen[-2:] == [("before_save", 3), ("at_end", 3)]
    assert hooks.metrics()["sdc/recorder/runs"] == 3  # its counters are logged with the others'


def test_a_registered_checks_verdict_is_delivered(tmp_path: Path) -> None:
    hooks = SDCHooks(run_dir=tmp_path, replay_every_n_steps=0, fingerprint_every_n_steps=0)
    hooks.add_check(Recorder(fail_at=2))
    with pytest.raises(SDCError, match="the recorder's verdict") as caught:
        _train(hooks, 4)
    assert caught.value.step == 2
    incidents = list((tmp_path / "sdc" / "incidents").glob("*.json"))
    assert len(incidents) == 1
    incident = json.loads(incidents[0].read_text())
    assert incident["step"] == 2 and "the recorder's verdict" in json.dumps(incident)


def test_a_check_without_the_contract_is_refused() -> None:
    with pytest.raises(TypeError, match="StepCheck"):
        SDCHooks().add_check(object())
