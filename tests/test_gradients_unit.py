"""Single-process parts of the non-finite check: local per-parameter flags and pending verdicts."""

from __future__ import annotations

import pytest
import torch

from sdc_core.gradients import NonFiniteGradient, _minmax, _StepFlags, local_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_local_norms_flag_exactly_the_non_finite_tensors(dtype: torch.dtype) -> None:
    big = 6e4 if dtype == torch.float16 else 1e15  # finite; fp16: a norm beyond fp16's range
    grads = [torch.randn(1000).to(dtype) for _ in range(5)] + [torch.full((4096,), big, dtype=dtype)]
    grads[1][7], grads[3][0], grads[4][999] = float("nan"), float("inf"), float("-inf")
    finite = torch.isfinite(local_norms(grads)).tolist()
    assert finite == [True, False, True, False, False, True]
    assert local_norms([]).numel() == 0


def test_discard_drops_a_pending_verdict_without_a_collective_and_warns_when_it_was_bad() -> None:
    check = NonFiniteGradient()
    clean = _minmax(torch.ones(3))
    check._pending = _StepFlags(4, [clean], [])
    assert check.discard() is None and check.pending_step is None
    check._pending = _StepFlags(5, [clean, _minmax(torch.tensor([1.0, float("nan")]))], [])
    with pytest.warns(RuntimeWarning, match="step 5 were non-finite"):
        assert check.discard() == 5
    assert check.pending_step is None and check.stats.failures == 0
