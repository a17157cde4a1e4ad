"""Peers are not trusted: what ranks send each other cannot run code, sizes are agreed before any
buffer is allocated, and every failure is a ``PayloadError`` on every rank within a bounded time.

The codec is tested in this process; the exchange with 3 real gloo ranks (torchrun), one of which
sends a pickle that runs code, bytes that are no payload, or a size it does not keep."""

from __future__ import annotations

import collections
import contextlib
import enum
import io
import random
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from conftest import results, torchrun, worker_env

from sdc_core.dist.payload import NotEncodable, PayloadError, decode, encode, max_payload_bytes, pickle_allowed
from sdc_core.dist.payload_checks import check_replay_payload, check_update_payload
from sdc_core.dist.topology import TRANSFER_ERROR, RankFacts
from sdc_core.replay.compare import Digest
from sdc_core.replay.state import MicroBatch, StepState, TensorRef

SCRIPT = Path(__file__).with_name("payload_scenarios.py")
WORLD = 3
HOSTILE = 1


class Pair(NamedTuple):
    x: torch.Tensor
    n: int


class Mode(enum.IntEnum):
    TRAIN = 1


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and torch.equal(a.detach(), b.detach()))  # fmt: skip
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple | collections.deque):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if dataclass_like(a):
        return type(a) is type(b) and all(same(getattr(a, k), getattr(b, k)) for k in vars(a))
    return type(a) is type(b) and a == b


def dataclass_like(a: Any) -> bool:
    return type(a).__module__.startswith("sdc_core.") and hasattr(a, "__dataclass_fields__")


def sample() -> dict[Any, Any]:
    """What replay batches, captured state and the checks' gathers hold."""
    z = torch.zeros(3, dtype=torch.float64)
    state = StepState({"buffer:m": torch.ones(2), "param:big": TensorRef(7, 1 << 21)},
                      {"": {"count": 3, "hist": collections.deque([1.0, 2.0], maxlen=4), "mode": Mode.TRAIN}},
                      user={"ema": torch.full((2,), 0.5)}, has_user=True, live=("a",), nbytes=8)  # fmt: skip
    micro = MicroBatch(batch=(torch.randn(2, 3), {"ids": torch.arange(4)}), batch_idx=2, cpu_rng=torch.get_rng_state(),
                       py_rng=random.getstate(), np_rng=np.random.get_state(), state=state)  # fmt: skip
    return {
        "scalars": (None, True, 3, -(2**70), 1.5, float("nan"), float("inf"), "tëxt\udc80", 1 + 2j, b"\x00b",
                    bytearray(b"c")),
        (0, 1): [{1, 2}, frozenset({"a"}), collections.OrderedDict(b=1), collections.defaultdict(list, {"k": [1]})],
        "tensors": [torch.randn(4, 5).t(), torch.tensor(2.5), torch.empty(0, 3), torch.tensor([True, False]),
                    torch.randn(3).bfloat16(), torch.randn(2, dtype=torch.complex64), torch.ones(2, requires_grad=True),
                    torch.nn.Parameter(torch.ones(3)), torch.Size([2, 3]), torch.float16, torch.device("cpu")],
        "numpy": [np.arange(6, dtype=np.uint32).reshape(2, 3), np.float32(1.25), np.bool_(True)],
        "named": Pair(torch.ones(1), 4),
        "payload": {"micro": [micro], "digest": Digest(0.5, z, z.clone(), torch.arange(3), z + 1)},
        "facts": RankFacts(0, "node-a", 0, 0, "cpu", None, (("torch", "2.13"),)),
    }  # fmt: skip


def test_every_kind_of_value_travels_unchanged() -> None:
    obj = sample()
    back = decode(encode(obj))
    assert same(obj, back)
    assert back[(0, 1)][3].default_factory is list
    assert back["payload"]["micro"][0].state.tensors["param:big"].digest == 7
    check_replay_payload(back["payload"])


def test_nothing_is_unpickled_unless_the_receiver_allows_it(tmp_path: Path) -> None:
    evil = {"batch": [Evil(tmp_path / "ran")]}
    with pytest.raises(NotEncodable, match=r"payload\['batch'\]\[0\]: a .*Evil does not travel without pickling"):
        encode(evil)
    pickled = encode(evil, allow_pickle=True)  # a sender may pickle; the receiver decides
    with pytest.raises(PayloadError, match="pickled object"):
        decode(pickled)
    assert not (tmp_path / "ran").exists()
    decode(pickled, allow_pickle=True)
    assert (tmp_path / "ran").exists()  # what opting in means: only when every rank is trusted
    buf = io.BytesIO()
    torch.save(evil, buf)  # what the exchange used to send
    with pytest.raises(PayloadError, match="not an sdc-checks payload"):
        decode(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))


