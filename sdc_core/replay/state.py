"""What a training step reads besides its batch, and the side-effect free re-run of a micro-batch.

Contract: ``StateCapture.capture()`` snapshots, at the start of an owner's audited micro-batch,
what the step reads besides its batch: buffers and parameters that do not train, tensor and plain
Python attributes of the module and every submodule, and the user's ``sdc_replay_state()``;
``MicroBatch`` adds the batch and the RNG state of Python, NumPy and torch (CPU and the CUDA
device). ``replay_gradients`` re-runs micro-batches with that state swapped in, on detached
aliases of the trainable parameters, with ``torch.distributed`` collectives refused
(``forbid_collectives``), and restores everything afterwards: ``.grad``, optimizer, DDP,
attributes, RNG and user state are as before, so training is bit-identical with the audit on and
off. ``GradientsAside`` keeps an audited step's own gradients out of the way of its re-runs
where DDP holds a copy of them anyway (its buckets, in DDP's default layout), bit for bit.

Cost: a capture clones state tensors on their device (no host sync) within ``max_state_mb`` per
audited step (larger tensors are read live and guarded against in-place change); frozen tensors
above ``SEND_BY_DIGEST_BYTES`` travel by digest (one host read per transfer). A re-run is one
forward and backward per micro-batch; ``replay_each_gradient`` hands each final gradient on as it
is produced and frees it (with several micro-batches the earlier ones' sum is held until the
last), ``replay_gradients`` returns the full set. ``DeterministicWindow`` sets five flags.

Limits: not captured are objects that are neither tensors nor plain Python values (rebinds are
undone, in-place changes are not), globals, iterators, files; collectives imported by name before
the replay and functional collectives are not refused.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

from sdc_core.checks.digest import tensor_digest

SEND_BY_DIGEST_BYTES = 1 << 20  # frozen parameters and buffers above this travel by digest
CUBLAS_DETERMINISTIC = ":4096:8"

# cuBLAS reads its workspace configuration when its first handle is created, long before any audit
# exists; torch refuses (or warns about) cuBLAS under deterministic algorithms without it. Set here,
# at import, when the user has not set it and CUDA is not yet initialised: a fixed 32 MiB workspace
# per handle and stream, no change of any result. A value the user set is kept.
if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.cuda.is_initialized():
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC


class CollectiveInReplay(RuntimeError):
    """A ``torch.distributed`` collective was called inside a replay (refused before transport)."""


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "all_reduce_coalesced", "all_gather_coalesced", "send_object_list", "recv_object_list",
)  # fmt: skip
_NAMESPACES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.nn.functional",
               "torch.distributed.nn")  # fmt: skip


class _Guard:
    """One replay's refusal of collectives, on the thread that entered it (``forbid_collectives``)."""

    __slots__ = ("__weakref__", "active", "entry")

    def __init__(self) -> None:
        self.active = False
        self.entry = 0  # id() of the frame that entered the guard: the signal-handler search stops there

    def __enter__(self) -> None:
        self.entry = id(sys._getframe(1))
        stack = _guards()
        stack[:] = [g for g in stack if (t := g()) is not None and t.active]  # guards cut short are gone
        stack.append(weakref.ref(self))
        _install(self)
        self.active = True  # from here on (one attribute store) this thread's collectives are refused

    def __exit__(self, *_exc: object) -> None:
        self.active = False
        stack = _guards()
        stack[:] = [g for g in stack if (t := g()) is not None and t is not self and t.active]
        _uninstall()


_GUARD_CODES = frozenset((_Guard.__enter__.__code__, _Guard.__exit__.__code__))
_LOCAL = threading.local()
_LOCK = threading.RLock()  # re-entrant: a signal handler on the locking thread may enter a guard too
_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}  # (namespace, name) -> the function wrapped


def _guards() -> list[weakref.ref[_Guard]]:
    """This thread's guards (weak: a guard whose exit was interrupted dies with its last reference)."""
    stack = getattr(_LOCAL, "guards", None)
    if stack is None:
        stack = _LOCAL.guards = []
    return stack


