"""The in-band non-finite flag of the FSDP2 check, on the reduce-scatter input alone (no process
group): finite local gradients are left bit for bit, -0.0 and subnormals included; a NaN or Inf
anywhere poisons element 0 of every rank's chunk, so every rank's reduced shard starts with NaN."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sdc_core.sharded import ShardedNonFinite

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