def forged(tree: Any, blobs: list[Any] | None = None, data: bytes = b"") -> torch.Tensor:
    """A payload with a hand-written header (what a hostile rank can send)."""
    import json

    from sdc_core.dist.payload import MAGIC

    header = json.dumps({"tree": tree, "blobs": blobs or []}).encode()
    raw = MAGIC + len(header).to_bytes(8, "little") + header
    raw += b"\0" * (-len(raw) % 64) + data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize(("tree", "blobs", "data", "why"), [
    ({"t": "os.system"}, None, b"", "unknown tag"),
    ({"t": "ntuple", "cls": "os:system", "v": []}, None, b"", "does not exist|not a named tuple"),
    ({"t": "ntuple", "cls": "never_imported_module:X", "v": []}, None, b"", "not imported"),
    ({"t": "dataclass", "cls": "collections:Counter", "f": {}}, None, b"", "not one of sdc_core's"),
    ({"t": "dataclass", "cls": "sdc_core.replay.state:TensorRef", "f": {"digest": "x", "nbytes": 1}}, None, b"",
     "not <class 'int'>"),
    ({"t": "dataclass", "cls": "sdc_core.replay.state:TensorRef", "f": {"digest": 1}}, None, b"", "has fields"),
    ({"t": "mapping", "cls": "builtins:dict", "k": [], "v": []}, None, b"", "not one that travels"),
    ({"t": "tensor", "i": 0}, [["tensor", "object", [1], 0, 8]], b"\0" * 8, "dtype"),
    ({"t": "tensor", "i": 0}, [["tensor", "float32", [1 << 40], 0, 4]], b"\0" * 4, "needs"),
    ({"t": "tensor", "i": 0}, [["tensor", "float32", [-1], 0, 4]], b"\0" * 4, "not a size"),
    ({"t": "tensor", "i": 0}, [["tensor", "float32", [2], 0, 8]], b"\0" * 4, "runs past the end"),
    ({"t": "list", "v": [{"t": "tensor", "i": 0}, {"t": "tensor", "i": 0}]}, [["tensor", "uint8", [1], 0, 1]], b"\1",
     "twice"),
    ({"t": "ndarray", "i": 0}, [["numpy", "|O", [1], 0, 8]], b"\0" * 8, "dtype"),
    ({"t": "pickle", "i": 0}, [["pickle", 0, 1]], b".", "pickled object"),
    ({"t": "dict", "k": [{"t": "list", "v": []}], "v": [1]}, None, b"", "cannot be rebuilt"),
    ({"t": "dict", "k": [1, 2], "v": [1]}, None, b"", "2 keys and 1 values"),
    ({"t": "device", "name": "cuda:0; import os"}, None, b"", "device"),
    ([1, 2], None, b"", "not a tagged value"),
])  # fmt: skip
def test_a_forged_payload_is_refused_with_a_reason(tree: Any, blobs: Any, data: bytes, why: str) -> None:
    with pytest.raises(PayloadError, match=why):
        decode(forged(tree, blobs, data))


def test_damaged_payloads_raise_payload_error_only() -> None:
    """Any byte flipped or cut: either the value comes back or PayloadError, never another error."""
    good = encode(sample()).clone()
    gen = torch.Generator().manual_seed(0)
    for i in range(300):
        bad = good.clone()
        if i % 3 == 0:
            bad = bad[: int(torch.randint(good.numel(), (1,), generator=gen))]
        else:
            pos = torch.randint(min(good.numel(), 4000), (3,), generator=gen)
            bad[pos] ^= torch.randint(1, 256, (3,), generator=gen, dtype=torch.uint8)
        with contextlib.suppress(PayloadError):
            decode(bad)
    nested = forged({"t": "list", "v": [{"t": "list", "v": []}]})
    deep = {"t": "list", "v": []}
    for _ in range(300):
        deep = {"t": "list", "v": [deep]}
    for payload in (nested, forged(deep), torch.zeros(3, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)):
        with contextlib.suppress(PayloadError):
            decode(payload)


def test_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert max_payload_bytes() == 4096 << 20 and not pickle_allowed()
    monkeypatch.setenv("SDC_MAX_PAYLOAD_MB", "16")
    monkeypatch.setenv("SDC_ALLOW_PICKLED_BATCHES", "true")
    assert max_payload_bytes() == 16 << 20 and pickle_allowed() and not pickle_allowed(False)
    monkeypatch.setenv("SDC_MAX_PAYLOAD_MB", "lots")
    with pytest.raises(ValueError, match="SDC_MAX_PAYLOAD_MB"):
        max_payload_bytes()
    monkeypatch.setenv("SDC_ALLOW_PICKLED_BATCHES", "maybe")
    with pytest.raises(ValueError, match="SDC_ALLOW_PICKLED_BATCHES"):
        pickle_allowed()


