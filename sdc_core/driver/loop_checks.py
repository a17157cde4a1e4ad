"""``LoopChecks``: the check cores of a hook set, built from the settings and attached to a DDP model, a
``fully_shard`` model or one process. None of this communicates (the caller gathers the topology)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sdc_core.checks.contract import require_check
from sdc_core.checks.fingerprint import WeightFingerprint
from sdc_core.checks.gradient_tap import GradientTap
from sdc_core.checks.gradients import NonFiniteGradient
from sdc_core.checks.screen import GradientScreen, ScreenConfig
from sdc_core.dist.topology import Topology
from sdc_core.driver.framework import Removal
from sdc_core.driver.replay_capture import LoopCapture
from sdc_core.driver.settings import SDCSettings
from sdc_core.replay.ring import RingReplay
from sdc_core.replay.state import StateCapture
from sdc_core.sharded.checks import ShardedFingerprint, ShardedNonFinite
from sdc_core.sharded.replay import ShardedReplay, screenable

_CONSUMER_LISTS = ("consumers", "writers")  # the gradient tap's consumer lists

LOOP_ADVICE = (
    "If the loss you back-propagate has terms that do not go through the model's outputs (a penalty on the "
    "parameters), wrap its computation with SDCHooks.replayable(fn); "
    "expose state the capture cannot see with SDCHooks(replay_state=..., load_replay_state=...)")


class LoopChecks:
    """The cores a hook set's settings turn on (each None when off), DDP or sharded once attached."""

    def __init__(self, settings: SDCSettings) -> None:
        nonfinite, replay, fingerprint = settings.nonfinite(), settings.replay(), settings.fingerprint()
        self.nonfinite: Any = NonFiniteGradient(nonfinite) if nonfinite else None
        self.replay: Any = RingReplay(replay, advice=LOOP_ADVICE) if replay else None
        self.fingerprint: Any = WeightFingerprint(fingerprint) if fingerprint else None
        self.update_audit: Any = None
        self.screen: Any = None  # the every-step screen: made at attach (DDP, with the gradient check)
        self.matmul: Any = None
        if (matmul := settings.matmul()) is not None:
            from sdc_core.checks.matmul import MatmulChecksum

            self.matmul = MatmulChecksum(matmul)
        self._consumers: list[tuple[list[Any], Any]] = []  # (tap list, consumer) pairs to remove on detach
        self.step_checks: list[Any] = []  # checks registered with ``add`` (``StepCheck``: run through the phases)

    def add(self, check: Any) -> None:
        """Register a check the driver runs through the phases (``sdc_core.checks.contract.StepCheck``)."""
        self.step_checks.append(require_check(check))

    @property
    def checks(self) -> list[Any]:
        """The cores in use (the update audit aside), whose counters the hook set logs and saves."""
        cores = (self.nonfinite, self.replay, self.fingerprint, self.matmul, self.screen)
        return [c for c in cores if c is not None] + self.step_checks

    def all(self) -> list[Any]:
        """Every core the driver orders, the update audit included."""
        return [*self.checks, *([self.update_audit] if self.update_audit is not None else [])]

    def single_process(self) -> None:
        """One process: the replay and the fingerprint are off (warned), the others stay."""
        for check, name in ((self.replay, "ring replay audit"), (self.fingerprint, "weight fingerprint check")):
            if check is not None:
                warnings.warn(f"SDC {name} is inactive: a single process has no replica", UserWarning, stacklevel=3)
        self.replay = self.fingerprint = None

    def attach_tap(self, module: nn.Module, ddp: Any, capture: LoopCapture, comm_hook: tuple[Any, Any],
                   screen: Callable[[], ScreenConfig | None], topo: Topology) -> list[Any]:  # fmt: skip
        """A DDP model: the gradient tap feeds the non-finite check (and the screen, when ``screen()``
        gives its config) and the replay; returns the handles of the replay's forward hooks."""
        if self.fingerprint:
            self.fingerprint.exclude = frozenset(getattr(ddp, "parameters_to_ignore", ()))  # each rank's own
        if not (self.nonfinite or self.replay):
            return []
        names = {id(p): n for n, p in module.named_parameters()}
        tap = GradientTap.attach(ddp, names, inner_hook=comm_hook[0], inner_state=comm_hook[1])
        before = {name: len(getattr(tap, name, ())) for name in _CONSUMER_LISTS}
        handles = []
        if self.nonfinite:
            self.nonfinite.attach(tap)
            config = screen()
            if config is not None:  # the screen reads the gradient check's magnitudes
                self.screen = GradientScreen(config, topo)
                self.screen.attach(self.nonfinite)
        if self.replay:
            trainable = [n for n, p in module.named_parameters() if p.requires_grad]
            self.replay.attach(tap, trainable)
            get, load = capture.state_hooks(module)
            self.replay.capture = StateCapture(module, trainable, get_state=get, load_state=load,
                                               max_state_mb=self.replay.config.max_state_mb)  # fmt: skip
            handles = capture.hook_forward(module)
        self._consumers = [(getattr(tap, n), c) for n in _CONSUMER_LISTS for c in getattr(tap, n, [])[before[n] :]]
        return handles

    def attach_sharded(self, model: nn.Module, optimizer: Any, capture: LoopCapture,
                       update_audit: Callable[[], Any], topo: Topology,
                       screen: Callable[[], ScreenConfig | None] = lambda: None) -> list[Any]:  # fmt: skip
        """A ``fully_shard`` model (FSDP2, HSDP): the sharded cores (matrix-product checksums do not cover DTensor
        weights: dropped); the fingerprint re-checks unreplicated shards before each forward. Returns the handles."""
        handles = []
        if self.matmul is not None:  # DTensor weights are not covered (sdc_core.checks.matmul)
            warnings.warn("SDC matmul_checksum is inactive on a fully_shard model", UserWarning, stacklevel=3)
            self.matmul = None
        if self.replay is not None:
            self.replay = ShardedReplay(self.replay.config, self.replay.stats, topo, advice=LOOP_ADVICE)
            get, load = capture.state_hooks(model)
            self.replay.attach(model, get_state=get, load_state=load)
            handles += capture.hook_forward(model)
        if self.nonfinite is not None:
            self.nonfinite = ShardedNonFinite(self.nonfinite.config, self.nonfinite.stats, topo)
            self.nonfinite.attach(model)
            config, self.screen = screen(), None
            if config is not None and screenable(model, self.nonfinite.taps):  # alike on every rank: the layout
                self.screen = GradientScreen(config, topo)
                self.screen.attach(self.nonfinite)  # reads the sharded gradient check's magnitudes
        if self.fingerprint is not None:
            fingerprint = self.fingerprint = ShardedFingerprint(self.fingerprint.config, self.fingerprint.stats, topo)

            def before_forward(module: nn.Module, args: Any) -> None:
                if module.training:
                    fingerprint.before_use()

            handles.append(model.register_forward_pre_hook(before_forward))
        self.update_audit = audit = update_audit()
        if audit is not None:  # wrong updates of shards without replicas: a partner recomputes them
            audit.topology = topo
            handles.append(audit.attach(optimizer, model))  # the driver snapshots before each update, audits after
        return handles

    def attach_matmul(self, module: nn.Module, topo: Topology, arm: Callable[[Any], None]) -> list[Any]:
        """The matrix-product checksums on ``module``; ``arm(matmul)`` runs before each training forward with
        gradients (the first of a step reads the previous verdict). Returns the removable handles."""
        matmul = self.matmul
        if matmul is None:
            return []
        matmul.topology = topo
        matmul.attach(module)

        def before_forward(mod: nn.Module, args: Any) -> None:
            if mod.training and torch.is_grad_enabled():
                arm(matmul)

        return [module.register_forward_pre_hook(before_forward), Removal(matmul.detach)]

    def detach(self) -> None:
        """The tap's consumers removed (its parameter hooks stay, reading nothing)."""
        for consumers, consumer in self._consumers:
            if consumer in consumers:
                consumers.remove(consumer)
        self._consumers = []


__all__ = ["LOOP_ADVICE", "LoopChecks"]