def _refuses(frame: Any) -> bool:
    """Whether the collective called from ``frame`` is the replay's: this thread has a live guard
    whose entering frame is on the stack, with no Python signal handler running in between (a
    handler interrupts the replay, what it does is not part of the replayed step). A guard whose
    entering frame has returned had its exit cut short: it is dropped here."""
    codes: set[Any] | None = None
    for ref in reversed(getattr(_LOCAL, "guards", ())):
        guard = ref()
        if guard is None or not guard.active:
            continue
        f = frame
        while f is not None and id(f) != guard.entry:
            codes = _handler_codes() if codes is None else codes
            if f.f_code in codes:
                return False
            f = f.f_back
        if f is not None and not _cut_short(guard):
            return True
        guard.active = False
    return False


def _cut_short(guard: _Guard) -> bool:
    """Whether an exception being handled now (or one it replaced) left ``guard``'s own entry or
    exit: that guard is over, though it may not have switched itself off."""
    err: BaseException | None = sys.exc_info()[1]
    seen = 0
    while err is not None and seen < 16:
        tb = err.__traceback__
        while tb is not None:
            if tb.tb_frame.f_locals.get("self") is guard and tb.tb_frame.f_code in _GUARD_CODES:
                return True
            tb = tb.tb_next
        err, seen = err.__context__, seen + 1
    return False


def _handler_codes() -> set[Any]:
    """The code objects of the Python signal handlers installed now."""
    codes = set()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        while isinstance(handler, functools.partial):
            handler = handler.func
        if not callable(handler):  # SIG_DFL, SIG_IGN, None
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        code = code or getattr(type(handler).__call__, "__code__", None)  # a callable object (Lightning's)
        if code is not None:
            codes.add(code)
    return codes


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "guards", None) and _refuses(sys._getframe(1)):
            raise CollectiveInReplay(f"torch.distributed.{name} was called inside the replayed training step")
        return original(*args, **kwargs)

    collective._sdc_wrapped = original  # type: ignore[attr-defined]
    return collective


def _install(guard: _Guard) -> None:
    """Wrap every collective (idempotent; an interrupted install leaves pass-through wrappers)."""
    with _LOCK:
        _ALL.add(guard)
        for ns in _NAMESPACES:
            mod = sys.modules.get(ns)
            for name in _COLLECTIVES if mod is not None else ():
                fn = getattr(mod, name, None)
                if callable(fn) and not hasattr(fn, "_sdc_wrapped"):
                    _ORIGINALS[(ns, name)] = fn
                    setattr(mod, name, _wrap(name, fn))


def _uninstall() -> None:
    """Put the originals back once no thread has a live guard (what is still wrapped refuses
    nothing outside a guard, so an interrupted uninstall only costs a function call)."""
    with _LOCK:
        if any(_live_anywhere()):
            return
        for (ns, name), fn in list(_ORIGINALS.items()):
            mod = sys.modules.get(ns)
            if mod is not None and hasattr(getattr(mod, name, None), "_sdc_wrapped"):
                setattr(mod, name, fn)


_ALL: weakref.WeakSet[_Guard] = weakref.WeakSet()


def _live_anywhere() -> list[_Guard]:
    return [g for g in list(_ALL) if g.active]


def forbid_collectives() -> AbstractContextManager[None]:
    """Inside, the ``torch.distributed`` collectives (as looked up at call time by Lightning,
    torchmetrics, ``torch.distributed.nn``) raise ``CollectiveInReplay`` on THIS thread instead of
    communicating. A replay runs on one rank only, so a collective in it would leave ranks in
    different collectives. Other threads' collectives, and those of a Python signal handler that
    interrupts the replay (Lightning's SIGTERM handler broadcasts), go through: they are not part
    of the replayed step, and refusing them on one rank would make the ranks diverge.

    Exception- and signal-safe: the wrappers are installed before the guard turns on (one
    attribute store) and refuse only while a live guard of the calling thread exists, so an entry
    or exit cut short by an exception or a signal handler never leaves collectives refused (a
    guard whose exit was cut short dies with its last reference, the exception's traceback).
    The originals are put back when the last guard of any thread ends. Not covered: functions
    imported by name before the replay, functional collectives
    (``torch.distributed._functional_collectives``). Cost: a wrapped collective outside a guard
    pays one thread-local look-up."""
    return _Guard()


