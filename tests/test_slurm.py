"""The node-replacement loop on a real Slurm: a private cluster on this host (a controller and
nodes n1..n4, scripts/slurm_cluster.sh), jobs submitted with ``sbatch`` exactly as the routes in
examples/after_detection/ are written. A fault on one node's rank ends the job with 86; that node
is drained with a reason naming the check, the step and the job; the job is requeued, runs on the
other three nodes, resumes from the last verified checkpoint and completes, with the weights of
a clean run resumed from the same checkpoint. Skipped, with one line why, where Slurm cannot run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, worker_env

CLUSTER = ROOT / "scripts" / "slurm_cluster.sh"
ROUTES = ROOT / "examples" / "after_detection"
SCENARIOS = Path(__file__).with_name("slurm_scenarios.py")
BIN = Path(sys.executable).parent  # sdc, torchrun and python of this environment


class Cluster:
    """A running private cluster: ``env`` reaches it (``SLURM_CONF``), ``dir`` holds its logs."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.env = worker_env() | {"SLURM_CONF": str(folder / "slurm.conf"),
                                   "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip

    def run(self, *cmd: str) -> str:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30, check=True).stdout

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.dir / "log").glob("*.log")))

    def nodes(self) -> dict[str, str]:
        """Node name -> state (``idle``, ``drained``, ...), once no node shows a transient ``*``/``~``."""
        for _ in range(50):
            rows = dict(line.split() for line in self.run("sinfo", "-h", "-N", "-o", "%N %T").split("\n") if line)
            if not any(s.endswith(("*", "~", "#")) or s in ("completing", "mixed") for s in rows.values()):
                return rows
            time.sleep(0.1)
        return rows

    def reason(self, node: str) -> str:
        return re.search(r"Reason=(.*?)(?: \[|$)", self.run("scontrol", "show", "node", node), re.M).group(1)

    def sbatch(self, route: str, cwd: Path, mode: str, *args: str, **export: str) -> int:
        """Submit ``route`` on 3 of the 4 nodes, as a user would (``train.py`` is this module's
        scenario), with one task (one process) per node."""
        (cwd / "train.py").write_text(
            "import runpy, sys\n"
            f"sys.argv = [{str(SCENARIOS)!r}, {mode!r}, *sys.argv[1:]]\n"
            f"runpy.run_path({str(SCENARIOS)!r}, run_name='__main__')\n"
        )
        cmd = ["sbatch", "--parsable", "--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=0",
               f"--chdir={cwd}", f"--output={cwd / 'job.out'}", str(ROUTES / route), *args]  # fmt: skip
        out = subprocess.run(cmd, env=self.env | export, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def wait(self, job: int, cwd: Path, timeout: float = 300) -> dict[str, str]:
        """Wait until ``job`` left the queue; its final record (``scontrol show job``) as a dict."""
        end = time.monotonic() + timeout
        while self.run("squeue", "-h", "-j", str(job), "-o", "%T").strip():
            if time.monotonic() > end:
                out = (cwd / "job.out").read_text() if (cwd / "job.out").exists() else ""
                pytest.fail(f"job {job} still queued after {timeout} s\n{out[-6000:]}\n{self.logs()}")
            time.sleep(0.5)
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", str(job))))

    def completions(self, job: int) -> list[dict[str, str]]:
        """The job's attempts as the controller recorded them when each ended (jobcomp)."""
        lines = (self.dir / "log" / "jobcomp.txt").read_text().splitlines()
        rows = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines]
        return [r for r in rows if r.get("JobId") == str(job)]


def start_cluster(**env: str) -> Iterator[Cluster]:
    if not shutil.which("sbatch"):
        pytest.skip("Slurm is not installed (scripts/setup.sh installs it where it runs as root with apt-get)")
    folder = Path(tempfile.mkdtemp(prefix="sdc-slurm-"))  # short: the munge socket path has a length limit
    proc = subprocess.run(["bash", str(CLUSTER), "start", str(folder)], env=os.environ | env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    try:
        if proc.returncode != 0:
            why = (proc.stderr.strip().splitlines() or [f"slurm_cluster.sh exited {proc.returncode}"])[-1]
            pytest.skip(f"no private Slurm cluster here: {why}")
        yield Cluster(folder)
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def slurm() -> Iterator[Cluster]:
    """A fresh cluster whose slurm.conf has ``RequeueExit=86``."""
    yield from start_cluster()


@pytest.fixture
def slurm_plain() -> Iterator[Cluster]:
    """A fresh cluster without ``RequeueExit``: the route asks for the requeue itself."""
    yield from start_cluster(SDC_SLURM_REQUEUE_EXIT="")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "final.pt", weights_only=True)


def read_attempt(run: Path, n: int) -> dict:
    import json

    return json.loads((run / f"attempt{n}.json").read_text())


