"""An SDC verdict reaches whoever started the job: exit code 86 through every launcher, the typed
exception in the caller of ``trainer.fit``, trackers closed, a report failure that costs nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, worker_env

from sdc_core.cli import main as sdc_main
from sdc_core.errors import FingerprintMismatchError, NonFiniteGradientError, SDCError, as_sdc_error
from sdc_core.ops.incidents import record_verdict
from sdc_core.ops.launch import job_exit_code, run_command

SCRIPT = str(Path(__file__).with_name("delivery_scenarios.py"))
BIN = Path(sys.executable).parent
SDC = [sys.executable, "-m", "sdc_core.cli"]  # the `sdc` console script
RUN = [sys.executable, "-m", "sdc_core.ops.launch"]  # what `sdc run` calls, without the other commands' imports
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]


def env(**extra: str) -> dict[str, str]:
    e = worker_env() | {"ACCELERATE_USE_CPU": "1", "ACCELERATE_SDC_CONFIG_FILE": os.devnull} | extra
    e["PYTHONWARNINGS"] = "default"  # the failed-write warning must be seen
    return e


def launch(cmd: list[str], cwd: Path, timeout: float = 420, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout)


def rank_errors(out: Path, world: int = 3) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank_error.rank{r}.json").read_text()) for r in range(world)]


def assert_verdict(proc: subprocess.CompletedProcess, out: Path, code: int = 86) -> dict[str, Any]:
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-6000:]
    errors = rank_errors(out)
    assert all(e == errors[0] for e in errors), errors  # the same verdict on every rank
    assert errors[0]["type"] == "FingerprintMismatchError" and errors[0]["rank"] == 1
    return errors[0]


# -- through the real launchers -------------------------------------------------------------------


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_sdc_run_torchrun_exits_86_even_when_the_incident_cannot_be_written(tmp_path: Path) -> None:
    """torchrun alone exits 1; inside `sdc run` the job exits 86. `<log dir>/sdc` is a file, so
    no incident can be written: every rank still raises the same verdict and a warning names it.
    Two instances of one callback (other settings) coexist. Before it, in the same processes, a
    NaN step the gradient check dropped (skip_step) is not audited by a replay listed first."""
    cmd = [*SDC, "run", "--", *TORCHRUN, SCRIPT, "lightning", "--out", "out", "--unwritable", "--skip-first"]
    proc = launch(cmd, tmp_path)
    assert_verdict(proc, tmp_path / "out")
    for r in range(3):  # first, a NaN step dropped by the gradient check was not audited by the replay
        skip = json.loads((tmp_path / "out" / f"skip.rank{r}.json").read_text())
        assert skip["sdc/nonfinite_gradient/skipped_steps"] == 1 and skip["sdc/ring_replay/failures"] == 0
        assert skip["sdc/ring_replay/runs"] == 3
    assert "ChildFailedError" in proc.stderr  # torchrun itself failed the usual way
    assert "not written to" in proc.stderr and str(Path("run", "version_0", "sdc", "incidents")) in proc.stderr
    assert "NotADirectoryError" in proc.stderr and "Connection closed by peer" not in proc.stderr


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes (ddp_spawn stays)
def test_accelerate_sdc_launch_exits_86_and_applies_policies(tmp_path: Path) -> None:
    """`accelerate-sdc launch` alone gives 86. Before the verdict, a NaN step the gradient check
    skipped (skip_step) with the replay on every step: not audited, no ReplayMismatchError, and
    the incident says skip_step."""
    cmd = [sys.executable, "-m", "accelerate_sdc.cli", "launch", "--multi_gpu", "--num_processes", "3",
           SCRIPT, "accelerate", "--out", "out"]  # fmt: skip
    proc = launch(cmd, tmp_path)
    assert_verdict(proc, tmp_path / "out")
    skip = [json.loads((tmp_path / "out" / f"skip.rank{r}.json").read_text()) for r in range(3)]
    for s in skip:
        assert s["metrics"]["sdc/nonfinite_gradient/skipped_steps"] == 1
        assert s["metrics"]["sdc/ring_replay/failures"] == 0
    incidents = [json.loads(p.read_text()) for p in (tmp_path / "out" / "run" / "sdc" / "incidents").glob("*.json")]
    policies = sorted((i["check"], i["policy"]) for i in incidents)
    assert policies == [("nonfinite_gradient", "skip_step"), ("weight_fingerprint", "raise")], policies


def test_ddp_spawn_caller_catches_the_sdc_error_and_exits_86(tmp_path: Path) -> None:
    proc = launch([sys.executable, SCRIPT, "lightning", "--out", "out", "--strategy", "ddp_spawn"], tmp_path)
    assert proc.returncode == 86, proc.stdout[-2000:] + proc.stderr[-6000:]
    (caught,) = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("caught.*.json")]  # the parent only
    assert caught["type"] == "FingerprintMismatchError" and caught["process_raised"]
    assert caught["error"]["rank"] == 1 and caught["error"]["check"] == "weight_fingerprint"
    assert "FingerprintMismatchError: SDC check 'weight_fingerprint' failed at step 3" in proc.stderr


def test_single_process_verdict_exits_86_and_names_no_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Plain python, one process: exit 86; the incident names no host to exclude (no witness)."""
    proc = launch([sys.executable, SCRIPT, "accelerate", "--out", "out"], tmp_path)
    assert proc.returncode == 86, proc.stderr[-6000:]
    error = json.loads((tmp_path / "out" / "rank_error.rank0.json").read_text())
    assert error["type"] == "NonFiniteGradientError" and error["rank"] is None and error["suspects"] == [0]
    assert "single process has no replica" in error["message"] and "3 or more" not in error["message"]
    (incident,) = [json.loads(p.read_text()) for p in (tmp_path / "out" / "run" / "sdc" / "incidents").glob("*.json")]
    assert incident["exclude_hosts"] == []
    assert sdc_main(["exclude-list", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == ""  # `sdc exclude-list` lists nothing


@pytest.mark.slow
def test_sdc_run_torchrun_max_restarts_does_not_retrain_after_a_verdict(tmp_path: Path) -> None:
    cmd = [*SDC, "run", "--", *TORCHRUN[:-2], "--nproc-per-node", "3", "--max-restarts", "1", SCRIPT, "lightning",
           "--out", "out"]  # fmt: skip
    proc = launch(cmd, tmp_path)
    assert_verdict(proc, tmp_path / "out")
    assert "not restarting after an SDC verdict of attempt 0" in proc.stderr


@pytest.mark.slow
def test_sdc_run_accelerate_launch_exits_86(tmp_path: Path) -> None:
    cmd = [*SDC, "run", "--", str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "3", SCRIPT,
           "accelerate", "--out", "out"]  # fmt: skip
    assert_verdict(launch(cmd, tmp_path), tmp_path / "out")


@pytest.mark.slow
def test_lightning_ddp_subprocess_launcher_exits_86(tmp_path: Path) -> None:
    proc = launch([sys.executable, SCRIPT, "lightning", "--out", "out", "--devices", "3"], tmp_path)
    assert_verdict(proc, tmp_path / "out")


# -- the wrapper itself (no training) ----------------------------------------------------------------

RAISE = (
    "import atexit, pathlib, sys\n"
    "from sdc_core.ops.process_exit import install_exit_code\n"
    "from sdc_core import FingerprintMismatchError\n"
    "install_exit_code()\n"
    "atexit.register(lambda: pathlib.Path(sys.argv[1]).write_text('FINISHED'))  # as MLflow ends its run\n"
    "raise FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={1: 'node-b'}, details={'world_size': 3})\n"
)


def test_uncaught_verdict_runs_atexit_handlers_then_exits_86(tmp_path: Path) -> None:
    proc = launch([sys.executable, "-c", RAISE, str(tmp_path / "tracker")], tmp_path)
    assert proc.returncode == 86, proc.stderr
    assert (tmp_path / "tracker").read_text() == "FINISHED"
    assert "node-b" in proc.stderr


@pytest.mark.parametrize(
    ("cmd", "code"),
    [
        (["-c", RAISE, os.devnull], 86),  # a verdict
        (["-c", "raise KeyError('a crash')"], 1),  # a crash stays a crash
        (["-c", "import sys; sys.exit(3)"], 3),
        (["-c", "pass"], 0),
        (["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], 128 + 9),
    ],
)
def test_sdc_run_exit_codes(cmd: list[str], code: int) -> None:
    assert run_command([sys.executable, *cmd], env=env()) == code  # what `sdc run --` does, in this process


def test_sdc_run_honours_sdc_exit_code_and_names_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command([sys.executable, "-c", RAISE, os.devnull], env=env(SDC_EXIT_CODE="42")) == 42
    assert sdc_main(["run", "--", "no-such-launcher-xyz"]) == 127
    assert "cannot start 'no-such-launcher-xyz'" in capsys.readouterr().err
    assert sdc_main(["run", "--"]) == 2 and "usage: sdc run" in capsys.readouterr().err


def test_sdc_run_forwards_sigterm(tmp_path: Path) -> None:
    child = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path('got').write_text('TERM'), sys.exit(7)))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"
    )
    wrapper = subprocess.Popen([*RUN, "--", sys.executable, "-c", child], cwd=tmp_path, env=env())
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.1)
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=60) == 7
    assert (tmp_path / "got").read_text() == "TERM"