_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"training"}
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_ITEMS = 10_000  # elements of plain Python containers captured per micro-batch


class _Skip(Exception):
    """A value that is not plain (or over budget): the capture leaves it out."""


@dataclass
class _Budget:
    bytes_left: int
    items_left: int = _MAX_ITEMS
    over: list[str] = field(default_factory=list)


def _copy_plain(value: Any, budget: _Budget, depth: int = 0) -> Any:
    """A copy of a plain value (tensors cloned on their device, containers rebuilt); ``_Skip``
    for anything else (objects, functions, modules) or past the budget."""
    if isinstance(value, _SCALARS):
        return value
    if depth > 6:
        raise _Skip
    budget.items_left -= 1
    if budget.items_left < 0:
        raise _Skip
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
    kind = type(value)
    if kind in (list, set, frozenset, deque) or (kind is tuple):
        items = [_copy_plain(v, budget, depth + 1) for v in value]
        return deque(items, value.maxlen) if kind is deque else kind(items)
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


def _fresh(value: Any, device: torch.device | None) -> Any:
    """A private copy of a captured value for one replay (tensors cloned onto ``device``)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to(device if device is not None else value.device, copy=True)
    kind = type(value)
    if kind is deque:
        return deque((_fresh(v, device) for v in value), value.maxlen)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return kind(*(_fresh(v, device) for v in value))
    if isinstance(value, list | tuple | set | frozenset):
        return kind(_fresh(v, device) for v in value)
    if isinstance(value, dict):
        out = copy.copy(value)
        out.clear()
        for k, v in value.items():
            out[k] = _fresh(v, device)
        return out
    return copy.deepcopy(value)


def _first_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple | deque):
        for v in value:
            d = _first_device(v)
            if d is not None:
                return d
    return None


@dataclass(frozen=True)
class TensorRef:
    """A large frozen parameter or buffer sent by digest: the receiver uses its own capture."""

    digest: int
    nbytes: int


@dataclass
class StepState:
    """The state one micro-batch's step read besides its batch, as its owner had it at the start.

    ``tensors``: ``"param:<name>"`` (not trained) and ``"buffer:<name>"`` clones (or, in
    transit, ``TensorRef``); ``attrs``: per module path, copies of its tensor and plain Python
    attributes; ``user``: what ``sdc_replay_state()`` returned; ``live``: tensors over the
    budget, read live by the replay.
    """

    tensors: dict[str, Any]
    attrs: dict[str, dict[str, Any]]
    user: Any = None
    has_user: bool = False
    live: tuple[str, ...] = ()
    nbytes: int = 0


class StateCapture:
    """Captures, reproduces and restores the state a training step reads besides its batch.

    Args:
        module: the unwrapped module the step runs.
        trainable: names of the parameters that train (replayed on aliases, never captured).
        exclude: attribute names of framework internals to leave out on every submodule (the
            ``nn.Module`` internals always are).
        get_state / load_state: the explicit hook for state the generic capture cannot see
            (``sdc_replay_state()`` / ``sdc_load_replay_state(state)``): ``get_state`` returns a
            snapshot (copies), ``load_state`` puts one in place.
        max_state_mb: default budget of cloned tensors per ``capture``.

    Captured: buffers and parameters that do not train, and for every submodule its tensor
    attributes and plain Python attributes (numbers, strings, None, NumPy arrays, and lists,
    tuples, dicts, sets, deques of them). Not captured: other objects (they are still put back
    after a replay when rebound, but in-place changes to them are not undone; lists, dicts, sets
    and deques left out reach the replay as shallow copies), globals, iterators, files.
    """

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

    def _device(self) -> torch.device:
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))

    def capture(self, budget_bytes: int | None = None) -> StepState:
        """The current state (clones on device, no host sync) within ``budget_bytes`` of tensor
        clones (default ``max_state_mb``); tensors past it are listed in ``live``."""
        start = self.max_bytes if budget_bytes is None else max(budget_bytes, 0)
        budget = _Budget(start)
        tensors: dict[str, Any] = {}
        live: list[str] = []
        named = [(f"param:{n}", p) for n, p in self.module.named_parameters() if n not in self.trainable]
        named += [(f"buffer:{n}", b) for n, b in self.module.named_buffers() if b is not None]
        for key, t in named:
            size = t.numel() * t.element_size()
            if size > budget.bytes_left:
                live.append(key)
                continue
            budget.bytes_left -= size
            tensors[key] = t.detach().clone()
        attrs: dict[str, dict[str, Any]] = {}
        for path, sub in self.module.named_modules():
            for k, v in vars(sub).items():
                if k in self.exclude or k.startswith("__") or isinstance(v, nn.Module):
                    continue
                try:
                    attrs.setdefault(path, {})[k] = _copy_plain(v, budget)
                except _Skip:
                    if isinstance(v, torch.Tensor):
                        live.append(f"{path}.{k}" if path else k)
        user = self.get_state() if self.get_state is not None else None
        return StepState(tensors, attrs, user, self.get_state is not None, tuple(live), start - budget.bytes_left)

    @staticmethod
    def for_transfer(state: StepState | None) -> StepState | None:
        """``state`` with frozen parameters and buffers above 1 MiB replaced by ``TensorRef``
        (replica-synchronised in data parallelism: the receiver has them); one host read."""
        if state is None:
            return None
        big = [k for k, t in state.tensors.items() if t.numel() * t.element_size() > SEND_BY_DIGEST_BYTES]
        if not big:
            return state
        digests = torch.stack([tensor_digest(state.tensors[k]).to(state.tensors[big[0]].device) for k in big])
        tensors = dict(state.tensors)
        for k, d in zip(big, digests.cpu().tolist(), strict=True):
            tensors[k] = TensorRef(int(d), state.tensors[k].numel() * state.tensors[k].element_size())
        return StepState(tensors, state.attrs, state.user, state.has_user, state.live, state.nbytes)

    @staticmethod
    def resolve(state: StepState | None, own: Sequence[StepState | None]) -> StepState | None:
        """Replace each ``TensorRef`` with the receiver's own capture of equal digest; raises
        ``RuntimeError`` naming the tensor when the receiver has none (it differs between ranks)."""
        if state is None or not any(isinstance(t, TensorRef) for t in state.tensors.values()):
            return state
        tensors = dict(state.tensors)
        for key, ref in state.tensors.items():
            if not isinstance(ref, TensorRef):
                continue
            candidates = [s.tensors[key] for s in own if s is not None and isinstance(s.tensors.get(key), torch.Tensor)]
            match = next((t for t in candidates if int(tensor_digest(t)) == ref.digest), None)
            if match is None:
                raise RuntimeError(
                    f"{key} ({ref.nbytes / 2**20:.1f} MiB) differs between the owner and the replayer at the start "
                    "of the step; the replay sends tensors this large by digest only"
                )
            tensors[key] = match
        return StepState(tensors, state.attrs, state.user, state.has_user, state.live, state.nbytes)

    @contextmanager
    def applied(self, state: StepState | None) -> Iterator[dict[str, torch.Tensor]]:
        """Put ``state`` in place for one replay; yields the parameter/buffer tensors to swap in.

        Afterwards every submodule's attribute dictionary is restored (rebinds undone, attributes
        the replay added removed), the user's state reloaded, and tensors read live are checked
        for in-place change (``RuntimeError`` naming them: that change cannot be undone)."""
        module, device = self.module, self._device()
        subs = dict(module.named_modules())
        saved = {path: dict(vars(sub)) for path, sub in subs.items()}
        own_user, loaded_user = None, False
        live = self._live_versions(state)
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
                        vars(sub)[k] = _fresh(v, target)
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
                "sdc_replay_state()/sdc_load_replay_state(state)"
            )

    def _live_versions(self, state: StepState | None) -> dict[str, tuple[torch.Tensor, int]]:
        if state is None or not state.live:
            return {}
        found: dict[str, torch.Tensor] = {}
        named = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        for key in state.live:
            kind, _, name = key.partition(":")
            t = named.get(name) if kind == "param" else buffers.get(name) if kind == "buffer" else None
            if t is None:
                path, _, attr = key.rpartition(".")
                sub = dict(self.module.named_modules()).get(path)
                t = vars(sub).get(attr) if sub is not None else None
            if isinstance(t, torch.Tensor):
                found[key] = t
        return {k: (t, t._version) for k, t in found.items()}


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


def capture_rng(device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU RNG state and, for a CUDA ``device``, that device's RNG state."""
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _np_random() -> Any:
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


