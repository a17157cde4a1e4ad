"""Single-process parts of the non-finite check: local per-parameter flags and pending verdicts."""

from __future__ import annotations

import pytest
import torch

from sdc_core.gradients import NonFiniteGradient, _StepFlags, fold_flag, local_sum, reduced_flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_local_sums_flag_exactly_the_non_finite_tensors(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    grads = [torch.randn(1000).to(dtype) for _ in range(6)] + [torch.full((4096,), info.max / 8192, dtype=dtype)]
    grads[1][7], grads[3][0], grads[4][999] = float("nan"), float("inf"), float("-inf")
    grads[5][0], grads[5][1] = float("inf"), float("-inf")  # Inf - Inf: NaN, still flagged
    finite = [bool(torch.isfinite(local_sum(g))) for g in grads]
    assert finite == [True, False, True, False, False, False, True]  # large finite values: not flagged


def test_discard_drops_a_pending_verdict_without_a_collective_and_warns_when_it_was_bad() -> None:
    check = NonFiniteGradient()
    clean = torch.ones(3)
    check._pending = _StepFlags(4, reduced_flags([clean]), [])
    assert check.discard() is None and check.pending_step is None
    check._pending = _StepFlags(5, reduced_flags([clean, torch.tensor([float("nan"), 1.0])]), [])
    with pytest.warns(RuntimeWarning, match="step 5 were non-finite"):
        assert check.discard() == 5
    assert check.pending_step is None and check.stats.failures == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_folded_flag_is_the_identity_when_finite_and_nan_otherwise(dtype: torch.dtype) -> None:
    """Element 0 of a gradient carries the flag: bit-identical for finite local sums of either sign
    (signed zeros, subnormals and extremes included), NaN as soon as the local sum is NaN or Inf."""
    info = torch.finfo(dtype)
    heads = [0.0, -0.0, info.tiny / 4, -info.max, info.max, 1.5, -3.25]
    for head in heads:
        for local in ([0.0], [-0.0], [1.0, 1e3], [-2.0, 0.5], [-info.max / 2, -info.max / 4]):
            buffer = torch.tensor([head, 7.0], dtype=dtype)
            before = buffer.clone()
            fold_flag(buffer, local_sum(torch.tensor(local, dtype=dtype)))
            assert torch.equal(buffer.view(torch.uint8), before.view(torch.uint8)), (head, local)
        for bad in (float("nan"), float("inf"), float("-inf")):
            buffer = torch.tensor([head, 7.0], dtype=dtype)
            fold_flag(buffer, local_sum(torch.tensor([1.0, bad, -3.0], dtype=dtype)))
            assert torch.isnan(buffer[0]) and buffer[1] == 7.0
    assert reduced_flags([]) is None