def test_job_exit_code_rules() -> None:
    marker = [{"error": {}}]
    assert job_exit_code(0, marker, 86) == 0  # the job finished (it handled the verdict)
    assert job_exit_code(1, marker, 86) == 86
    assert job_exit_code(1, marker, 0) == 1  # SDC_EXIT_CODE=0 turns it off
    assert job_exit_code(1, [], 86) == 1 and job_exit_code(-15, [], 86) == 143


# -- reports and names ------------------------------------------------------------------------------


def test_failed_incident_write_warns_and_returns(tmp_path: Path) -> None:
    (tmp_path / "sdc").write_text("not a folder")
    error = FingerprintMismatchError(step=2, rank=1, suspects=(1,), hosts={1: "h"}, details={"world_size": 3})
    check = SimpleNamespace(last_error=error, topology=None, config={"every_n_steps": 1})
    with pytest.warns(RuntimeWarning, match=r"not written to .*sdc.incidents: NotADirectoryError"):
        assert record_verdict(check, tmp_path, True, "raise") is None
    assert check.last_error is None


def test_unlocalized_messages_fit_the_world_size() -> None:
    def message(world: int, suspects: tuple[int, ...]) -> str:
        return str(NonFiniteGradientError(step=1, rank=None, suspects=suspects, details={"world_size": world}))

    assert "single process has no replica" in message(1, (0,))
    assert "run with 3 or more replicas to localize" in message(2, (0, 1))
    assert "3 or more" not in message(3, (0, 1)) and "test these hosts" in message(3, (0, 1))
    assert "3 or more" not in message(3, (0, 1, 2)) and "common cause" in message(3, (0, 1, 2))


