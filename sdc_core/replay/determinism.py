"""Deterministic kernels around the audited micro-batches and their replays (five flags, restored after). Limits: custom
CUDA or Triton kernels outside torch's switch are not covered; compiled graphs keep the kernels they were compiled
with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.deterministic as det

CUBLAS_DETERMINISTIC = ":4096:8"

# cuBLAS reads its workspace configuration when its first handle is created, long before any audit, and
# torch refuses cuBLAS under deterministic algorithms without it: set at import unless the user set it (a
# fixed 32 MiB workspace per handle and stream, no change of any result).
if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.cuda.is_initialized():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC


@dataclass
class DeterministicWindow:
    """``enter(strict)``: deterministic algorithms with ``warn_only=not strict`` (through ``torch._C``: the inductor
    config is left alone), cuDNN deterministic without benchmarking, no filling of uninitialised memory.
    ``exit()`` restores what ``enter`` found; both are idempotent."""

    _saved: tuple[bool, bool, bool, bool, bool] | None = None

    def enter(self, strict: bool) -> None:
        if self._saved is None:
            cudnn = torch.backends.cudnn
            self._saved = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled(),
                           cudnn.deterministic, cudnn.benchmark, det.fill_uninitialized_memory)  # fmt: skip
        torch._C._set_deterministic_algorithms(True, warn_only=not strict)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        det.fill_uninitialized_memory = False  # type: ignore[attr-defined]

    def exit(self) -> None:
        if self._saved is None:
            return
        mode, warn_only, cudnn_det, cudnn_bench, fill = self._saved
        self._saved = None
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench
        det.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


@contextmanager
def deterministic(enabled: bool = True, strict: bool = False) -> Iterator[None]:
    """Inside: deterministic kernels (nothing when ``enabled`` is False); the caller's settings back after."""
    window = DeterministicWindow()
    if enabled:
        window.enter(strict)
    try:
        yield
    finally:
        window.exit()
