"""The benchmark entry point runs on the smallest size and emits well-formed results (no speed asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, torchrun, worker_env


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_benchmark_entry_point_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== kernels" in proc.stdout and "== transformer step" in proc.stdout
    result = json.loads(out.read_text())
    methods = {r["method"] for r in result["kernels"]}
    assert {
        "sum",
        "fingerprint",
        "nonfinite_ddp",
        "nonfinite_tensor",
        "sha1_host",
        "isfinite_loop",
        "copy",
    } <= methods
    for row in result["kernels"]:
        assert row["gb_per_s"] > 0 and math.isfinite(row["vs_sum"]) and row["seconds"]["n"] == 2
    step = result["step"]
    assert set(step["seconds"]) >= {"none", "nonfinite", "fingerprint", "all_three", "detect_anomaly", "replay_audit"}
    assert all(s["median"] > 0 for s in step["seconds"].values())
    assert set(step["work_vs_step"]) == {"nonfinite", "fingerprint", "replay_amortised", "all_three"}


def test_gpu_step_benchmark_quick_on_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's CPU mode: one tiny model through the checks' DDP paths (one gloo rank)."""
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_step", "--quick", "--device", "cpu", "--sizes", "tiny",
           "--steps", "1", "--rounds", "2", "--host-wait", "--screen-next", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "tiny" and row["tensors"] > 10 and row["digest_matches_cpu"] is True
    assert row["step_ms"]["none"] > 0 and row["step_ms"]["checks"] > 0
    assert row["step_ms"]["host_wait"] > 0 and len(row["step_ms"]["samples_host_wait"]) == 2  # the screen's read
    assert row["step_ms"]["screen_next"] > 0 and len(row["step_ms"]["samples_screen_next"]) == 2  # one step later
    assert set(row["work_ms"]) == {"nonfinite", "fingerprint"} and all(v > 0 for v in row["work_ms"].values())
    assert all(v > 0 for v in row["fingerprint_gbps"].values())


