"""The RNG states a re-run needs: torch (CPU and the CUDA device), Python's ``random`` and NumPy's.

Contract: ``all_rng(device)`` returns the states in ``MicroBatch``'s field order, as
``torch.get_rng_state``, ``torch.cuda.get_rng_state``, ``random.getstate()`` and
``numpy.random.get_state()`` give them; ``set_rng`` puts such states back in place.

Cost: with a screen the replay takes them at the start of EVERY step (a step it may have to
re-run), where ``numpy.random.get_state()`` alone takes about 50 us and ``random.getstate()``
13 us (four times that right after an optimizer step, with cold caches). ``_Unchanged`` makes
both nearly free when the generator did not move since the last call, the common case (a
forward that draws from neither): it copies the generator's raw words (2.5 KB, under a
microsecond, through ``ctypes``) and hands back the state object it took last time when they
are the same. The raw words are the whole Mersenne Twister state; what lies beside them is
compared too (Python's ``gauss_next``), or the state is taken in full whenever it may differ:
NumPy's cached Gaussian, which ``get_state`` reports but no raw word holds, so a state is reused
only while none is cached (the one case this misses: a program that puts back, with
``set_state``, the very words of the last state but with a Gaussian cached). The raw layout is
checked against the full state on first use; a generator it does not match (another Python or
NumPy build, another bit generator) is always taken in full. The states handed out are shared
between calls: callers treat them as read-only (``set_rng`` only reads them).
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import torch

_WORDS = 624  # MT19937: 624 32-bit words of state and an index (Python's and NumPy's alike)
_RAW_BYTES = 4 * _WORDS + 4
_CPU_GENERATOR = torch.default_generator


def capture_rng(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU RNG state and, for a CUDA ``device``, that device's RNG state."""
    if device is None or device.type != "cuda":
        return _CPU_GENERATOR.get_state(), None  # what torch.get_rng_state returns, without its wrapper
    return _CPU_GENERATOR.get_state(), torch.cuda.get_rng_state(device)


def _np_random() -> Any:
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


class _Unchanged:
    """One generator's full state (``take``: e.g. ``random.getstate``), taken again only when its
    raw words (``raw()``: bytes, or None where they cannot be read) or ``side()`` (what the
    state holds beside them) changed since the last full take, or when ``reusable(state)`` says
    the last one may not be reused. ``matches(raw, state)`` checks the raw layout once."""

    def __init__(self, raw: Callable[[], bytes | None], side: Callable[[], Any],
                 matches: Callable[[bytes, Any], bool], reusable: Callable[[Any], bool]) -> None:  # fmt: skip
        self._raw, self._side, self._matches, self._reusable = raw, side, matches, reusable
        self._checked: bool | None = None  # the raw layout matched the full state (None: not tried yet)
        self._last: tuple[bytes, Any, Any] | None = None  # (raw, side, state) of the last full take

    def get(self, take: Callable[[], Any]) -> Any:
        if self._checked is False:
            return take()
        try:
            raw, side = self._raw(), self._side()
        except Exception:  # a layout this code does not know: full takes from now on
            self._checked = False
            return take()
        last = self._last
        if raw is not None and last is not None and last[0] == raw and last[1] == side:
            return last[2]
        state = take()
        if self._checked is None:
            self._checked = raw is not None and self._matches(raw, state)
        self._last = (raw, side, state) if self._checked and raw is not None and self._reusable(state) else None
        return state


def _python_raw() -> bytes | None:
    """The raw words of ``random``'s global generator: CPython's ``RandomObject`` (``index``, then
    the 624 words) right after the object header; None on another Python (``id`` is no address)."""
    if sys.implementation.name != "cpython":
        return None
    inst = random.getstate.__self__  # type: ignore[attr-defined]
    return ctypes.string_at(id(inst) + object.__basicsize__, _RAW_BYTES)


def _python_matches(raw: bytes, state: Any) -> bool:
    index, *words = struct.unpack(f"i{_WORDS}I", raw)
    return tuple(words) == state[1][:_WORDS] and index == state[1][_WORDS]


def _numpy_raw() -> bytes | None:
    """The raw words of NumPy's global ``RandomState`` where its bit generator is MT19937 (its
    ``mt19937_state``: the 624 words, then the position), else None."""
    npr = _np_random()
    if npr is None:
        return None
    bits = npr.mtrand._rand._bit_generator
    if type(bits).__name__ != "MT19937":
        return None
    return ctypes.string_at(bits.ctypes.state_address, _RAW_BYTES)


def _numpy_matches(raw: bytes, state: Any) -> bool:
    *words, pos = struct.unpack(f"{_WORDS}I i", raw)
    return state[0] == "MT19937" and tuple(state[1].tolist()) == tuple(words) and int(state[2]) == pos


def _numpy_side() -> Any:
    npr = _np_random()
    return (id(npr.mtrand._rand), id(npr.mtrand._rand._bit_generator)) if npr is not None else None


_PYTHON = _Unchanged(_python_raw, lambda: (id(random.getstate.__self__), random.getstate.__self__.gauss_next),  # type: ignore[attr-defined]
                     _python_matches, lambda state: True)  # fmt: skip
_NUMPY = _Unchanged(_numpy_raw, _numpy_side, _numpy_matches, lambda state: not state[3])  # no Gaussian cached


def all_rng(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None, Any, Any]:
    """The RNG state of torch (CPU and, for a CUDA ``device``, that device), Python and NumPy,
    in ``MicroBatch``'s field order (module docstring: the last states are reused while unchanged)."""
    cpu, cuda = capture_rng(device)
    npr = _np_random()
    return cpu, cuda, _PYTHON.get(random.getstate), _NUMPY.get(npr.get_state) if npr is not None else None


def set_rng(cpu: torch.Tensor, cuda: torch.Tensor | None, py: Any, np_state: Any, device: torch.device) -> None:
    """Put an RNG state taken by ``all_rng`` back in place (the CUDA one on a CUDA ``device`` only)."""
    torch.set_rng_state(cpu.clone())
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda.clone(), device)
    if py is not None:
        random.setstate(py)
    npr = _np_random()
    if np_state is not None and npr is not None:
        npr.set_state(np_state)


__all__ = ["all_rng", "capture_rng", "set_rng"]
