"""Ring replay audit: replicas recompute each other's micro-batches and compare.

Contract: on every ``every_n_steps``-th optimizer step, rank ``r`` sends the micro-batches of
that step (inputs, the state the step reads besides its batch, its loss and a digest of its
LOCAL gradients, taken in each parameter's gradient hook before DDP's all-reduce) to its partner
``partners[r]``: a rank on another node when there are several, else the next rank. The partner
recomputes loss and gradients with the same weights and the owner's state and compares. Every
rank then learns which (owner, replayer) pairs disagree and reaches the same attribution:

* a rank whose own result and whose replay of another rank both disagree is the faulty one;
* a single disagreeing pair is settled by a third rank (a referee on yet another node where
  possible) replaying the disputed batch: the side it agrees with is healthy;
* with two ranks no third opinion exists: ``rank`` is None and both are suspects.

Faithful replay: at the start of each audited micro-batch the owner captures what its step reads
besides the batch (``StateCapture``): Python ``random``, NumPy and torch CPU/CUDA RNG state,
buffers and parameters that do not train, tensor and plain Python attributes of the module and
its submodules, and the user's ``sdc_replay_state()``. The replayer runs the unwrapped module on
detached aliases of its trainable parameters with that state swapped in, and afterwards puts its
own state back (every submodule's attributes, RNG, user state): the replay has no side effect,
``.grad``, optimizer, DDP, metrics objects and loggers are untouched, and a run with the audit on
trains bit-identically to one with it off. Collectives called inside a replay are refused
(``CollectiveInReplay``) before they reach the transport, so no rank is ever left in a
collective the others do not enter.

Trust before accusation: at the first audit of a process, and at every audit with a
disagreement, each rank also re-runs its OWN micro-batches on its own device. A step that two or
more ranks cannot reproduce on their own device (nondeterminism, state the capture cannot see),
or a step where every replay pair disagrees while each rank reproduces itself (the step depends
on the rank, or ranks run different software), is not replayable: ``ReplayUnavailableError`` on
every rank (not an ``SDCError``), or with ``on_unreplayable="warn"`` one warning and the audit
off. A failure inside any replay (an exception, a refused collective) ends the same way.

Comparison: ``exact="auto"`` (default) calibrates at the first audit: when each rank's re-run
of its own micro-batches is bit-identical (the lower median over ranks), comparisons are exact;
otherwise the tolerance is ``min(rtol, 100 * noise floor)``, the noise floor being the lower
median of the ranks' same-device differences. A disagreement later triggers a new same-device
round, which may raise the tolerance (never above ``rtol``) on the evidence of the majority. One
faulty device cannot move a lower median, and ``rtol`` caps what any evidence can do.
``exact=True`` demands bit equality; ``exact=False`` uses ``rtol`` as is. Differences are
measured per parameter on loss, gradient norm and gradient sum (the latter relative to
``sqrt(numel) * norm``), with ``atol`` the floor of the denominators.

Cost: on audited steps, one extra forward and backward of the partner's micro-batches (twice at
the first audit: the self re-run), the batch and state transfer (point to point, never
gathered), a per-parameter digest of the local gradients read with one device-to-host copy, a
clone of the state per audited step (at most ``max_state_mb``, 256 MiB; larger tensors are read live and
guarded against in-place change) and one all-gather of six float64 per rank. Other steps pay
nothing. The referee and self re-run rounds run only when a pair disagrees.
"""

from __future__ import annotations

import copy
import math
import random
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from sdc_core.errors import ReplayMismatchError, ReplayUnavailableError
from sdc_core.fingerprint import tensor_digest
from sdc_core.gradients import GradientTap
from sdc_core.stats import CheckStats
from sdc_core.topology import (
    TRANSFER_ERROR,
    Topology,
    all_gather_objects,
    all_gather_tensor,
    exchange,
    group_ring_partners,
    is_distributed,
    owners_of,
)

EXACT_MODES = (True, False, "auto")
AUTO_MARGIN = 100.0  # exact="auto": tolerance = AUTO_MARGIN * measured same-device noise floor (GPU noise
# fluctuates from batch to batch; a fault must stand out from it by two orders of magnitude)
SEND_BY_DIGEST_BYTES = 1 << 20  # frozen parameters and buffers above this travel by digest


