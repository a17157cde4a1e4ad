"""The checks under FSDP2 (4 CPU ranks) and HSDP 3 x 2 (6 CPU ranks) with Lightning ModelParallelStrategy.

Real ``torchrun`` launches of ``tests/sharded_scenarios.py`` over gloo, all under ``-m slow`` (the
default run keeps the plain-PyTorch FSDP2 launch of ``tests/test_plain.py`` and the in-band
verdict launch of ``tests/test_sharded_inband_unit.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun, worker_env

SCENARIOS = Path(__file__).with_name("sharded_scenarios.py")


def launch(out: Path, scenarios: list[str], nproc: int, timeout: float = 540, script: Path = SCENARIOS) -> Path:
    torchrun(script, out, scenarios, nproc, timeout=timeout, cwd=out)
    return out


def same_error(out: Path, scenario: str, world: int, error_type: str) -> dict[str, Any]:
    """The error every rank raised: one and the same, of ``error_type``."""
    errors = [r["error"] for r in results(out, scenario, world)]
    assert errors[0] is not None and errors[0]["type"] == error_type, errors[0]
    assert all(e == errors[0] for e in errors), errors
    return errors[0]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scenarios = ["nan_one", "at_rest", "replay_fault", "update_fault", "clean", "off"]
    return launch(tmp_path_factory.mktemp("fsdp"), scenarios, 4)


@pytest.mark.slow  # Lightning FSDP2 launch; the default run keeps the plain FSDP2 one (test_plain)
def test_fsdp2_clean_run_of_all_three_checks_with_bf16_dropout_accumulation_is_bit_identical(fsdp: Path) -> None:
    clean, off = results(fsdp, "clean", 4), results(fsdp, "off", 4)
    assert all(r["error"] is None and r["global_step"] == 8 for r in clean)
    assert [r["weights"] for r in clean] == [r["weights"] for r in off]  # every rank's shards, bit for bit
    assert len({r["weights"] for r in clean}) == 4  # pure FSDP: four different shards
    states = clean[0]["states"]
    assert states["NonFiniteGradientCheck"]["runs"] == 8 and states["NonFiniteGradientCheck"]["failures"] == 0
    assert states["WeightFingerprintCheck"]["failures"] == 0 and states["WeightFingerprintCheck"]["runs"] >= 8
    assert states["RingReplayAudit"]["runs"] == 4 and states["RingReplayAudit"]["max_diff"] == 0.0  # exact replays


@pytest.mark.slow  # Lightning FSDP2 launch; the default run keeps the plain FSDP2 one (test_plain)
def test_fsdp2_ring_replay_names_a_rank_computing_wrong(fsdp: Path) -> None:
    err = same_error(fsdp, "replay_fault", 4, "ReplayMismatchError")
    assert err["rank"] == 2 and err["step"] == 2
    assert err["details"]["mismatching_pairs"] == [[1, 2], [2, 3]]  # as owner and as replayer: no referee needed
    assert err["details"]["classification"] == "persistent"


@pytest.mark.slow  # Lightning FSDP2 launch; the default run keeps the plain FSDP2 one (test_plain)
def test_fsdp2_nan_in_one_ranks_local_gradients_names_it(fsdp: Path) -> None:
    err = same_error(fsdp, "nan_one", 4, "NonFiniteGradientError")
    assert err["rank"] == 2 and err["step"] == 3 and err["details"]["pattern"] == "one_rank"
    assert "layers.2.weight" in err["details"]["parameters"]["2"]
    assert list((fsdp / "sdc" / "incidents").glob("*nonfinite_gradient-step3.json"))


@pytest.mark.slow  # Lightning FSDP2 launch; the default run keeps the plain FSDP2 one (test_plain)
def test_fsdp2_bit_flip_at_rest_in_one_shard_names_the_rank(fsdp: Path) -> None:
    err = same_error(fsdp, "at_rest", 4, "FingerprintMismatchError")
    assert err["rank"] == 3 and err["suspects"] == [3]
    assert err["details"]["changed_at_rest"] == {"3": ["param:layers.1.weight"]}
    assert err["step"] == 3  # the flip happened after the update of step 3, before the next forward
    # reported before the update of step 4 (global step 4), the first that would use it (was: global step 6)
    assert all(r["global_step"] == 4 for r in results(fsdp, "at_rest", 4))


@pytest.mark.slow  # Lightning FSDP2 launch; the default run keeps the plain FSDP2 one (test_plain)
def test_fsdp2_wrong_update_is_named_by_partner_and_referee_recomputation(fsdp: Path) -> None:
    err = same_error(fsdp, "update_fault", 4, "FingerprintMismatchError")
    assert err["rank"] == 1 and err["step"] == 4
    assert err["details"]["update_audit"] == [{"owner": 1, "recomputed_by": 2, "tensors": ["layers.1.weight"]}]
    assert err["details"]["rulings"] == {"1->2": "referee agrees with the replayer: the owner is faulty"}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("hsdp"), ["hsdp_update", "hsdp_nan"], 6)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_hsdp_wrong_update_on_one_replica_is_named_by_majority(hsdp: Path) -> None:
    err = same_error(hsdp, "hsdp_update", 6, "FingerprintMismatchError")
    assert err["rank"] == 3 and err["step"] == 4
    assert err["details"]["differing_tensors"] == {"3": ["param:layers.1.weight"]}
    assert err["details"]["replica_groups"] == {"[1, 3, 5]": ["3"]}  # compared within its replica group only


@pytest.mark.slow
def test_hsdp_heal_restores_identical_replicas(hsdp_more: Path) -> None:
    rows = results(hsdp_more, "hsdp_heal", 6)
    assert all(r["error"] is None and r["global_step"] == 8 for r in rows)
    assert rows[0]["states"]["WeightFingerprintCheck"]["extra"]["heals"] == 1
    assert rows[0]["weights"] == rows[2]["weights"] == rows[4]["weights"]
    assert rows[1]["weights"] == rows[3]["weights"] == rows[5]["weights"]


@pytest.fixture(scope="module")
def fsdp_more(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scenarios = ["nan_all", "skip", "user_rs", "update_clean", "update_skip", "checkpoint"]
    return launch(tmp_path_factory.mktemp("fsdp_more"), scenarios, 4)


@pytest.mark.slow
def test_fsdp2_update_audit_every_step_raises_nothing_on_a_clean_bf16_run_or_a_skipped_step(fsdp_more: Path) -> None:
    assert all(r["error"] is None and r["global_step"] == 8 for r in results(fsdp_more, "update_clean", 4))
    skipped = results(fsdp_more, "update_skip", 4)  # the NaN step dropped after the update audit's snapshot
    assert all(r["error"] is None and r["finite"] for r in skipped)
    assert skipped[0]["states"]["NonFiniteGradientCheck"]["extra"]["skipped_steps"] == 1


@pytest.mark.slow
def test_fsdp2_distributed_checkpoints_are_written_with_the_checks_on(fsdp_more: Path) -> None:
    assert all(r["error"] is None and r["global_step"] == 8 for r in results(fsdp_more, "checkpoint", 4))
    assert (fsdp_more / "ckpt" / "epoch=0-step=6.ckpt").exists()


@pytest.mark.slow
def test_fsdp2_nan_on_every_rank_is_divergence(fsdp_more: Path) -> None:
    err = same_error(fsdp_more, "nan_all", 4, "NonFiniteGradientError")
    assert err["rank"] is None and err["details"]["pattern"] == "all_ranks" and err["suspects"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_fsdp2_skip_step_is_alike_on_every_rank_and_weights_stay_finite(fsdp_more: Path) -> None:
    rows = results(fsdp_more, "skip", 4)
    assert all(r["error"] is None and r["finite"] and r["global_step"] == 8 for r in rows)
    assert all(r["states"]["NonFiniteGradientCheck"]["extra"]["skipped_steps"] == 1 for r in rows)


@pytest.mark.slow
def test_fsdp2_user_reduce_scatter_is_wrapped_not_replaced(fsdp_more: Path) -> None:
    rows = results(fsdp_more, "user_rs", 4)
    assert all(r["user_rs_calls"] > 0 for r in rows)  # the user's comm still reduces
    err = same_error(fsdp_more, "user_rs", 4, "NonFiniteGradientError")
    assert err["rank"] == 1


@pytest.fixture(scope="module")
def hsdp_more(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("hsdp_more"), ["hsdp_heal", "hsdp_clean"], 6)


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_hsdp_nan_in_one_ranks_local_gradients_names_it(hsdp: Path) -> None:
    """The flag rides the reduce-scatter and then the replicate all-reduce: every rank of both
    dimensions learns it from its own reduced shard."""
    err = same_error(hsdp, "hsdp_nan", 6, "NonFiniteGradientError")
    assert err["rank"] == 4 and err["step"] == 2 and err["details"]["pattern"] == "one_rank"


@pytest.mark.slow
def test_hsdp_bf16_clean_run_is_quiet(hsdp_more: Path) -> None:
    assert all(r["error"] is None and r["global_step"] == 8 for r in results(hsdp_more, "hsdp_clean", 6))


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_torchrun_demo.py"


def run_example(nproc: int, *args: str) -> str:
    return torchrun(EXAMPLE, None, None, nproc, *args, timeout=300).stdout


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_plain_fully_shard_with_tensor_parallel_names_the_rank_whose_shard_changed_at_rest() -> None:
    out = run_example(4, "--tp", "2", "--fault", "at_rest")  # FSDP 2 x TP 2 over gloo
    assert "SDC check 'weight_fingerprint' failed at step 4: rank 1" in out and "param:2.weight" in out


@pytest.mark.slow
def test_plain_fully_shard_tensor_parallel_nan_and_hsdp_update() -> None:
    assert "SDC check 'nonfinite_gradient' failed at step 5: rank 1" in run_example(4, "--tp", "2", "--fault", "nan")
    assert "no SDC verdict" in run_example(4, "--tp", "2", "--fault", "none")
    out = run_example(6, "--hsdp", "3", "--fault", "weights")
    assert "SDC check 'weight_fingerprint' failed at step 4: rank 1" in out and "param:2.weight" in out


@pytest.fixture(scope="module")
def accelerate_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("acc_fsdp2")
    env = worker_env() | {"ACCELERATE_USE_CPU": "1", "ACCELERATE_SDC_CONFIG_FILE": os.devnull}
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "4",
           str(SCENARIOS.with_name("accelerate_fsdp2_scenarios.py")), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return out


@pytest.mark.slow  # a second launch of the FSDP topology (the default run keeps one per topology)
def test_accelerate_attach_on_an_fsdp2_model(accelerate_fsdp2: Path) -> None:
    clean = results(accelerate_fsdp2, "clean", 4)
    assert all(r["error"] is None and r["sharded"] for r in clean)
    assert clean[0]["cores"] == ["ShardedNonFinite", "ShardedReplay", "ShardedFingerprint"]
    assert clean[0]["runs"] == {"sdc/nonfinite_gradient/runs": 8.0, "sdc/gradient_screen/runs": 8.0,
                                "sdc/ring_replay/runs": 4.0,
                                "sdc/weight_fingerprint/runs": 9.0}  # fmt: skip (8 steps, finish: 1 more)
    assert clean[0]["warnings"] == []
    nan = same_error(accelerate_fsdp2, "nan", 4, "NonFiniteGradientError")
    assert nan["rank"] == 2 and nan["step"] == 3 and nan["details"]["pattern"] == "one_rank"
    rest = same_error(accelerate_fsdp2, "at_rest", 4, "FingerprintMismatchError")
    assert rest["rank"] == 1 and rest["details"]["changed_at_rest"] == {"1": ["param:body.weight"]}
    compute = same_error(accelerate_fsdp2, "compute", 4, "ReplayMismatchError")
    assert compute["rank"] == 3 and compute["step"] == 2
    # update_audit_every_n_steps as an SDCHooks setting: a wrong update on rank 1 named by recomputation
    update = same_error(accelerate_fsdp2, "update_fault", 4, "FingerprintMismatchError")
    assert update["rank"] == 1 and update["step"] == 4
    assert update["details"]["update_audit"] == [{"owner": 1, "recomputed_by": 2, "tensors": ["body.weight"]}]
    # a stateful forward (counter, EMA buffer): exact replays, bit-identical with the replay off
    on, off = results(accelerate_fsdp2, "stateful_on", 4), results(accelerate_fsdp2, "stateful_off", 4)
    assert all(r["error"] is None and r["calls"] == 8 for r in on + off)
    assert [r["weights"] for r in on] == [r["weights"] for r in off]
    assert on[0]["runs"]["sdc/ring_replay/runs"] == 4.0 and on[0]["update_audit"]["runs"] == 8
    assert len(list((accelerate_fsdp2 / "sdc" / "incidents").glob("*.json"))) == 4  # one per verdict, rank 0
