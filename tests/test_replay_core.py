"""Unit tests of the replay's state capture, calibration, digest and collective guard (one process)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from sdc_core.replay.compare import assemble, compare_raw, digest_row, disagree, grad_digest
from sdc_core.replay.guard import CollectiveInReplay, forbid_collectives
from sdc_core.replay.rerun import replay_gradients
from sdc_core.replay.ring import ReplayConfig, RingReplay
from sdc_core.replay.rng import all_rng  # tests build micro-batches
from sdc_core.replay.state import MicroBatch, StateCapture, TensorRef


class Opaque:
    def __init__(self) -> None:
        self.value = 1


class Stepper(nn.Module):
    """Reads and changes state besides its input: a hidden tensor, a counter, containers, a frozen
    layer updated in place, a buffer, RNG of Python, NumPy and torch, an opaque object."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("seen", torch.zeros(()))
        self.hidden = torch.zeros(4)
        self.count = 0
        self.history: list[float] = []
        self.table = {"scale": 1.0}
        self.noise = np.zeros(2)
        self.opaque = Opaque()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        self.history.append(float(self.count))
        self.seen += 1
        with torch.no_grad():
            self.frozen.weight.mul_(0.5)
        self.hidden = self.hidden + 1.0
        r = random.random() + float(np.random.rand()) + float(torch.rand(()))
        out = self.body(x) + self.frozen(x) + self.hidden * self.count * self.table["scale"] * r
        return out.pow(2).mean()


def names(m: nn.Module) -> list[str]:
    return [n for n, p in m.named_parameters() if p.requires_grad]


def snapshot(m: Stepper) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in m.named_parameters()},
        "seen": m.seen.clone(),
        "hidden": m.hidden.clone(),
        "count": m.count,
        "history": list(m.history),
        "table": dict(m.table),
        "opaque": m.opaque,
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        and torch.equal(a["seen"], b["seen"])
        and torch.equal(a["hidden"], b["hidden"])
        and (a["count"], a["history"], a["table"]) == (b["count"], b["history"], b["table"])
        and a["opaque"] is b["opaque"]
        and torch.equal(a["rng"][0], b["rng"][0])
        and a["rng"][1] == b["rng"][1]
        and np.array_equal(a["rng"][2], b["rng"][2])
    )


def run_owner(m: Stepper, x: torch.Tensor, capture: StateCapture) -> tuple[MicroBatch, torch.Tensor, dict]:
    """What the owner does on an audited micro-batch: record, then its real step."""
    mb = MicroBatch(x, 0, *all_rng(None), state=capture.capture())
    loss = m(x)
    grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
    return mb, loss.detach(), dict(zip(names(m), grads, strict=True))


def test_replay_reproduces_the_owner_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    owner = Stepper()
    replayer = Stepper()
    replayer.load_state_dict(owner.state_dict())
    x = torch.randn(3, 4)
    for _ in range(2):  # the replayer has moved on: its own state differs from the owner's
        replayer(torch.randn(3, 4))
    owner(torch.randn(3, 4))
    cap_o = StateCapture(owner, names(owner))
    mb, loss, grads = run_owner(owner, x, cap_o)
    before = snapshot(replayer)
    cap_r = StateCapture(replayer, names(replayer))
    with torch.no_grad():  # same trainable weights, as in data parallelism
        for p, q in zip(replayer.body.parameters(), owner.body.parameters(), strict=True):
            p.copy_(q)
    before = snapshot(replayer)
    r_loss, r_grads = replay_gradients(replayer, names(replayer), [mb], lambda b, _i: replayer(b), capture=cap_r)
    assert torch.equal(r_loss.float(), loss.double().float())
    assert all(torch.equal(r_grads[n], grads[n]) for n in grads)
    assert same(before, snapshot(replayer))  # attributes, frozen weights, buffer, RNG: all its own again
    # replaying twice gives the same result (the captured state is not consumed)
    again, _ = replay_gradients(replayer, names(replayer), [mb], lambda b, _i: replayer(b), capture=cap_r)
    assert torch.equal(again, r_loss)


