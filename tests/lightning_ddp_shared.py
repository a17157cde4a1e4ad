"""The Lightning DDP scenarios that several test files read, in one ``torchrun`` (``conftest.lightning_ddp``):
those of ``ddp_scenarios`` and ``nonfinite_scenarios`` in one process group, so Lightning starts once."""

from __future__ import annotations

from ddp_scenarios import SCENARIOS as DDP
from nonfinite_scenarios import SCENARIOS as NONFINITE
from scenario_runner import main_for

if __name__ == "__main__":
    assert not DDP.keys() & NONFINITE.keys(), DDP.keys() & NONFINITE.keys()
    main_for(DDP | NONFINITE)
