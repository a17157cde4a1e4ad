"""The RNG states a re-run restores (``sdc_core.replay.rng``): always equal to what
``random.getstate`` / ``numpy.random.get_state`` give, and put back exactly."""

from __future__ import annotations

import random

import numpy as np
import torch

from sdc_core.replay.rng import all_rng, set_rng

CPU = torch.device("cpu")


def _same_numpy(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def _check(states) -> None:
    assert states[2] == random.getstate()
    assert _same_numpy(states[3], np.random.get_state())


def test_an_unmoved_generator_gives_the_same_state() -> None:
    first = all_rng(CPU)
    again = all_rng(CPU)
    _check(again)
    assert again[2] == first[2] and _same_numpy(again[3], first[3])
    assert torch.equal(again[0], first[0]) and again[1] is None


def test_every_draw_is_seen() -> None:
    before = all_rng(CPU)
    random.random()
    np.random.rand()
    after = all_rng(CPU)
    _check(after)
    assert after[2] != before[2] and not _same_numpy(after[3], before[3])


def test_cached_gaussians_are_seen() -> None:
    """Python keeps ``gauss_next`` beside its words; NumPy caches a Gaussian that no raw word
    holds: a draw from that cache changes the state without moving the generator."""
    random.gauss(0.0, 1.0)  # caches the second value of the pair
    _check(all_rng(CPU))
    random.gauss(0.0, 1.0)  # takes it: the words do not move, gauss_next does
    _check(all_rng(CPU))
    np.random.seed(3)
    np.random.standard_normal()  # one of a pair: the other is cached
    cached = all_rng(CPU)
    assert cached[3][3] == 1
    _check(cached)
    np.random.standard_normal()  # served from the cache: the words do not move
    used = all_rng(CPU)
    assert used[3][3] == 0
    _check(used)


def test_set_rng_puts_back_what_all_rng_took() -> None:
    np.random.seed(5)
    random.seed(5)
    states = all_rng(CPU)
    want = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand()
    set_rng(*states, CPU)
    assert (random.random(), np.random.rand(), torch.rand(1)) == want