def test_attributes_added_or_rebound_by_a_replay_are_undone() -> None:
    m = Stepper()
    m.outputs = [object()]  # not plain: not captured, yet an append in the replay must not stay
    cap = StateCapture(m, names(m))
    state = cap.capture()
    assert "outputs" not in state.attrs[""] and state.attrs[""]["count"] == 0
    kept = m.outputs
    with cap.applied(state):
        m.new_attr = 5
        m.opaque = Opaque()
        m.history.append(99.0)
        m.outputs.append(1)
    assert not hasattr(m, "new_attr") and m.history == [] and isinstance(m.opaque, Opaque)
    assert m.outputs is kept and len(kept) == 1


def test_explicit_hook_gets_private_copies_and_restores_the_replayers_state() -> None:
    m = Stepper()
    store = {"v": torch.tensor(1.0)}
    loads: list[float] = []

    def get() -> torch.Tensor:
        return store["v"].clone()

    def load(v: torch.Tensor) -> None:
        loads.append(float(v))
        store["v"] = v

    cap = StateCapture(m, names(m), get_state=get, load_state=load)
    state = cap.capture()
    store["v"] = torch.tensor(7.0)
    with cap.applied(state):
        assert float(store["v"]) == 1.0
        store["v"] += 10  # in place on the loaded copy
    assert float(state.user) == 1.0 and float(store["v"]) == 7.0 and loads == [1.0, 7.0]
    with pytest.raises(ValueError, match="together"):
        StateCapture(m, names(m), get_state=get)


def test_over_budget_tensors_are_read_live_and_guarded() -> None:
    m = Stepper()
    cap = StateCapture(m, names(m), max_state_mb=0)
    state = cap.capture()
    assert "param:frozen.weight" in state.live and not state.tensors
    with pytest.raises(RuntimeError, match="in place"), cap.applied(state), torch.no_grad():
        m.frozen.weight.mul_(2)


def test_large_frozen_tensors_travel_by_digest_and_must_match() -> None:
    m = nn.Linear(600, 600)  # 1.4 MiB weight
    m.requires_grad_(False)
    cap = StateCapture(m, [])
    state = cap.capture()
    sent = StateCapture.for_transfer(state)
    assert isinstance(sent.tensors["param:weight"], TensorRef) and isinstance(sent.tensors["param:bias"], torch.Tensor)
    resolved = StateCapture.resolve(sent, [state])
    assert torch.equal(resolved.tensors["param:weight"], m.weight)
    other = cap.capture()
    other.tensors["param:weight"] = other.tensors["param:weight"] + 1
    with pytest.raises(RuntimeError, match=r"param:weight \(1.4 MiB\) differs between the owner and the replayer"):
        StateCapture.resolve(sent, [other])


def test_collectives_are_refused_inside_and_restored_after() -> None:
    original = dist.all_reduce
    with forbid_collectives():
        with pytest.raises(CollectiveInReplay, match=r"torch\.distributed\.all_reduce"):
            dist.all_reduce(torch.zeros(1))
        with pytest.raises(CollectiveInReplay):
            torch.distributed.distributed_c10d.barrier()
    assert dist.all_reduce is original


def test_digest_is_read_with_one_device_to_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = {f"p{i}": torch.randn(5) for i in range(40)}
    rows = {n: digest_row(g) for n, g in grads.items()}
    calls = []
    real = torch.Tensor.cpu

    def counting(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        calls.append(self.shape)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    d = assemble([*grads, "missing"], rows, torch.tensor(2.5, dtype=torch.float64))
    assert len(calls) == 1
    monkeypatch.undo()
    assert d.loss == 2.5 and d.sums.shape == (41,) and d.fps.dtype == torch.int64 and d.fps[-1] == 0
    same = grad_digest([*grads, "missing"], grads, 2.5)
    assert torch.equal(d.fps, same.fps) and torch.equal(d.sums, same.sums) and torch.equal(d.norms, same.norms)


def test_compare_raw_and_disagree() -> None:
    names = ["a"]
    g = {"a": torch.ones(10)}
    a = grad_digest(names, g, 1.0)
    b = grad_digest(names, {"a": torch.ones(10) * (1 + 1e-6)}, 1.0)
    assert compare_raw(a, a, names) == (True, 0.0, "")
    exact, diff, where = compare_raw(a, b, names)
    assert not exact and 0 < diff < 1e-5 and where == "a"
    assert disagree(exact, diff, 0.0) and not disagree(exact, diff, 1e-4) and disagree(exact, diff, 1e-7)
    assert disagree(False, math.nan, 1e-3)


def test_calibration_takes_the_lower_median_and_is_capped() -> None:
    def calibrated(*rounds: list[float], exact: object = "auto", rtol: float = 1e-3) -> float:
        r = RingReplay(ReplayConfig(exact=exact, rtol=rtol))
        for diffs in rounds:
            r.calibration.calibrate(diffs, r.config, r.stats)
        return r.tolerance

    assert calibrated([0.0, 0.0, 0.3]) == 0.0  # one (faulty) rank cannot loosen anything
    assert calibrated([0.0, 0.3]) == 0.0  # two ranks: the lower one counts
    assert calibrated([1e-7, 2e-7, 0.5]) == pytest.approx(2e-5)
    assert calibrated([0.1, 0.1, 0.1]) == 1e-3  # never above rtol
    assert calibrated([1e-7, 1e-7, 1e-7], [0.0, 0.0, 0.0]) == pytest.approx(1e-5)  # raised only, never lowered
    assert calibrated([0.1, 0.1], exact=True) == 0.0 and calibrated([0.1, 0.1], exact=False, rtol=0.01) == 0.01


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"exact": "yes"}, "exact"), ({"exact": 1}, "exact"), ({"on_unreplayable": "ignore"}, "on_unreplayable"),
     ({"max_state_mb": -1}, "max_state_mb"), ({"max_state_mb": True}, "max_state_mb")],
)  # fmt: skip
def test_replay_config_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**kwargs)


