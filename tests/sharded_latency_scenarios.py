"""How soon a shard flipped at rest is reported under FSDP2 (Lightning ``ModelParallelStrategy``
with ``fully_shard``, 4 CPU ranks): run under torchrun.

``torchrun --nproc-per-node 4 tests/sharded_latency_scenarios.py --out DIR --only a,b`` runs the
named scenarios in one process group; each rank writes ``DIR/<scenario>.rank<r>.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenario_runner import main_for
from sharded_scenarios import FlipShard, fit

from lightning_sdc import NonFiniteGradientCheck, RingReplayAudit, WeightFingerprintCheck

SCENARIOS: dict[str, Any] = {
    # rank 3's shard flipped after the update of step 2, before the next forward: reported (step 2)
    # before the update of step 3, whatever the callback order
    "rest_every_step": lambda o: fit(
        o, "rest_every_step",
        [FlipShard(rank=3, step=3), RingReplayAudit(every_n_steps=1, exact=True), NonFiniteGradientCheck(),
         WeightFingerprintCheck(every_n_steps=1)],
    ),
    # compared every 2nd update (steps 1, 3, 5, ...): a flip after the update of step 3, reported before step 4's
    "rest_every_2": lambda o: fit(
        o,
        "rest_every_2",
        [FlipShard(rank=1, step=4), WeightFingerprintCheck(every_n_steps=2), NonFiniteGradientCheck()],
    ),
}


if __name__ == "__main__":
    main_for(SCENARIOS)
