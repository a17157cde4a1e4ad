"""No replay code reads a tensor before its copy has landed (one process, CPU).

A ``.to(..., non_blocking=True)`` from a GPU returns at once into pinned host memory; reading the
result (a stack, ``.tolist()``, a collective) before a sync reads stale bytes. On an H200 this gave
a false SDC verdict. The replay modules therefore copy with blocking copies where the result is
read at once. These tests record every copy the replay's digest, transfer and re-run paths make
and fail if one of them asks for ``non_blocking=True``; on CPU they also check the values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from sdc_core.replay.compare import assemble, digest_row, grad_digest
from sdc_core.replay.rerun import replay_gradients
from sdc_core.replay.ring import RingReplay
from sdc_core.replay.rng import all_rng  # tests build micro-batches
from sdc_core.replay.state import MicroBatch, StateCapture, StepState


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, bool]]]:
    """Every ``Tensor.to`` / ``Tensor.copy_`` call as ``(method, non_blocking)``."""
    seen: list[tuple[str, bool]] = []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def flag(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(kwargs.get("non_blocking", False)) or any(a is True for a in args)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(("to", flag(args, kwargs)))
        return real_to(self, *args, **kwargs)

    def copy_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(("copy_", flag(args[1:], kwargs)))
        return real_copy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    yield seen
    monkeypatch.undo()


def test_assemble_copies_blocking_and_reads_the_values(copies: list[tuple[str, bool]]) -> None:
    grads = {f"p{i}": torch.randn(7, dtype=torch.float32 if i % 2 else torch.bfloat16) for i in range(6)}
    rows = {n: digest_row(g) for n, g in grads.items()}
    d = assemble([*grads, "missing"], rows, torch.tensor(1.25, dtype=torch.float32))
    assert copies and not any(nb for _, nb in copies), copies  # the loss at least is converted
    assert d.loss == 1.25 and d.sums[-1] == 0 and d.fps[-1] == 0
    for i, g in enumerate(grads.values()):
        assert d.sums[i] == g.float().sum().double() and d.norms[i] == torch.linalg.vector_norm(g.float()).double()
        assert d.numels[i] == 7


def test_grad_digest_and_record_loss_copy_blocking(copies: list[tuple[str, bool]]) -> None:
    grads = {"a": torch.randn(5), "b": None}
    d = grad_digest(["a", "b"], grads, torch.tensor(2.0))
    core = RingReplay()
    core._armed_step = 0
    core.record_loss(torch.tensor(1.0, dtype=torch.bfloat16))
    core.record_loss(torch.tensor(0.5))
    assert float(core._loss) == 1.5 and d.loss == 2.0
    assert copies and not any(nb for _, nb in copies), copies


def test_state_transfer_and_replay_copy_blocking(copies: list[tuple[str, bool]]) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    m[1].requires_grad_(False)
    m.register_buffer("big", torch.randn(300_000))  # over SEND_BY_DIGEST_BYTES: travels by digest
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    cap = StateCapture(m, names)
    state = cap.capture()
    sent = StateCapture.for_transfer(state)
    assert isinstance(sent, StepState) and not isinstance(sent.tensors["buffer:big"], torch.Tensor)
    resolved = StateCapture.resolve(sent, [state])
    assert resolved is not None and torch.equal(resolved.tensors["buffer:big"], m.big)
    x = torch.randn(3, 4)
    loss, grads = replay_gradients(m, names, [MicroBatch(x, 0, *all_rng(None), state=resolved)],
                                   lambda b, _: m(b).pow(2).mean(), capture=cap)  # fmt: skip
    expected = torch.autograd.grad(m(x).pow(2).mean(), [p for p in m.parameters() if p.requires_grad])
    assert all(torch.equal(grads[n], e) for n, e in zip(names, expected, strict=True)) and float(loss) > 0
    assert copies and not any(nb for _, nb in copies), copies


# -- the replay's gradients are digested as they are produced, never held as a second full set ---


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.side = nn.Linear(16, 16)  # used by the first micro-batch only

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (self.side(x) if use_side else x).pow(2).mean()


def micro(n: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(5)
    return [MicroBatch((torch.randn(4, 16, generator=g), i == 0), i, *all_rng(None)) for i in range(n)]


@pytest.mark.parametrize("n", [1, 3])
def test_each_gradient_is_digested_and_freed_as_it_is_produced(n: int) -> None:
    import weakref

    from sdc_core.replay.rerun import replay_each_gradient

    torch.manual_seed(0)
    m = Deep()
    names = [k for k, _ in m.named_parameters()]
    step = lambda b, _i: m(*b)  # noqa: E731
    loss_full, full = replay_gradients(m, names, micro(n), step)
    alive: list[weakref.ref] = []
    most_alive = 0
    rows = {}

    def consume(name: str, grad: torch.Tensor) -> None:
        nonlocal most_alive
        most_alive = max(most_alive, sum(r() is not None for r in alive))
        alive.append(weakref.ref(grad))
        rows[name] = digest_row(grad)

    loss = replay_each_gradient(m, names, micro(n), step, consume)
    assert sorted(rows) == sorted(full) == sorted(names)  # the side layer's gradient from micro-batch 0 too
    assert most_alive <= 1  # the previous gradient was freed before the next arrived: no full second set
    got, want = assemble(names, rows, loss), grad_digest(names, full, loss_full)
    assert torch.equal(got.fps, want.fps) and torch.equal(got.sums, want.sums) and got.loss == want.loss
    assert all(p.grad is None for p in m.parameters())  # no side effect on .grad
