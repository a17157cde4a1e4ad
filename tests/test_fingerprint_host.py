"""The host (CPU) fingerprint path: every batch kind gives exactly ``tensor_digest`` of each
tensor and leaves the tensors' bytes as they were (the batches shift their own copy in place)."""

from __future__ import annotations

import pytest
import torch

from sdc_core.checks import digest as fp
from sdc_core.checks.digest import combine, grouped_digests, tensor_digest


def _check(tensors: list[torch.Tensor]) -> None:
    before = [t.detach().clone() for t in tensors]
    digests = grouped_digests(tensors)
    expected = [int(tensor_digest(t)) for t in tensors]
    assert digests.tolist() == expected
    assert int(combine(digests)) == int(combine(torch.tensor(expected)))
    for t, b in zip(tensors, before, strict=True):  # bitwise: NaN payloads included
        assert torch.equal(t.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _randn(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


def test_same_size_batches_one_row_and_several_rows():
    g = torch.Generator().manual_seed(0)
    one_row = [torch.randn(301, generator=g) for _ in range(40)]  # 151 words each, the last one padded
    rows = [torch.randn(5000, generator=g).bfloat16() for _ in range(30)]  # 1250 words: 2 rows and a tail
    big = [torch.randn(3, 9000, generator=g) for _ in range(2)]  # 13,500 words: 16 rows, own batch of two
    assert fp._own_batch(40, 151) and fp._own_batch(30, 1250) and fp._own_batch(2, 13_500)
    _check(one_row + rows + big)


def test_mixed_batches_every_dtype_odd_sizes_and_layouts():
    g = torch.Generator().manual_seed(1)
    tensors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32):
        tensors += [_randn(n, dtype, g) for n in (1, 3, 7, 8, 511, 1023, 1024, 1025, 2047, 2049, 4099, 8191)]
    tensors.append(torch.randn(40, 30, generator=g).t())  # non-contiguous
    tensors.append(torch.randn(101, generator=g)[1:])  # misaligned for int64 words
    tensors.append(torch.full((9,), float("nan")))  # NaN bytes are hashed as they are
    assert not fp._own_batch(1, 1023) and not fp._own_batch(1, 4099)
    _check(tensors)


def test_a_lone_tensor_of_each_batch_kind():
    g = torch.Generator().manual_seed(2)
    for t in (torch.randn(100, generator=g), torch.randn(101, generator=g), torch.randn(5001, generator=g),
              torch.randn(20_000, generator=g), torch.randn(70_000, generator=g)):  # fmt: skip
        _check([t])


def test_batches_split_into_chunks(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fp, "_CHUNK_WORDS", 4096)  # many chunks: same-size and mixed
    g = torch.Generator().manual_seed(3)
    same = [torch.randn(2000, generator=g) for _ in range(30)]  # 1000 words: 4 per chunk
    mixed = [torch.randn(100 + 37 * i, generator=g) for i in range(60)]
    _check(same + mixed)


def test_host_path_order_is_kept_with_interleaved_kinds():
    g = torch.Generator().manual_seed(4)
    tensors = []
    for i in range(50):
        tensors += [torch.randn(64, generator=g), torch.randn(10 + i, generator=g).half()]
        tensors.append(torch.randn(40_000, generator=g))
    tensors += [torch.zeros(0), torch.ones(5, dtype=torch.bool)]
    _check(tensors)


def test_row_weighting_without_mv_matches_mv():
    """CUDA has no integer ``mv``: the product-and-sum form used there gives the same values."""
    g = torch.Generator().manual_seed(5)
    m = torch.randint(-(2**62), 2**62, (7, 300), generator=g)
    w = fp._weights(0, 300, torch.device("cpu"))
    assert torch.equal(fp._wmv(m, w, fused=False), fp._wmv(m, w, fused=True))
    assert torch.equal(fp._wmv(m[:, 3:], w[3:], fused=False), fp._wmv(m[:, 3:], w[3:], fused=True))


def test_batches_joined_by_cat_or_by_flatten():
    """Batches of 1-d tensors, or of tensors sharing their trailing dimensions, are joined by
    ``cat`` (pads too, when 1-d); other shapes and 0-d tensors by ``flatten``: same digests."""
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(10, 30, generator=g) for _ in range(40)]  # same shape: cat
    tensors += [torch.randn(7, 5, 3, generator=g) for _ in range(40)]  # same shape, odd bytes: pads, flatten
    tensors += [torch.randn(n, 16, generator=g) for n in range(1, 30)]  # mixed sizes, same tail: cat
    tensors += [torch.randn(16, n, generator=g) for n in range(1, 30)]  # mixed tails: flatten
    tensors += [torch.randn((), generator=g).double() for _ in range(3)]  # 0-d
    tensors += [torch.randn(3 + n, generator=g).half() for n in range(30)]  # 1-d with pads: cat
    plan = fp._host_plan(tuple((t.device, t.dtype, t.shape) for t in tensors))
    assert {cat for _, _, _, cat in plan[0]} == {True, False}
    _check(tensors)


def test_channels_last_tensors_batched_on_the_host_give_their_tensor_digests() -> None:
    """Conv weights in channels-last layout (not contiguous) batched together: ``cat`` keeps their
    layout, so the batch is read in logical order (the GPU suite's conv model crashed on a view)."""
    import torch

    from sdc_core.checks.digest import grouped_digests, tensor_digest

    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last) for _ in range(4)]
    digests = grouped_digests(weights)
    assert digests.tolist() == [int(tensor_digest(w)) for w in weights]