@dataclass(frozen=True)
class ReplayConfig:
    """Settings of the ring replay audit (validated on construction).

    Args:
        every_n_steps: audit every n-th optimizer step (steps 0, n, 2n, ...; >= 1).
        exact: ``"auto"`` (default): bit equality where the first audit shows the step replays
            bit for bit, else a tolerance from the measured noise floor (at most ``rtol``);
            ``True``: bit equality; ``False``: the tolerance ``rtol``.
        rtol: relative tolerance of loss, gradient norms and sums with ``exact=False``; the
            loosest tolerance ``exact="auto"`` may choose (> 0, < 1).
        atol: absolute floor of the denominators (>= 0).
        on_failure: ``"raise"`` (default) or ``"skip_step"``: when the faulty rank is named and
            its fault proves transient (re-running the disagreeing computation gives a different
            result), every rank drops the step instead; a persistent fault still raises.
        on_unreplayable: ``"raise"`` (default): a step that cannot be replayed faithfully raises
            ``ReplayUnavailableError``; ``"warn"``: warn once and turn the audit off.
        max_state_mb: at most this many MiB of state tensors are cloned per audited step (all its
            micro-batches together, held until the audit); tensors past it are read live, and a
            replay that changes one of them in place is refused.
    """

    every_n_steps: int = 100
    exact: bool | str = "auto"
    rtol: float = 1e-3
    atol: float = 1e-6
    on_failure: str = "raise"
    on_unreplayable: str = "raise"
    max_state_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.on_failure not in ("raise", "skip_step", "rollback"):
            raise ValueError(f"on_failure must be 'raise', 'skip_step' or 'rollback', got {self.on_failure!r}")
        if isinstance(self.every_n_steps, bool) or not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {self.every_n_steps!r}")
        if not any(self.exact is m or (isinstance(self.exact, str) and self.exact == m) for m in EXACT_MODES):
            raise ValueError(f"exact must be True, False or 'auto', got {self.exact!r}")
        if isinstance(self.rtol, bool) or not isinstance(self.rtol, int | float) or not 0 < self.rtol < 1:
            raise ValueError(f"rtol must be a number in (0, 1), got {self.rtol!r}")
        if isinstance(self.atol, bool) or not isinstance(self.atol, int | float) or not 0 <= self.atol < math.inf:
            raise ValueError(f"atol must be a finite number >= 0, got {self.atol!r}")
        if self.on_unreplayable not in ("raise", "warn"):
            raise ValueError(f"on_unreplayable must be 'raise' or 'warn', got {self.on_unreplayable!r}")
        mb = self.max_state_mb
        if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 <= mb < math.inf:
            raise ValueError(f"max_state_mb must be a finite number >= 0, got {mb!r}")


@dataclass
class Digest:
    """What one computation of a step's micro-batches produced, in comparable form."""

    loss: float
    sums: torch.Tensor  # float64 [P]: per-parameter gradient sum
    norms: torch.Tensor  # float64 [P]: per-parameter gradient L2 norm
    fps: torch.Tensor  # int64 [P]: per-parameter exact gradient fingerprint
    numels: torch.Tensor  # float64 [P]


def _sum_norm(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and L2 norm of a gradient, reduced in float32 (no float64 copy of the gradient; owner
    and replayer reduce identically, so equal gradients give equal digests) and returned as
    float64 scalars for the comparison."""
    g = g.detach()
    g = g if g.dtype in (torch.float32, torch.float64) else g.float()
    return g.sum().double(), torch.linalg.vector_norm(g).double()


def _grad_fingerprint(g: torch.Tensor) -> torch.Tensor:
    """Exact fingerprint of a gradient with -0.0 read as +0.0 (kernels differ in the sign of
    an exact zero, e.g. the gradient row of a unit ReLU switched off; the value is the same)."""
    return tensor_digest(g.detach() + 0.0)


def _digest_row(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(sum, norm, exact fingerprint, numel)`` of one gradient, on its device (no sync)."""
    gs, gn = _sum_norm(g)
    return gs, gn, _grad_fingerprint(g), g.numel()


Row = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def _assemble(names: Sequence[str], rows: dict[str, Row], loss: torch.Tensor | float) -> Digest:
    """A ``Digest`` in ``names`` order; a parameter without a row (no gradient) counts as zeros.

    Cost: the rows are packed on their device into one float64 vector (fingerprints bit-cast)
    and read with ONE device-to-host copy, whatever the number of parameters."""
    loss_t = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), dtype=torch.float64)
    first = next((r for r in rows.values() if r is not None), None)
    device = first[0].device if first is not None else loss_t.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    zero_fp = torch.zeros((), dtype=torch.int64, device=device)
    picked = [rows.get(n) for n in names]

    def col(i: int, z: torch.Tensor) -> list[torch.Tensor]:
        return [r[i].to(device, non_blocking=True) if r else z for r in picked]

    parts = [loss_t.detach().reshape(1).to(device=device, dtype=torch.float64)]
    if picked:
        fps = torch.stack(col(2, zero_fp)).view(torch.float64)  # bit-cast: travels unchanged
        parts += [torch.stack(col(0, zero)), torch.stack(col(1, zero)), fps]
    packed = torch.cat(parts).cpu()  # the one device-to-host transfer
    p = len(picked)
    return Digest(
        loss=float(packed[0]),
        sums=packed[1 : 1 + p].clone(),
        norms=packed[1 + p : 1 + 2 * p].clone(),
        fps=packed[1 + 2 * p : 1 + 3 * p].clone().view(torch.int64),
        numels=torch.tensor([r[3] if r else 0 for r in picked], dtype=torch.float64),
    )


def grad_digest(names: Sequence[str], grads: dict[str, torch.Tensor], loss: torch.Tensor | float) -> Digest:
    """Digest of gradients keyed by parameter name (a missing gradient counts as zeros)."""
    return _assemble(names, {n: _digest_row(g) for n, g in grads.items() if g is not None}, loss)


