"""Causal order of the verdicts under Lightning DDP: run under torchrun (3 CPU ranks).

``torchrun --nproc-per-node 3 tests/causal_order_scenarios.py --out DIR --only a,b`` runs the
named scenarios in one process group; each rank writes ``DIR/<scenario>.rank<r>.json``. A weight
flipped on one rank after step ``s`` makes the replay of step ``s + 1`` disagree; what every rank
must raise is the weight fault (``FingerprintMismatchError`` naming the tensor), not a compute fault.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddp_scenarios import fit
from scenario_runner import main_for

from lightning_sdc import Fault, FaultInjector, NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck


def flip(step: int = 3, target: str = "body.weight") -> FaultInjector:
    """Rank 1's ``target`` gets one mantissa bit flipped right after optimizer step ``step``."""
    return FaultInjector([Fault("weight_bit_flip", rank=1, step=step, target=target, index=7, bit=20)])


def checks(fingerprint_every: int | None = 1) -> list[Any]:
    """Replay every step, the non-finite check and (unless None) the weight fingerprint."""
    out: list[Any] = [RingReplayAudit(every_n_steps=1, exact=True), NonFiniteGradientCheck()]
    if fingerprint_every is not None:
        out.append(WeightFingerprintCheck(every_n_steps=fingerprint_every))
    return out


SCENARIOS: dict[str, Any] = {
    # the pending comparison of step 3 is read before the replay of step 4, in either callback order
    "flip": lambda o: fit(o, "flip", [*checks(), flip()], steps=6),
    "flip_reversed": lambda o: fit(o, "flip_reversed", [flip(), *reversed(checks())], steps=6),
    # no comparison pending (cadence 5): the replay's disagreement at step 3 has the weights compared first
    "flip_cadence": lambda o: fit(o, "flip_cadence", [*checks(fingerprint_every=5), flip(2, "head.weight")], steps=6),
    # no WeightFingerprintCheck: a one-off comparison names the tensors all the same
    "flip_no_fingerprint": lambda o: fit(o, "flip_no_fingerprint", [*checks(None), flip(2, "head.weight")], steps=6),
    # heal: the replay's disagreement is explained by the healed replica; the step is dropped, training goes on
    "flip_heal": lambda o: fit(
        o, "flip_heal",
        [RingReplayAudit(every_n_steps=1, exact=True), WeightFingerprintCheck(every_n_steps=5, on_failure="heal"),
         flip(2, "head.weight")],
        steps=6,
    ),
    # a wrong product with equal weights stays a compute fault
    "compute": lambda o: fit(
        o, "compute", [*checks(), FaultInjector([Fault("module_output", rank=1, step=3, target="head", factor=1.5)])],
        steps=6,
    ),
}


if __name__ == "__main__":
    main_for(SCENARIOS)