def assert_drain_requeue_resume(slurm: Cluster, job: int, cwd: Path, run: Path, check: str) -> dict:
    """The loop after a fault on n2's rank; returns the resumed attempt's record."""
    record = slurm.wait(job, cwd)
    out = (cwd / "job.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", out[-6000:] + slurm.logs()
    assert f"sdc: job {job} (attempt 0, nodes n[1-3]): training ended with 86" in out, out[-6000:]
    assert f"sdc: job {job} (attempt 1, nodes n[1,3-4]): training ended with 0" in out, out[-6000:]
    assert slurm.nodes() == {"n1": "idle", "n2": "drained", "n3": "idle", "n4": "idle"}
    reason = slurm.reason("n2")  # check, step and job: what `sinfo -R` shows the operator
    assert re.fullmatch(rf"SDC {check} at step (\d+) on n2, job {job}", reason), reason
    step = int(re.search(r"at step (\d+)", reason).group(1))
    first, second = read_attempt(run, 0), read_attempt(run, 1)
    assert first["resumed_from"] is None and second["nodes"] == "n[1,3-4]" and second["node"] in ("n1", "n3", "n4")
    # the last checkpoint written (each after the replicas were compared) before the verdict's step
    assert second["resumed_from"] == str(run / "ckpt" / second["resumed_from"].rsplit("/", 1)[-1]), second
    assert 0 < second["start_step"] < step and step - second["start_step"] <= 3, (second, reason)
    report = subprocess.run(["sdc", "report", str(run)], env=slurm.env, capture_output=True, text=True).stdout
    assert re.search(rf"^n2 .* 1 +1  {check}", report, re.M), report  # what `sdc report` shows
    assert "n2" in out and check in out  # the job's own log has the report too
    return second


def faulty_torchrun_job(slurm: Cluster, tmp_path: Path) -> dict:
    """``sbatch slurm_requeue.sh`` on 3 of 4 nodes, a weight bit flip on n2's rank: the job exits
    86 (the controller records it), n2 is drained, the job is requeued by Slurm (RequeueExit=86),
    runs on n1, n3, n4 from the last verified checkpoint and completes. Returns the resumed
    attempt's record."""
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    job = slurm.sbatch("slurm_requeue.sh", faulty, "torchrun", "--fault-node", "n2",
                       NPROC="1", RDZV_PORT=str(free_port()), RUN_DIR=str(faulty / "run"))  # fmt: skip
    second = assert_drain_requeue_resume(slurm, job, faulty, faulty / "run", "weight_fingerprint")
    ended = slurm.completions(job)
    assert [(r["JobState"], r["ExitCode"]) for r in ended] == [("FAILED", "86:0"), ("COMPLETED", "0:0")], ended
    named = subprocess.run(["sdc", "exclude-list", str(faulty / "run")], env=slurm.env, capture_output=True, text=True)
    assert named.stdout.strip() == "n2"  # the node, not the host name all four nodes share
    return second


@pytest.mark.slow  # a real Slurm job (about 30 s): the default run stays under 10 minutes on 2 cores
def test_torchrun_route_drains_the_faulty_node_requeues_and_resumes(slurm: Cluster, tmp_path: Path) -> None:
    """``faulty_torchrun_job``; its clean counterpart resumed from the same checkpoint: ``-m slow``."""
    faulty_torchrun_job(slurm, tmp_path)


@pytest.mark.slow  # a second job (about 30 s)
def test_a_clean_job_resumed_from_the_same_checkpoint_ends_with_the_same_weights(slurm: Cluster,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """After the faulty job above, n2 is put back (as after its replacement) and a clean job
    resumed from that same checkpoint completes with the same weights and drains nothing."""
    second = faulty_torchrun_job(slurm, tmp_path)
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME")  # the operator, once n2 is replaced
    (clean / "run" / "ckpt").mkdir(parents=True)
    shutil.copy(second["resumed_from"], clean / "run" / "ckpt")
    job = slurm.sbatch("slurm_requeue.sh", clean, "torchrun", NPROC="1", RDZV_PORT=str(free_port()),
                       RUN_DIR=str(clean / "run"))  # fmt: skip
    record = slurm.wait(job, clean)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", (clean / "job.out").read_text()[-6000:]
    assert read_attempt(clean / "run", 0)["start_step"] == second["start_step"]
    assert slurm.nodes() == {f"n{i}": "idle" for i in range(1, 5)}  # nothing drained
    assert not list((clean / "run").glob("**/sdc/incidents/*.json"))
    a, b = final_weights(faulty / "run"), final_weights(clean / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed job's weights differ"


@pytest.mark.slow  # three Lightning processes per attempt on two cores: about a minute more
def test_lightning_under_srun_drains_the_faulty_node_requeues_and_resumes(slurm_plain: Cluster,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    """``sbatch slurm_lightning.sh``: Trainer(num_nodes=3, devices=1) under srun (Lightning's
    SLURMEnvironment, no torchrun) with the lightning_sdc callbacks; the cluster has no
    RequeueExit, so the route requeues the job itself. The same loop; then a clean job resumed
    from the same checkpoint ends with the same weights."""
    slurm = slurm_plain
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    faulty.mkdir()
    job = slurm.sbatch("slurm_lightning.sh", faulty, "lightning", "--fault-node", "n2",
                       MASTER_PORT=str(free_port()), RUN_DIR=str(faulty / "run"))  # fmt: skip
    second = assert_drain_requeue_resume(slurm, job, faulty, faulty / "run", "weight_fingerprint")
    assert second["resumed_from"].endswith(".ckpt")
    ended = slurm.completions(job)  # the route's own `scontrol requeue` stopped it before it exited 86
    assert len(ended) == 2 and ended[0]["ExitCode"] != "86:0" and ended[1]["JobState"] == "COMPLETED", ended

    slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME")
    (clean / "run" / "ckpt").mkdir(parents=True)
    shutil.copy(second["resumed_from"], clean / "run" / "ckpt")
    job = slurm.sbatch("slurm_lightning.sh", clean, "lightning", MASTER_PORT=str(free_port()),
                       RUN_DIR=str(clean / "run"))  # fmt: skip
    record = slurm.wait(job, clean)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", (clean / "job.out").read_text()[-6000:]
    assert slurm.nodes() == {f"n{i}": "idle" for i in range(1, 5)}
    a, b = final_weights(faulty / "run"), final_weights(clean / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed job's weights differ"