def compare_raw(a: Digest, b: Digest, names: Sequence[str], atol: float = 1e-6) -> tuple[bool, float, str]:
    """``(bit-identical, largest relative difference, where)`` between two digests of the same work.

    The relative difference is per parameter the larger of the gradient-norm and gradient-sum
    differences (0 where the fingerprints are equal), and the loss difference."""
    if a.sums.shape != b.sums.shape:
        return False, math.inf, "parameter count"
    floor = max(atol, 1e-300)
    loss_same = a.loss == b.loss or (math.isnan(a.loss) and math.isnan(b.loss))
    loss_diff = 0.0 if loss_same else (abs(a.loss - b.loss) / max(abs(a.loss), abs(b.loss), floor))
    if math.isnan(loss_diff):
        loss_diff = math.inf
    norm_den = torch.maximum(torch.maximum(a.norms, b.norms), torch.tensor(floor, dtype=torch.float64))
    norm_diff = (a.norms - b.norms).abs() / norm_den
    sum_den = torch.maximum(norm_den * a.numels.clamp(min=1).sqrt(), torch.tensor(floor, dtype=torch.float64))
    sum_diff = (a.sums - b.sums).abs() / sum_den
    per_param = torch.maximum(norm_diff, sum_diff).nan_to_num(nan=math.inf)
    same_fp = a.fps == b.fps
    per_param = torch.where(same_fp, torch.zeros_like(per_param), per_param)  # bit-identical
    worst_param = int(per_param.argmax()) if per_param.numel() else -1
    grad_diff = float(per_param[worst_param]) if worst_param >= 0 else 0.0
    exact = loss_same and bool(same_fp.all())
    if not loss_same:
        where = "loss" if loss_diff >= grad_diff else names[worst_param]
    elif grad_diff > 0:
        where = names[worst_param]
    else:
        bad = (~same_fp).nonzero().flatten().tolist()
        where = names[bad[0]] if bad else ""
    return exact, max(loss_diff, grad_diff), where


def disagree(exact: bool, diff: float, tolerance: float) -> bool:
    """Whether a comparison is a mismatch: any bit with ``tolerance == 0``, else ``diff > tolerance``."""
    return (not exact) if tolerance == 0 else (diff > tolerance or math.isnan(diff))


def compare(a: Digest, b: Digest, config: ReplayConfig, names: Sequence[str]) -> tuple[bool, float, str]:
    """``(mismatch, largest relative difference, where)`` under ``config``'s fixed tolerance
    (bit equality for ``exact=True``, ``rtol`` otherwise; ``RingReplay`` calibrates ``"auto"``)."""
    exact, diff, where = compare_raw(a, b, names, config.atol)
    return disagree(exact, diff, 0.0 if config.exact is True else config.rtol), diff, where


# --------------------------------------------------------------------------------------------
# What a step reads besides its batch: captured at the owner's micro-batch start


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


@contextmanager
def forbid_collectives() -> Iterator[None]:
    """Inside, the ``torch.distributed`` collectives (as looked up at call time by Lightning,
    torchmetrics, ``torch.distributed.nn``) raise ``CollectiveInReplay`` instead of communicating.
    A replay runs on one rank only, so a collective in it would leave ranks in different
    collectives. Not covered: functions imported by name before the replay, functional
    collectives (``torch.distributed._functional_collectives``)."""
    saved: list[tuple[Any, str, Any]] = []

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*_args: Any, **_kwargs: Any) -> Any:
            raise CollectiveInReplay(f"torch.distributed.{name} was called inside the replayed training step")

        return refused

    for ns in _NAMESPACES:
        mod = sys.modules.get(ns)
        for name in _COLLECTIVES if mod is not None else ():
            if callable(getattr(mod, name, None)):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, refuse(name))
    try:
        yield
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


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
    Returns the loss as a float64 device tensor (no host sync) and the gradients.
    """
    capture = capture or StateCapture(module, names, max_state_mb=0)
    params = dict(module.named_parameters())
    aliases = {n: params[n].detach().requires_grad_() for n in names}
    device = next((p.device for p in params.values()), torch.device("cpu"))
    saved_rng = _all_rng(device)
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    total: dict[str, torch.Tensor] = {}
    try:
        for mb in micro_batches:
            _set_rng(mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng, device)
            batch = to_device(mb.batch)
            with capture.applied(mb.state) as tensors:
                swapped = {**tensors, **aliases}
                with _reparametrize_module(module, swapped, tie_weights=True), context(), forbid_collectives():
                    loss = step_fn(batch, mb.batch_idx)
                    grads = torch.autograd.grad(loss, list(aliases.values()), allow_unused=True)
            total_loss = total_loss + loss.detach().to(total_loss.device, torch.float64)
            for n, g in zip(aliases, grads, strict=True):
                if g is not None:
                    total[n] = g if n not in total else total[n] + g
    finally:
        _set_rng(*saved_rng, device)
    return total_loss, total


def explain(
    world: int, partners: Sequence[int], mismatching: Iterable[tuple[int, int]]
) -> tuple[set[int], list[tuple[int, int]]]:
    """First attribution pass over disagreeing ``(owner, replayer)`` pairs.

    Returns ``(culprits, disputed)``: ranks that disagree both as owner and as replayer, and the
    pairs no culprit explains, which need a referee.
    """
    pairs = set(mismatching)
    owners_bad = {o for o, _ in pairs}
    replayers_bad = {q for _, q in pairs}
    culprits = owners_bad & replayers_bad if world > 2 else set()
    disputed = sorted((o, q) for o, q in pairs if o not in culprits and q not in culprits)
    return culprits, disputed


def pick_referee(owner: int, replayer: int, world: int, node_of: Sequence[int], busy: set[int]) -> int | None:
    """A third rank for a disputed pair: outside the pair, preferably not involved in any
    disagreement and on a node of its own. None when ``world < 3``."""
    candidates = [(replayer + k) % world for k in range(1, world)]
    candidates = [r for r in candidates if r not in (owner, replayer)]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r in busy, node_of[r] in (node_of[owner], node_of[replayer])))


def settle(
    world: int,
    culprits: set[int],
    disputed: Sequence[tuple[int, int]],
    referee_says: dict[tuple[int, int], tuple[bool, bool]],
) -> tuple[int | None, tuple[int, ...], dict[str, Any]]:
    """Final attribution: ``(rank, suspects, notes)``.

    ``referee_says[(owner, replayer)] = (agrees_with_owner, agrees_with_replayer)``.
    """
    suspects = set(culprits)
    notes: dict[str, Any] = {}
    for o, q in disputed:
        verdict = referee_says.get((o, q))
        if verdict is None:
            suspects.update((o, q))
            notes[f"{o}->{q}"] = "no referee"
            continue
        with_owner, with_replayer = verdict
        if with_owner and not with_replayer:
            suspects.add(q)
            notes[f"{o}->{q}"] = "referee agrees with the owner: the replayer is faulty"
        elif with_replayer and not with_owner:
            suspects.add(o)
            notes[f"{o}->{q}"] = "referee agrees with the replayer: the owner is faulty"
        else:
            suspects.update((o, q))
            notes[f"{o}->{q}"] = "referee agrees with " + ("both" if with_owner else "neither")
    ordered = tuple(sorted(suspects))
    return (ordered[0] if len(ordered) == 1 and world > 2 else None), ordered, notes


def _lower_median(values: Sequence[float]) -> float:
    """The lower median: no single value (one faulty rank) can raise it above a healthy one."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


