"""The CPU read of the non-finite check (``peaks``): the largest magnitude of every tensor
(``aminmax`` for large tensors, one multi-tensor inf-norm for small ones). It must flag exactly the
tensors holding NaN or Inf, never a finite tensor whose sum or norm would overflow."""

from __future__ import annotations

import pytest
import torch

from sdc_core.checks.reductions import _AMINMAX_FROM, peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_cpu_screen_flags_exactly_nan_and_inf_in_small_and_large_tensors(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max / 4  # finite, but sums and squares of several such values overflow
    sizes = [3, 1000, _AMINMAX_FROM - 1, _AMINMAX_FROM + 5]
    clean = [torch.randn(n).to(dtype) for n in sizes]
    clean += [torch.full((n,), big, dtype=dtype) for n in (7, _AMINMAX_FROM + 1)]  # overflowing screens
    clean.append(torch.tensor([-big, big] * (_AMINMAX_FROM // 2), dtype=dtype))
    before = [t.clone() for t in clean]
    values = peaks(clean)
    assert bool(torch.isfinite(values).all()), values
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(clean, before, strict=True))
    for k in range(len(clean)):
        bad = (float("nan"), float("inf"), float("-inf"))[k % 3]
        grads = list(clean)
        grads[k] = clean[k].clone()
        grads[k].view(-1)[len(grads[k]) // 2] = bad
        flags = (~torch.isfinite(peaks(grads))).tolist()
        assert flags == [i == k for i in range(len(grads))], (bad, k, flags)
    grads = list(clean)
    grads[3] = clean[3].clone()
    grads[3][0], grads[3][1] = float("inf"), float("-inf")  # Inf - Inf in a sum: NaN, still flagged
    assert (~torch.isfinite(peaks(grads))).tolist() == [i == 3 for i in range(len(grads))]