def _all_rng(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None, Any, Any]:
    cpu, cuda = capture_rng(device)
    npr = _np_random()
    return cpu, cuda, random.getstate(), npr.get_state() if npr is not None else None


def _set_rng(cpu: torch.Tensor, cuda: torch.Tensor | None, py: Any, np_state: Any, device: torch.device) -> None:
    torch.set_rng_state(cpu.clone())
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda.clone(), device)
    if py is not None:
        random.setstate(py)
    npr = _np_random()
    if np_state is not None and npr is not None:
        npr.set_state(np_state)


StepFn = Callable[[Any, int], torch.Tensor]


def replay_gradients(
    module: nn.Module,
    names: Sequence[str],
    micro_batches: Iterable[MicroBatch],
    step_fn: StepFn,
    to_device: Callable[[Any], Any] = lambda b: b,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    capture: StateCapture | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Recompute the summed loss and gradients of ``micro_batches`` without any side effect.

    ``step_fn(batch, batch_idx)`` returns the loss exactly as the owner back-propagated it
    (normalised for accumulation, scaled by a GradScaler). Per micro-batch the owner's RNG and
    state are put in place (``capture``; without one, private copies of the replayer's own),
    trainable parameters are detached aliases, collectives are refused; everything is restored.
    ``context()`` is entered around each forward only (``step_fn``), never the backward.
    Returns the loss as a float64 device tensor (no host sync) and the gradients (a full set:
    ``replay_each_gradient`` consumes them as they are produced instead).
    """
    total: dict[str, torch.Tensor] = {}
    loss = replay_each_gradient(module, names, micro_batches, step_fn, total.__setitem__, to_device, context, capture)
    return loss, total


def replay_each_gradient(
    module: nn.Module,
    names: Sequence[str],
    micro_batches: Iterable[MicroBatch],
    step_fn: StepFn,
    consume: Callable[[str, torch.Tensor], None],
    to_device: Callable[[Any], Any] = lambda b: b,
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    capture: StateCapture | None = None,
) -> torch.Tensor:
    """``replay_gradients`` that hands each parameter's final gradient (summed over the
    micro-batches) to ``consume(name, grad)`` as soon as the last micro-batch's backward has
    produced it, and frees it there: for one micro-batch, no second full set of gradients ever
    exists (the peak is the backward's own); with several, the sum of the earlier micro-batches
    is held until the last one. ``consume`` runs on the autograd thread: no host sync, no raise.
    Gradients accumulate as in ``.grad`` (the owner's layout and order of summation). Returns
    the summed loss as a float64 device tensor."""
    capture = capture or StateCapture(module, names, max_state_mb=0)
    params = dict(module.named_parameters())
    aliases = {n: params[n].detach().requires_grad_() for n in names}
    device = next((p.device for p in params.values()), torch.device("cpu"))
    saved_rng = _all_rng(device)
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    last = [False]

    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(alias: torch.Tensor) -> None:
            if last[0] and alias.grad is not None:
                consume(name, alias.grad)
                alias.grad = None

        return on_grad

    handles = [a.register_post_accumulate_grad_hook(hook(n)) for n, a in aliases.items()]
    batches = list(micro_batches)
    try:
        for i, mb in enumerate(batches):
            last[0] = i == len(batches) - 1
            _set_rng(mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng, device)
            batch = to_device(mb.batch)
            with capture.applied(mb.state) as tensors:
                swapped = {**tensors, **aliases}
                with _reparametrize_module(module, swapped, tie_weights=True), forbid_collectives():
                    with context():  # the forward only, as the frameworks run it (autocast, ...)
                        loss = step_fn(batch, mb.batch_idx)
                    # the backward outside the precision context, as the owner's: on CPU a backward
                    # inside torch.autocast runs its ops under autocast and gives other gradients
                    loss.backward(inputs=list(aliases.values()))
            total_loss = total_loss + loss.detach().to(total_loss.device, torch.float64)
        for n, a in aliases.items():  # used by earlier micro-batches only
            if a.grad is not None:
                consume(n, a.grad)
                a.grad = None
    finally:
        for h in handles:
            h.remove()
        _set_rng(*saved_rng, device)
    return total_loss


# --------------------------------------------------------------------------------------------
# Deterministic kernels around the audited micro-batches and their replays


@dataclass
class DeterministicWindow:
    """Switches torch to deterministic kernels and back, and puts the caller's settings back.

    ``enter(strict)``: ``torch.use_deterministic_algorithms(True, warn_only=not strict)`` (set
    through ``torch._C`` so that ``torch._inductor.config`` is neither imported, seconds, nor
    changed, which could recompile compiled graphs), cuDNN deterministic without benchmarking,
    and no filling of uninitialised memory (it changes no correct result and costs a write of
    every new tensor). ``strict=False`` never raises in a kernel without a deterministic
    implementation (it warns and runs it): the owner's micro-batch runs in the user's loop and
    must not fail there; flash and memory-efficient attention backward stay nondeterministic
    then (torch makes them deterministic only with ``warn_only=False``). ``exit()`` restores
    what ``enter`` found; both are idempotent. Cost: setting five flags (microseconds).

    Limits: custom CUDA or Triton kernels outside torch's switch (atomics in an extension) are
    not covered; compiled graphs keep the kernels they were compiled with.
    """

    _saved: tuple[bool, bool, bool, bool, bool] | None = None

    @property
    def on(self) -> bool:
        return self._saved is not None

    def enter(self, strict: bool) -> None:
        if self._saved is None:
            import torch.utils.deterministic as det

            cudnn = torch.backends.cudnn
            self._saved = (torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled(),
                           cudnn.deterministic, cudnn.benchmark, det.fill_uninitialized_memory)  # fmt: skip
        torch._C._set_deterministic_algorithms(True, warn_only=not strict)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]

    def exit(self) -> None:
        if self._saved is None:
            return
        mode, warn_only, cudnn_det, cudnn_bench, fill = self._saved
        self._saved = None
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, cudnn_bench
        torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


@contextmanager
def deterministic(enabled: bool = True, strict: bool = False) -> Iterator[None]:
    """Inside: deterministic kernels (``DeterministicWindow``; nothing when ``enabled`` is False);
    the caller's settings are back afterwards, whatever was on before."""
    if not enabled:
        yield
        return
    window = DeterministicWindow()
    window.enter(strict)
    try:
        yield
    finally:
        window.exit()


def is_determinism_error(err: BaseException) -> bool:
    """Whether ``err`` is torch refusing a kernel without a deterministic implementation."""
    text = str(err)
    return isinstance(err, RuntimeError) and ("deterministic" in text or "CUBLAS_WORKSPACE_CONFIG" in text)


# --------------------------------------------------------------------------------------------
# The step's own gradients kept out of the way of the re-runs (DDP's default layout)


class _BucketCopies(TorchDispatchMode):
    """Records, while on, each ``copy_`` into one of ``grads`` (data pointer -> (parameter,
    gradient)) and its source: DDP's end-of-backward copy of a reduced bucket view into
    ``.grad``. Never raises into the caller's operators."""

    def __init__(self, grads: dict[int, tuple[nn.Parameter, torch.Tensor]]) -> None:
        super().__init__()
        self.grads = grads
        self.found: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default and len(args) >= 2:
            try:
                dst, src = args[0], args[1]
                hit = self.grads.get(dst.data_ptr()) if isinstance(src, torch.Tensor) else None
                if hit is not None and hit[1] is dst:
                    self.found.append((hit[0], dst, src))
            except Exception:  # a record missed is a gradient kept where it is
                pass
        return out


class GradientsAside:
    """Keeps an audited step's own gradients out of the way of its re-runs where DDP holds a copy
    of them anyway: with ``gradient_as_bucket_view=False`` (DDP's default) ``.grad`` is memory of
    its own, which DDP fills from its reduced buckets at the end of backward; the buckets are
    DDP's scratch space until the next synchronised backward writes every bucket view again.

    ``watch(ddp, params)`` (the end of an audited step's synchronised backward, before DDP's own
    end-of-backward callback): records which bucket view DDP copies into each parameter's
    ``.grad`` (a dispatch mode over the callbacks that follow, left in the next one).
    ``aside()`` (around the audit): each recorded gradient that owns its storage whole is copied
    into its bucket view (the values ``.grad`` holds now, after clipping or unscaling) and its
    storage released; on exit, on every path, the storage is allocated again and the values are
    copied back: same tensor objects, same bits. Where that cannot be shown safe nothing moves
    (today's layout: the gradients stay where they are): DDP with bucket views (nothing to
    gain), a communication hook (its result may be state the hook keeps), mixed precision,
    a reducer finalised outside that backward, gradients that are views or share storage.

    Cost, on audited steps only: a Python call per operator of DDP's end-of-backward callback and
    two copies of the moved gradients; no host sync, no collective; nothing on other steps.
    """

    def __init__(self) -> None:
        self._mode: _BucketCopies | None = None
        self._found: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self.moved_bytes = 0  # set aside by the last ``aside()``

    @staticmethod
    def applies(ddp: Any) -> bool:
        """Whether ``ddp``'s buckets are a second copy of ``.grad`` that nothing else reads."""
        return (
            ddp is not None
            and getattr(ddp, "gradient_as_bucket_view", True) is False
            and not getattr(ddp, "_comm_hooks", None)
            and getattr(ddp, "mixed_precision", None) is None
            and not getattr(ddp, "_delay_all_reduce_all_params", False)
        )

    def clear(self) -> None:
        self._found = []

    def watch(self, ddp: Any, params: Sequence[nn.Parameter]) -> None:
        """At the end of a synchronised backward (an autograd callback, queued before DDP's):
        record DDP's copies of its buckets into ``.grad`` in the callbacks that follow."""
        self._found, self._mode = [], None  # a mode left by a failed callback is gone with that backward's state
        if not self.applies(ddp):
            return
        grads = {}
        for p in params:
            g = p.grad
            if g is not None and g.layout == torch.strided and g.numel() > 0 and g.data_ptr():
                grads[g.data_ptr()] = (p, g)
        if not grads:
            return
        mode = _BucketCopies(grads)

        def stop() -> None:
            if self._mode is mode:
                self._mode = None
                self._found = mode.found
                mode.__exit__(None, None, None)

        mode.__enter__()
        self._mode = mode
        try:
            torch.autograd.Variable._execution_engine.queue_callback(stop)
        except Exception:  # no callback to leave the mode: leave it now, record nothing
            self._mode = None
            mode.__exit__(None, None, None)

    @contextmanager
    def aside(self) -> Iterator[int]:
        """Release the recorded gradients' storage (their values kept in DDP's buckets) for the
        block; put them back on exit. Yields the bytes set aside."""
        found, self._found = self._found, []
        moved: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        storages: dict[int, int] = {}
        for p, grad, view in found:
            g = p.grad
            if (g is not grad or g.requires_grad or view.requires_grad or g.dtype != view.dtype
                    or g.shape != view.shape or g.device != view.device or g.storage_offset() != 0):  # fmt: skip
                continue
            storage = g.untyped_storage()
            nbytes = g.numel() * g.element_size()
            dense = g.is_contiguous() or (g.dim() == 4 and g.is_contiguous(memory_format=torch.channels_last))
            if not dense or storage.nbytes() != nbytes or not storage.resizable():
                continue
            key = storage.data_ptr()
            if key == view.untyped_storage().data_ptr():
                continue
            storages[key] = storages.get(key, 0) + 1
            moved.append((g, nbytes, view))
        moved = [m for m in moved if storages[m[0].untyped_storage().data_ptr()] == 1]
        released: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        try:
            for g, nbytes, view in moved:
                view.copy_(g)
                g.untyped_storage().resize_(0)
                released.append((g, nbytes, view))
            self.moved_bytes = sum(n for _, n, _ in released)
            yield self.moved_bytes
        finally:
            error: BaseException | None = None
            for g, nbytes, view in released:  # every one is tried, the first failure raised after
                try:
                    g.untyped_storage().resize_(nbytes)
                    g.copy_(view)
                except BaseException as err:  # the others are still put back
                    error = error or err
            if error is not None:
                raise error
