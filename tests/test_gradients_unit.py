"""Single-process parts of the non-finite check: local per-parameter flags and pending verdicts."""

from __future__ import annotations

import pytest
import torch

from sdc_core.checks.gradients import NonFiniteGradient, _StepFlags
from sdc_core.checks.reductions import any_nonfinite_multi, local_sum


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
    check._pending = _StepFlags(4, any_nonfinite_multi([clean]), [])
    assert check.discard() is None and check.pending_step is None
    check._pending = _StepFlags(5, any_nonfinite_multi([clean, torch.tensor([float("nan"), 1.0])]), [])
    with pytest.warns(RuntimeWarning, match="step 5 were non-finite"):
        assert check.discard() == 5
    assert check.pending_step is None and check.stats.failures == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_multi_tensor_verdict_flags_exactly_nan_and_inf(dtype: torch.dtype) -> None:
    """The reduced-gradient read: NaN or Inf anywhere, in any of many tensors of mixed dtypes, is
    flagged; finite extremes (no overflow: largest magnitude, not a sum) and signed zeros are not;
    and it writes nothing."""
    info = torch.finfo(dtype)
    clean = [torch.full((n,), v, dtype=dtype) for n, v in ((3, info.max), (5000, -info.max), (1, -0.0), (70, 1.0))]
    clean.append(torch.randn(300, dtype=torch.float64))
    before = [t.clone() for t in clean]
    assert not bool(any_nonfinite_multi(clean))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(clean, before, strict=True))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for k in range(len(clean)):
            grads = [t.clone() for t in clean]
            grads[k].view(-1)[-1] = bad
            assert bool(any_nonfinite_multi(grads)), (bad, k)
