"""Shared helpers: launch the multi-process scenarios with real ``torchrun`` and read results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = Path(__file__).with_name("ddp_scenarios.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def must_run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 420,
             cwd: Path | str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run a launch command (``worker_env()`` by default); fail the test with the end of its output
    when it exits non-zero (a crashed scenario) or times out (a hang)."""
    proc = subprocess.run(cmd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")  # fmt: skip
    return proc


def torchrun_cmd(script: Path | str, out: Path | str | None, scenarios: Sequence[str] | str | None, nproc: int,
                 *extra_args: str, module: bool = False) -> list[str]:  # fmt: skip
    """``python -m torch.distributed.run --standalone --nproc-per-node=<nproc> <script> [--out OUT]
    [--only a,b] <extra_args>`` (``module``: ``script`` is a module name, run with ``-m``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", str(script)] if module else [str(script)]
    if out is not None:
        cmd += ["--out", str(out)]
    if scenarios is not None:
        cmd += ["--only", scenarios if isinstance(scenarios, str) else ",".join(scenarios)]
    return cmd + [str(a) for a in extra_args]


def torchrun(script: Path | str, out: Path | str | None, scenarios: Sequence[str] | str | None, nproc: int,
             *extra_args: str, timeout: float = 420, env: dict[str, str] | None = None,
             cwd: Path | str | None = None, module: bool = False) -> subprocess.CompletedProcess:  # fmt: skip
    """One single-node ``torchrun`` of ``script`` (``torchrun_cmd``): ``scenarios`` in sequence, each
    rank writing under ``out``; ``env`` is ``worker_env()`` by default. Fails the test on a crash or
    a hang (``must_run``)."""
    return must_run(torchrun_cmd(script, out, scenarios, nproc, *extra_args, module=module), env, timeout, cwd)


def results(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    """Every rank's result of ``scenario``, in rank order."""
    return [json.loads((out / f"{scenario}.rank{r}.json").read_text()) for r in range(world)]


# The scenarios of ``lightning_ddp_shared.py`` that the default runs of test_lightning_ddp, test_causal_order and
# test_nonfinite_deferred read
LIGHTNING_DDP_DEFAULT = [
    "clean", "clean_exact", "clean_bf16", "clean_fp16", "clean_validation", "clean_adam_buffers",
    "audit_off", "tap_only", "audit_on",
    "nonfinite", "nonfinite_all", "nonfinite_skip", "fingerprint", "optimizer_state",
    "replay_persistent", "replay_persistent_validated", "replay_intermittent", "comm_hook",
    "fp16_one_overflow", "fp16_sole_overflow", "replay_step_hook", "replay_crash",
    "heal", "heal_limit", "replay_transient_skip", "replay_persistent_skip", "rollback", "rollback_none",
    "save", "resume", "own_check", "flip", "flip_reversed",
    "probe_raise", "probe_skip", "clip_nan", "nan_last_step", "nan_checkpoint", "nan_warn", "nan_sample",
    "diverging",
]  # fmt: skip


@pytest.fixture(scope="session")
def lightning_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``torchrun`` of ``lightning_ddp_shared.py`` on 3 ranks with ``LIGHTNING_DDP_DEFAULT``, in the output folder:
    the test files that read them share one launch (each launch pays about 10 s of Lightning start-up on 2 cores)."""
    path = tmp_path_factory.mktemp("ddp3")
    torchrun(Path(__file__).with_name("lightning_ddp_shared.py"), path, LIGHTNING_DDP_DEFAULT, 3, cwd=path)
    return path
