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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_host_log2_peaks_equal_the_kernels_ones(dtype: torch.dtype) -> None:
    """The CPU path of ``log2_peaks_by_group`` (maxima and log2 in Python) gives what the kernels
    give, within one float32 rounding of the log2, and exactly NaN for empty or all-zero groups and
    +Inf for non-finite ones."""
    from sdc_core.checks.reductions import _log2_peaks_on_device, _log2_peaks_on_host, log2_peaks_by_group

    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        groups = 1 + trial % 7
        pairs = []
        for _ in range(1 + trial % 3):
            n = int(torch.randint(1, 12, (1,), generator=g))
            values = (torch.rand(n, generator=g) * 10.0 ** float(torch.randint(-30, 30, (1,), generator=g))).to(dtype)
            if trial % 4 == 1:
                values[0] = 0.0
            if trial % 5 == 2:
                values[-1] = float("nan") if trial % 2 else float("inf")
            if trial == 7:
                values.fill_(1e300 if dtype == torch.float64 else 0.0)  # float64 beyond float32: Inf
            pairs.append((values, torch.randint(0, groups, (n,), generator=g)))
        host = _log2_peaks_on_host(pairs, groups)
        kernels = _log2_peaks_on_device(pairs, groups, torch.device("cpu"))
        assert torch.equal(host.isnan(), kernels.isnan()), (trial, host, kernels)
        assert torch.equal(host.isinf(), kernels.isinf()), (trial, host, kernels)
        finite = host.isfinite()
        assert torch.allclose(host[finite], kernels[finite], rtol=2**-22, atol=2**-22), (trial, host, kernels)
        assert torch.equal(log2_peaks_by_group(pairs, groups).nan_to_num(nan=-1.0), host.nan_to_num(nan=-1.0))
        listed = [(v, i.tolist()) for v, i in pairs]  # the indices as the check caches them on the host
        assert torch.equal(_log2_peaks_on_host(listed, groups).nan_to_num(nan=-1.0), host.nan_to_num(nan=-1.0))
        assert torch.equal(_log2_peaks_on_device(listed, groups, torch.device("cpu")).nan_to_num(nan=-1.0),
                           kernels.nan_to_num(nan=-1.0))  # fmt: skip
