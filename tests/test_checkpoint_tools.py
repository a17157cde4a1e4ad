"""`sdc corrupt-checkpoint`, `sdc verify-checkpoint`, fingerprinted checkpoints and a tiny campaign."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from ddp_scenarios import Net, loader

from lightning_sdc import FingerprintMismatchError, WeightFingerprintCheck
from sdc_core.cli import main as sdc
from sdc_core.faults.checkpoint import bits_of_class
from sdc_core.io.checkpoints import Checkpoint

INT = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def trainer(root: Path, steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[WeightFingerprintCheck()], logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    t = trainer(root, 3)
    t.fit(Net(optimizer="adam"), loader())
    t.save_checkpoint(root / "run.ckpt")
    return root / "run.ckpt"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, _, t in Checkpoint.load(path).tensors()}


def test_corrupter_flips_exactly_what_its_log_says(ckpt: Path, tmp_path: Path) -> None:
    before = digest(ckpt)
    out = tmp_path / "bad.ckpt"
    assert sdc(["corrupt-checkpoint", str(ckpt), "-o", str(out), "--target", "all", "--count", "6",
                "--bit-class", "exponent", "--seed", "11"]) == 0  # fmt: skip
    assert digest(ckpt) == before  # the input is untouched
    log = json.loads(Path(f"{out}.flips.json").read_text())
    assert len(log["flips"]) == 6
    a, b = tensors(ckpt), tensors(out)
    flipped = {(f["tensor"], f["index"]) for f in log["flips"]}
    for name in a:
        diff = a[name].reshape(-1).view(INT[a[name].element_size()]) ^ b[name].reshape(-1).view(
            INT[a[name].element_size()]
        )
        for index in diff.nonzero().flatten().tolist():
            assert (name, index) in flipped, f"{name}[{index}] changed without a log entry"
    for f in log["flips"]:
        old, new = a[f["tensor"]].reshape(-1), b[f["tensor"]].reshape(-1)
        width = INT[old.element_size()]
        assert int(old.view(width)[f["index"]] ^ new.view(width)[f["index"]]) & ((1 << 32) - 1) == 1 << f["bit"]
        assert f["bit"] in bits_of_class(old.dtype, "exponent")
        assert f["old"] == pytest.approx(float(old[f["index"]]), nan_ok=True)
        assert torch.isnan(new[f["index"]]) if f["new"] != f["new"] else f["new"] == float(new[f["index"]])


def test_corrupter_is_seeded(ckpt: Path, tmp_path: Path) -> None:
    logs = []
    for i, seed in enumerate((5, 5, 6)):
        out = tmp_path / f"c{i}.ckpt"
        sdc(["corrupt-checkpoint", str(ckpt), "-o", str(out), "--count", "3", "--seed", str(seed)])
        logs.append(
            [(f["tensor"], f["index"], f["bit"]) for f in json.loads(Path(f"{out}.flips.json").read_text())["flips"]]
        )
    assert logs[0] == logs[1] and logs[0] != logs[2]


def test_targets_and_patterns(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.ckpt"
    sdc(["corrupt-checkpoint", str(ckpt), "-o", str(out), "--target", "optimizer", "--count", "4", "--bits", "0,1"])
    flips = json.loads(Path(f"{out}.flips.json").read_text())["flips"]
    assert all(f["tensor"].startswith("optimizer_states/") and f["bit"] in (0, 1) for f in flips)
    sdc(["corrupt-checkpoint", str(ckpt), "-o", str(out), "--pattern", r"head\.", "--fraction", "0.5"])
    flips = json.loads(Path(f"{out}.flips.json").read_text())["flips"]
    assert flips and all(f["tensor"].startswith("state_dict/head.") for f in flips)


def test_plain_state_dict_and_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(Net().state_dict(), plain)
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(tmp_path / "p2.pt"), "--bit-class", "sign"]) == 0
    assert sdc(["verify-checkpoint", str(plain)]) == 3  # written without the callback: nothing to compare
    junk = tmp_path / "junk.ckpt"
    junk.write_text("not a checkpoint")
    assert sdc(["corrupt-checkpoint", str(junk), "-o", str(tmp_path / "j.ckpt")]) == 4
    assert "junk.ckpt is not a readable torch checkpoint" in capsys.readouterr().err
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(plain)]) == 2
    assert "--in-place" in capsys.readouterr().err
    assert sdc(["corrupt-checkpoint", str(plain), "-o", str(tmp_path / "x.pt"), "--pattern", "nothing-matches"]) == 2


def test_verify_and_resume_catch_a_changed_checkpoint(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert sdc(["verify-checkpoint", str(ckpt)]) == 0
    bad = tmp_path / "bad.ckpt"
    sdc(["corrupt-checkpoint", str(ckpt), "-o", str(bad), "--pattern", "body.weight", "--bit-class", "mantissa"])
    capsys.readouterr()
    assert sdc(["verify-checkpoint", str(bad)]) == 1
    assert "state_dict/body.weight" in capsys.readouterr().out
    with pytest.raises(FingerprintMismatchError) as info:
        trainer(tmp_path, 5).fit(Net(optimizer="adam"), loader(), ckpt_path=bad)
    assert info.value.details["checkpoint_changed_tensors"] == ["state_dict/body.weight"]
    assert info.value.step == 3


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_tiny_campaign_writes_its_outputs(tmp_path: Path) -> None:
    from sdc_core.faults.campaign_run import run_campaign

    summary = run_campaign(tmp_path, injections=6, clean=1, steps=8)
    assert summary["injections"] == 6 and summary["clean_runs"] == 1 and summary["false_alarms"] == 0
    assert summary["defaults"]["false_alarms"] == 0 and summary["defaults"]["clean_runs"] == 1
    rows = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {r["site"] for r in rows} == {"activation", "gradient", "matmul_output", "weights", "optimizer",
                                         "checkpoint", "clean"}  # fmt: skip
    assert all("defaults_by" in r and ("harmful" in r) == (r["site"] != "clean") for r in rows)
    assert all(r["outcome"] in ("detected", "masked", "silent", "clean") for r in rows)
    weights = next(r for r in rows if r["site"] == "weights")  # a sign flip in one replica's weights
    # the replay of the next step or the fingerprint of this one, whichever is read first
    assert weights["outcome"] == "detected" and weights["attributed"]
    assert weights["detected_by"] in ("ring_replay", "weight_fingerprint")
    ckpt = next(r for r in rows if r["site"] == "checkpoint")
    assert ckpt["outcome"] == "detected" and ckpt["detected_by"] == "weight_fingerprint" and ckpt["latency"] == 0
    assert (tmp_path / "results.csv").read_text().count("\n") == 8
    assert (tmp_path / "detection.png").read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "sdc" / "incidents").glob("*.json"))  # the trainings' incidents stay in the campaign folder


def test_count_1_never_permutes_the_whole_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--count 1 built a permutation of every entry (8 bytes each: 56 GB for a 7B checkpoint)."""
    from sdc_core.faults.checkpoint import Corruption, corrupt

    real = torch.randperm

    def small_only(n: int, *args: object, **kwargs: object) -> torch.Tensor:
        assert n <= 1000, f"a permutation of {n} entries"
        return real(n, *args, **kwargs)

    monkeypatch.setattr(torch, "randperm", small_only)
    ckpt = Checkpoint("state_dict", tmp_path / "x.pt", {"": {"w": torch.zeros(1 << 20), "b": torch.zeros(3)}})
    for seed in range(3):
        log = corrupt(ckpt, Corruption(count=1, seed=seed))
        assert len(log) == 1 and 0 <= log[0]["index"] < (1 << 20)
    log = corrupt(ckpt, Corruption(count=50, seed=4))
    assert len({(f["tensor"], f["index"]) for f in log}) == 50  # distinct positions


def test_sampled_positions_are_distinct_and_uniform() -> None:
    from collections import Counter
    from itertools import combinations

    from sdc_core.faults.checkpoint import distinct_positions

    seen = Counter()
    for seed in range(3000):
        picked = distinct_positions(6, 2, torch.Generator().manual_seed(seed)).tolist()
        assert len(set(picked)) == 2 and picked == sorted(picked) and all(0 <= p < 6 for p in picked)
        seen[tuple(picked)] += 1
    assert set(seen) == set(combinations(range(6), 2))  # every pair, each about 3000 / 15 = 200 times
    assert all(130 < c < 270 for c in seen.values()), seen
    big = distinct_positions(1 << 40, 5, torch.Generator().manual_seed(0))
    assert big.unique().numel() == 5 and int(big.max()) < 1 << 40
    assert distinct_positions(5, 5, torch.Generator()).tolist() == [0, 1, 2, 3, 4]
