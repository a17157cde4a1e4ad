"""Other world shapes: two replicas, and two nodes (two torchrun agents on localhost, c10d)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCENARIOS, free_port, results, torchrun, worker_env


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_two_replicas_cannot_localize(tmp_path: Path) -> None:
    torchrun(SCENARIOS, tmp_path, ["pair_fingerprint", "pair_replay", "pair_heal"], 2)
    for scenario, error_type in (
        ("pair_fingerprint", "FingerprintMismatchError"),
        ("pair_replay", "ReplayMismatchError"),
    ):
        errors = [r["error"] for r in results(tmp_path, scenario, 2)]
        assert errors[0] is not None and errors[0] == errors[1], errors
        assert errors[0]["type"] == error_type
        assert errors[0]["rank"] is None and errors[0]["suspects"] == [0, 1]
        assert "cannot localize" in errors[0]["message"]
    # never heal without a majority
    assert results(tmp_path, "pair_heal", 2)[0]["error"]["details"]["action"] == "not healed: no strict majority"


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_two_nodes_pair_across_nodes_and_report_node_rank(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=sdc-multinode",
        "--max-restarts=0", str(SCENARIOS), "--out", str(tmp_path), "--only", "multinode",
    ]  # fmt: skip
    agents = [subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]  # fmt: skip
    try:
        logs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    if any(a.returncode for a in agents):
        pytest.fail("\n\n".join(log[-5000:] for log in logs))
    per_rank = results(tmp_path, "multinode", 4)
    errors = [r["error"] for r in per_rank]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    err = errors[0]
    assert err["type"] == "ReplayMismatchError" and err["rank"] == 3 and err["step"] == 2
    # ranks 0-1 sit on node 0, ranks 2-3 on node 1: every replay partner is on the other node
    partners = err["details"]["partners"]
    node = [0, 0, 1, 1]
    assert all(node[r] != node[p] for r, p in enumerate(partners)), partners
    assert err["details"]["node_ranks"] == {"3": 1}
    assert "node 1" in err["message"] and err["hosts"]["3"] in err["message"]
