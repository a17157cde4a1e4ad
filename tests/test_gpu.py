"""The GPU suite (``pytest -m gpu``): the checks on CUDA tensors, skipped where no CUDA device exists.

Three DDP ranks share one GPU over gloo (NCCL refuses two ranks on one device; with as many GPUs
as ranks the scenarios pick NCCL) through the plain-PyTorch hook set, for each model of
``tests/plain_scenarios.py``: fp32, bf16 autocast, fp16 with a GradScaler, SDPA attention (flash
and memory-efficient backends), an embedding pooled with ``index_add_``/``scatter_add_``,
``torch.compile``, conv + BatchNorm channels-last. Each: a clean run raises nothing (and, for the
models whose kernels are bit-reproducible, ends bit-identical to a run without checks); a NaN, an
activation fault and a weight flip on one rank are named on every rank. Plus Lightning and
Accelerate on a single device. One call of a few minutes on one GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import results, worker_env
from test_plain import KINDS, check_models, launch, same_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODELS = ["mlp", "bf16", "fp16", "attention", "embedding", "compile", "conv"]
# bit-reproducible run to run on a GPU (the others use atomic adds or nondeterministic backward kernels
# outside the audited micro-batches, so a run with checks may differ from one without in the last bits)
EXACT = {"mlp", "bf16", "fp16", "compile"}


@pytest.fixture(scope="module")
def gpu_ddp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scenarios = [f"{m}:{k}" for m in MODELS for k in (*KINDS, "matmul_clean")] + ["mlp:matmul", "bf16:matmul"]
    return launch(tmp_path_factory.mktemp("gpu"), scenarios, 3, device="cuda", timeout=480)


@pytest.mark.parametrize("model", MODELS)
def test_gpu_three_ranks_on_one_device_clean_and_faults_named(gpu_ddp: Path, model: str) -> None:
    check_models(gpu_ddp, [model], 3, exact=EXACT & {model})


@pytest.mark.parametrize("route", ["lightning", "accelerate"])
def test_gpu_single_device_route_names_a_nan_and_runs_clean(tmp_path: Path, route: str) -> None:
    out = tmp_path / f"{route}.json"
    script = Path(__file__).with_name("gpu_single_scenarios.py")
    proc = subprocess.run([sys.executable, str(script), route, str(out)], env=worker_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert "type" not in result["clean"], result["clean"]
    assert result["nan"]["type"] == "NonFiniteGradientError" and result["nan"]["step"] == 2, result["nan"]


def test_gpu_matmul_checksums_never_alarm_on_clean_products_and_name_a_wrong_one(gpu_ddp: Path) -> None:
    """``matmul_checksum`` on CUDA (TF32 allowed or not, bf16/fp16 autocast, split-K): no alarm on any
    model's clean run; a wrong element inside rank 2's product at step 3 is named there (fp32, bf16)."""
    for model in MODELS:
        rows = results(gpu_ddp, f"{model}:matmul_clean", 3)
        assert all(r["error"] is None for r in rows), f"{model}: {rows[0]['error']}"
    for model in ("mlp", "bf16"):
        err = same_error(gpu_ddp, f"{model}:matmul", 3)
        assert (err["type"], err["rank"], err["step"]) == ("ChecksumMismatchError", 2, 3), err["message"]