def test_spawned_exception_becomes_the_sdc_error() -> None:
    import pickle

    from torch.multiprocessing.spawn import ProcessRaisedException

    error = FingerprintMismatchError(step=3, rank=1, suspects=(1,), hosts={1: "node-b"}, details={"world_size": 3})
    raised = ProcessRaisedException("worker traceback", 0, 123)
    as_sdc_error(raised, SDCError.from_dict(json.loads(json.dumps(error.to_dict()))))
    assert isinstance(raised, FingerprintMismatchError) and isinstance(raised, ProcessRaisedException)
    assert str(raised) == str(error) and raised.to_dict() == error.to_dict() and raised.msg == "worker traceback"
    again = pickle.loads(pickle.dumps(raised))
    assert type(again) is FingerprintMismatchError and again.to_dict() == error.to_dict()
    with pytest.raises(ValueError, match="not an SDC error record"):
        SDCError.from_dict({"type": "os.system", "step": 1})


def test_deepspeed_strategy_is_refused() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_sdc._common import require_supported_strategy

    trainer = SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy))  # deepspeed not installed
    with pytest.raises(ValueError, match="got DeepSpeedStrategy"):
        require_supported_strategy(trainer, "WeightFingerprintCheck")  # type: ignore[arg-type]


def test_two_instances_of_a_check_have_their_own_state_key() -> None:
    import lightning.pytorch as L

    from lightning_sdc import WeightFingerprintCheck

    a, b = WeightFingerprintCheck(every_n_steps=1), WeightFingerprintCheck(every_n_steps=10)
    assert a.state_key != b.state_key
    L.Trainer(accelerator="cpu", devices=1, callbacks=[a, b], logger=False, enable_progress_bar=False)


