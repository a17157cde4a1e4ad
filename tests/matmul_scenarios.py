"""Multi-process scenarios of the matrix-product checksum check: run under ``torchrun`` (3 ranks),
each a real ``Trainer(accelerator="cpu", devices=3, strategy="ddp")`` fit of the MLP of
``ddp_scenarios.py``; each rank writes JSON results (see ``scenario_runner``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_scenarios import fit
from scenario_runner import main_for

from lightning_sdc import (
    Fault,
    FaultInjector,
    MatmulChecksumCheck,
    NonFiniteGradientCheck,
    RingReplayAudit,
    WeightFingerprintCheck,
)


def defaults() -> list[Any]:
    return [NonFiniteGradientCheck(), RingReplayAudit(), WeightFingerprintCheck()]


def fault(phase: str, target: str = "body", factor: float = -3.0) -> FaultInjector:
    """Rank 1, step 3: one element of ``target``'s product comes out -3x its value (finite: the
    gradient check cannot see it; step 3 is not one the replay audits at its default cadence)."""
    return FaultInjector([Fault("matmul_output", rank=1, step=3, target=target, index=5, factor=factor, mode="once",
                                phase=phase)])  # fmt: skip


SCENARIOS: dict[str, Any] = {
    "mm_off": lambda o: fit(o, "mm_off", defaults(), accumulate_grad_batches=2),
    "mm_clean": lambda o: fit(o, "mm_clean", [*defaults(), MatmulChecksumCheck()], accumulate_grad_batches=2),
    "mm_clean_bf16": lambda o: fit(o, "mm_clean_bf16", [MatmulChecksumCheck()], precision="bf16-mixed"),
    "mm_forward": lambda o: fit(o, "mm_forward", [*defaults(), MatmulChecksumCheck(), fault("forward")]),
    "mm_input_grad": lambda o: fit(
        o, "mm_input_grad", [*defaults(), MatmulChecksumCheck(), fault("input_grad", target="head")]
    ),
    "mm_weight_grad": lambda o: fit(o, "mm_weight_grad", [*defaults(), MatmulChecksumCheck(), fault("weight_grad")]),
    "mm_forward_unchecked": lambda o: fit(o, "mm_forward_unchecked", [*defaults(), fault("forward")]),
}


if __name__ == "__main__":
    main_for(SCENARIOS)
