"""The run's closing line: rank 0 logs what was checked and "no SDC found" (or the verdicts) once,
at the end of a plain torchrun loop and of a Lightning ``Trainer.fit``; ``SDC_RUN_SUMMARY=0`` quiets it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sdc_core.ops.summary import run_summary
from sdc_core.stats import CheckStats
from tests.conftest import ROOT, torchrun, worker_env

LINE = re.compile(r"^sdc-checks: (\d+) steps checked by (.+); (no SDC found|.+)$", re.MULTILINE)


class _Check:
    def __init__(self, name: str, runs: int, failures: int = 0) -> None:
        self.stats = CheckStats(name, runs=runs, failures=failures)


def test_the_line_names_each_check_and_the_verdicts() -> None:
    clean = run_summary(100, [_Check("nonfinite_gradient", 100), _Check("ring_replay", 10)])
    assert clean == "sdc-checks: 100 steps checked by nonfinite_gradient (100), ring_replay (10 audits); no SDC found"
    found = run_summary(100, [_Check("nonfinite_gradient", 100), _Check("weight_fingerprint", 100, 2)], "runs/x")
    assert found.endswith("; 2 SDC verdicts (weight_fingerprint 2): sdc report runs/x")


def test_screen_hits_and_unexplained_differences_are_counted_beside_their_check_and_are_no_verdict() -> None:
    """A screen hit waits for a partner's confirmation (a confirmed one is the replay's verdict), and
    an unexplained difference accused nobody: the line says "no SDC found" and counts them."""
    import torch

    from sdc_core.checks.screen import GradientScreen, ScreenConfig
    from sdc_core.dist.topology import RankFacts, Topology

    facts = tuple(RankFacts(rank=r, host="h", node_rank=0, local_rank=r) for r in range(4))
    screen = GradientScreen(ScreenConfig(), Topology(ranks=facts, rank=0))
    screen._setup(2, ["a", "b"])
    rows = torch.tensor([[0.0, 3.0, -8.0, -8.0, 1.0]] * 4, dtype=torch.float64)
    rows[2, 2] = 40.0  # rank 2's first group 2^48 above the others
    assert screen.judge(0, rows).ranks == (2,) and screen.stats.failures == 0  # a hit: no verdict
    replay = _Check("ring_replay", 10)
    replay.stats.bump("unexplained_differences")
    replay.stats.extra.update({"last_unexplained_rank": 1.0, "last_unexplained_step": 30.0})  # type: ignore[union-attr]
    line = run_summary(100, [_Check("nonfinite_gradient", 100), screen, replay])
    assert line == ("sdc-checks: 100 steps checked by nonfinite_gradient (100), gradient_screen (1; 1 hit), "
                    "ring_replay (10 audits; 1 unexplained difference, rank 1 at step 30); no SDC found"), line


@pytest.mark.parametrize("quiet", [False, pytest.param(True, marks=pytest.mark.slow)])  # each is a torchrun launch
def test_a_clean_plain_loop_ends_with_one_summary_line(tmp_path: Path, quiet: bool) -> None:
    env = worker_env()
    if quiet:
        env["SDC_RUN_SUMMARY"] = "0"
    proc = torchrun(ROOT / "examples" / "torchrun_demo.py", None, None, 2, "--fault", "none", timeout=300,
                    cwd=tmp_path, env=env)  # fmt: skip
    lines = LINE.findall(proc.stdout + proc.stderr)
    if quiet:
        assert lines == []
        return
    assert len(lines) == 1, proc.stderr[-2000:]  # rank 0 only, once
    steps, checks, verdict = lines[0]
    assert int(steps) > 0 and verdict == "no SDC found"
    assert "nonfinite_gradient" in checks and "weight_fingerprint" in checks and "audits" in checks


@pytest.mark.slow  # a 3-rank Lightning launch: the default run stays under 10 minutes (the plain loop's line stays)
def test_a_clean_lightning_fit_ends_with_one_summary_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_ddp_demo.py"), "--fault", "none"],
                          env=worker_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = LINE.findall(proc.stdout + proc.stderr)
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]  # one line for the Trainer, on rank 0
    steps, checks, verdict = lines[0]
    demo_steps = re.search(r"No SDC detected in (\d+) steps", proc.stdout + proc.stderr)
    assert demo_steps is not None and int(steps) == int(demo_steps.group(1)) and verdict == "no SDC found"
    assert "gradient_screen" in checks and "ring_replay" in checks
