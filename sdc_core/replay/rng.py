"""The RNG states a re-run needs: torch (CPU and the CUDA device), Python's ``random`` and NumPy's.

Cost: with a screen they are taken at the start of EVERY step: host work only, about 50 us for NumPy's and 13 us for
Python's on a CPU core; no device work and no host wait."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


def capture_rng(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU RNG state and, for a CUDA ``device``, that device's RNG state."""
    cuda = device is not None and device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None


def _np_random() -> Any:
    """``numpy.random`` where the program imported NumPy (no import of our own), else None."""
    return getattr(sys.modules.get("numpy"), "random", None)


def all_rng(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None, Any, Any]:
    """The RNG state of torch (CPU and, for a CUDA ``device``, that device), Python and NumPy,
    in ``MicroBatch``'s field order."""
    npr = _np_random()
    return *capture_rng(device), random.getstate(), npr.get_state() if npr is not None else None


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
