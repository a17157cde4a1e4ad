"""The plain-PyTorch route: ``sdc_core.SDCHooks`` in a hand-written torchrun loop (DDP and FSDP2).

Real ``torchrun`` ranks over gloo on CPU (``tests/plain_scenarios.py``). ``check_models`` is the
assertion shared with the GPU suite (``tests/test_gpu.py``), which runs the same scenarios on CUDA.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, results, torchrun, worker_env

SCRIPT = Path(__file__).with_name("plain_scenarios.py")
KINDS = ("off", "clean", "nan", "activation", "flip")
EXPECTED = {"nan": ("NonFiniteGradientError", 1), "activation": ("ReplayMismatchError", 2),
            "flip": ("FingerprintMismatchError", 1)}  # fmt: skip


def launch(out: Path, scenarios: list[str], nproc: int, device: str = "cpu", timeout: float = 540) -> Path:
    torchrun(SCRIPT, out, scenarios, nproc, "--device", device, timeout=timeout)
    return out


def same_error(out: Path, scenario: str, world: int) -> dict[str, Any]:
    """The verdict every rank raised (the same on each), or a failed assertion naming the scenario."""
    rows = results(out, scenario, world)
    errors = [r["error"] for r in rows]
    assert all(e is not None for e in errors), f"{scenario}: not every rank raised: {errors}"
    assert len({(e["type"], e["rank"], e["step"]) for e in errors}) == 1, f"{scenario}: ranks disagree: {errors}"
    return errors[0]


def check_models(out: Path, models: list[str], world: int, exact: set[str]) -> None:
    """For each model: the clean run raises nothing (bit-identical to the run without checks for the
    models in ``exact``); a NaN, an activation fault and a weight flip are named on every rank."""
    for model in models:
        clean, off = results(out, f"{model}:clean", world), results(out, f"{model}:off", world)
        assert all(r["error"] is None and r["finite"] for r in clean), f"{model}: false verdict {clean[0]['error']}"
        if model in exact:
            assert [r["weights"] for r in clean] == [r["weights"] for r in off], f"{model}: clean run changed training"
        state = clean[0]["state"]["checks"]
        assert state["ring_replay"]["runs"] >= 3 and state["weight_fingerprint"]["failures"] == 0, (model, state)
        for kind, (error_type, rank) in EXPECTED.items():
            err = same_error(out, f"{model}:{kind}", world)
            # with a GradScaler a lone NaN is the scaler's overflow; on an audited step the replay names it first
            allowed = {error_type, "ReplayMismatchError"} if (model, kind) == ("fp16", "nan") else {error_type}
            assert err["type"] in allowed and err["rank"] == rank, f"{model}:{kind}: {err['message']}"
            assert results(out, f"{model}:{kind}", world)[0]["incidents"], f"{model}:{kind}: no incident written"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kinds = (*KINDS, "save", "flip_audited", "flip_audited_nofp", "flip_audited_heal", "matmul_clean", "matmul",
             "matmul_backward", "nan_deferred", "nan_early_deferred", "zero", "accumulate", "accumulate_synced")
    more = ["own:clean", "own:flip", "sparse:clean", "sparse:activation", "mlp:compiled", "mlp:compiled_activation",
            "outside:off", "outside:clean", "outside:activation", "outside:accumulate", "outside:small",
            "outside:twice", "outside_bf16:clean", "outside_bf16:activation", "outside:screened",
            "outside_bf16:screened", "mlp:evaluated", "outside:evaluated", "mlp:discarded", "mlp:nan_skip",
            "mlp:bad_data", "mlp:bad_data_raise", "mlp:overflow_skip", "mlp:diverging"]
    return launch(tmp_path_factory.mktemp("plain_ddp"), [f"mlp:{k}" for k in kinds] + more, 3)


def test_zero_redundancy_optimizer_trains_clean_and_the_fingerprint_says_what_it_cannot_see(ddp: Path) -> None:
    """torch's ZeroRedundancyOptimizer broadcasts each rank's updated shard, so the replicas agree by
    construction: a clean run raises nothing, and every rank is warned once that the fingerprint cannot see
    weight or update faults there (the replay still audits)."""
    rows = results(ddp, "mlp:zero", 3)
    assert all(r["error"] is None and r["finite"] for r in rows), rows[0]["error"]
    for r in rows:
        assert [w for w in r["warnings"] if "ZeroRedundancyOptimizer" in w] == [r["warnings"][0]], r["warnings"]
    assert rows[0]["state"]["checks"]["ring_replay"]["runs"] >= 2
    assert all(r["warnings"] == [] for r in results(ddp, "mlp:clean", 3))  # a plain optimizer: no warning


def test_a_non_finite_batch_its_partner_reproduces_names_no_rank(ddp: Path) -> None:
    """With the non-finite verdict read before the update (``on_failure="skip_step"``), a NaN in one input sample is
    the data (no rank named), and the offending rank's partner recomputes its micro-batch on the same weights: a finite
    input that overflows comes back there too (no rank named), a NaN in the rank's own gradient does not (named). Each
    step is dropped."""
    for kind, said_here in (("bad_data", "the data, not a faulty device: the micro-batches of rank 1 held NaN/Inf"),
                            ("overflow_skip", "the data or the model's numerics, not a faulty device: the partners'"),
                            ("nan_skip", "rank 1 (host")):  # fmt: skip
        rows = results(ddp, f"mlp:{kind}", 3)
        assert all(r["error"] is None and r["finite"] for r in rows), rows[0]["error"]
        assert rows[0]["state"]["checks"]["nonfinite_gradient"]["extra"]["skipped_steps"] == 1
        (said,) = [w for w in rows[0]["warnings"] if "nonfinite_gradient" in w]
        assert said_here in said and ("no rank could be named" in said) != (kind == "nan_skip"), said


def test_a_nan_input_sample_names_no_rank_at_the_defaults(ddp: Path) -> None:
    """At the default ``"raise"`` the verdict is read one step later, after the update spread the NaN to every replica,
    so nothing can be recomputed; the batch the rank ran is still kept and held the NaN itself: the data, no rank
    named, no host to take out. Raised on every rank alike."""
    rows = results(ddp, "mlp:bad_data_raise", 3)
    for r in rows:
        error = r["error"]
        assert error["type"] == "NonFiniteGradientError" and error["step"] == 3, error
        assert error["rank"] is None and error["suspects"] == [] and error["details"]["pattern"] == "bad_inputs", error


def test_a_diverging_run_whose_values_overflow_first_on_one_rank_names_no_rank(ddp: Path) -> None:
    """A learning rate that diverges the run: every rank's loss grows toward overflow, and rank 1 (larger inputs)
    overflows first, alone, the SDC signature at the default read. The screen saw the ranks' median loss grow 2^16 and
    more in the steps before: a diverging run, no rank named, no host to take out (until 2026-12-07 rank 1 was named
    faulty). Raised on every rank alike."""
    for r in results(ddp, "mlp:diverging", 3):
        error = r["error"]
        assert error["type"] == "NonFiniteGradientError" and error["step"] == 4, error
        assert list(error["details"]["parameters"]) == ["1"], error  # rank 1's local gradients alone
        assert error["rank"] is None and error["suspects"] == [] and error["details"]["pattern"] == "diverging", error
        assert "a diverging run, not a faulty device: the ranks' median loss had grown from 2^" in error["message"]


def test_evaluation_forwards_between_steps_change_nothing_the_checks_see(ddp: Path) -> None:
    """A forward in eval mode after each update, with no backward (under ``no_grad``, or with autograd on as a loop
    that forgets it runs): no alarm, the same audits and the same weights as the run without it, for a loss computed
    in the model and one computed in the loop from the outputs. One in training mode is refused with the fix."""
    for model in ("mlp", "outside"):
        clean, evaluated = results(ddp, f"{model}:clean", 3), results(ddp, f"{model}:evaluated", 3)
        assert all(r["error"] is None for r in evaluated), evaluated[0]["error"]
        assert [r["weights"] for r in evaluated] == [r["weights"] for r in clean], model
        runs = [r["state"]["checks"][c]["runs"] for r in (clean[0], evaluated[0])
                for c in ("ring_replay", "weight_fingerprint")]
        assert runs[:2] == runs[2:] and runs[0] >= 3, runs
    # in training mode with autograd on, a forward never back-propagated looks like one view of two: refused with
    # the fix at the first audit, not replayed
    discarded = same_error(ddp, "mlp:discarded", 3)
    assert (discarded["type"], discarded["step"]) == ("ReplayUnavailableError", 0), discarded
    assert "or a training-mode forward never back-propagated (run it in eval mode" in discarded["message"]


def test_parameters_ddp_leaves_to_each_rank_are_never_compared_and_the_replay_is_off(ddp: Path) -> None:
    """A head DDP ignores (``parameters_to_ignore``, as for local experts) differs per rank by design: the
    fingerprint leaves it out and raises nothing, and still names a flip in a replicated weight; the replay,
    whose partner would recompute with its own head, is off and says so on every rank."""
    clean = results(ddp, "own:clean", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    for r in clean:
        assert any("replay audit is inactive" in w and "head.bias" in w for w in r["warnings"]), r["warnings"]
    checks = clean[0]["state"]["checks"]
    assert checks["ring_replay"]["runs"] == 0 and checks["weight_fingerprint"]["runs"] >= 6, checks
    flip = same_error(ddp, "own:flip", 3)
    assert (flip["type"], flip["rank"], flip["step"]) == ("FingerprintMismatchError", 1, 3), flip["message"]


def test_a_sparse_embedding_gradient_is_left_out_and_the_replay_still_names_a_compute_fault(ddp: Path) -> None:
    """``nn.Embedding(sparse=True)``: the tap reads no sparse gradient, and the replay leaves it out on both sides
    (it raised ``ReplayUnavailableError`` at its first audit before); a wrong head output is still named."""
    clean = results(ddp, "sparse:clean", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    assert clean[0]["state"]["checks"]["ring_replay"]["runs"] >= 3
    err = same_error(ddp, "sparse:activation", 3)
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 2, 2), err["message"]


def test_a_loss_computed_in_the_loop_from_the_outputs_is_replayed_without_being_told(ddp: Path) -> None:
    """``loss = F.mse_loss(model(x)[0], y) * world + 1e-3 * features ** 2`` in the loop, no ``loss_fn`` or
    ``replayable`` (it raised ``ValueError`` at the first audit before): the replay recomputes through the gradients
    the loss sent into the two outputs, one computed from the other; clean runs are exact and bit-identical to the
    run without checks, with accumulation too, and a wrong output on rank 2 is named."""
    clean, off = results(ddp, "outside:clean", 3), results(ddp, "outside:off", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    assert [r["weights"] for r in clean] == [r["weights"] for r in off]
    replay = clean[0]["state"]["checks"]["ring_replay"]
    assert replay["runs"] == 3 and replay["extra"]["tolerance"] == 0.0, replay
    accumulate = results(ddp, "outside:accumulate", 3)
    assert all(r["error"] is None for r in accumulate) and accumulate[0]["state"]["checks"]["ring_replay"]["runs"] == 3
    err = same_error(ddp, "outside:activation", 3)
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 2, 2), err["message"]
    bf16 = results(ddp, "outside_bf16:clean", 3)  # under bf16 autocast: still exact
    assert all(r["error"] is None for r in bf16), bf16[0]["error"]
    assert bf16[0]["state"]["checks"]["ring_replay"]["extra"]["tolerance"] == 0
    err = same_error(ddp, "outside_bf16:activation", 3)
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 2, 2), err["message"]
    small = same_error(ddp, "outside:small", 3)  # outputs over the step's budget: the fix, at the first audit
    assert (small["type"], small["step"]) == ("ValueError", 0), small
    assert "raise replay_max_state_mb" in small["message"], small["message"]
    # two forwards before one backward: a partner's backward per forward rounds differently (under autocast it
    # named a healthy rank): refused on every rank, each text once
    twice = same_error(ddp, "outside:twice", 3)
    assert (twice["type"], twice["step"]) == ("ReplayUnavailableError", 0), twice
    assert "ranks 0, 1, 2, each replaying its owner: the model ran again before the backward" in twice["message"]
    # a head output 10^6 too large from step 3, which the replay does not audit: the screen's row holds the outputs'
    # projection on the loss's gradients and flags it (it was cleared as a genuine spike); on the weights after the
    # update a gap of 2^20 names nobody (an update can fit a hard batch), so the replay audits step 5, the first it
    # can, and names rank 2 there
    for name in ("outside:screened", "outside_bf16:screened"):
        err = same_error(ddp, name, 3)
        assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 2, 5), err["message"]
        assert "the fault is persistent" in err["message"], err["message"]
        replay = results(ddp, name, 3)[0]["state"]["checks"]["ring_replay"]
        assert replay["extra"]["screen_unconfirmed"] >= 1 and replay["extra"]["screen_cleared"] == 0, replay


def test_a_compiled_ddp_model_is_checked(ddp: Path) -> None:
    """``torch.compile(DistributedDataParallel(net))`` given to ``attach`` (it was refused): a clean run raises
    nothing with every check running, and a wrong output of rank 2 is named by the replay."""
    clean = results(ddp, "mlp:compiled", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    checks = clean[0]["state"]["checks"]
    assert checks["ring_replay"]["runs"] >= 3 and checks["nonfinite_gradient"]["runs"] == 6, checks
    err = same_error(ddp, "mlp:compiled_activation", 3)
    assert (err["type"], err["rank"], err["step"]) == ("ReplayMismatchError", 2, 2), err["message"]


def test_gradient_accumulation_under_no_sync_is_audited_and_without_it_the_replay_says_why_not(ddp: Path) -> None:
    """Two micro-batches a step: under ``no_sync`` (as docs/integrations.md asks) every audit runs clean; with
    both all-reduced the local gradients cannot be read, and the replay says so (not a generic difference)."""
    clean = results(ddp, "mlp:accumulate", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    assert clean[0]["state"]["checks"]["ring_replay"]["runs"] >= 3
    err = same_error(ddp, "mlp:accumulate_synced", 3)
    assert err["type"] == "ReplayUnavailableError" and err["step"] == 0, err
    assert "DDP all-reduced more than one backward" in err["message"] and "no_sync()" in err["message"], err["message"]


@pytest.fixture(scope="module")
def ddp_bucket_view(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("plain_ddp_bv"), ["mlp:clean", "mlp:nan"] + [f"mlp_bv:{k}" for k in KINDS], 3)


def test_plain_torchrun_ddp_loop_names_the_faulty_rank_with_every_check(ddp: Path) -> None:
    check_models(ddp, ["mlp"], 3, exact={"mlp"})
    nan = same_error(ddp, "mlp:nan", 3)
    assert nan["step"] == 2 and nan["details"]["pattern"] == "one_rank"
    assert same_error(ddp, "mlp:activation", 3)["step"] == 2
    assert same_error(ddp, "mlp:flip", 3)["step"] == 3  # flipped after update 2, digested after update 3
    # the tracker's failure point: at the updates done when the verdict is read (Lightning's global_step),
    # after the update of the step it is about for the flip (read one step later), before it for the others
    for kind, check, after in (("flip", "weight_fingerprint", 1), ("nan", "nonfinite_gradient", 0),
                               ("activation", "ring_replay", 0)):  # fmt: skip
        at, metrics = results(ddp, f"mlp:{kind}", 3)[0]["metrics"]
        assert at == same_error(ddp, f"mlp:{kind}", 3)["step"] + after, (kind, at)
        assert metrics[f"sdc/{check}/failures"] == 1, (kind, metrics)


def test_audited_steps_set_their_own_gradients_aside_with_ddp_defaults(ddp: Path) -> None:
    """DDP's default layout: on the audited steps the step's own gradients wait in DDP's buckets
    while the partner's micro-batch is re-run (every trainable parameter's), and the clean run is
    still bit-identical to the run without checks, the faults still named (``check_models``)."""
    clean = results(ddp, "mlp:clean", 3)
    for r in clean:
        extra = r["state"]["checks"]["ring_replay"]["extra"]
        assert extra["gradients_set_aside_bytes"] > 0, extra
    assert [r["weights"] for r in clean] == [r["weights"] for r in results(ddp, "mlp:off", 3)]


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_every_check_holds_with_gradients_in_ddp_buckets(ddp_bucket_view: Path) -> None:
    """``gradient_as_bucket_view=True`` (the layout docs/performance.md recommends for audits close to
    the memory limit): clean runs bit-identical to runs without checks, and the same verdicts."""
    out = ddp_bucket_view
    check_models(out, ["mlp_bv"], 3, exact={"mlp_bv"})
    weights = {name: [r["weights"] for r in results(out, name, 3)] for name in ("mlp_bv:clean", "mlp:clean")}
    assert weights["mlp_bv:clean"] == weights["mlp:clean"]
    assert same_error(out, "mlp_bv:nan", 3)["step"] == same_error(out, "mlp:nan", 3)["step"]


def test_a_deferred_verdict_names_the_rank_one_step_later(ddp: Path) -> None:
    """No replay, fingerprint every step: the gradient verdict is read from the reduced gradients
    one step later, beside the fingerprint's own all-reduce. Rank 1's NaN after the first two
    backwards (batched local read) and during them (per-parameter reads) is named at its step on
    every rank, with its parameter, one step later."""
    grad = "body.0.weight"
    for scenario, step in (("mlp:nan_deferred", 3), ("mlp:nan_early_deferred", 1)):
        err = same_error(ddp, scenario, 3)
        assert (err["type"], err["rank"], err["step"]) == ("NonFiniteGradientError", 1, step), err["message"]
        assert err["details"]["pattern"] == "one_rank" and err["details"]["parameters"] == {"1": [grad]}
        assert all(r["step"] == step + 1 for r in results(ddp, scenario, 3))  # read at the next optimizer step
    clean = results(ddp, "mlp:clean", 3)[0]["state"]["checks"]["nonfinite_gradient"]  # replay every 2nd step
    assert clean["runs"] >= 3 and clean["failures"] == 0, clean
    fp = results(ddp, "mlp:clean", 3)[0]["state"]["checks"]["weight_fingerprint"]
    assert fp["runs"] >= 3 and fp["failures"] == 0, fp


def test_a_weight_flip_before_an_audited_step_is_reported_as_a_weight_fault(ddp: Path) -> None:
    """The replay disagrees first (rank 1 computes with other weights), but the weights are compared
    before a compute fault is raised: the verdict is the weight fault, naming the tensor."""
    err = same_error(ddp, "mlp:flip_audited", 3)
    assert (err["type"], err["rank"]) == ("FingerprintMismatchError", 1), err["message"]
    assert "body.3.weight" in err["message"]
    assert [i.split("-", 1)[1] for i in results(ddp, "mlp:flip_audited", 3)[0]["incidents"]] == [
        "weight_fingerprint-step1.json"]  # one incident: the weight fault, not a compute fault besides
    nofp = same_error(ddp, "mlp:flip_audited_nofp", 3)  # no fingerprint check: a one-off comparison
    assert (nofp["type"], nofp["rank"]) == ("FingerprintMismatchError", 1), nofp["message"]
    assert "body.3.weight" in nofp["message"]
    healed = results(ddp, "mlp:flip_audited_heal", 3)  # healed: the replay's symptom drops the step, no error
    assert all(r["error"] is None for r in healed), [r["error"] for r in healed]
    assert len({r["weights"] for r in healed}) == 1  # the replicas agree at the end
    assert [i.split("-", 1)[1] for i in healed[0]["incidents"]] == ["weight_fingerprint-step1.json"]
    assert healed[0]["state"]["updates"] == healed[0]["state"]["step"] - 1  # step 2 dropped


def test_matmul_checksum_setting_names_a_wrong_product_in_its_own_step(ddp: Path) -> None:
    """``matmul_checksum=True`` on the plain route: a wrong element inside rank 2's ``head`` product at
    step 3 (a step the replay does not audit) is named at step 3, forward and backward; a clean run
    with the check trains bit-identically to one without any check."""
    clean, off = results(ddp, "mlp:matmul_clean", 3), results(ddp, "mlp:off", 3)
    assert all(r["error"] is None for r in clean)
    assert [r["weights"] for r in clean] == [r["weights"] for r in off]
    for kind, phase in (("matmul", "forward"), ("matmul_backward", "backward")):
        err = same_error(ddp, f"mlp:{kind}", 3)
        assert (err["type"], err["rank"], err["step"]) == ("ChecksumMismatchError", 2, 3), err["message"]
        assert "head" in err["message"] and phase in err["message"]


def test_plain_loop_logs_through_the_callable_and_carries_counters(ddp: Path) -> None:
    clean = results(ddp, "mlp:clean", 3)
    step, metrics = clean[0]["metrics"]
    assert step == 6 and metrics["sdc/nonfinite_gradient/runs"] == 6.0 and metrics["sdc/ring_replay/runs"] == 3.0
    assert clean[0]["state"]["step"] == 6 and clean[0]["state"]["updates"] == 6


def test_plain_before_save_fingerprints_the_checkpoint_and_load_verifies_it(ddp: Path) -> None:
    rows = results(ddp, "mlp:save", 3)
    assert all(r["error"] is None and r["saved"]["restored_step"] == 6 for r in rows), rows[0]
    refused = [r["saved"]["refused"] for r in rows]
    assert all(e is not None and e["type"] == "FingerprintMismatchError" for e in refused), refused
    assert "head.weight" in refused[0]["message"]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kinds = (*KINDS, "update", "accumulate", "accumulate_synced", "accumulate_activation", "accumulate_off")
    return launch(tmp_path_factory.mktemp("plain_fsdp"), [f"fsdp:{k}" for k in kinds], 4)


def test_plain_torchrun_fsdp2_loop_names_the_faulty_rank_with_every_check(fsdp: Path) -> None:
    clean, off = results(fsdp, "fsdp:clean", 4), results(fsdp, "fsdp:off", 4)
    assert all(r["error"] is None for r in clean)
    assert [r["weights"] for r in clean] == [r["weights"] for r in off]  # every shard, bit for bit
    assert clean[0]["state"]["checks"]["ring_replay"]["runs"] == 3
    nan = same_error(fsdp, "fsdp:nan", 4)
    assert (nan["type"], nan["rank"], nan["step"]) == ("NonFiniteGradientError", 1, 2)
    act = same_error(fsdp, "fsdp:activation", 4)
    assert (act["type"], act["rank"], act["step"]) == ("ReplayMismatchError", 2, 2)
    flip = same_error(fsdp, "fsdp:flip", 4)
    assert (flip["type"], flip["rank"]) == ("FingerprintMismatchError", 1)
    assert flip["details"]["changed_at_rest"] == {"1": ["param:body.weight"]}
    update = same_error(fsdp, "fsdp:update", 4)
    assert (update["type"], update["rank"], update["step"]) == ("FingerprintMismatchError", 1, 4)


def test_fsdp2_gradient_accumulation_is_audited_with_gradient_sync_on_and_off(fsdp: Path) -> None:
    """FSDP2, two micro-batches a step, each reduce-scattered or the first with gradient sync off
    (``set_requires_gradient_sync(False)``, what Accelerate's ``accumulate`` does): every audit runs clean, training
    is unchanged by them, and a wrong activation on a rank is named by the replay, which mirrors the owner's sync."""
    for kind in ("accumulate_synced", "accumulate"):
        clean = results(fsdp, f"fsdp:{kind}", 4)
        assert all(r["error"] is None for r in clean), clean[0]["error"]
        assert clean[0]["state"]["checks"]["ring_replay"]["runs"] >= 3
    off = results(fsdp, "fsdp:accumulate_off", 4)  # the replays left no gradient behind: every shard bit for bit
    assert [r["weights"] for r in results(fsdp, "fsdp:accumulate", 4)] == [r["weights"] for r in off]
    act = same_error(fsdp, "fsdp:accumulate_activation", 4)
    assert (act["type"], act["rank"], act["step"]) == ("ReplayMismatchError", 2, 2), act


def test_plain_single_process_names_a_nan_and_rejects_bad_arguments(tmp_path: Path) -> None:
    code = f"""
import sys, warnings, torch
sys.path.insert(0, {str(ROOT)!r})
from sdc_core import SDCHooks, NonFiniteGradientError, SDCConfigError
for bad in (dict(replay_every_n_steps=-1), dict(accumulation_steps=0), dict(replay_evry_n_steps=3)):
    try:
        SDCHooks(**bad)
    except (SDCConfigError, ValueError) as err:
        print("refused", type(err).__name__, err)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hooks = SDCHooks(run_dir={str(tmp_path)!r}).attach(model, opt)
try:
    for step in range(3):
        loss = model(torch.randn(2, 4)).sum() * (float("nan") if step == 1 else 1.0)
        loss.backward(); opt.step(); opt.zero_grad()
    hooks.finish()
except NonFiniteGradientError as err:
    print("verdict", err.step, err.rank, err.details["pattern"])
"""
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 or "verdict" in proc.stdout, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused SDCConfigError") and "replay_every_n_steps" in lines[0]
    assert lines[1].startswith("refused ValueError") and "accumulation_steps" in lines[1]
    assert "did you mean 'replay_every_n_steps'" in lines[2]
    assert "verdict 1 None single_process" in proc.stdout
    assert list(tmp_path.glob("sdc/incidents/*nonfinite_gradient-step1.json"))


@pytest.mark.slow
def test_plain_model_matrix_on_cpu(tmp_path: Path) -> None:
    """Every model of the GPU suite through the plain route on 3 CPU ranks (what ``-m gpu`` runs on CUDA)."""
    models = ["bf16", "fp16", "attention", "embedding", "sparse", "compile", "conv"]
    out = launch(tmp_path, [f"{m}:{k}" for m in models for k in KINDS], 3, timeout=900)
    check_models(out, models, 3, exact=set(models))


def test_core_and_fabric_adapter_import_without_accelerate() -> None:
    code = ("import sys; sys.modules['accelerate'] = None\n"  # an import of accelerate now fails
            "import sdc_core, lightning_sdc, lightning_sdc.fabric\n"
            "assert 'accelerate_sdc' not in sys.modules, 'an adapter imported the Accelerate adapter'\n"
            "print('ok')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Every import statement of ``tree``, lazy ones included, except those under ``if TYPE_CHECKING:``."""
    found: list[ast.AST] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                walk(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return found


def test_no_import_cycle_and_no_adapter_imports_another() -> None:
    """The module-level imports of the three packages form no cycle; neither adapter imports the other."""
    packages = ("sdc_core", "lightning_sdc", "accelerate_sdc")
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in (ROOT / package).glob("*.py"):
            name = f"{package}.{path.stem}" if path.stem != "__init__" else package
            deps = set()
            for node in _runtime_imports(ast.parse(path.read_text())):  # lazy imports count too
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
            graph[name] = {d for d in deps if d.split(".")[0] in packages}
    graph = {k: {d for d in v if d in graph} for k, v in graph.items()}
    for name, deps in graph.items():
        other = {"lightning_sdc": "accelerate_sdc", "accelerate_sdc": "lightning_sdc"}.get(name.split(".")[0])
        assert not any(d.split(".")[0] == other for d in deps), f"{name} imports the other adapter: {deps}"
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError(f"import cycle: {' -> '.join([*path, node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(graph[node]):
            if dep != node and not node.startswith(dep + "."):  # a package importing its own submodule's parent
                visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_replay_reenters_the_recorded_autocast_and_attention_backends() -> None:
    """The forward context recorded at the owner's forward (autocast dtype, the SDPA backends an
    ``sdpa_kernel`` block allowed) is what the replay runs under; bad recorded values are refused."""
    from sdc_core.driver.replay_capture import _autocast, _autocast_state, _sdpa_backends, _sdpa_state

    cpu = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recorded = _autocast_state(cpu)
    assert recorded == ("cpu", "bfloat16") and _autocast_state(cpu) is None
    with _autocast(recorded):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    before = _sdpa_state()
    with _sdpa_backends((False, False, True, False)):
        assert _sdpa_state() == (False, False, True, False)
    assert _sdpa_state() == before
    with pytest.raises(ValueError, match="autocast"):
        _autocast(("cpu", "not_a_dtype")).__enter__()
    with pytest.raises(ValueError, match="attention backends"), _sdpa_backends(("yes",)):
        pass


def test_replay_deterministic_is_a_setting_on_every_route() -> None:
    """``replay_deterministic`` (hook sets, ``ACCELERATE_SDC_REPLAY_DETERMINISTIC``) and
    ``RingReplayAudit(deterministic=...)`` reach the replay's config; a bad value is refused."""
    from lightning_sdc import RingReplayAudit
    from sdc_core import SDCConfigError, SDCHooks

    assert SDCHooks().replay.config.deterministic is True
    assert SDCHooks(replay_deterministic=False).replay.config.deterministic is False
    assert RingReplayAudit(deterministic=False)._core.config.deterministic is False
    with pytest.raises(SDCConfigError, match="replay_deterministic"):
        SDCHooks(replay_deterministic="maybe")


def test_replay_allow_pickled_batches_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``replay_allow_pickled_batches`` (hook sets, ``ACCELERATE_SDC_REPLAY_ALLOW_PICKLED_BATCHES``) reaches
    the replay's config: True allows; the default leaves it to ``SDC_ALLOW_PICKLED_BATCHES``."""
    from accelerate_sdc.config import resolve
    from sdc_core import SDCConfigError, SDCHooks

    assert SDCHooks().replay.config.allow_pickled_batches is None
    assert SDCHooks(replay_allow_pickled_batches=True).replay.config.allow_pickled_batches is True
    monkeypatch.setenv("ACCELERATE_SDC_REPLAY_ALLOW_PICKLED_BATCHES", "1")
    assert resolve()[0].replay().allow_pickled_batches is True
    with pytest.raises(SDCConfigError, match="replay_allow_pickled_batches"):
        SDCHooks(replay_allow_pickled_batches="maybe")


def test_the_step_wrapper_keeps_the_schedulers_mark_so_torch_does_not_warn() -> None:
    """An LR scheduler created before ``attach`` marks ``optimizer.step``; the hook set's wrapper keeps
    the original's attributes (``functools.wraps``), so torch does not warn on every step that
    ``optimizer.step()`` was overridden after the scheduler."""
    import warnings

    from sdc_core import SDCHooks

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks = SDCHooks().attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        scheduler.step()
    assert hooks.step == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.01)
