"""Single-process parts of the non-finite check: local per-parameter flags and pending verdicts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sdc_core.checks.gradients import NonFiniteGradient, _StepFlags
from sdc_core.dist.topology import HostRead


def test_discard_drops_a_pending_verdict_without_a_collective_and_warns_when_this_rank_was_bad() -> None:
    check = NonFiniteGradient()
    clean = torch.ones(3)
    check._pending = _StepFlags(4, HostRead(torch.ones(1)), [(clean, [])])  # another rank's flag: not read
    assert check.discard() is None and check.pending_step is None
    check._pending = _StepFlags(5, HostRead(torch.zeros(1)), [(clean, []), (torch.tensor([float("nan"), 1.0]), [])])
    with pytest.warns(RuntimeWarning, match="local gradients of step 5 were non-finite"):
        assert check.discard() == 5
    assert check.pending_step is None and check.stats.failures == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_flag_each_rank_sends_is_set_exactly_by_nan_and_inf(dtype: torch.dtype) -> None:
    """The one-element flag a rank all-reduces: 1.0 when any of its local peaks (of any dtype, in any
    of several reads) is NaN or Inf; finite extremes and signed zeros leave it 0.0; nothing is
    written to the peaks."""
    info = torch.finfo(dtype)
    clean = [torch.tensor([info.max, 1.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype), torch.ones(5).double()]
    before = [t.clone() for t in clean]
    check = NonFiniteGradient()
    assert check._any_rank([(t, []) for t in clean]).get().tolist() == [0.0]
    assert check._any_rank([]).get().tolist() == [0.0]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(clean, before, strict=True))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for k in range(len(clean)):
            local = [t.clone() for t in clean]
            local[k][-1] = bad
            assert check._any_rank([(t, []) for t in local]).get().tolist() == [1.0], (bad, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_log2_peaks_by_group_take_each_groups_largest_peak(dtype: torch.dtype) -> None:
    """``log2_peaks_by_group`` gives per group the log2 of its largest peak (within one float32
    rounding of Python's), exactly NaN for empty or all-zero groups and +Inf for non-finite ones,
    with the indices as a tensor or as a list."""
    from sdc_core.checks.reductions import log2_peaks_by_group

    def expected(pairs: list, groups: int) -> list[float]:  # in Python, from the values read
        best = [0.0] * groups
        for values, index in pairs:
            for v, j in zip(values.to(torch.float32).tolist(), index.tolist(), strict=True):
                best[j] = max(best[j], v if -math.inf < v < math.inf else math.inf)
        return [math.log2(b) if b > 0 else math.nan for b in best]

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
        want = torch.tensor(expected(pairs, groups), dtype=torch.float64)
        got = log2_peaks_by_group(pairs, groups)
        assert got.dtype == torch.float32 and got.shape == (groups,)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (trial, got, want)
        finite = want.isfinite()
        assert torch.allclose(got.double()[finite], want[finite], rtol=2**-22, atol=2**-22), (trial, got, want)
        listed = [(v, i.tolist()) for v, i in pairs]  # the indices as the check caches them on the CPU
        assert torch.equal(log2_peaks_by_group(listed, groups).nan_to_num(nan=-1.0), got.nan_to_num(nan=-1.0))


def test_batched_reads_need_no_hook_per_parameter_and_still_flag_and_peak_exactly(tmp_path: Path) -> None:
    """A one-rank DDP: the tap's per-parameter hooks run on the first two backwards (the probes),
    are removed once the read is batched (no hook left on any parameter), come back while another
    consumer needs them and go again after; the batched read from ``tap.present()`` gives the same
    peaks and magnitudes as the gradients themselves, and names a NaN'd parameter."""
    import torch.distributed as dist
    from torch import nn

    from sdc_core.checks.gradient_tap import GradientTap
    from sdc_core.checks.reductions import peaks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
        ddp = nn.parallel.DistributedDataParallel(net)
        names = {id(p): n for n, p in net.named_parameters()}
        tap = GradientTap.attach(ddp, names)
        check = NonFiniteGradient()
        check.attach(tap)
        check.want_magnitudes(3)
        need = {"now": False}
        seen: list[str] = []
        consumer = lambda p, g: seen.append(names[id(p)])  # noqa: E731
        tap.consumers.append(consumer)
        tap.wanted_when[consumer] = lambda: need["now"]

        def hooks() -> int:
            return sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())

        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        counts = []
        for step in range(6):
            need["now"] = step == 3
            seen.clear()
            ddp(x).pow(2).mean().backward()
            counts.append((hooks(), len(seen)))
            magnitudes = check.take_magnitudes()
            local = check._local
            check.verdict(step, net.named_parameters())
            check.resolve()
            if step >= 2:  # batched: one read per dtype, the exact peaks of the local gradients
                assert check.batched and len(local) == 1
                values, params = local[0]
                assert torch.equal(values, peaks([p.grad for p in params])) and len(params) == 10
                expected = [max(float(peaks([p.grad]).max()) for p in net.parameters()
                                if check._group_of[id(p)] == j) for j in range(3)]  # fmt: skip
                assert magnitudes == pytest.approx([float(torch.tensor(e).log2()) for e in expected])
            net.zero_grad()
        assert counts == [(10, 10), (10, 10), (0, 0), (10, 10), (0, 0), (0, 0)]
        net[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
        ddp(x).pow(2).mean().backward()
        assert not tap.reading_each
        check.verdict(6, net.named_parameters())
        from sdc_core.errors import NonFiniteGradientError

        with pytest.raises(NonFiniteGradientError, match=r"2\.weight"):
            check.resolve()
        tap.remove()
        assert hooks() == 0
    finally:
        dist.destroy_process_group()


def test_what_the_witness_says_explains_non_finite_gradients() -> None:
    """The witness (``StepDriver._witness``: the batches held NaN/Inf, the partners reproduce it, the NaN/Inf on every
    rank follows a screen hit no partner could confirm) is asked about the offending ranks whenever some rank's local
    gradients were non-finite and no GradScaler owns the overflow, and what it says is the verdict's pattern, suspects
    and reason; where it says nothing the ranks are named as before."""
    from sdc_core.checks.gradients import NonFiniteConfig
    from sdc_core.dist.topology import RankFacts, Topology
    from sdc_core.errors import NonFiniteGradientError

    asked: list[tuple[int, tuple[int, ...]]] = []
    topo = Topology(ranks=tuple(RankFacts(rank=r, host=f"h{r}", node_rank=r, local_rank=0) for r in range(3)), rank=0)
    check = NonFiniteGradient(config=NonFiniteConfig(on_failure="raise"), topology=topo)

    def failure(per_rank: list, says: tuple | None, scaler: bool = False) -> NonFiniteGradientError:
        check.witness = lambda step, ranks: asked.append((step, ranks)) or says
        with pytest.raises(NonFiniteGradientError) as raised:
            check._failure(4, per_rank, scaler, 0.0, None)
        return raised.value

    err = failure([None, ["w"], ["w"]], ("bad_inputs", (), "the data, not a faulty device"))
    assert (err.rank, err.suspects, err.hosts, err.details["pattern"]) == (None, (), {}, "bad_inputs")
    assert "the data, not a faulty device in w" in str(err) and asked == [(4, (1, 2))]
    err = failure([["w"], ["w"], ["w"]], ("after_screen_hit", (1,), "after rank 1's hit"))
    assert (err.rank, err.suspects, err.hosts, err.details["pattern"]) == (None, (1,), {1: "h1"}, "after_screen_hit")
    assert "suspects: rank 1 (host h1, node 1): after rank 1's hit" in str(err) and asked[-1] == (4, (0, 1, 2))
    err = failure([None, ["w"], None], None)
    assert (err.rank, err.suspects, err.details["pattern"]) == (1, (1,), "one_rank")
    assert failure([["w"], ["w"], ["w"]], None).details["pattern"] == "all_ranks"
    asked.clear()
    check.config = NonFiniteConfig(on_failure="raise", overflow_patience=1)
    assert failure([None, ["w"], None], ("reproduced", (), "r"), scaler=True).rank == 1 and asked == []  # the scaler's
