"""Rolling fingerprints (``FingerprintConfig(rolling=k)``): the partition, the schedule and its
detection latency (one gloo rank in this process), the settings, and 3 CPU ranks through the
plain-PyTorch hook set (``tests/rolling_scenarios.py``) where a flip outside the slice being
compared is named within k comparisons."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import results, torchrun
from torch import nn

from sdc_core.checks.fingerprint import (
    FingerprintConfig,
    WeightFingerprint,
    fingerprinted_tensors,
    rolling_slices,
)
from sdc_core.driver.settings import SDCConfigError, resolve

SCRIPT = Path(__file__).with_name("rolling_scenarios.py")


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "3", None])
def test_rolling_must_be_an_integer_of_at_least_one(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^rolling must be an integer >= 1"):
        FingerprintConfig(rolling=bad)  # type: ignore[arg-type]
    assert FingerprintConfig().rolling == 1 and FingerprintConfig(rolling=7).rolling == 7


def test_slices_partition_the_tensors_by_index_balanced_by_bytes() -> None:
    sizes = (4096, 256, 16384, 256, 1024, 16, 999, 5, 70_000, 12)
    for k in (1, 2, 3, 4, 7, 10, 13):
        slices = rolling_slices(sizes, k)
        assert len(slices) == k
        assert sorted(i for s in slices for i in s) == list(range(len(sizes)))  # each tensor once
        assert all(s == sorted(s) for s in slices)
        loads = [sum(sizes[i] for i in s) for s in slices]
        assert max(loads) - min(loads) <= max(sizes)
        assert rolling_slices(tuple(int(n) for n in sizes), k) == slices  # another rank's equal sizes: the same
    assert rolling_slices(sizes, 1) == [list(range(len(sizes)))]
    assert sum(1 for s in rolling_slices(sizes, 13) if not s) == 3  # more slices than tensors
    # appending tensors (optimizer state, created by the first step) leaves the earlier ones in place
    longer = rolling_slices((*sizes, 8, 3000, 40), 3)
    assert [[i for i in s if i < len(sizes)] for s in longer] == rolling_slices(sizes, 3)
    # a layer of weight, bias, weight, bias, ...: ``i % 2`` would put every weight in one slice
    layer = (4096, 64) * 6
    assert [sum(layer[i] for i in s) for s in rolling_slices(layer, 2)] == [12_480, 12_480]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 9])
def test_every_tensor_is_compared_within_k_comparisons(one_rank: None, k: int) -> None:
    net = _Net()
    check = WeightFingerprint(FingerprintConfig(rolling=k))
    everything = [n for n, _ in fingerprinted_tensors(net, [], check.config)]
    compared: list[list[str]] = []
    for step in range(3 * k):
        check.start(step, net, [])
        compared.append(check._pending.names())  # type: ignore[union-attr]
        check.resolve()
    slices = min(k, len(everything))
    for c in range(len(compared) - slices + 1):  # any k consecutive comparisons cover every tensor, once
        window = [n for names in compared[c : c + slices] for n in names]
        assert sorted(window) == sorted(everything)
    for name in everything:  # detection latency: from any comparison, the next one of a tensor is < k away
        seen = [c for c, names in enumerate(compared) if name in names]
        assert all(b - a == slices for a, b in itertools.pairwise(seen)) and seen[0] < slices
    assert check.stats.runs == 3 * k and check.stats.failures == 0
    # the replica is known to agree everywhere at the oldest of the slices' last clean comparisons
    assert check.stats.last_verified_step == 3 * k - slices
    check.check_now(3 * k, net, [])  # on demand: every tensor at once
    assert check.stats.last_verified_step == 3 * k


def test_comparison_walks_parameters_and_names_follow_it(one_rank: None) -> None:
    """The comparison digests ``module.parameters()`` (torch's own walk):
    pre-order, a shared module or tied weight once, a ``None`` parameter skipped; a comparison's
    names are ``named_parameters``', and a tensor replaced since the comparison is named by index."""
    shared = nn.Linear(3, 3)
    net = nn.Sequential(nn.Linear(4, 3, bias=False), shared, nn.ModuleList([shared, nn.Linear(3, 2)]),
                        nn.Sequential(nn.LayerNorm(2), nn.Identity()), nn.Linear(2, 4))  # fmt: skip
    net[4].weight = net[0].weight  # tied (4 x 3)
    net.extra = nn.Parameter(torch.ones(1))  # registered on the root after its children
    check = WeightFingerprint(FingerprintConfig())
    check.start(0, net, [])
    names = check._pending.names()  # type: ignore[union-attr]
    assert names == [n for n, _ in fingerprinted_tensors(net, [], FingerprintConfig())] and "param:extra" in names
    check.resolve()
    check.start(1, net, [])
    net[1].bias = nn.Parameter(torch.zeros(3))  # replaced after the comparison started
    assert check._pending.names() == [f"tensor {i}" for i in range(len(names))]  # type: ignore[union-attr]
    check.resolve()


def test_the_setting_reaches_the_check_and_is_validated() -> None:
    settings, origin = resolve(fingerprint_rolling="4")
    fingerprint = settings.fingerprint()
    assert fingerprint is not None and fingerprint.rolling == 4 and origin["fingerprint_rolling"] == "keyword arguments"
    assert resolve()[0].fingerprint().rolling == 1  # type: ignore[union-attr]
    with pytest.raises(SDCConfigError, match="fingerprint_rolling"):
        resolve(fingerprint_rolling=0)
    with pytest.raises(SDCConfigError, match="fingerprint_rolling"):  # checked also while the check is off
        resolve(fingerprint_rolling=-1, fingerprint_every_n_steps=0)


def test_the_accelerate_routes_carry_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from accelerate_sdc import config
    from accelerate_sdc.cli import main

    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("ACCELERATE_SDC_FINGERPRINT_ROLLING", "5")
    assert config.resolve()[0].fingerprint().rolling == 5  # type: ignore[union-attr]
    monkeypatch.setenv("ACCELERATE_SDC_FINGERPRINT_ROLLING", "0")
    with pytest.raises(SDCConfigError, match="ACCELERATE_SDC_FINGERPRINT_ROLLING"):
        config.resolve()
    monkeypatch.delenv("ACCELERATE_SDC_FINGERPRINT_ROLLING")
    monkeypatch.delenv("ACCELERATE_SDC_CONFIG_FILE")
    path = tmp_path / "sdc_config.yaml"
    assert main(["config", "--config_file", str(path), "--fingerprint_rolling", "4"]) == 0
    assert yaml.safe_load(path.read_text())["fingerprint_rolling"] == 4


def test_lightning_callback_argument() -> None:
    from lightning_sdc import WeightFingerprintCheck

    assert WeightFingerprintCheck(rolling=3)._core.config.rolling == 3
    with pytest.raises(ValueError, match="WeightFingerprintCheck: rolling must be"):
        WeightFingerprintCheck(rolling=0)
    plain, rolled = WeightFingerprintCheck(), WeightFingerprintCheck(rolling=2)
    assert "rolling" not in plain.state_key and "'rolling': 2" in rolled.state_key  # rolling=1: the key as before


@pytest.mark.slow  # about 40 s on a loaded 2-core machine: python -m pytest -m slow tests/test_fingerprint_rolling.py
def test_three_ranks_name_a_flip_outside_the_slice_within_k_comparisons(tmp_path: Path) -> None:
    torchrun(SCRIPT, tmp_path, "clean,flip,flip_every,flip_end", 3, timeout=420)
    clean = results(tmp_path, "clean", 3)
    assert all(r["error"] is None for r in clean), clean[0]["error"]
    assert all(r["stats"]["failures"] == 0 and r["stats"]["runs"] == 7 for r in clean)  # 6 rolling, 1 at the end
    errors = {}
    for name, step in (("flip", 3), ("flip_every", 1), ("flip_end", 5)):
        rows = results(tmp_path, name, 3)
        assert rows[1]["fired"], name
        errs = [r["error"] for r in rows]
        assert all(e is not None for e in errs), (name, errs)
        assert len({(e["type"], e["rank"], e["step"]) for e in errs}) == 1, (name, errs)  # every rank alike
        err = errors[name] = errs[0]
        assert (err["type"], err["rank"], err["step"]) == ("FingerprintMismatchError", 1, step), (name, err)
        assert "body.0.weight" in err["message"], err["message"]
    # flipped after update 0, whose comparison took slice 0 already: slices 1 and 2 next, then slice 0
    assert errors["flip"]["details"]["rolling_slice"] == {"slice": 0, "slices": 3, "tensors": 1}
    # (step 3: 3 comparisons after the flip, the bound k; without rolling, step 1)
    assert all("rolling_slice" not in errors[name]["details"] for name in ("flip_every", "flip_end"))


def test_fingerprinted_tensors_leave_out_each_ranks_own_and_keep_other_optimizer_state() -> None:
    """``exclude`` (DDP's ``parameters_to_ignore``) drops those parameters, buffers and their optimizer state; the
    state of a parameter outside the module is still compared (named ``?``)."""
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    net[0].register_buffer("scale", torch.ones(2))
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([*net.parameters(), extra])
    (net(torch.randn(4, 2)).sum() + extra.sum()).backward()
    opt.step()
    config = FingerprintConfig(include_buffers=True, include_optimizer_state=True)
    every = [n for n, _ in fingerprinted_tensors(net, [opt], config)]
    own = frozenset({"2.weight", "2.bias", "0.scale"})
    kept = [n for n, _ in fingerprinted_tensors(net, [opt], config, own)]
    assert [n for n in every if n not in kept] == [
        "param:2.weight", "param:2.bias", "buffer:0.scale", *(f"optimizer0:2.{p}:{k}" for p in ("weight", "bias")
                                           for k in ("exp_avg", "exp_avg_sq", "step"))]  # fmt: skip
    assert "optimizer0:?:exp_avg" in kept and "param:0.weight" in kept
