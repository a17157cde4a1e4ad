"""What a training step reads besides its batch (frozen tensors, buffers, module attributes, the user's
``sdc_replay_state()``): its capture, transfer and restoration for one re-run.

Cost: clones on the state's device (no host sync) within ``max_state_mb`` per audited step (larger tensors are read live
and guarded against in-place change); frozen tensors above ``SEND_BY_DIGEST_BYTES`` travel by digest (one host read per
transfer)."""

from __future__ import annotations

import copy
import functools
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from sdc_core.checks.digest import tensor_digest

SEND_BY_DIGEST_BYTES = 1 << 20  # frozen parameters and buffers above this travel by digest


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_ITEMS = 10_000  # elements of plain Python containers captured per micro-batch


@functools.cache
def _configuration_only(kind: type) -> bool:
    """Whether a module class is one of torch.nn's own (in ``torch.nn.modules``, not bare ``nn.Module``):
    their forwards rebind no attribute (a test checks), so a capture leaves their plain attributes out."""
    return kind is not nn.Module and kind.__module__.startswith("torch.nn.modules.")


class _Skip(Exception):
    """A value that is not plain (or over budget): the capture leaves it out."""


@dataclass
class _Budget:
    bytes_left: int
    items_left: int = _MAX_ITEMS


def _copy_plain(value: Any, budget: _Budget, depth: int = 0) -> Any:
    """A copy of a plain value (tensors cloned on their device); ``_Skip`` for anything else or past the budget."""
    if isinstance(value, _SCALARS):
        return value
    if depth > 6:
        raise _Skip
    budget.items_left -= 1
    if budget.items_left < 0:
        raise _Skip
    kind = type(value)
    if kind in (list, set, frozenset, deque, tuple):  # first: a module's sizes and paddings (cheaper than
        items = [_copy_plain(v, budget, depth + 1) for v in value]  # the isinstance check on Parameter)
        return deque(items, value.maxlen) if kind is deque else kind(items)
    if isinstance(value, nn.Parameter | nn.Module):
        raise _Skip
    if isinstance(value, torch.Tensor):
        size = value.numel() * value.element_size()
        if size > budget.bytes_left:
            raise _Skip
        budget.bytes_left -= size
        return value.detach().clone()
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray | np.generic):
        return value.copy()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return kind(*(_copy_plain(v, budget, depth + 1) for v in value))
    if isinstance(value, dict):
        try:
            out = copy.copy(value)  # keeps the type (OrderedDict, defaultdict's factory, ...)
            out.clear()
        except Exception as err:
            raise _Skip from err
        for k, v in value.items():
            out[_copy_plain(k, budget, depth + 1)] = _copy_plain(v, budget, depth + 1)
        return out
    raise _Skip


def fresh(value: Any, device: torch.device | None) -> Any:
    """A private copy of a captured value for one replay (tensors cloned onto ``device``)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to(device if device is not None else value.device, copy=True)
    kind = type(value)
    if kind is deque:
        return deque((fresh(v, device) for v in value), value.maxlen)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return kind(*(fresh(v, device) for v in value))
    if isinstance(value, list | tuple | set | frozenset):
        return kind(fresh(v, device) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        out.clear()
        for k, v in value.items():
            out[k] = fresh(v, device)
        return out
    return copy.deepcopy(value)


def _first_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple | deque):
        return next((d for v in value if (d := _first_device(v)) is not None), None)
    return None


@dataclass(frozen=True)
class TensorRef:
    """A large frozen parameter or buffer sent by digest: the receiver uses its own capture."""

    digest: int
    nbytes: int


@dataclass
class StepState:
    """The state one micro-batch's step read besides its batch, as its owner had it at the start."""

    tensors: dict[str, Any]  # "param:<name>" (not trained), "buffer:<name>": clones (in transit, or TensorRef)
    attrs: dict[str, dict[str, Any]]  # per module path: copies of its tensor and plain Python attributes
    user: Any = None  # what sdc_replay_state() returned
    has_user: bool = False
    live: tuple[str, ...] = ()  # tensors over the budget, read live by the replay
    nbytes: int = 0