def test_payload_checks_refuse_what_the_callers_cannot_use() -> None:
    z = torch.zeros(2, dtype=torch.float64)
    good = Digest(0.0, z, z, torch.zeros(2, dtype=torch.int64), z)
    check_replay_payload({"replay": good})
    check_replay_payload({TRANSFER_ERROR: "why"})
    short = Digest(0.0, z, z[:1], torch.zeros(2, dtype=torch.int64), z)
    for bad in ({"micro": []}, {"digest": good, "x": 1}, {"replay": Digest(0.0, z, z, z, z)}, [1], {"replay": short},
                {TRANSFER_ERROR: 3}):  # fmt: skip
        with pytest.raises(ValueError):
            check_replay_payload(bad)
    item = {"name": "w", "param": torch.ones(3), "grad": torch.ones(3), "state": {"step": torch.tensor(1.0)}}
    check_update_payload({"groups": [{"hyper": {"lr": 0.1}, "items": [item]}], "after": [5]})
    check_update_payload({"skipped": True})
    for bad in ({"groups": [{"hyper": {}, "items": [item]}], "after": []},
                {"groups": [{"hyper": {}, "items": [item | {"grad": torch.ones(2)}]}], "after": [1]},
                {"skipped": True, "groups": []}):  # fmt: skip
        with pytest.raises(ValueError):
            check_update_payload(bad)


# -- 3 real gloo ranks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("payload_peers")
    env = worker_env() | {"PG_TIMEOUT": "60"}
    env["PYTHONPATH"] = str(SCRIPT.parent) + ":" + env["PYTHONPATH"]
    torchrun(SCRIPT, out, None, WORLD, timeout=240, env=env)
    return out


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_clean_exchange_and_gather_deliver_batches_without_pickle(peers: Path) -> None:
    for r, row in enumerate(results(peers, "clean", WORLD)):
        assert row["error"] is None, row["message"]
        got = row["result"]
        src = (r - 1) % WORLD
        assert got["src"] == src and got["x"] == [[float(src)] * 3] * 2 and got["y"] == [src] and got["idx"] == src
        assert got["rest"] == ["text", [1.5, None]] and got["digest_fps"] == [0, 1, 2]
        assert got["gathered"] == [[[[[q, 1], [True, False]]], f"rank {q}"] for q in range(WORLD)]
        assert got["ranks"] == list(range(WORLD))


@pytest.mark.parametrize(("scenario", "says"), [
    ("malicious_pickle", "rank 2 refused the payload of rank 1: it holds a pickled object"),
    ("foreign_bytes", "rank 2 refused the payload of rank 1: it is not an sdc-checks payload"),
    ("huge_size", "rank 1 announced 1125899906842624 bytes for rank 2"),
    ("short_size", "rank 2 refused the payload of rank 1: data entry"),
    ("gather_huge_size", "rank 1 announced 1125899906842624 bytes"),
    ("gather_pickle", "rank 1 could not send its object"),
    ("bad_shape", "rank 2 refused the payload of rank 1: a replay payload has the keys ['micro']"),
    ("update_bad_payload", "rank 2 refused the payload of rank 1: an update payload's gradient of weight does not "
                           "match its parameter"),
])  # fmt: skip
@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_a_hostile_peer_gives_every_rank_the_same_typed_error_at_once(peers: Path, scenario: str, says: str) -> None:
    rows = results(peers, scenario, WORLD)
    assert all(r["error"] == "PayloadError" for r in rows), [(r["error"], r["message"][:200]) for r in rows]
    assert len({r["message"] for r in rows}) == 1 and says in rows[0]["message"]
    assert all(r["seconds"] < 20 for r in rows)  # the process group timeout is 60 s: nobody waited for it
    assert not any(r["ran_code"] for r in rows)  # no code from a peer ran anywhere


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_the_update_audit_accepts_honest_payloads(peers: Path) -> None:
    for row in results(peers, "update_clean", WORLD):
        assert row["error"] is None, row["message"]
        assert row["result"] == {"runs": 2, "verified": 1}


@pytest.mark.slow  # a multi-process launch: the default run stays under 10 minutes
def test_an_honest_batch_that_would_need_pickling_or_is_too_large_arrives_as_a_message(peers: Path) -> None:
    rows = results(peers, "unencodable", WORLD)
    assert all(r["error"] is None and not r["ran_code"] for r in rows)
    said = rows[(HOSTILE + 1) % WORLD]["result"][str(HOSTILE)][TRANSFER_ERROR]
    assert "Evil does not travel without pickling" in said and "allow_pickled_batches" in said
    for row in results(peers, "over_limit", WORLD):
        assert row["error"] is None and row["result"] == {str(k): [TRANSFER_ERROR] for k in row["result"]}