def test_scheduler_routes_use_the_wrapper() -> None:
    routes = ROOT / "examples" / "after_detection"
    for name in ("slurm_requeue.sh", "slurm_lightning.sh", "torchrun_elastic.sh"):
        assert "sdc run --" in (routes / name).read_text(), name
    assert "sdc run --" in (routes / "k8s_cordon.sh").read_text()


# -- the after-detection routes, as written (single node) -------------------------------------------


def _route_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "train.py").write_text(  # the routes run `train.py --run-dir DIR`
        "import runpy, sys\n"
        f"sys.argv = [{SCRIPT!r}, 'lightning', '--out', sys.argv[sys.argv.index('--run-dir') + 1]]\n"
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n"
    )
    return {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}", "RUN_DIR": "run",
            "NPROC": "3"}  # fmt: skip


@pytest.mark.slow
def test_torchrun_elastic_route_leaves_the_named_host(tmp_path: Path) -> None:
    from conftest import free_port

    extra = _route_env(tmp_path) | {"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
    proc = launch(["bash", str(ROOT / "examples" / "after_detection" / "torchrun_elastic.sh")], tmp_path, **extra)
    assert proc.returncode == 86, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "this node was named faulty by an SDC check: leaving the job" in proc.stderr


@pytest.mark.slow
def test_kubernetes_route_cordons_its_own_node(tmp_path: Path) -> None:
    """kubectl is a stand-in that records its arguments (no cluster here)."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "kubectl.log"}\n')
    fake.chmod(0o755)
    extra = _route_env(tmp_path) | {"NODE_NAME": "node-x"}
    cmd = ["bash", str(ROOT / "examples" / "after_detection" / "k8s_cordon.sh"), "torchrun", "--standalone",
           "--nproc-per-node", "3", "train.py", "--run-dir", "run"]  # fmt: skip
    proc = launch(cmd, tmp_path, **extra)
    assert proc.returncode == 86, proc.stdout[-2000:] + proc.stderr[-6000:]
    calls = (tmp_path / "kubectl.log").read_text().splitlines()
    assert calls[0] == "cordon node-x" and calls[1].startswith("label --overwrite node node-x"), calls
    named = subprocess.run([*SDC, "exclude-list", str(tmp_path / "run")], capture_output=True, text=True)
    assert named.stdout.strip() == "node-x"  # the incident names the node as the scheduler knows it


# The Slurm routes run on a real (private, single-host) Slurm cluster: tests/test_slurm.py.


def test_worker_restarted_after_a_verdict_stops_at_import(tmp_path: Path) -> None:
    """What a torchrun restart inside `sdc run` sees: a marker of attempt 0 of the same run."""
    marker = {"restart": 0, "run_id": "run-a", "error": {"message": "SDC check 'weight_fingerprint' failed"}}
    (tmp_path / "host-1-1.json").write_text(json.dumps(marker))
    code = "import sdc_core.ops.incidents; print('trained')"  # what the adapters import
    base = {"SDC_VERDICT_DIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "run-a"}
    restarted = launch([sys.executable, "-c", code], tmp_path, **base, TORCHELASTIC_RESTART_COUNT="1")
    assert restarted.returncode == 86 and "trained" not in restarted.stdout
    assert "not restarting after an SDC verdict of attempt 0: SDC check 'weight_fingerprint'" in restarted.stderr
    other_run = launch([sys.executable, "-c", code], tmp_path, **base | {"TORCHELASTIC_RUN_ID": "b"},
                       TORCHELASTIC_RESTART_COUNT="1")  # fmt: skip
    assert other_run.returncode == 0 and "trained" in other_run.stdout