LIGHTNING_ADVICE = (
    "Expose state the capture cannot see with sdc_replay_state()/sdc_load_replay_state(state) on the "
    "LightningModule, or define a side-effect free sdc_replay_step(batch, batch_idx)"
)


def _cause(failures: Sequence[str], advice: str) -> str:
    """The likely cause and fix of replay failures, from their messages."""
    text = " ".join(failures)
    if "CollectiveInReplay" in text:
        return (
            "the training step communicates (a torch.distributed collective inside it, e.g. self.all_gather, "
            "accelerator.gather, a metric synced on step): a replay runs on one rank only and cannot take part in "
            "a collective. Replay a step without communication (sdc_replay_step in Lightning, a loss function "
            "without gathers with Accelerate), or turn the audit off"
        )
    if "use_reentrant" in text:
        return (
            "activation checkpointing with use_reentrant=True does not support torch.autograd.grad, which the "
            "replay uses: pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it is also torch's "
            "recommended setting)"
        )
    if "differs between the owner and the replayer" in text or "in place, which the capture" in text:
        return "the step's state is too large to capture. " + advice
    return advice


@dataclass
class RingReplay:
    """Framework-neutral ring replay audit.

    Adapter calls, per optimizer step: ``arm(step)`` (is this step audited?), ``record(...)``
    per micro-batch (``begin()`` where the step itself starts, when later than ``record``) and
    ``record_loss(...)``, then ``audit(...)`` after backward and before the update, on every rank.
    ``capture`` (a ``StateCapture``) and ``advice`` (the adapter's hint for unreplayable steps)
    are set by the adapter.
    """

    config: ReplayConfig = field(default_factory=ReplayConfig)
    stats: CheckStats = field(default_factory=lambda: CheckStats("ring_replay"))
    topology: Topology | None = None
    names: list[str] = field(default_factory=list)
    capture: StateCapture | None = None
    advice: str = LIGHTNING_ADVICE
    disabled: bool = False
    replaying: bool = False
    lockstep: bool = False  # replays run collectives (sharded models): every rank replays in every round
    groups: list[tuple[int, ...]] | None = None  # ranks computing one batch together (tensor parallel), or None
    _armed_step: int | None = None
    _micro: list[MicroBatch] = field(default_factory=list)
    _loss: torch.Tensor | None = None
    _local: dict[str, Row] = field(default_factory=dict)
    _tap: GradientTap | None = None
    _calibrated: bool = False
    _tolerance: float | None = None
    _capture_error: str = ""
    last_error: ReplayMismatchError | None = None

    @property
    def active(self) -> bool:
        return is_distributed() and not self.disabled

    def attach(self, tap: GradientTap, names: Sequence[str]) -> None:
        """Digest local gradients from the tap on audited steps; ``names``: trainable params."""
        self._tap = tap
        self.names = list(names)
        tap.consumers.append(self._consume)

    def arm(self, step: int) -> bool:
        """Called at each micro-batch start; True when this step's micro-batches are audited."""
        due = self.active and not self.replaying and step % self.config.every_n_steps == 0
        if not due:
            self._armed_step = None
            return False
        if self._armed_step != step:
            self._armed_step, self._micro, self._loss, self._local = step, [], None, {}
            self._capture_error = ""
        return True

    def disarm(self) -> None:
        """Drop the micro-batches recorded for the armed step: it is not audited (every rank alike),
        e.g. because another check already dropped that optimizer step."""
        self._armed_step, self._micro, self._loss, self._local = None, [], None, {}

    @property
    def armed(self) -> bool:
        """True between ``arm`` of an audited step and its ``audit``."""
        return self._armed_step is not None

    @property
    def recorded(self) -> int:
        """Micro-batches recorded for the armed step so far."""
        return len(self._micro)

    @property
    def tolerance(self) -> float:
        """The tolerance comparisons use now (0: bit equality)."""
        if self.config.exact is True:
            return 0.0
        if self.config.exact is False:
            return float(self.config.rtol)
        return self._tolerance if self._tolerance is not None else 0.0

    def record(self, batch: Any, batch_idx: int, device: torch.device | None = None, state: bool = True) -> None:
        """Remember an audited micro-batch, the RNG state and (``state=True``) the module state
        it starts from. Cost: the capture's clones, on audited micro-batches only."""
        self._micro.append(MicroBatch(batch, batch_idx, *_all_rng(device)))
        if state:
            self.begin(device)

    def begin(self, device: torch.device | None = None) -> None:
        """The step of the last recorded micro-batch starts now: (re)capture its RNG and state."""
        if self._armed_step is None or not self._micro or self.replaying:
            return
        mb = self._micro[-1]
        mb.cpu_rng, mb.cuda_rng, mb.py_rng, mb.np_rng = _all_rng(device)
        if self.capture is not None:  # one budget for all micro-batches of the step (held until the audit)
            used = sum(m.state.nbytes for m in self._micro[:-1] if m.state is not None)
            try:  # a failure here is reported by the audit, on every rank alike
                mb.state = self.capture.capture(self.capture.max_bytes - used)
            except Exception as err:
                mb.state = None
                self._capture_error = self._capture_error or f"capturing its state: {_describe(err)}"

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss the owner back-propagates for the current audited micro-batch (no host sync)."""
        if self._armed_step is not None and not self.replaying:
            loss = loss.detach().double()
            self._loss = loss if self._loss is None else self._loss + loss.to(self._loss.device)

    def _consume(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        if self._armed_step is None or self._tap is None:
            return
        self._local[self._tap.names.get(id(p), "?")] = _digest_row(grad)

    def _own_digest(self) -> Digest:
        return _assemble(self.names, self._local, self._loss if self._loss is not None else 0.0)

    def _replay_digest(
        self,
        module: nn.Module,
        batches: list[MicroBatch],
        step_fn: StepFn,
        to_device: Callable[[Any], Any],
        context: Callable[[], AbstractContextManager[Any]],
    ) -> Digest:
        """Recompute ``batches`` on this rank (no collective, no side effect) and digest the result."""
        self.replaying = True
        try:
            loss, grads = replay_gradients(module, self.names, batches, step_fn, to_device, context, self.capture)
        finally:
            self.replaying = False
        return grad_digest(self.names, grads, loss)

    def _unreplayable(self, step: int, message: str) -> bool:
        """Every rank alike: raise ``ReplayUnavailableError``, or warn once and turn the audit off."""
        self.stats.bump("unreplayable")
        if self.config.on_unreplayable == "warn":
            self.disabled = True
            warnings.warn(f"{message} The ring replay audit is now off.", UserWarning, stacklevel=4)
            return False
        raise ReplayUnavailableError(message)

    def _calibrate(self, self_diffs: Sequence[float]) -> None:
        """``exact="auto"``: set (or raise, never above ``rtol``) the tolerance from the lower
        median of the ranks' same-device differences (0: bit for bit -> exact comparisons)."""
        if self.config.exact != "auto" or self.config.exact is True:
            return
        floor = _lower_median(self_diffs)
        candidate = 0.0 if floor == 0 else min(float(self.config.rtol), AUTO_MARGIN * floor)
        self._tolerance = candidate if self._tolerance is None else max(self._tolerance, candidate)
        self.stats.extra = {**(self.stats.extra or {}), "tolerance": self._tolerance}

    def audit(
        self,
        step: int,
        module: nn.Module,
        step_fn: StepFn,
        to_device: Callable[[Any], Any] = lambda b: b,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> bool:
        """Run the audit of ``step`` if it was armed (every rank alike); raise on a verdict.

        Returns True when the optimizer step must be skipped (``on_failure="skip_step"`` and a
        transient fault). Raises ``ReplayMismatchError`` (a fault) or ``ReplayUnavailableError``
        (the step cannot be replayed faithfully) on every rank."""
        if self._armed_step != step:
            return False
        t0 = time.perf_counter()
        topo = self.topology or Topology.gather()
        world, me = topo.world_size, topo.rank
        partners = self._partners(topo)
        inverse = owners_of(partners)
        rings = len(self.groups) if self.groups else world  # the length of each replay cycle
        own = self._own_digest()
        micro, self._micro, self._armed_step = self._micro, [], None
        own_states = [mb.state for mb in micro]
        atol = float(self.config.atol)

        def replay(batches: list[MicroBatch]) -> Digest:
            return self._replay_digest(module, batches, step_fn, to_device, context)

        def prepare(payload: dict[str, Any]) -> list[MicroBatch]:
            if TRANSFER_ERROR in payload:
                raise RuntimeError(payload[TRANSFER_ERROR])
            return [
                MicroBatch(**{**vars(mb), "state": StateCapture.resolve(mb.state, own_states)})
                for mb in payload["micro"]
            ]

        def replay_payload(payload: dict[str, Any]) -> Digest:
            return replay(prepare(payload))

        def attempt(fn: Callable[[], Digest]) -> tuple[Digest | None, str]:
            try:
                return fn(), ""
            except Exception as err:  # decided together: no rank may be left in a collective
                return None, _describe(err)

        def self_round() -> tuple[tuple[bool, float, str], str]:
            again, err = attempt(lambda: replay(micro))
            return (compare_raw(own, again, self.names, atol) if again is not None else (True, 0.0, "")), err

        failure, self._capture_error = self._capture_error, ""
        try:
            payload: dict[str, Any] = {"micro": self._for_transfer(micro), "digest": own}
        except Exception as err:  # the partner still gets a message: no rank is left waiting
            failure = failure or f"preparing its micro-batches: {_describe(err)}"
            payload = {TRANSFER_ERROR: f"the owner could not send its micro-batches: {_describe(err)}"}
        received = exchange({partners[me]: payload}, [inverse[me]])[inverse[me]]
        if self.lockstep:  # replays are collective: every rank must be able to start one, or none does
            try:
                batches, prep_failure = prepare(received), ""
            except Exception as err:
                batches, prep_failure = [], _describe(err)
            failure = failure or prep_failure
            if any(all_gather_tensor(torch.tensor([float(bool(failure))], dtype=torch.float64)).flatten().tolist()):
                return self._failed(step, all_gather_objects(failure), inverse, t0)
            mine, replay_failure = attempt(lambda: replay(batches))
        else:
            mine, replay_failure = attempt(lambda: replay_payload(received))
        failure = failure or replay_failure
        cross = compare_raw(received["digest"], mine, self.names, atol) if mine is not None else (True, 0.0, "")
        first = not self._calibrated
        mine_self, self_failure = self_round() if first else ((True, 0.0, ""), "")
        if self_failure and not failure:
            failure = f"re-running its own micro-batches: {self_failure}"
        row = [float(cross[0]), cross[1], float(bool(failure)), float(first), float(mine_self[0]), mine_self[1]]
        table = all_gather_tensor(torch.tensor(row, dtype=torch.float64)).tolist()
        if any(r[2] for r in table):
            return self._failed(step, all_gather_objects(failure), inverse, t0)
        if first:
            self._calibrated = True
            self._calibrate([r[5] if not r[4] and r[5] > 0 else (0.0 if r[4] else 1e-12) for r in table])
        self.stats.runs += 1

        def judge() -> tuple[list[tuple[int, int]], list[int]]:
            tol = self.tolerance
            pairs = [(inverse[q], q) for q, r in enumerate(table) if disagree(bool(r[0]), r[1], tol)]
            unrepro = [q for q, r in enumerate(table) if r[3] and disagree(bool(r[4]), r[5], tol)]
            return pairs, unrepro

        mismatching, unreproducible = judge()
        if mismatching and not first:  # a same-device re-run decides whether the replay can be trusted
            mine_self, self_failure = self_round()
            srow = [float(mine_self[0]), mine_self[1], float(bool(self_failure))]
            stable = all_gather_tensor(torch.tensor(srow, dtype=torch.float64)).tolist()
            if any(r[2] for r in stable):
                fails = all_gather_objects(f"re-running its own micro-batches: {self_failure}" if self_failure else "")
                return self._failed(step, fails, inverse, t0)
            for q, (s_exact, s_diff, _) in enumerate(stable):
                table[q][3:6] = [1.0, s_exact, s_diff]
            self._calibrate([r[5] if not r[4] and r[5] > 0 else (0.0 if r[4] else 1e-12) for r in table])
            mismatching, unreproducible = judge()
        worst = max((r[1] for r in table if not math.isnan(r[1])), default=0.0)
        if math.isfinite(worst):
            self.stats.max_diff = max(self.stats.max_diff, worst)
        if len(unreproducible) >= 2:
            wheres = all_gather_objects(mine_self[2])
            self.stats.add_time(time.perf_counter() - t0)
            worst_self = max(table[q][5] for q in unreproducible)
            how = (
                "compares bit for bit (exact=True): use exact='auto' to allow measured noise, or make the step "
                "deterministic (torch.use_deterministic_algorithms(True))"
                if self.config.exact is True
                else "is nondeterministic (e.g. GPU atomics beyond rtol) or reads state the replay does not capture "
                "(an object that is neither a tensor nor a plain Python value, a global, an iterator)"
            )
            return self._unreplayable(
                step,
                f"RingReplayAudit cannot trust its replay at step {step}: ranks {unreproducible} could not reproduce "
                f"their own result on their own device (largest difference {worst_self:.3g} in "
                f"{', '.join(sorted({wheres[q] or 'loss' for q in unreproducible}))}; tolerance "
                f"{self.tolerance:.3g}). This is not evidence of a faulty device: the step {how}. {self.advice}.",
            )
        if mismatching and len(mismatching) == world and (rings >= 3 or first):
            self.stats.add_time(time.perf_counter() - t0)
            return self._unreplayable(step, self._every_pair_message(step, topo, first))
        if not mismatching:
            if unreproducible:  # verified by the partner; the one rank's re-run differed: note it
                self.stats.bump("self_replay_mismatches")
            self.stats.last_verified_step = step
            self.stats.add_time(time.perf_counter() - t0)
            return False
        return self._attribute(step, topo, partners, inverse, table, mismatching, micro, own, received, mine,
                               replay, prepare, replay_payload, attempt, t0)  # fmt: skip

    def _partners(self, topo: Topology) -> tuple[int, ...]:
        """``partners[r]``: the rank replaying rank ``r``'s batch (per tensor-parallel coordinate
        over the data-parallel groups when ``groups`` is set)."""
        if not self.groups:
            return topo.partners()
        return group_ring_partners(self.groups, [f.node_rank for f in topo.ranks])

    def _group_of(self, world: int) -> list[int]:
        """The data-parallel group index of every rank (each rank its own without ``groups``)."""
        if not self.groups:
            return list(range(world))
        index = [0] * world
        for g, members in enumerate(self.groups):
            for r in members:
                index[r] = g
        return index

    def _referee_jobs(
        self, disputed: Sequence[tuple[int, int]], mismatching: Sequence[tuple[int, int]], topo: Topology
    ) -> tuple[dict[tuple[int, int], int | None], list[tuple[int, int, int]]]:
        """The referee of each disputed pair, and every ``(owner, replayer, referee)`` replay job.

        Without ``groups`` one job per disputed pair. With tensor-parallel ``groups`` the referee
        is a whole third group: a disputed pair of groups ``(A, B)`` gets group ``C``, each of
        whose ranks ``(C, t)`` replays what ``(A, t)`` computed (its collectives need its peers to
        replay the same batch), whichever coordinates disagreed."""
        world = topo.world_size
        node_of = [f.node_rank for f in topo.ranks]
        busy = {r for pair in mismatching for r in pair}
        if not self.groups:
            referees = {pair: pick_referee(*pair, world, node_of, busy) for pair in disputed}
            return referees, [(o, q, t) for (o, q), t in referees.items() if t is not None]
        group_of, groups = self._group_of(world), self.groups
        group_node = [node_of[g[0]] for g in groups]
        busy_groups = {group_of[r] for r in busy}
        by_pair: dict[tuple[int, int], int | None] = {}
        for o, q in disputed:
            a, b = group_of[o], group_of[q]
            if (a, b) not in by_pair:
                by_pair[(a, b)] = pick_referee(a, b, len(groups), group_node, busy_groups)
        referees = {}
        for o, q in disputed:
            c = by_pair[(group_of[o], group_of[q])]
            referees[(o, q)] = None if c is None else groups[c][groups[group_of[o]].index(o)]
        jobs = [(groups[a][t], groups[b][t], groups[c][t]) for (a, b), c in sorted(by_pair.items()) if c is not None
                for t in range(len(groups[a]))]  # fmt: skip
        return referees, jobs

    @staticmethod
    def _for_transfer(micro: Sequence[MicroBatch]) -> list[MicroBatch]:
        return [MicroBatch(**{**vars(mb), "state": StateCapture.for_transfer(mb.state)}) for mb in micro]

    def _every_pair_message(self, step: int, topo: Topology, first: bool) -> str:
        software = {(f.device, f.versions) for f in topo.ranks}
        differ = (
            " The ranks do run different devices or software: "
            + "; ".join(f"rank {f.rank}: {f.device} {dict(f.versions)}" for f in topo.ranks)
            + "."
            if len(software) > 1
            else ""
        )
        when = "at its first audit" if first else ""
        return (
            f"RingReplayAudit cannot trust its replay at step {step}: every replay pair disagrees {when} while "
            "each rank reproduces its own result on its own device, so the replay does not compute what the "
            "owners computed: the step depends on the rank (self.global_rank, per-rank data outside the batch, "
            "a loss computed from values the replay does not receive) or the ranks compute differently."
            f"{differ} {self.advice}."
        ).replace("  ", " ")

    def _failed(self, step: int, failures: Sequence[str], inverse: Sequence[int], t0: float) -> bool:
        self.stats.add_time(time.perf_counter() - t0)
        listed = "; ".join(f"rank {r} replaying rank {inverse[r]}: {f}" for r, f in enumerate(failures) if f)
        return self._unreplayable(
            step,
            f"RingReplayAudit could not replay at step {step}: {listed}. Likely cause and fix: "
            f"{_cause([f for f in failures if f], self.advice)}.",
        )

    def _attribute(self, step, topo, partners, inverse, table, mismatching, micro, own, received, mine,  # type: ignore[no-untyped-def]
                   replay, prepare, replay_payload, attempt, t0) -> bool:  # fmt: skip
        """Rare path: attribute the disagreeing pairs, with a referee round for pairs no culprit
        explains, and classify the named rank's fault; raises ``ReplayMismatchError``."""
        world, me = topo.world_size, topo.rank
        tol, atol = self.tolerance, float(self.config.atol)
        rings = len(self.groups) if self.groups else world
        group_of = self._group_of(world)

        def differs(a: Digest, b: Digest) -> bool:
            exact, diff, _ = compare_raw(a, b, self.names, atol)
            return disagree(exact, diff, tol)

        where = compare_raw(received["digest"], mine, self.names, atol)[2] if mine is not None else ""
        wheres = all_gather_objects(where)
        culprits, disputed = explain(rings, partners, mismatching)
        referees, assignments = self._referee_jobs(disputed, mismatching, topo)
        sends: dict[int, Any] = {}
        recv_from: list[int] = []
        for o, q, t in assignments:
            if me == o:
                sends.setdefault(t, {}).update(micro=self._for_transfer(micro), digest=own)
            if me == q:
                # the replayer's result travels to the referee too (a different destination
                # from the owner's: referee t is neither o nor q)
                sends.setdefault(t, {}).update(replay=mine)
            if me == t:
                recv_from += [r for r in (o, q) if r not in recv_from]
        sends = {d: v for d, v in sends.items() if d != me}
        got = exchange(sends, recv_from) if referees else {}
        my_rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        my_failure = ""
        jobs = [(o, q) for o, q, t in assignments if t == me]
        rounds = len(jobs)
        if self.lockstep:  # replays are collective: every rank replays in every referee round
            for o, q in jobs:
                try:
                    prepare(got[o])
                except Exception as err:
                    my_failure = my_failure or f"refereeing {o}->{q}: {_describe(err)}"
            if any(all_gather_tensor(torch.tensor([float(bool(my_failure))], dtype=torch.float64)).flatten().tolist()):
                return self._failed(step, all_gather_objects(my_failure), inverse, t0)
            assigned = [t for _, _, t in assignments]
            rounds = max(assigned.count(r) for r in range(world))
        for i in range(rounds):
            if i >= len(jobs):  # lockstep: no pair for this rank in this round; its replay joins the others'
                attempt(lambda: replay(micro))
                continue
            o, q = jobs[i]
            ref, err = attempt(lambda o=o: replay_payload(got[o]))
            if ref is None:
                my_failure = f"refereeing {o}->{q}: {err}"
                continue
            if (o, q) in referees:  # a tensor-parallel peer's job that agreed: its replay served the group
                my_rulings[(o, q)] = (not differs(got[o]["digest"], ref), not differs(got[q]["replay"], ref))
        rulings: dict[tuple[int, int], tuple[bool, bool]] = {}
        gathered = all_gather_objects((my_rulings, my_failure))
        if any(f for _, f in gathered):
            return self._failed(step, [f for _, f in gathered], inverse, t0)
        for part, _ in gathered:
            rulings.update(part)
        rank, suspects, notes = settle(rings, culprits, disputed, rulings)
        classification = None
        if rank is not None:  # the suspect re-runs what disagreed: does it reproduce its result?
            mine_again = None
            as_owner = (rank, partners[rank]) in mismatching
            if me == rank:
                again, err = attempt(lambda: replay(micro) if as_owner else replay_payload(received))
                before = own if as_owner else mine
                if again is None:
                    mine_again = f"unknown ({err.split(':')[0]})"
                else:
                    mine_again = "persistent" if before is not None and not differs(before, again) else "transient"
            elif self.lockstep and group_of[me] == group_of[rank]:  # its tensor-parallel peers re-run the same
                attempt(lambda: replay(micro) if as_owner else replay_payload(received))
            elif self.lockstep:  # the suspect's re-run is collective: the others replay alongside
                attempt(lambda: replay(micro))
            classification = all_gather_objects(mine_again)[rank]
        self.stats.failures += 1
        self.stats.add_time(time.perf_counter() - t0)
        bad = [q for q in range(world) if disagree(bool(table[q][0]), table[q][1], tol)]
        worst = max((table[q][1] for q in bad), default=0.0)
        details = {
            "mismatching_pairs": [list(p) for p in mismatching],
            "differences": {inverse[q]: table[q][1] for q in bad},
            "where": {inverse[q]: wheres[q] for q in bad},
            "self_replay": {q: "reproduced" if not disagree(bool(table[q][4]), table[q][5], tol) else "differed"
                            for q in range(world) if table[q][3]},
            "partners": list(partners),
            "referees": {f"{o}->{q}": t for (o, q), t in referees.items()},
            "rulings": notes,
            "exact": self.config.exact,
            "tolerance": tol,
            "rtol": self.config.rtol,
            "node_ranks": topo.node_ranks(suspects),
            "world_size": world,
            "classification": classification,
            **({"tensor_parallel_groups": [list(g) for g in self.groups]} if self.groups else {}),
        }  # fmt: skip
        reproduced = all(r[3] and not disagree(bool(r[4]), r[5], tol) for r in table)
        note = " while each rank reproduces its own result on its own device" if reproduced else ""
        if rank is not None:
            reason = (
                f"its results disagree with its partners' replays "
                f"(largest difference {worst:.3g} in {wheres[partners[rank]] or wheres[rank]}; "
                f"the fault is {classification})"
            )
        elif world == 2:
            reason = (
                f"the two replicas disagree on a replayed batch{note}; "
                "with two replicas no third opinion can tell which is wrong"
            )
        elif rings == 2:
            reason = (
                f"the two data-parallel groups disagree on a replayed batch{note}; with two groups no third "
                "opinion can tell which of each disagreeing pair (same tensor-parallel coordinate) is wrong"
            )
        else:
            reason = f"{len(mismatching)} of {world} replay pairs disagree{note}, and no single rank explains them all"
            if self.groups and len(suspects) > 1 and len({group_of[r] for r in suspects}) == 1:
                reason += (
                    "; the suspects are one tensor-parallel group: a fault before one of its collectives reaches "
                    "every peer, so the group is named"
                )
        skip = self.config.on_failure == "skip_step" and classification == "transient"
        if skip:
            details["action"] = "step skipped on every rank"
        self.last_error = ReplayMismatchError(
            step=step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason
        )
        if not skip:
            raise self.last_error
        self.stats.bump("skipped_steps")
        return True
