"""The latency bound of the sharded weight fingerprint under FSDP2 (Lightning ``ModelParallelStrategy``
with ``fully_shard``, 4 gloo CPU ranks): a shard flipped at rest after the compared update of
step ``s`` is reported, naming the rank and the tensor, before the update of step ``s + 1``.

One real ``torchrun`` launch of ``tests/sharded_latency_scenarios.py`` (about a minute on two
cores: marked slow; the default run keeps one FSDP2 launch, in test_sharded.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sharded import launch, results, same_error

SCRIPT = Path(__file__).with_name("sharded_latency_scenarios.py")


@pytest.fixture(scope="module")
def latency(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("fsdp_latency"), ["rest_every_step", "rest_every_2"], 4, script=SCRIPT)


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "rank", "step"), [("rest_every_step", 3, 2), ("rest_every_2", 1, 3)])
def test_fsdp2_shard_flipped_at_rest_is_reported_before_the_next_update(
    latency: Path, scenario: str, rank: int, step: int
) -> None:
    err = same_error(latency, scenario, 4, "FingerprintMismatchError")
    assert (err["rank"], err["suspects"], err["step"]) == (rank, [rank], step)
    assert err["details"]["changed_at_rest"] == {str(rank): ["param:layers.1.weight"]}
    # raised in the next step, before its update (before the fix: two and four steps later)
    assert all(r["global_step"] == step + 1 for r in results(latency, scenario, 4))
