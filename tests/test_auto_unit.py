"""Zero-code enable: parsing ``SDC_CHECKS`` and what the entry-point factories return."""

from __future__ import annotations

import pytest

from lightning_sdc.auto import SDCAutoEnable, callbacks, pytorch_lightning_callbacks, requested


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("", []),
        ("0", []),
        ("False", []),
        ("1", ["nonfinite_gradient", "ring_replay", "weight_fingerprint"]),
        ("True", ["nonfinite_gradient", "ring_replay", "weight_fingerprint"]),
        (" ring_replay, nonfinite_gradient,ring_replay ", ["ring_replay", "nonfinite_gradient"]),
    ],
)
def test_sdc_checks_values(value: str, names: list[str]) -> None:
    assert requested(value) == names


@pytest.mark.parametrize("value", ["fingerprint", "yes", "on"])
def test_bad_sdc_checks_value_names_it(value: str) -> None:
    with pytest.raises(ValueError, match=rf"SDC_CHECKS='{value}': unknown check\(s\) {value}"):
        requested(value)


def test_factories_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDC_CHECKS", raising=False)
    assert callbacks() == [] and pytorch_lightning_callbacks() == []
    monkeypatch.setenv("SDC_CHECKS", "weight_fingerprint")
    (auto,) = callbacks()
    assert isinstance(auto, SDCAutoEnable) and auto.checks == ["weight_fingerprint"]
    with pytest.raises(ValueError, match="standalone `pytorch_lightning`"):
        pytorch_lightning_callbacks()
