"""An uncaught verdict prints one line per rank (check, step, rank, host, what to do, the incident),
no traceback unless SDC_TRACEBACK=1; `sdc run` ends with one line naming the verdict or the crash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import worker_env

from sdc_core.errors import FingerprintMismatchError, verdict_line

SDC_RUN = [sys.executable, "-m", "sdc_core.cli", "run", "--"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]

TRAIN = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from sdc_core import Fault, FaultInjector, SDCHooks

dist.init_process_group("gloo")
torch.manual_seed(0)
net = nn.Linear(8, 2)
model = DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
hooks = SDCHooks(replay_every_n_steps=0, run_dir="run")
hooks.attach(model, optimizer)
injector = FaultInjector([Fault("weight_bit_flip", rank=1, step=1, target="weight", bit=27)])
injector.install(net, dist.get_rank())
for step in range(4):
    injector.set_step(step)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    injector.after_step(step, net, [optimizer])
hooks.finish()
"""

RAISE = (
    "from sdc_core.ops.process_exit import install_exit_code\n"
    "from sdc_core import FingerprintMismatchError\n"
    "install_exit_code()\n"
    "raise FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={1: 'node-b'}, details={'world_size': 3})\n"
)


def test_torchrun_verdict_is_one_line_per_rank_and_sdc_run_names_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    proc = subprocess.run([*SDC_RUN, *TORCHRUN, "train.py"], cwd=tmp_path, env=worker_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 86, proc.stderr[-6000:]
    assert 'train.py", line' not in proc.stderr  # no worker traceback (torchrun prints its own ChildFailedError)
    lines = [line for line in proc.stderr.splitlines() if "FingerprintMismatchError: SDC check" in line]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank0", "[rank1", "[rank2"], proc.stderr[-4000:]
    (incident,) = (tmp_path / "run" / "sdc" / "incidents").glob("*.json")
    for line in lines:
        assert "'weight_fingerprint' failed at step" in line and ": rank 1 (host" in line and "out of service" in line
        assert "Incident: run/sdc/incidents" in line and "SDC_TRACEBACK=1" in line
    assert f"Incident: {Path('run') / 'sdc' / 'incidents' / incident.name}." in "".join(lines)  # rank 0: the file
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sdc run: the job ended on an SDC verdict (exit 86): SDC check 'weight_fingerprint'")
    assert incident.name in last


def test_sdc_traceback_brings_the_traceback_back(tmp_path: Path) -> None:
    quiet = subprocess.run([sys.executable, "-c", RAISE], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 86
    assert quiet.stderr.strip().splitlines() == [verdict_line(
        FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={1: "node-b"}, details={"world_size": 3}))]
    loud = subprocess.run([sys.executable, "-c", RAISE], env=worker_env() | {"SDC_TRACEBACK": "1"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert loud.returncode == 86 and "Traceback (most recent call last)" in loud.stderr and "node-b" in loud.stderr


def test_sdc_run_says_when_a_job_failed_for_another_reason() -> None:
    proc = subprocess.run([*SDC_RUN, sys.executable, "-c", "raise KeyError('a crash')"], env=worker_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1 and "KeyError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "sdc run: the job failed (exit 1) for a reason other than an SDC verdict"
    )
    ok = subprocess.run([*SDC_RUN, sys.executable, "-c", "pass"], env=worker_env(), capture_output=True, text=True,
                        timeout=60)  # fmt: skip
    assert ok.returncode == 0 and ok.stderr == ""