def test_gpu_profile_on_cpu_says_where_the_checks_time_goes(tmp_path: Path) -> None:
    """``benchmarks.gpu_profile`` on the CPU: each configuration's step times and operator tables,
    and the checks' own Python (``sdc_core`` functions; the matrix-product check's with ``--matmul``)
    in ``profile.txt``."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_profile", "--size", "tiny", "--device", "cpu", "--steps", "2",
           "--matmul", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "profile.txt").read_text()
    assert "== none:" in text and "== checks:" in text and "== matmul:" in text
    assert text.count("Self CPU time total") == 3 and text.count("Ordered by: internal time") == 2
    assert "sdc_core/checks/fingerprint.py" in text and "sdc_core/checks/gradient_tap.py" in text
    assert "sdc_core/checks/matmul.py" in text.split("== matmul:")[1]


def test_live_bytes_counts_new_storages_until_they_are_freed() -> None:
    """The memory benchmark's CPU tracker: new storages count until freed; views, in-place and
    ``out=`` results and storages made before are not new."""
    import torch

    from benchmarks.memory import LiveBytes

    before = torch.ones(256)
    tracker = LiveBytes()
    with tracker:
        a = torch.ones(1000)  # 4000 bytes
        assert tracker.live == 4000
        a.view(10, 100).add_(1)
        torch.mul(a, 2, out=a)
        assert before.view(16, 16).shape == (16, 16) and tracker.live == 4000
        c = a * 2
        assert tracker.live == 8000
        del c
        assert tracker.live == 4000 and tracker.peak == 8000
        tracker.reset()
        assert tracker.peak == 4000
        del a
        assert tracker.live == 0
        b = torch.ones(1000)  # a storage resized in place counts its new size (the replay's .grad set aside)
        b.untyped_storage().resize_(0)
        assert tracker.live == 0 and b.untyped_storage().nbytes() == 0
        b.untyped_storage().resize_(4000)
        assert tracker.live == 4000
    assert "resize_" not in vars(torch.UntypedStorage)  # the tracker's patch is gone


def memory_run(tmp_path: Path, configs: str, bucket_view: bool) -> dict[str, Any]:
    out = tmp_path / f"mem{bucket_view}.json"
    torchrun("benchmarks.memory", out, None, 2, "--spec", "128,2,4,512", "--batch", "4", "--seq", "64", "--skip", "2",
             "--steps", "2", "--configs", configs, *(["--bucket-view"] if bucket_view else []), timeout=300, cwd=ROOT,
             module=True)  # fmt: skip
    return json.loads(out.read_text())  # type: ignore[no-any-return]


@pytest.mark.slow  # a multi-process launch (about 15 s); its claim is in docs/performance.md (memory)
def test_memory_benchmark_audited_step_adds_under_a_tenth_of_the_weights_with_ddp_defaults(tmp_path: Path) -> None:
    """DDP's default layout (``.grad`` memory of its own, ``gradient_as_bucket_view=False``): the
    audited step's own gradients wait in DDP's buckets while the partner's micro-batch is re-run,
    so the audit adds under 10% of the weights to the step's peak (it added one copy of the
    weights before), the first audits (the self re-run, the probe) included."""
    row = memory_run(tmp_path, "none,audited", False)
    assert row["excess_vs_weights"]["none"] == 0 and row["peak_step_bytes"]["none"] > 0
    assert row["excess_vs_weights"]["audited"] < 0.10
    assert row["first_steps_excess_vs_weights"]["audited"] < 0.10


@pytest.mark.slow  # two multi-process launches
def test_memory_benchmark_audited_step_adds_under_a_tenth_of_the_weights_in_both_layouts(tmp_path: Path) -> None:
    """An audited step's peak adds under 10% of the weights with gradients in DDP's buckets and
    with separate ``.grad`` memory alike; a clean step with the default checks adds nothing."""
    rows = {view: memory_run(tmp_path, "none,defaults,audited", view) for view in (False, True)}
    for row in rows.values():
        assert row["excess_vs_weights"]["none"] == 0 and row["peak_step_bytes"]["none"] > 0
        assert abs(row["excess_vs_weights"]["defaults"]) < 0.05
        assert row["excess_vs_weights"]["audited"] < 0.10


def test_report_keeps_the_sections_written_by_hand() -> None:
    """Re-rendering benchmarks/results/performance-history.md from its JSON (what ``make bench`` ends
    with) leaves the page
    as it is: the generated sections come out the same and the ones written by hand (GPU results,
    the step-by-step DDP run, the matrix-product and memory sections) stay where they stood."""
    from benchmarks.report import merge, render

    page = (ROOT / "benchmarks" / "results" / "performance-history.md").read_text()
    rendered = render(json.loads((ROOT / "benchmarks" / "results" / "performance.json").read_text()))
    assert "## 8. Memory" not in rendered and "## 8. Memory" in page  # a section the render does not make
    assert merge(rendered, page) == page
    moved = merge(rendered.replace("## 2. A transformer step", "## 2. The transformer step"), page)
    assert "## 8. Memory" in moved and "### Step by step: plain DDP" in moved


def test_digest_launch_shape_benchmark_dry_run_on_cpu(tmp_path: Path) -> None:
    """``benchmarks.digest_blocks --dry-run``: every (BLOCK, warps) configuration of each set is
    timed and checked against the reference digests (the torch path in place of the kernel)."""
    out = tmp_path / "blocks.json"
    cmd = [sys.executable, "-m", "benchmarks.digest_blocks", "--dry-run", "--reps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["sets"]) == {"tiny", "tiny x3"}
    for row in data["sets"].values():
        assert len(row["configs"]) == 20 and row["flat_sum_gbps"] > 0
        assert all(c["same_digests"] and c["gbps"] > 0 for c in row["configs"].values())


@pytest.mark.slow  # two 2-rank launches per route (about 30 s; Lightning's start-up in each of its own)
@pytest.mark.parametrize("route", ["plain", "lightning", "accelerate"])
def test_calls_per_step_do_not_grow_with_the_parameter_tensors(tmp_path: Path, route: str) -> None:
    """``benchmarks.calls --route``: the Python calls per step (cProfile, 2 gloo ranks, defaults) of the hook set,
    the three Lightning callbacks and Accelerate's hook set (their adapter's counted with the core's) are a count,
    the same in two runs, and at 10 times the parameter tensors at most 1.25x (counts, not times: no clock in the
    assertion)."""
    out = tmp_path / "calls.json"
    cmd = [sys.executable, "-m", "benchmarks.calls", "--out", str(out), "--tensors", "8", "80", "--steps", "3",
           "--route", route]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    small, large = result["calls_per_step"]
    assert result["tensors"] == [8, 80] and small > 50 and result["route"] == route
    assert large / small == result["ratio"] <= 1.25 and large <= 400
    if route == "plain":
        from benchmarks.calls import count

        assert count(8, 3)["calls_per_step"] == small  # deterministic
    else:
        assert result["packages"] == ["sdc_core", f"{route}_sdc"]
        assert result["adapter_calls_per_step"][0] > 0  # the steps went through the adapter


def test_screen_budget_checks_the_tail_fit_on_held_out_steps_and_predicts_one_hit_a_day_at_the_tail_band() -> None:
    """``benchmarks.screen_budget`` on healthy deviations with an exponential tail: the exceedances
    the fit predicts on held-out steps match those counted (within 30%), and where the bulk band
    and the cap do not bind, the prediction at each world's band is one hit a day."""
    import torch

    from benchmarks.screen_budget import budget

    g = torch.Generator().manual_seed(4)

    def steps(n: int) -> torch.Tensor:
        exp = torch.empty(n, 16, 5, dtype=torch.float64).exponential_(1 / 0.4, generator=g) + 0.5
        return torch.where(torch.rand(n, 16, 5, generator=g, dtype=torch.float64) < 0.5, exp, math.nan)

    report = budget(steps(400), steps(2000))  # a long held-out stretch: its counts are not the noise here
    for row in report["held_out_check"]:
        assert row["predicted_per_rank_step"] == pytest.approx(row["counted_per_rank_step"], rel=0.3), row
    for world, w in report["worlds"].items():
        assert w["at_max_band"] == 0 and all(b > 5.0 for b in w["band"]), (world, w["band"])
        assert w["predicted_hits_per_day"] == pytest.approx(1.0, rel=1e-6), world