def _frozen(modules: list[tuple[str, nn.Module]], trainable: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters()`` less ``trainable``, as ``"param:<name>"``, from ``named_modules()`` (no new walk)."""
    first: dict[int, tuple[str, torch.Tensor]] = {}  # each parameter once, by its first name
    for path, sub in modules:
        for k, t in sub._parameters.items():
            if t is not None:
                first.setdefault(id(t), (f"{path}.{k}" if path else k, t))
    return [("param:" + name, t) for name, t in first.values() if name not in trainable]


def _signature(modules: list[nn.Module]) -> list[Any]:
    """What a walk of ``modules`` depends on, flat: per module its class, children, parameters (names, then
    ids: ``_Walk.pinned`` keeps them alive) and buffer names, each run after its length."""
    out: list[Any] = []
    put, add = out.append, out.extend
    for sub in modules:
        d = sub.__dict__
        children, params, buffers = d["_modules"], d["_parameters"], d["_buffers"]
        put(type(sub))
        put(len(children))
        add(children.values())
        put(len(params))
        add(params)
        add(map(id, params.values()))
        put(len(buffers))
        add(buffers)
    return out


@dataclass
class _Walk:
    """One walk of the module tree, reused while its ``_signature`` is unchanged."""

    modules: list[nn.Module]
    signature: list[Any]
    pinned: list[Any]  # the parameters the signature names by id (an id is not reused while they live)
    frozen: list[tuple[str, torch.Tensor]]  # ("param:<name>", tensor): fixed by the signature
    buffers: list[tuple[str, nn.Module, str]]  # ("buffer:<name>", its module, key): the tensor read live
    attributed: list[tuple[str, nn.Module]]  # modules not of torch.nn's own classes: attributes read live


class StateCapture:
    """Captures, reproduces and restores the state a training step reads besides its batch (``trainable``
    parameters are replayed on aliases, never captured). Not captured: objects that are neither tensors nor
    plain values (rebinds are undone after a replay, in-place changes are not), globals, iterators, files."""

    def __init__(
        self,
        module: nn.Module,
        trainable: Iterable[str],
        exclude: Iterable[str] = (),
        get_state: Callable[[], Any] | None = None,
        load_state: Callable[[Any], None] | None = None,
        max_state_mb: float = 256.0,
    ) -> None:
        if (get_state is None) != (load_state is None):
            raise ValueError("sdc_replay_state and sdc_load_replay_state must be defined together")
        self.module = module
        self.trainable = frozenset(trainable)
        self.exclude = _MODULE_INTERNALS | frozenset(exclude)
        self.get_state, self.load_state = get_state, load_state
        self.max_bytes = int(max_state_mb * 2**20)
        self._walk: _Walk | None = None

    def _walked(self) -> _Walk:
        """The last walk while the tree kept its shape (about half a walk's cost to check), else a new one."""
        walk = self._walk
        if walk is not None and _signature(walk.modules) == walk.signature:
            return walk
        named = list(self.module.named_modules())
        subs = [sub for _, sub in named]
        buffers = [(f"buffer:{path}.{k}" if path else f"buffer:{k}", sub, k)
                   for path, sub in named for k in sub._buffers]  # fmt: skip
        walk = _Walk(subs, _signature(subs), [list(sub._parameters.values()) for sub in subs],
                     _frozen(named, self.trainable), buffers,
                     [(path, sub) for path, sub in named if not _configuration_only(type(sub))])  # fmt: skip
        self._walk = walk
        return walk

    def capture(self, budget_bytes: int | None = None) -> StepState:
        """The current state (clones, no host sync) within ``budget_bytes``; tensors past it go in ``live``."""
        start = self.max_bytes if budget_bytes is None else max(budget_bytes, 0)
        budget = _Budget(start)
        tensors: dict[str, Any] = {}
        live: list[str] = []
        walk = self._walked()
        buffers: dict[int, tuple[str, torch.Tensor]] = {}  # each buffer once (``named_buffers``)
        for key, sub, k in walk.buffers:
            t = sub._buffers.get(k)
            if t is not None:
                buffers.setdefault(id(t), (key, t))
        for key, t in [*walk.frozen, *buffers.values()]:
            size = t.numel() * t.element_size()
            if size > budget.bytes_left:
                live.append(key)
                continue
            budget.bytes_left -= size
            tensors[key] = t.detach().clone()
        attrs: dict[str, dict[str, Any]] = {}
        exclude, scalars = self.exclude, _SCALARS
        for path, sub in walk.attributed:
            d = vars(sub)
            keys = d.keys() - exclude  # one set operation: most of a module's attributes are its internals
            if not keys:
                continue
            taken: dict[str, Any] = {}
            for k in sorted(keys):
                v = d[k]
                if type(v) in scalars:  # immutable: no copy (``_copy_plain``'s first case, without the call)
                    taken[k] = v
                    continue
                if k.startswith("__") or isinstance(v, nn.Module):
                    continue
                try:
                    taken[k] = _copy_plain(v, budget)
                except _Skip:
                    if isinstance(v, torch.Tensor):
                        live.append(f"{path}.{k}" if path else k)
            if taken:
                attrs[path] = taken
        user = self.get_state() if self.get_state is not None else None
        return StepState(tensors, attrs, user, self.get_state is not None, tuple(live), start - budget.bytes_left)

    @staticmethod
    def for_transfer(state: StepState | None) -> StepState | None:
        """``state`` with tensors above 1 MiB replaced by ``TensorRef`` (the receiver has them); one host read."""
        if state is None:
            return None
        big = [k for k, t in state.tensors.items() if t.numel() * t.element_size() > SEND_BY_DIGEST_BYTES]
        if not big:
            return state
        digests = torch.stack([tensor_digest(state.tensors[k]).to(state.tensors[big[0]].device) for k in big])
        refs = {k: TensorRef(int(d), state.tensors[k].numel() * state.tensors[k].element_size())
                for k, d in zip(big, digests.cpu().tolist(), strict=True)}
        return replace(state, tensors=state.tensors | refs)

    @staticmethod
    def resolve(state: StepState | None, own: Sequence[StepState | None]) -> StepState | None:
        """Replace each ``TensorRef`` with the receiver's own capture of equal digest; raises
        ``RuntimeError`` naming the tensor when the receiver has none (it differs between ranks)."""
        if state is None or not any(isinstance(t, TensorRef) for t in state.tensors.values()):
            return state
        tensors = dict(state.tensors)
        for key, ref in [(k, r) for k, r in state.tensors.items() if isinstance(r, TensorRef)]:
            candidates = [s.tensors[key] for s in own if s is not None and isinstance(s.tensors.get(key), torch.Tensor)]
            match = next((t for t in candidates if int(tensor_digest(t)) == ref.digest), None)
            if match is None:
                raise RuntimeError(
                    f"{key} ({ref.nbytes / 2**20:.1f} MiB) differs between the owner and the replayer at the start "
                    "of the step; the replay sends tensors this large by digest only")
            tensors[key] = match
        return replace(state, tensors=tensors)

    @contextmanager
    def applied(self, state: StepState | None) -> Iterator[dict[str, torch.Tensor]]:
        """Put ``state`` in place for one replay; yields the parameter/buffer tensors to swap in. Afterwards
        every attribute dictionary and the user's state are restored; tensors read live that changed in place
        raise ``RuntimeError``."""
        module = self.module
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        subs = dict(module.named_modules())
        saved = {path: dict(vars(sub)) for path, sub in subs.items()}
        own_user, loaded_user = None, False
        live: dict[str, tuple[torch.Tensor, int]] = {}  # the tensors read live, with their versions now
        if state is not None and state.live:
            tensors = {f"param:{n}": p for n, p in module.named_parameters()}
            tensors |= {f"buffer:{n}": b for n, b in module.named_buffers()}
            for key in state.live:
                path, _, attr = key.rpartition(".")
                t = tensors[key] if key in tensors else vars(subs[path]).get(attr) if path in subs else None
                if isinstance(t, torch.Tensor):
                    live[key] = (t, t._version)
        swapped: dict[str, torch.Tensor] = {}
        try:
            if state is None:  # nothing captured: the replayer's own state, on private copies
                swapped = {n: p.detach().clone() for n, p in module.named_parameters() if n not in self.trainable}
                swapped.update({n: b.clone() for n, b in module.named_buffers() if b is not None})
            else:
                params = dict(module.named_parameters())
                buffers = dict(module.named_buffers())
                for key, t in state.tensors.items():
                    kind, name = key.split(":", 1)
                    own = (params if kind == "param" else buffers).get(name)
                    if own is not None:
                        swapped[name] = t.detach().to(own.device, copy=True)
                for path, sub in subs.items():  # containers the capture left out: the replay mutates a copy
                    taken = state.attrs.get(path, {})
                    for k, v in list(vars(sub).items()):
                        if k not in taken and k not in self.exclude and type(v) in (list, dict, set, deque):
                            vars(sub)[k] = copy.copy(v)
                for path, attrs in state.attrs.items():
                    sub = subs.get(path)
                    if sub is None:
                        continue
                    for k, v in attrs.items():
                        target = _first_device(vars(sub).get(k)) or (device if _first_device(v) else None)
                        vars(sub)[k] = fresh(v, target)
                if state.has_user and self.load_state is not None:
                    own_user = self.get_state()  # type: ignore[misc]
                    loaded_user = True
                    self.load_state(copy.deepcopy(state.user))
            yield swapped
        finally:
            if loaded_user:
                self.load_state(own_user)  # type: ignore[misc]
            for path, sub in subs.items():
                d = vars(sub)
                d.clear()
                d.update(saved[path])
        changed = [k for k, (t, v) in live.items() if t._version != v]
        if changed:
            raise RuntimeError(
                f"the replay changed {', '.join(changed)} in place, which the capture could not copy "
                f"(over max_state_mb={self.max_bytes / 2**20:g}): raise max_state_mb or expose it with "
                "sdc_replay_state()/sdc_load_replay_state(state)")


@dataclass
class MicroBatch:
    """One micro-batch as the owner ran it: inputs, index, RNG and state before its step."""

    batch: Any
    batch_idx: int
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None = None
    py_rng: Any = None
    np_rng: Any = None
    state: StepState | None = None
    reduced: bool = True  # FSDP2: reduce-scattered at its backward (False: sync off, summed into a later one's)


StepFn = Callable[[Any, int], torch.Tensor]


@dataclass(frozen=True)
class Rerun:
    """How a re-run runs the step: ``step_fn(to_device(batch), batch_idx)`` on ``module``, forward in ``context()``."""

    module: nn.Module
    step_fn: StepFn
    to_device: Callable[[Any], Any]
    context: Callable[[], AbstractContextManager[Any]] = nullcontext
