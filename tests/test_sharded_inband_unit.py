"""The in-band non-finite flag of the FSDP2 check, on the reduce-scatter input alone (no process
group): finite local gradients are left bit for bit, -0.0 and subnormals included; a NaN or Inf
anywhere poisons element 0 of every rank's chunk, so every rank's reduced shard starts with NaN.
And on 3 real gloo ranks: a NaN formed inside the reduction, on one rank's shard only, still gives
every rank the same verdict (the decision to gather names is taken from data every rank holds)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import results, torchrun, worker_env

from sdc_core.sharded.checks import ShardedNonFinite

SCRIPT = Path(__file__).with_name("sharded_nan_scenarios.py")


@pytest.fixture(scope="module")
def nan_in_reduction(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nan_in_reduction")
    env = worker_env() | {"PG_TIMEOUT": "60"}
    env["PYTHONPATH"] = str(SCRIPT.parent) + ":" + env["PYTHONPATH"]
    torchrun(SCRIPT, out, None, 3, timeout=180, env=env)
    return out


SPECIAL = [0.0, -0.0, 1e-45, -1e-40, 3.0e38, -3.0e38, 1.0, -2.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_input_is_left_bit_for_bit(dtype: torch.dtype) -> None:
    check = ShardedNonFinite(in_band=True)
    tap = SimpleNamespace(group_size=4)
    flat = torch.randn(4 * 16).to(dtype)
    specials = torch.tensor(SPECIAL).to(dtype)
    flat[:: 16][:4] = specials[:4]  # element 0 of every chunk: zeros of both signs, subnormals
    flat[1 : 1 + len(SPECIAL)] = specials
    flat = torch.where(torch.isfinite(flat), flat, torch.zeros_like(flat))  # fp16: 3e38 overflows
    before = flat.clone()
    check._consume(tap, flat, ["w"])
    assert torch.equal(flat.view(torch.int16 if flat.element_size() == 2 else torch.int32),
                       before.view(torch.int16 if flat.element_size() == 2 else torch.int32))  # fmt: skip
    assert not bool(torch.isnan(flat).any())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_poisons_element_0_of_every_chunk(bad: float) -> None:
    check = ShardedNonFinite(in_band=True)
    flat = torch.randn(4 * 8)
    flat[13] = bad  # in rank 1's chunk
    check._consume(SimpleNamespace(group_size=4), flat, ["w"])
    assert bool(torch.isnan(flat.view(4, 8)[:, 0]).all())  # every rank's reduced shard sums a NaN
    reduced = flat.view(4, 8) + torch.randn(3, 4, 8).sum(0)  # other ranks' finite chunks added
    assert bool(torch.isnan(reduced[:, 0]).all())


@pytest.mark.slow  # a 3-rank FSDP2 launch (about 10 s): the default run stays under 10 minutes on 2 cores
@pytest.mark.parametrize("scenario", ["now", "deferred"])
def test_a_nan_formed_in_the_reduction_on_one_shard_gives_one_verdict_everywhere(
    nan_in_reduction: Path, scenario: str
) -> None:
    """Rank 1's reduced shard alone starts with NaN: every rank must decide alike (it entered the
    names gather alone and the others went on training: a hang)."""
    rows = results(nan_in_reduction, scenario, 3)
    assert all(r["in_band"] for r in rows)
    assert all(r["error"] == "NonFiniteGradientError" and r["step"] == 1 for r in rows), rows
    assert len({json.dumps(r["details"], sort_keys=True) for r in rows}) == 1
    assert rows[0]["details"]["parameters"] == {}  # no rank's local gradients were non-finite
    assert rows[0]["details"]["pattern"] == "formed_in_reduction"  # not "several ranks produced NaN"
    if scenario == "now":  # read before the update: the NaN is still on rank 1's shard alone
        assert rows[0]["details"]["formed_in_reduction"] == {"1": ["2.weight"]}
    else:
        assert "formed_in_reduction" in rows[0]["details"]
    assert all(r["seconds"] < 30 for r in rows)  # the process group timeout is 60 s: nobody waited for it