def test_replay_config_defaults() -> None:
    c = ReplayConfig()
    assert (c.exact, c.on_unreplayable, c.rtol) == ("auto", "raise", 1e-3)
    assert ReplayConfig(exact=True).exact is True and ReplayConfig(exact=False).exact is False


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("AUTO", "auto"), (True, True), ("0", False)])
def test_accelerate_replay_exact_takes_the_same_values(monkeypatch: pytest.MonkeyPatch, value: object,
                                                       expected: object) -> None:  # fmt: skip
    import os

    from accelerate_sdc.config import SDCConfigError, resolve

    monkeypatch.setenv("ACCELERATE_SDC_CONFIG_FILE", os.devnull)
    assert resolve(replay_exact=value)[0].replay().exact == expected
    monkeypatch.setenv("ACCELERATE_SDC_REPLAY_EXACT", str(value))
    assert resolve()[0].replay().exact == expected
    assert resolve()[0].replay().on_unreplayable == "raise"
    with pytest.raises(SDCConfigError, match="replay_on_unreplayable"):
        resolve(replay_on_unreplayable="ignore")


def _self_assignments(fn: object) -> tuple[set[str], set[str]]:
    """The attributes ``fn`` assigns on ``self`` (``self.x = ...``, ``self.x += ...``, ``setattr(self, ...)``)
    and the methods it calls on ``self``, from its source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    assigned, called = set(), set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])  # fmt: skip
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                assigned.add(t.attr)
        if not isinstance(node, ast.Call):
            continue
        func, first = node.func, node.args[0] if node.args else None
        if isinstance(func, ast.Name) and func.id == "setattr" and isinstance(first, ast.Name) and first.id == "self":
            assigned.add("<setattr>")
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            called.add(func.attr)
    return assigned, called


def test_torch_nn_forwards_rebind_no_attribute_so_the_capture_leaves_them_out() -> None:
    """The capture leaves out the plain attributes of torch.nn's own module classes
    (``state._configuration_only``): sound only while their forwards, and the methods those call
    on the module, rebind no attribute. Checked on every such class of the installed torch; the
    one exception, RNNs' lists of their own parameters (not plain values: never captured), named.
    A custom module's attributes are still captured."""
    import importlib
    import pkgutil

    from sdc_core.replay.state import _configuration_only

    allowed = {"_flat_weights", "_flat_weight_refs"}  # RNNBase._init_flat_weights: parameters and weakrefs
    classes = []
    for info in pkgutil.iter_modules(nn.modules.__path__):
        mod = importlib.import_module(f"torch.nn.modules.{info.name}")
        classes += [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, nn.Module)
                    and c.__module__ == mod.__name__ and c is not nn.Module]  # fmt: skip
    assert len(classes) > 100 and all(_configuration_only(c) for c in classes)
    for cls in classes:
        if cls.forward is nn.Module.forward:
            continue
        seen, todo = set(), ["forward"]
        while todo:
            name = todo.pop()
            fn = getattr(cls, name, None)
            own = getattr(fn, "__module__", "").startswith("torch.nn.modules.")  # not nn.Module's own machinery
            if name in seen or not callable(fn) or not own:
                continue
            seen.add(name)
            assigned, called = _self_assignments(fn)
            assert assigned <= allowed, (cls.__name__, name, assigned)
            todo += [c for c in called if hasattr(cls, c) and callable(getattr(cls, c))]
    assert not _configuration_only(nn.Module) and not _configuration_only(Stepper)
    assert StateCapture(Stepper(), names(Stepper())).capture().attrs[""]["count"] == 0


