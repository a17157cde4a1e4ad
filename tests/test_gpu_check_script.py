"""scripts/gpu_check.sh in its dry run (CPU, tiny sizes): every stage's path runs (argument parsing,
output folder, each python entry point, the replay's verdicts, the summary) so a broken script is
found before a GPU's time is spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAGES = ["trust", "bench", "memory", "matmul", "kernels"]
JSON = {
    "trust": ["gpu_replay.json"],
    "bench": ["gpu_step.json"],
    "memory": ["memory.json", "memory-bucket-view.json"],
    "matmul": ["matmul_clean.json", "matmul_stress.json", "matmul_cost.json"],
    "kernels": ["digest_blocks.json", "performance-gpu-kernels.json"],
}


def gpu_check(*args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SDC_GPU_")}
    base.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def summary(out: Path) -> dict[str, str]:
    lines = (out / "summary.txt").read_text().splitlines()
    return {line.split()[0]: line for line in lines}


@pytest.fixture(scope="module")
def dry_all(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The memory, matmul and kernels stages' dry run (about 30 s); trust's and bench's (about 40 and 15 s
    more) run with -m slow (``dry_trust``, ``dry_bench``)."""
    out = tmp_path_factory.mktemp("gpu_check") / "r"
    return out, gpu_check("--dry-run", "all", str(out), SDC_GPU_SKIP="trust,bench")


@pytest.fixture(scope="module")
def dry_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("gpu_check_bench") / "r"
    return out, gpu_check("--dry-run", "all", str(out), SDC_GPU_SKIP="trust,memory,matmul,kernels")


@pytest.fixture(scope="module")
def dry_trust(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("gpu_check_trust") / "r"
    return out, gpu_check("--dry-run", "trust", str(out))


# every stage's dry run is a set of launches (trust about 40 s, memory and matmul 35 s together, bench 15 s,
# kernels 20-40 s): under -m slow, so the default run stays under 10 minutes on 2 cores; the default run keeps the
# script's own logic (a stage by name, a lone path, a stage run to its timeout, bad calls). Run them before a
# device session.
_SLOW_DRY = ("trust", "bench", "memory", "matmul", "kernels")


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s in _SLOW_DRY else s for s in STAGES])
def test_dry_run_runs_each_stage_and_writes_its_log_json_and_summary_line(request, stage: str) -> None:
    out, proc = request.getfixturevalue({"trust": "dry_trust", "bench": "dry_bench"}.get(stage, "dry_all"))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = summary(out)
    assert list(lines) == (["trust"] if stage == "trust" else STAGES)  # in the order of importance, one line each
    line = lines[stage]
    assert line.startswith(f"{stage} PASS ") and "[dry run]" in line and "skipped:" in line, line
    assert f"== {stage} [dry run]" in (out / f"{stage}.log").read_text()
    for name in JSON[stage]:
        assert json.loads((out / name).read_text()), name
    if stage == "trust":  # the replay's verdicts are judged, not just printed
        assert "replay verdicts as expected" in line and "intermittent kernel verdicts as expected" in line, line
    if stage == "bench":  # the matrix-product configuration rides the step benchmark
        (row,) = json.loads((out / "gpu_step.json").read_text())["rows"]
        assert row["step_ms"]["matmul"] > 0 and "matmul" in line, line
        assert row["step_ms"]["host_wait"] > 0 and "host wait" in line, line  # and the screen's host read
        assert row["step_ms"]["screen_next"] > 0 and "screen next step" in line, line  # and its read one step later
        assert "== matmul:" in (out / "profile.txt").read_text() and "profile exit 0" in line, line
    if stage == "matmul":
        precisions = [r["precision"] for r in json.loads((out / "matmul_clean.json").read_text())["clean_runs"]]
        assert precisions == ["fp32", "tf32", "bf16"]
    if stage == "kernels":  # the launch shapes' digests are judged, and the kernel table written
        assert "launch shapes give the same digests" in line and "kernel_table exit 0" in line, line
        assert json.loads((out / "performance-gpu-kernels.json").read_text())["kernels"]
    assert "(no CUDA device)" in (out / "machine.txt").read_text()


def test_one_stage_by_name_with_the_environment_switch(tmp_path: Path) -> None:
    proc = gpu_check("memory", str(tmp_path), SDC_GPU_DRY_RUN="1", SDC_GPU_SKIP="memory")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(summary(tmp_path)) == ["memory"] and "[dry run]" in summary(tmp_path)["memory"]


def test_a_lone_path_means_all_and_a_failed_stage_fails_the_call(tmp_path: Path) -> None:
    """The older form ``gpu_check.sh OUT``; stages left out are reported; a timed-out stage is FAIL."""
    out = tmp_path / "r"
    proc = gpu_check(str(out), "--dry-run", SDC_GPU_SKIP="trust,memory,matmul,kernels", SDC_GPU_BENCH_TIMEOUT="1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = summary(out)
    assert list(lines) == STAGES
    assert all(lines[s].startswith(f"{s} SKIPPED") for s in ("trust", "memory", "matmul", "kernels")), lines
    assert lines["bench"].startswith("bench FAIL") and "TIMEOUT" in lines["bench"], lines["bench"]


@pytest.mark.parametrize("args", [["bogus", "OUT"], ["--bogus"], ["trust", "OUT", "extra"]])
def test_a_bad_call_is_one_line_naming_the_stages(tmp_path: Path, args: list[str]) -> None:
    proc = gpu_check(*[str(tmp_path / "x") if a == "OUT" else a for a in args], "--dry-run", timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert "stages: trust, bench, memory, matmul, kernels, all" in line, line
    assert not (tmp_path / "x").exists()
