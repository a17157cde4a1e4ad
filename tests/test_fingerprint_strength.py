"""Strength of the version-2 digest against structured faults (property tests, CPU, no processes).

The module docstring of ``sdc_core.checks.digest`` derives the guarantee: a difference is missed
only when every class sum cancels (words exactly a multiple of the odd column count apart) or,
otherwise, with probability <= 2**-31. These tests check the definition against a pure-Python
reference, and that the fault patterns the plain word sum (version 1) let cancel are now seen.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdc_core.checks.digest import combine, grouped_digests, splitmix64, tensor_digest, tensor_digest_v1
from sdc_core.faults.inject import flip_bit
from sdc_core.io.checkpoints import FINGERPRINT_KEY, changed_tensors, fingerprint_checkpoint

MASK = (1 << 64) - 1
FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _ref_splitmix(seed: int, i: int) -> int:
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) | 1


def _signed(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


def _ref_digest(t: torch.Tensor) -> int:
    """The module docstring's definition, in Python integers."""
    from sdc_core.checks import digest as fp
    raw = bytes(t.contiguous().view(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 8)
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    n = len(words)
    rows = max(1, min(fp._ROWS, n // fp._MIN_COLUMNS), -(-n // fp._MAX_CLASSES))
    if rows == 1:
        sums = words
    else:
        cols = n // rows
        cols -= 1 - cols % 2
        sums = [_signed(sum(words[j + r * cols] for r in range(rows))) for j in range(cols)] + words[rows * cols :]
    total = 0
    for j, c in enumerate(sums):
        total += _ref_splitmix(fp._SEEDS[0], j) * c + _ref_splitmix(fp._SEEDS[1], j) * (c >> 32)
    return _signed(total)


def _columns(n_words: int) -> int:
    """The class stride of a tensor of ``n_words`` 64-bit words (n_words when one row)."""
    from sdc_core.checks import digest as fp
    rows = max(1, min(fp._ROWS, n_words // fp._MIN_COLUMNS))
    if rows == 1:
        return n_words
    cols = n_words // rows
    return cols - (1 - cols % 2)


def _tensor(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_weights_are_splitmix64_in_integers():
    for seed in (0, 1, 0x5DC0DE0F1A9E12, MASK):
        got = [w & MASK for w in splitmix64(seed, 50).tolist()]
        assert got == [_ref_splitmix(seed & MASK, i) for i in range(50)]


@FAST
@given(n=st.sampled_from([0, 1, 3, 7, 100, 1023, 1024, 1030, 5000, 20001]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_digest_is_the_documented_integer_function(n, dtype, seed):
    t = _tensor(n, dtype, seed)
    assert int(tensor_digest(t)) == _ref_digest(t)


def test_digest_does_not_depend_on_threads_or_layout():
    t = _tensor(300_001, torch.float32, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int(tensor_digest(t))
        torch.set_num_threads(2)
        two = int(tensor_digest(t))
    finally:
        torch.set_num_threads(threads)
    assert one == two
    m = _tensor(600 * 700, torch.float32, 4).view(600, 700)
    assert int(tensor_digest(m.t())) == int(tensor_digest(m.t().contiguous()))
    assert int(tensor_digest(t[1:])) == int(tensor_digest(t[1:].clone()))  # misaligned storage offset


def test_the_issue_example_and_version_1_blind_spot():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.5, 2.0, 2.0, 4.0])
    assert int(tensor_digest_v1(a)) == int(tensor_digest_v1(b))  # the plain word sum cancels
    assert int(tensor_digest(a)) != int(tensor_digest(b))


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64) if t.element_size() == 8 else t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@FAST
@given(n=st.sampled_from([64, 1000, 4096, 40_000, 300_000]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16), data=st.data())  # fmt: skip
def test_two_opposite_flips_of_one_bit_are_seen(n, dtype, seed, data):
    t = _tensor(n, dtype, seed)
    width = 8 * t.element_size()
    bit = data.draw(st.integers(0, width - 1), label="bit")
    per_word = 8 // t.element_size()
    i = data.draw(st.integers(0, n - 1), label="i")
    j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i), label="j")
    cols = _columns((n * t.element_size() + 7) // 8)
    wi, wj = i // per_word, j // per_word
    if wi != wj and (wi - wj) % cols == 0 and max(wi, wj) < cols * 16:
        return  # the stated exception: the two words share a class
    bits = _words(t)
    up, down = (i, j) if (int(bits[i]) >> bit) & 1 == 0 else (j, i)
    # make the pair "one bit up here, the same bit down there" (the v1 cancellation)
    if (int(bits[down]) >> bit) & 1 == 0:
        flip_bit(t, down, bit)
    d0 = int(tensor_digest(t))
    flip_bit(t, up, bit)
    flip_bit(t, down, bit)
    assert int(tensor_digest(t)) != d0


@FAST
@given(n_words=st.sampled_from([4, 600, 5000, 100_000]), seed=st.integers(0, 2**16),
       count=st.sampled_from([2, 4, 6, 64]), data=st.data())  # fmt: skip
def test_even_number_of_sign_flips_in_high_halves_is_seen(n_words, seed, count, data):
    t = _tensor(2 * n_words, torch.float32, seed).abs()  # every sign bit 0: a stuck-at-1 fault sets them
    count = min(count, n_words)
    words = data.draw(st.lists(st.integers(0, n_words - 1), min_size=count, max_size=count, unique=True))
    cols = _columns(n_words)
    classes = [w % cols for w in words]
    if len(set(classes)) < len(classes) and n_words >= 1024:
        return  # two in one class: the stated exception
    d0, v0 = int(tensor_digest(t)), int(tensor_digest_v1(t))
    for w in words:
        flip_bit(t, 2 * w + 1, 31)  # the high fp32 half of word w: bit 63 of the int64 word
    assert int(tensor_digest_v1(t)) == v0  # carried out of the word: version 1 is blind
    assert int(tensor_digest(t)) != d0


@FAST
@given(n=st.sampled_from([4096, 65_536, 1_000_000]), period=st.sampled_from([32, 64, 128, 256, 1024]),
       lane=st.integers(0, 31), bit=st.integers(0, 31), seed=st.integers(0, 2**16))  # fmt: skip
def test_a_bad_lane_flipping_one_bit_either_way_is_seen(n, period, lane, bit, seed):
    t = _tensor(n, torch.float32, seed)
    d0 = int(tensor_digest(t))
    bits = t.view(torch.int32)
    bits[lane::period] ^= -(1 << 31) if bit == 31 else (1 << bit)  # xor: up where 0, down where 1
    assert int(tensor_digest(t)) != d0


@FAST
@given(seed=st.integers(0, 2**16), count=st.integers(1, 6), data=st.data())
def test_fingerprint_of_many_tensors_sees_any_change(seed, count, data):
    tensors = [_tensor(n, torch.float32, seed + k) for k, n in enumerate([10, 5000, 3, 70_000, 1, 4095])]
    originals = [x.clone() for x in tensors]
    fp0 = int(combine(grouped_digests(tensors)))
    assert fp0 == int(combine(grouped_digests(originals)))
    for _ in range(count):
        k = data.draw(st.integers(0, len(tensors) - 1))
        flip_bit(tensors[k], data.draw(st.integers(0, tensors[k].numel() - 1)), data.draw(st.integers(0, 31)))
    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(tensors, originals, strict=True))
    assert (int(combine(grouped_digests(tensors))) == fp0) == same  # flips that undo each other: no change


def test_checkpoints_store_version_2_and_version_1_still_verify():
    state = {"w": _tensor(50, torch.float32, 1), "b": _tensor(3, torch.float32, 2)}
    new = {**state, FINGERPRINT_KEY: fingerprint_checkpoint(state)}
    assert new[FINGERPRINT_KEY]["version"] == 2
    old = {**state, FINGERPRINT_KEY: fingerprint_checkpoint(state, version=1)}
    assert changed_tensors(new) == [] and changed_tensors(old) == []
    flip_bit(state["w"], 7, 3)
    assert changed_tensors(new) == ["w"] and changed_tensors(old) == ["w"]
    bad = {**state, FINGERPRINT_KEY: {"version": 99, "tensors": {}}}
    try:
        changed_tensors(bad)
    except ValueError as err:
        assert "version 99" in str(err)
    else:
        raise AssertionError("an unknown fingerprint version must be refused")
