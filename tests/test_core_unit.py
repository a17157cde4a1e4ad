"""Fast in-process unit tests of sdc_core's pure logic (no process group, no Lightning).

Expectations are derived from the documented semantics, never copied from a run of the code.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

from sdc_core.checks.digest import combine, tensor_digest, tensor_digests
from sdc_core.checks.fingerprint import FingerprintConfig, vote
from sdc_core.checks.gradients import NonFiniteConfig
from sdc_core.dist.topology import ring_partners
from sdc_core.errors import FingerprintMismatchError, NonFiniteGradientError, ReplayMismatchError, SDCError
from sdc_core.faults.inject import Fault, flip_bit
from sdc_core.replay.attribution import explain, pick_referee, settle
from sdc_core.replay.compare import compare, grad_digest
from sdc_core.replay.ring import ReplayConfig
from sdc_core.stats import CheckStats

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# --------------------------------------------------------------------------------------------
# helpers


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _words(t):
    """The raw bit patterns of a contiguous tensor's elements, as a flat integer tensor (a view)."""
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def _bits(t, index):
    """Unsigned bit pattern of flat element ``index`` of a contiguous tensor."""
    width = 8 * t.element_size()
    return int(_words(t)[index]) & ((1 << width) - 1)


def _same_float(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def _digest(t):
    return int(tensor_digest(t))


def _fingerprint(tensors):
    return int(combine(tensor_digests(tensors)))


def _inverse(partners):
    inv = [0] * len(partners)
    for o, q in enumerate(partners):
        inv[q] = o
    return inv


# --------------------------------------------------------------------------------------------
# 1. fingerprint: every single bit flip is seen


def _case_tensor(case, dtype):
    """(tensor, flat indices to flip) for the tensor shapes under test."""
    if case == "vector":
        return _randn(10, dtype=dtype, seed=1), [0, 4, 9]
    if case == "three_elements":  # 3 bf16/fp16 = 6 bytes, 3 fp32 = 12 bytes: not a multiple of 8
        return _randn(3, dtype=dtype, seed=2), [0, 2]
    if case == "matrix":
        return _randn(4, 6, dtype=dtype, seed=3), [0, 13, 23]
    if case == "storage_offset":  # contiguous slice whose storage does not start at element 0
        t = _randn(11, dtype=dtype, seed=4)[1:]
        assert t.is_contiguous() and t.storage_offset() == 1
        return t, [0, 9]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["vector", "three_elements", "matrix", "storage_offset"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_every_single_bit_flip_changes_digest_and_fingerprint(dtype, case):
    t, indices = _case_tensor(case, dtype)
    width = 8 * t.element_size()
    others = [_randn(5, seed=10), _randn(2, 3, dtype=dtype, seed=11)]
    tensors = [others[0], t, others[1]]
    snapshot = _words(t).clone()
    d0 = _digest(t)
    fp0 = _fingerprint(tensors)
    for index in indices:
        for bit in range(width):
            before_bits = _bits(t, index)
            before_val = float(t.reshape(-1)[index])
            old, new = flip_bit(t, index, bit)
            # exactly that bit of exactly that element changed
            assert _bits(t, index) ^ before_bits == 1 << bit, (index, bit)
            assert int((_words(t) != snapshot).sum()) == 1
            # (old, new) match the tensor's content before and after
            assert _same_float(old, before_val)
            assert _same_float(new, float(t.reshape(-1)[index]))
            assert _digest(t) != d0, f"bit {bit} of element {index} ({dtype}) not seen by tensor_digest"
            assert _fingerprint(tensors) != fp0, f"bit {bit} of element {index} ({dtype}) not seen by combine"
            flip_bit(t, index, bit)  # flip back
            assert torch.equal(_words(t), snapshot)
            assert _digest(t) == d0
            assert _fingerprint(tensors) == fp0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("view", ["transpose", "strided_columns"])
def test_bit_flip_seen_through_non_contiguous_tensor(dtype, view):
    base = _randn(6, 5, dtype=dtype, seed=5)
    cols = base.shape[1]
    if view == "transpose":
        t = base.t()
        inside = [(0, 0), (2, 3), (5, 4)]  # (row, col) of base elements the view shows
        outside = []
    else:
        t = base[:, 1::2]
        inside = [(0, 1), (3, 3), (5, 3)]
        outside = [(0, 0), (4, 2), (5, 4)]
    assert not t.is_contiguous()
    width = 8 * base.element_size()
    tensors = [_randn(3, seed=6), t]
    d0, fp0 = _digest(t), _fingerprint(tensors)
    assert d0 == _digest(t.contiguous())  # same content, same digest, whatever the layout
    for i, j in inside:
        for bit in range(width):
            flip_bit(base, i * cols + j, bit)
            assert _digest(t) != d0, (i, j, bit)
            assert _fingerprint(tensors) != fp0, (i, j, bit)
            flip_bit(base, i * cols + j, bit)
            assert _digest(t) == d0
            assert _fingerprint(tensors) == fp0
    for i, j in outside:  # elements the view does not show do not count
        flip_bit(base, i * cols + j, width - 2)
        assert _digest(t) == d0
        flip_bit(base, i * cols + j, width - 2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_identical_tensors_identical_digests(dtype):
    a = _randn(7, 3, dtype=dtype, seed=7)
    b = _randn(7, 3, dtype=dtype, seed=7)  # built independently, same values
    assert a.data_ptr() != b.data_ptr()
    assert _digest(a) == _digest(b)
    assert _fingerprint([a, b.t()]) == _fingerprint([b, a.t().contiguous()])
    # a different value is a different digest (one element changed)
    b.view(-1)[5] = b.view(-1)[5] * 2 + 1
    assert _digest(a) != _digest(b)


def test_fingerprint_sees_tensor_order_and_count():
    a, b = _randn(4, seed=8), _randn(4, seed=9)
    assert _fingerprint([a, b]) != _fingerprint([b, a])
    assert _fingerprint([a, b]) != _fingerprint([a])
    assert _fingerprint([a, torch.zeros(3)]) != _fingerprint([a])  # a zero-digest tensor still counts


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_flip_bit_rejects_out_of_range(dtype):
    t = _randn(4, dtype=dtype, seed=12)
    snapshot = t.clone()
    width = 8 * t.element_size()
    for index, bit in [(0, -1), (0, width), (0, width + 7), (-1, 0), (4, 0), (100, 1)]:
        with pytest.raises(ValueError):
            flip_bit(t, index, bit)
    assert torch.equal(_words(t), _words(snapshot))


# --------------------------------------------------------------------------------------------
# 2. vote

GOOD, BAD, OTHER = (11, 22, 33), (11, 22, 34), (10, 22, 33)


@pytest.mark.parametrize("world", range(2, 9))
def test_vote_single_faulty_rank(world):
    for f in range(world):
        rows = [BAD if r == f else GOOD for r in range(world)]
        rank, suspects, reference = vote(rows)
        if world >= 3:
            assert rank == f
            assert suspects == (f,)
            assert reference is not None and reference != f and rows[reference] == GOOD
        else:
            assert rank is None
            assert suspects == (0, 1)


@pytest.mark.parametrize("world", range(1, 9))
def test_vote_all_equal(world):
    rank, suspects, reference = vote([GOOD] * world)
    assert rank is None
    assert suspects == ()
    assert reference is not None and 0 <= reference < world


def test_vote_tie_two_against_two():
    for rows in ([GOOD, GOOD, BAD, BAD], [GOOD, BAD, GOOD, BAD], [BAD, GOOD, GOOD, BAD]):
        rank, suspects, _ = vote(rows)
        assert rank is None
        assert suspects == (0, 1, 2, 3)


@pytest.mark.parametrize("same_bad_row", [True, False])
def test_vote_two_faulty_of_five(same_bad_row):
    for f1, f2 in [(0, 1), (1, 3), (3, 4), (0, 4)]:
        rows = [GOOD] * 5
        rows[f1] = BAD
        rows[f2] = BAD if same_bad_row else OTHER
        rank, suspects, reference = vote(rows)
        assert rank is None
        assert suspects == (f1, f2)
        assert reference not in (f1, f2) and rows[reference] == GOOD


def test_vote_no_majority_three_way():
    rank, suspects, reference = vote([GOOD, BAD, OTHER])
    assert (rank, suspects, reference) == (None, (0, 1, 2), None)


# --------------------------------------------------------------------------------------------
# 3. ring partners


def _blocked(nodes, per_node):
    return [r // per_node for r in range(nodes * per_node)]


def _interleaved(nodes, per_node):
    return [r % nodes for r in range(nodes * per_node)]


MULTI_NODE_LAYOUTS = {
    f"{n}x{k}-{kind}": fn(n, k)
    for n, k in [(2, 2), (2, 4), (4, 2), (3, 3), (2, 1), (2, 3)]
    for kind, fn in [("blocked", _blocked), ("interleaved", _interleaved)]
}
MULTI_NODE_LAYOUTS["2x3-scrambled"] = [1, 0, 0, 1, 1, 0]
MULTI_NODE_LAYOUTS["3x2-scrambled"] = [2, 0, 1, 1, 2, 0]


@pytest.mark.parametrize("world", range(1, 10))
def test_ring_partners_single_node(world):
    partners = ring_partners([0] * world)
    assert sorted(partners) == list(range(world))
    assert list(partners) == [(r + 1) % world for r in range(world)]
    if world >= 2:
        assert all(partners[r] != r for r in range(world))


@pytest.mark.parametrize("name", sorted(MULTI_NODE_LAYOUTS))
def test_ring_partners_multi_node_cross_node(name):
    node_of = MULTI_NODE_LAYOUTS[name]
    partners = ring_partners(node_of)
    world = len(node_of)
    assert sorted(partners) == list(range(world)), "not a permutation"
    for r in range(world):
        assert partners[r] != r
        assert node_of[partners[r]] != node_of[r], f"rank {r} is replayed on its own node: {partners}"


@pytest.mark.parametrize("name", sorted(MULTI_NODE_LAYOUTS))
def test_ring_partners_no_mutual_pairs(name):
    # if r and partners[r] replayed each other, a persistent fault on either would show the same
    # two mismatching pairs, (r, p) and (p, r): the replay could not tell which rank is faulty
    node_of = MULTI_NODE_LAYOUTS[name]
    partners = ring_partners(node_of)
    if len(node_of) >= 3:
        assert all(partners[partners[r]] != r for r in range(len(node_of))), partners


@pytest.mark.parametrize("node_of", [[0, 0, 0, 1], [0, 0, 1, 1, 1], [3, 3, 3, 3, 1, 2]])
def test_ring_partners_unbalanced_is_still_a_derangement(node_of):
    partners = ring_partners(node_of)
    assert sorted(partners) == list(range(len(node_of)))
    assert all(partners[r] != r for r in range(len(node_of)))


# --------------------------------------------------------------------------------------------
# 4. ring replay attribution


def _layouts(world):
    out = [("one_node", [0] * world)]
    if world % 2 == 0:
        out.append(("two_nodes", _blocked(2, world // 2)))
        out.append(("two_nodes_interleaved", _interleaved(2, world // 2)))
    return out


def _replay_cases():
    """(world, layout name, node_of) for worlds 2..8: one node, and two equal nodes when even."""
    return [
        pytest.param(world, name, node_of, id=f"w{world}-{name}")
        for world in range(2, 9)
        for name, node_of in _layouts(world)
    ]


def _simulate(world, node_of, wrong_as_owner, wrong_as_replayer):
    """The attribution protocol of ``RingReplay.audit`` with simulated computations.

    A rank in ``wrong_as_owner`` reports a wrong result for its own batch; a rank in
    ``wrong_as_replayer`` computes a wrong result for any batch it replays (as partner or as
    referee). Healthy computations agree; a wrong one agrees with nothing.
    """
    partners = ring_partners(node_of)
    inverse = _inverse(partners)
    mismatching = sorted(
        (inverse[q], q) for q in range(world) if inverse[q] in wrong_as_owner or q in wrong_as_replayer
    )
    culprits, disputed = explain(world, partners, mismatching)
    busy = {r for pair in mismatching for r in pair}
    rulings = {}
    for o, q in disputed:
        t = pick_referee(o, q, world, node_of, busy)
        if t is None:
            assert world < 3
            continue
        assert t not in (o, q) and 0 <= t < world
        referee_ok = t not in wrong_as_replayer
        rulings[(o, q)] = (referee_ok and o not in wrong_as_owner, referee_ok and q not in wrong_as_replayer)
    return partners, inverse, mismatching, settle(world, culprits, disputed, rulings)


@pytest.mark.parametrize(("world", "layout", "node_of"), _replay_cases())
def test_replay_persistent_fault(world, layout, node_of):
    wrong = {}
    for f in range(world):
        partners, inverse, mismatching, (rank, suspects, _) = _simulate(world, node_of, {f}, {f})
        assert set(mismatching) == {(f, partners[f]), (inverse[f], f)}
        expected = (f, (f,)) if world >= 3 else (None, (0, 1))
        if (rank, suspects) != expected:
            wrong[f] = (rank, suspects)
    assert not wrong, f"faulty rank -> (rank, suspects) found, with partners {ring_partners(node_of)}: {wrong}"


@pytest.mark.parametrize("side", ["owner", "replayer"])
@pytest.mark.parametrize(("world", "layout", "node_of"), _replay_cases())
def test_replay_one_sided_fault_is_settled_by_a_referee(world, layout, node_of, side):
    """A fault that hits only the owner's own step, or only its replay of another rank's batch."""
    partners = ring_partners(node_of)
    inverse = _inverse(partners)
    for f in range(world):
        pair = (f, partners[f]) if side == "owner" else (inverse[f], f)
        culprits, disputed = explain(world, partners, [pair])
        assert culprits == set()
        assert list(disputed) == [pair]
        referee = pick_referee(*pair, world, node_of, set(pair))
        if world < 3:
            assert referee is None
            assert settle(world, culprits, disputed, {})[:2] == (None, (0, 1))
            continue
        assert referee is not None and 0 <= referee < world and referee not in pair
        # the referee agrees with the healthy side: (agrees_with_owner, agrees_with_replayer)
        ruling = (False, True) if side == "owner" else (True, False)
        rank, suspects, _ = settle(world, culprits, disputed, {pair: ruling})
        assert (rank, suspects) == (f, (f,))
        # the whole protocol reaches the same verdict
        faulty_owner, faulty_replayer = ({f}, set()) if side == "owner" else (set(), {f})
        _, _, simulated_pairs, (rank, suspects, _) = _simulate(world, node_of, faulty_owner, faulty_replayer)
        assert simulated_pairs == [pair]
        assert (rank, suspects) == (f, (f,))


@pytest.mark.parametrize("ruling", [(True, True), (False, False)], ids=["both", "neither"])
@pytest.mark.parametrize("world", range(3, 9))
def test_replay_referee_agrees_with_both_or_neither(world, ruling):
    partners = ring_partners([0] * world)
    for o in range(world):
        pair = (o, partners[o])
        culprits, disputed = explain(world, partners, [pair])
        rank, suspects, _ = settle(world, culprits, disputed, {pair: ruling})
        assert rank is None
        assert suspects == tuple(sorted(pair))


def test_pick_referee_prefers_idle_rank_on_another_node():
    # 3 nodes of 3: a pair spanning nodes 0 and 1 gets a referee on node 2
    node_of = _blocked(3, 3)
    for o, q in [(0, 3), (4, 1), (2, 5)]:
        t = pick_referee(o, q, 9, node_of, {o, q})
        assert node_of[t] == 2
    # one node of 6: ranks involved in another disagreement are avoided
    busy = {0, 1, 2, 3}
    t = pick_referee(0, 1, 6, [0] * 6, busy)
    assert t in (4, 5)


# --------------------------------------------------------------------------------------------
# 5. compare and grad_digest

NAMES = ["w", "b"]


def _grads(**changes):
    grads = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([[0.5, -0.25], [0.125, 4.0]])}
    for name, fn in changes.items():
        grads[name] = grads[name].clone()
        fn(grads[name])
    return grads


def _cmp(grads_a, grads_b, loss_a=1.0, loss_b=1.0, **config):
    a = grad_digest(NAMES, grads_a, loss_a)
    b = grad_digest(NAMES, grads_b, loss_b)
    return compare(a, b, ReplayConfig(**config), NAMES)


@pytest.mark.parametrize("exact", [False, True])
def test_compare_identical(exact):
    mismatch, diff, _ = _cmp(_grads(), _grads(), 2.5, 2.5, exact=exact)
    assert not mismatch
    assert diff == 0.0


def test_compare_relative_change_against_rtol():
    def bump(g):
        g.view(-1)[2] *= 1.01

    a, b = _grads(), _grads(w=bump)
    mismatch, diff, where = _cmp(a, b, rtol=1e-3)
    assert mismatch and where == "w"
    # the documented measure: max of the norm difference (relative to the larger norm) and the
    # sum difference (relative to sqrt(numel) * the larger norm); both reduced in float32
    wa, wb = a["w"].float(), b["w"].float()
    na, nb = wa.norm().double().item(), wb.norm().double().item()
    sa, sb = wa.sum().double().item(), wb.sum().double().item()
    expected = max(abs(na - nb) / max(na, nb), abs(sa - sb) / (math.sqrt(3) * max(na, nb)))
    assert diff == pytest.approx(expected, rel=1e-6)
    assert not _cmp(a, b, rtol=0.5)[0]


def test_compare_exact_flags_one_ulp():
    def ulp(g):
        g.view(-1)[1] = torch.nextafter(g.view(-1)[1], torch.tensor(math.inf))

    a, b = _grads(), _grads(b=ulp)
    assert not torch.equal(a["b"], b["b"])
    assert not _cmp(a, b, exact=False)[0]
    mismatch, _, where = _cmp(a, b, exact=True)
    assert mismatch and where == "b"


@pytest.mark.parametrize("exact", [False, True])
def test_compare_signed_zero_is_not_a_mismatch(exact):
    def negative_zeros(g):
        g.view(-1)[0] = -0.0
        g.view(-1)[1] = -0.0

    def positive_zeros(g):
        g.view(-1)[0] = 0.0
        g.view(-1)[1] = 0.0

    a = _grads(w=positive_zeros, b=lambda g: g.zero_())
    b = _grads(w=negative_zeros, b=lambda g: g.copy_(torch.full_like(g, -0.0)))
    assert _digest(a["w"]) != _digest(b["w"]) and _digest(a["b"]) != _digest(b["b"])  # bit patterns differ
    mismatch, diff, _ = _cmp(a, b, exact=exact)
    assert not mismatch
    assert diff == 0.0


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("side", ["a", "b"])
def test_compare_nan_on_one_side(exact, side):
    def nan(g):
        g.view(-1)[0] = math.nan

    clean, dirty = _grads(), _grads(w=nan)
    a, b = (dirty, clean) if side == "a" else (clean, dirty)
    mismatch, _, where = _cmp(a, b, exact=exact, rtol=0.5)
    assert mismatch and where == "w"
    # a NaN loss on one side too
    la, lb = (math.nan, 1.0) if side == "a" else (1.0, math.nan)
    mismatch, _, where = _cmp(clean, clean, la, lb, exact=exact, rtol=0.5)
    assert mismatch and where == "loss"


def test_compare_loss_difference():
    g = _grads()
    mismatch, diff, where = _cmp(g, g, 1.0, 1.01, rtol=1e-3)
    assert mismatch and where == "loss"
    assert diff == pytest.approx(0.01 / 1.01, rel=1e-9)
    assert not _cmp(g, g, 1.0, 1.01, rtol=0.5)[0]
    one_ulp = math.nextafter(1.0, 2.0)
    assert not _cmp(g, g, 1.0, one_ulp)[0]
    mismatch, _, where = _cmp(g, g, 1.0, one_ulp, exact=True)
    assert mismatch and where == "loss"


def test_grad_digest_missing_gradient_counts_as_zeros():
    zeros = {"w": torch.zeros(3), "b": torch.tensor([[0.5, -0.25], [0.125, 4.0]])}
    missing = {"b": zeros["b"]}
    assert not _cmp(zeros, missing, exact=True)[0]
    assert _cmp(_grads(), missing, exact=True)[0]


# --------------------------------------------------------------------------------------------
# 6. configuration validation


def _fault(**kw):
    return Fault(**{"kind": "module_output", "rank": 0, **kw})


BAD_CONFIGS = [
    *[(FingerprintConfig, {"every_n_steps": v}, "every_n_steps") for v in (0, -1, 1.5, True)],
    *[(ReplayConfig, {"every_n_steps": v}, "every_n_steps") for v in (0, -1, 1.5, True)],
    (NonFiniteConfig, {"on_failure": "explode"}, "on_failure"),
    (NonFiniteConfig, {"overflow_patience": 0}, "overflow_patience"),
    *[(ReplayConfig, {"rtol": v}, "rtol") for v in (0, 1, "x", -0.1, math.nan, True)],
    *[(ReplayConfig, {"atol": v}, "atol") for v in (-1, math.inf, math.nan, "x")],
    (_fault, {"kind": "x"}, "kind"),
    (_fault, {"mode": "x"}, "mode"),
    (_fault, {"rank": -1}, "rank"),
    (_fault, {"kind": "weight_bit_flip", "target": "p"}, "bit"),
    (_fault, {"kind": "optimizer_state", "target": "p"}, "bit"),
]


@pytest.mark.parametrize(
    ("factory", "kwargs", "name"),
    BAD_CONFIGS,
    ids=[f"{getattr(f, '__name__', f)}-{k}" for f, k, _ in BAD_CONFIGS],
)
def test_config_rejects_bad_argument(factory, kwargs, name):
    with pytest.raises(ValueError, match=name):
        factory(**kwargs)


def test_valid_configs_construct():
    assert FingerprintConfig(every_n_steps=1).every_n_steps == 1
    assert ReplayConfig(every_n_steps=3, exact=True, rtol=0.5, atol=0).rtol == 0.5
    assert NonFiniteConfig(on_failure="skip_step", overflow_patience=1).overflow_patience == 1
    assert _fault(kind="weight_bit_flip", bit=3, mode="intermittent").bit == 3


# --------------------------------------------------------------------------------------------
# 7. errors

ERRORS = [
    (NonFiniteGradientError, "nonfinite_gradient"),
    (ReplayMismatchError, "ring_replay"),
    (FingerprintMismatchError, "weight_fingerprint"),
]


def _make(cls, rank):
    if rank is not None:
        return cls(
            step=17,
            rank=rank,
            suspects=[rank],
            hosts={rank: "gpu-node-b"},
            details={"node_ranks": {rank: 1}, "tensors": ["param:w", "param:b"], "world_size": 4},
            reason="its result differs",
        )
    return cls(
        step=17,
        rank=None,
        suspects=(3, 1),
        hosts={1: "gpu-node-a", 3: "gpu-node-c"},
        details={"node_ranks": {1: 0, 3: 1}, "world_size": 2},
        reason="the two replicas disagree",
    )


@pytest.mark.parametrize(("cls", "check"), ERRORS, ids=[c.__name__ for c, _ in ERRORS])
@pytest.mark.parametrize("rank", [2, None], ids=["rank", "no_rank"])
def test_error_fields_pickle_and_dict(cls, check, rank):
    err = _make(cls, rank)
    assert isinstance(err, SDCError) and isinstance(err, RuntimeError)
    assert err.check == check
    assert list(err.suspects) == sorted(err.suspects)
    msg = str(err)
    assert "\n" not in msg and msg
    if rank is not None:
        assert err.suspects == (2,)
        assert "rank 2" in msg and "gpu-node-b" in msg
    else:
        assert err.suspects == (1, 3)
        assert all(s in msg for s in ("rank 1", "gpu-node-a", "rank 3", "gpu-node-c"))

    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    for attr in ("check", "step", "rank", "suspects", "hosts", "details", "reason"):
        assert getattr(back, attr) == getattr(err, attr), attr
    assert str(back) == msg

    d = err.to_dict()
    loaded = json.loads(json.dumps(d, allow_nan=False))
    assert loaded["type"] == cls.__name__
    assert loaded["check"] == check
    assert loaded["step"] == 17
    assert loaded["rank"] == rank
    assert loaded["suspects"] == list(err.suspects)
    assert loaded["hosts"] == {str(r): h for r, h in err.hosts.items()}
    assert loaded["message"] == msg
    assert loaded["details"]["world_size"] == err.details["world_size"]


@pytest.mark.parametrize(("cls", "check"), ERRORS, ids=[c.__name__ for c, _ in ERRORS])
def test_error_non_finite_details_stay_json(cls, check):
    err = cls(
        step=3,
        rank=None,
        suspects=[0, 1],
        details={
            "differences": {0: math.inf, 1: -math.inf},
            "values": [math.nan, (1.5, -math.inf)],
            "nested": {"x": {"y": math.nan}},
            "tensor": torch.tensor([1.0, math.nan]),
        },
    )
    text = json.dumps(err.to_dict(), allow_nan=False)  # strict JSON: no NaN/Infinity tokens
    loaded = json.loads(text)
    assert loaded["check"] == check
    assert set(loaded["details"]) == {"differences", "values", "nested", "tensor"}
    assert set(loaded["details"]["differences"]) == {"0", "1"}
    assert len(loaded["details"]["values"]) == 2
    assert loaded["details"]["values"][1][0] == 1.5
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back.suspects == (0, 1) and str(back) == str(err)


def test_error_suspects_sorted_from_any_iterable():
    err = ReplayMismatchError(step=0, rank=None, suspects=iter([5, 0, 3]))
    assert err.suspects == (0, 3, 5)
    assert "\n" not in str(err)


# --------------------------------------------------------------------------------------------
# 8. CheckStats


def test_check_stats_round_trip():
    s = CheckStats("ring_replay", runs=7, failures=2, last_verified_step=40, max_diff=0.25)
    s.bump("skipped_steps", 3)
    s.bump("scaler_overflows")
    s.add_time(0.5)
    state = s.state_dict()
    json.dumps(state)  # plain types
    restored = CheckStats("ring_replay")
    restored.load_state_dict(pickle.loads(pickle.dumps(state)))
    for attr in ("runs", "failures", "last_verified_step", "max_diff", "extra"):
        assert getattr(restored, attr) == getattr(s, attr), attr
    assert restored.state_dict() == state
    # the saved state is a snapshot: later changes to the stats do not leak into it
    s.bump("skipped_steps")
    assert state["extra"]["skipped_steps"] == 3


def _state(**changes):
    state = {"runs": 4, "failures": 1, "last_verified_step": 12, "max_diff": 0.5, "extra": {"skipped_steps": 1.0}}
    for k, v in changes.items():
        if v is KeyError:
            del state[k]
        else:
            state[k] = v
    return state


CORRUPTED = {
    "missing_runs": _state(runs=KeyError),
    "missing_failures": _state(failures=KeyError),
    "missing_last_verified_step": _state(last_verified_step=KeyError),
    "runs_str": _state(runs="many"),
    "runs_none": _state(runs=None),
    "runs_list": _state(runs=[1]),
    "failures_nan": _state(failures=math.nan),
    "max_diff_str": _state(max_diff="big"),
    "extra_int": _state(extra=5),
    "extra_value_str": _state(extra={"skipped_steps": "x"}),
    "not_a_dict": None,
    "a_list": [1, 2, 3],
}


@pytest.mark.parametrize("name", sorted(CORRUPTED))
def test_check_stats_corrupted_state_raises_value_error(name):
    s = CheckStats("weight_fingerprint")
    with pytest.raises(ValueError, match="weight_fingerprint"):
        s.load_state_dict(CORRUPTED[name])


@pytest.mark.parametrize("key", ["runs", "last_verified_step"])
def test_check_stats_infinite_counter_raises_value_error(key):
    s = CheckStats("nonfinite_gradient")
    with pytest.raises(ValueError, match="nonfinite_gradient"):
        s.load_state_dict(_state(**{key: math.inf}))


def test_check_stats_failed_load_changes_nothing():
    s = CheckStats("ring_replay")
    s.load_state_dict(_state(runs=3))
    before = s.state_dict()
    with pytest.raises(ValueError, match="ring_replay"):
        s.load_state_dict({**_state(runs=9), "failures": "bad"})
    assert s.state_dict() == before


def test_nonfinite_flags_are_exact_across_dtypes():
    from sdc_core.checks.reductions import nonfinite_flags

    tensors = [
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([1e300, -1e300], dtype=torch.float64),  # finite; would overflow in float32
        torch.tensor([1.0, float("inf")], dtype=torch.float16),
        torch.tensor([1.0, float("nan")]),
        torch.full((1000,), 3e38),  # finite values whose sum overflows: not flagged
    ]
    assert nonfinite_flags(tensors).tolist() == [False, False, True, True, False]


def test_the_replay_unit_of_a_loss_outside_the_model_shows_a_changed_output_value() -> None:
    """A loss computed outside the model is replayed by back-propagating the owner's gradient of its outputs, so the
    gradients cannot show a wrong value of the last layer's output; ``sum <output, gradient>`` in float64 does, down
    to one bf16 rounding step in one of 4096 outputs (summed in bf16 it would not), and its gradient is exactly the
    recorded one."""
    from sdc_core.driver.replay_capture import _unit_loss

    g = torch.Generator().manual_seed(0)
    out = torch.randn(64, 64, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(64, 64, generator=g).bfloat16()
    wrong = out.detach().clone()
    wrong.view(torch.int16)[5, 7] += 1  # the next bf16 value (one rounding step)
    assert wrong[5, 7] != out[5, 7]
    assert _unit_loss([wrong], [grad]) != _unit_loss([out.detach()], [grad])
    flipped = out.detach().clone()
    flipped[5, 7] *= -1  # a sign flip changes the value too
    assert _unit_loss([flipped], [grad]) != _unit_loss([out.detach()], [grad])
    products = out.detach().double() * grad.double()  # no sum that cancels: at least half of sum |p|, at most 1.5x
    assert 0.5 <= float(_unit_loss([out.detach()], [grad]) / products.abs().sum()) <= 1.5
    _unit_loss([out], [grad]).backward()
    assert torch.equal(out.grad, grad)