def test_the_capture_walks_again_whenever_the_module_tree_changed() -> None:
    """A capture reuses its last walk of the module tree while no module changed its class,
    children, parameters or buffers' names (``state._Walk``); each change below must show in the
    next capture exactly as a first walk of the changed tree (a fresh ``StateCapture``) sees it:
    tied weights once, frozen parameters and buffers cloned with their current values."""
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    m[0].weight.requires_grad_(False)
    trainable = ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    cap = StateCapture(m, trainable)

    def same_as_a_first_walk() -> dict[str, torch.Tensor]:
        a, b = cap.capture(), StateCapture(m, trainable).capture()
        assert list(a.tensors) == list(b.tensors) and a.attrs.keys() == b.attrs.keys() and a.nbytes == b.nbytes
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
        return a.tensors

    first = same_as_a_first_walk()
    assert list(first) == ["param:0.weight", "buffer:1.running_mean", "buffer:1.running_var",
                           "buffer:1.num_batches_tracked"]  # fmt: skip
    walk = cap._walk
    assert cap.capture() and cap._walk is walk  # nothing changed: the same walk
    m[1].running_mean = torch.full((4,), 3.0)  # a buffer rebound: read at each capture, no new walk
    assert torch.equal(cap.capture().tensors["buffer:1.running_mean"], torch.full((4,), 3.0)) and cap._walk is walk
    m.append(nn.Linear(4, 4))  # a new child (trainable by name)
    assert "param:2.weight" not in same_as_a_first_walk() and cap._walk is not walk
    m[2].register_buffer("scale", torch.ones(2))  # a new buffer on a leaf
    assert "buffer:2.scale" in same_as_a_first_walk()
    m[0].weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)  # a frozen parameter replaced
    assert torch.equal(same_as_a_first_walk()["param:0.weight"], torch.zeros(4, 4))
    m[0]._parameters["weight"] = nn.Parameter(torch.ones(4, 4))  # replaced behind Module's back: same names
    assert torch.equal(same_as_a_first_walk()["param:0.weight"], torch.ones(4, 4))
    m._modules["2"] = nn.BatchNorm1d(4)  # a child replaced behind Module's back: same names
    assert "buffer:2.running_var" in same_as_a_first_walk()
    m[2].weight = m[0].weight  # tied to a frozen parameter seen first: captured once, under its first name
    assert "param:2.weight" not in same_as_a_first_walk()
    m[2].__class__ = type("Custom", (nn.BatchNorm1d,), {})  # no longer torch.nn's own: attributes read
    m[2].note = "x"
    assert cap.capture().attrs["2"]["note"] == "x"


def test_noise_widens_the_tolerance_only_when_seen_on_two_ranks_at_two_audits() -> None:
    """Issue 52: one unexplained difference (a transient fault, or one rank again and again) buys no tolerance."""
    r = RingReplay(ReplayConfig(exact="auto", rtol=1e-3))
    cal, config, stats = r.calibration, r.config, r.stats
    cal.calibrate([0.0, 0.0, 0.0], config, stats)  # the calibration rounds: bit for bit
    cal.noise_seen(3, {1: 2e-6}, config, stats)
    assert r.tolerance == 0.0  # one look
    cal.noise_seen(4, {1: 3e-6}, config, stats)
    cal.noise_seen(9, {1: 5e-6}, config, stats)
    assert r.tolerance == 0.0  # the same rank at every audit: still no evidence of noise
    cal.noise_seen(9, {2: 1e-6}, config, stats)
    assert r.tolerance == pytest.approx(1e-4)  # two ranks at two audits: the smaller level they share, x 100
    cal.noise_seen(12, {0: 1.0, 2: 1.0}, config, stats)
    assert r.tolerance == pytest.approx(5e-4)  # two ranks at one audit: the level seen at a second one counts
    cal.noise_seen(13, {1: 1.0}, config, stats)
    assert r.tolerance == 1e-3  # never above rtol
