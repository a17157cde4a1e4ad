"""``StepDriver``: the one loop driver of the SDC checks, called by every seam (``SDCHooks`` from its wrapper of
``optimizer.step``, the Lightning callbacks from the trainer's events). It owns the phases of an optimizer step and the
order of the verdicts in them (an earlier step's fault is always read before a later step can show it as a symptom),
what one check's verdict means for the others, and the delivery of a verdict (``Delivery``). docs/architecture.md ("One
step's journey") walks through a step; the ``Seam`` answers what only the framework knows.

Every rank calls the same methods in the same order; each runs the same collectives on every rank, on its error paths
too. Cost: a few Python calls per step beyond the checks' own."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from sdc_core.checks.contract import Role, role_of
from sdc_core.checks.fingerprint import WeightFingerprint, healed_by_comparison
from sdc_core.checks.gradients import drop_step
from sdc_core.driver.screen_step import ScreenVerdicts
from sdc_core.errors import ReplayMismatchError, SDCError
from sdc_core.ops.incidents import record_verdict
from sdc_core.ops.process_exit import mark_verdict
from sdc_core.ops.trackers import log_incident
from sdc_core.replay.confirm import held_nonfinite, reproduces
from sdc_core.sharded.checks import is_sharded


class RolledBack:
    """What ``deliver`` returns when the seam rolled back instead of raising."""

    def __repr__(self) -> str:
        return "ROLLED_BACK"


ROLLED_BACK = RolledBack()


class Delivery:
    """What happens to one check's verdict: returned (skipped, warned, healed: recorded with the policy applied),
    raised (recorded once as ``"raise"``, marked for the launcher) or, with ``on_failure="rollback"``, handed to the
    seam's rollback (``ROLLED_BACK`` returned; ``rolled_back``: that verdict). No communication beyond the seam's
    rollback (every rank together)."""

    def __init__(self, seam: Any) -> None:
        self.seam = seam
        self._recorded: BaseException | None = None  # the last verdict whose incident was written
        self.rolled_back: SDCError | None = None

    def deliver(self, check: Any, run: Callable[[], Any], policy: str | None = None) -> Any:
        """Run one check's call and deliver its verdict (``policy``: default the check's ``on_failure``)."""
        policy = policy or _policy(check)
        try:
            out = run()
        except SDCError as err:
            if err is self._recorded:  # raised through an outer call: recorded once
                self.seam.mark(err)
                raise
            if check.last_error is None:
                check.last_error = err
            if _policy(check) == "rollback":
                # the newest step a rollback may return to: for a weight fault, the step after the last comparison
                # that found the replicas equal; for a compute fault, the faulty step
                fingerprint = role_of(check) is Role.FINGERPRINT
                bound = check.stats.last_verified_step + 1 if fingerprint else err.step
                try:
                    check.last_error = self.seam.rollback(err, bound)
                except SDCError as failed:
                    check.last_error = failed
                    self._raise(check, failed)
                check.stats.bump("rollbacks")
                self.rolled_back = check.last_error
                self._record(check, "rollback")
                return ROLLED_BACK
            self._raise(check, err)
        self._record(check, policy)
        return out

    def _raise(self, check: Any, err: SDCError) -> None:
        self._recorded = err
        self._record(check, "raise")
        self.seam.mark(err)
        raise err

    def _record(self, check: Any, policy: str) -> None:
        """The incident of ``check``'s last verdict (main process; a failed write only warns)."""
        error = check.last_error
        if error is None:
            return
        path = record_verdict(check, self.seam.run_dir, self.seam.is_main, policy)
        self.seam.report(check, policy)
        if self.seam.is_main:  # the verdict (its incident file, or None) to the trackers
            log_incident(self.seam.tracker_targets(), error, path, error.step)


def _policy(check: Any) -> str:
    return getattr(getattr(check, "config", None), "on_failure", "raise")  # no config: "raise"


@dataclass
class StepContext:
    """What the seam knows of one optimizer step.

    Args:
        index: the step (0-based): ``SDCError.step``, the replay's and matmul check's cadence.
        update: the 0-based index of the update in question (the fingerprint's cadence): the
            coming one before the update, the one just done after it.
        module: the unwrapped (or ``fully_shard``) model.
        optimizers: the inner torch optimizers of the step.
        scaler_active: an fp16 GradScaler scales this step."""

    index: int
    update: int
    module: nn.Module
    optimizers: list[Any]
    scaler_active: bool = False


class Seam:
    """What the driver asks of a framework; this default is the plain-PyTorch answer."""

    @property
    def run_dir(self) -> str:
        """Where incidents go (``<run_dir>/sdc/incidents``)."""
        return "."

    @property
    def is_main(self) -> bool:
        """True on the process that writes incidents (global rank 0)."""
        return True

    @property
    def world_size(self) -> int:
        return 1

    def report(self, check: Any, policy: str) -> None:
        """A verdict of ``check`` was recorded with ``policy``. Must not raise and run no collective."""

    def tracker_targets(self) -> list[tuple[str, Any]]:
        """The trackers that get a verdict and the closing line as text (``(kind, object)``, ``ops.trackers``)."""
        return []

    def mark(self, error: SDCError) -> None:
        """A verdict is raised: leave the marker for the launcher (``mark_verdict``)."""
        mark_verdict(error)

    def rollback(self, error: SDCError, max_step: int) -> SDCError:
        """Restore the newest checkpoint verified clean at or before ``max_step`` (every rank together) and return
        ``error`` with what was done; raise it when impossible (the plain loop: always)."""
        raise error

    def audit(self, replay: Any, step: StepContext) -> bool:
        """Run ``replay.audit`` for this step; True when every rank drops the step (a transient fault)."""
        return bool(replay.audit(step.index, step.module, *self.replay_functions(replay, step)))

    def replay_functions(self, replay: Any, step: StepContext) -> tuple[Any, Any, Any]:
        """``(step_fn, to_device, context)``: how a replay recomputes a recorded micro-batch here."""
        raise NotImplementedError

    def replay_inputs(self, batch: Any) -> Any:
        """What the model read of a recorded micro-batch (here, all of it)."""
        return batch

    def loss(self) -> Any:
        """This rank's loss of the step (a tensor, no host read), or None: the screen's loss value."""
        return None


def _with_role(role: Role) -> Any:
    """A property of ``StepDriver``: the checks in use that declare ``role``, in order (a phase's look, once made)."""
    return property(lambda self: (self._phase_roles or self._roles()).get(role, []))


def _phase(method: Callable[..., Any]) -> Callable[..., Any]:
    """A phase of ``StepDriver``: the checks in use are looked up once (at the first role list read in it), and
    every role list read inside it, nested phases included, comes from that look. The checks change only between
    phases (attach, fit start)."""

    @functools.wraps(method)
    def run(self: StepDriver, *args: Any, **kwargs: Any) -> Any:
        if self._phase_roles is not None:  # inside another phase: its look
            return method(self, *args, **kwargs)
        self._phase_roles = {}
        try:
            return method(self, *args, **kwargs)
        finally:
            self._phase_roles = None

    return run


class StepDriver:
    """The verdicts of the SDC checks in the order of cause and effect, for any seam. The phases (``StepCheck``'s
    methods) are ``before_optimizer_step`` (``observe``, the earlier steps' verdicts, ``before_update``),
    ``after_update``, ``before_save`` and the end; a ``StepCheck`` runs in each phase after the built-in checks (found
    by ``Role``). Each phase looks the checks up once.

    Args:
        seam: the framework's answers (``Seam``).
        checks: returns the checks now in use, asked at every call."""

    def __init__(self, seam: Seam, checks: Callable[[], Iterable[Any]]) -> None:
        self.seam = seam
        self._checks = checks
        self._decided: dict[int, tuple[int, bool]] = {}  # id(non-finite check) -> (step decided, dropped)
        self._planned: tuple[int, bool] | None = None  # (step, skipped) of the last before_update
        self._observed: int | None = None  # the step whose screen all_gathers were started
        self._saved: tuple[Any, bool] | None = None  # (key, weights changed) of the last before_save
        self.delivery = Delivery(seam)  # runs a check's call and delivers its verdict
        self.screen_verdicts = ScreenVerdicts(self)  # when each screen's verdict is read, and its confirmation
        self._phase_roles: dict[Role, list[Any]] | None = None  # in a phase: the checks by role (empty: not looked up)
        self._before_update: StepContext | None = None  # the step whose non-finite verdicts are read before its update

    def _roles(self) -> dict[Role, list[Any]]:
        """A new look at the checks in use, by role, in order; in a phase it is kept for the rest of the phase (the role
        properties read it there without this call)."""
        looked: dict[Role, list[Any]] = {}
        for check in self._checks():  # role_of's test inline: no Python call per check (benchmarks/calls.py)
            looked.setdefault(getattr(check, "role", Role.STEP_CHECK), []).append(check)
        if self._phase_roles is not None:  # in a phase: kept for the rest of it
            self._phase_roles.update(looked)
        return looked

    @_phase
    def prepare(self) -> None:
        """Once the checks are in place (every rank alike): with a screen, the replay keeps every step's
        micro-batches, so that a partner can confirm a hit."""
        screening = bool(self.screens)
        for replay in self.replays:
            replay.keep_every_step = screening

    nonfinite = _with_role(Role.NONFINITE)
    fingerprints = _with_role(Role.FINGERPRINT)
    replays = _with_role(Role.REPLAY)
    update_audits = _with_role(Role.UPDATE_AUDIT)
    screens = _with_role(Role.SCREEN)
    matmuls = _with_role(Role.MATMUL)
    step_checks = _with_role(Role.STEP_CHECK)

    @property
    def _magnitudes(self) -> Any:
        """The gradient check whose read gives the screen its magnitudes."""
        return next((nf for nf in self.nonfinite if nf.magnitude_groups), None)

    def _witness(self, index: int, ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...], str] | None:
        """``NonFiniteVerdicts.witness`` (pattern, suspects, reason): "bad_inputs" when the batches ``ranks`` ran at
        step ``index`` held NaN/Inf (``confirm.held_nonfinite``); "diverging" when the screen saw the ranks' loss grow
        toward overflow before (``GradientScreen.diverging``); all ranks: "after_screen_hit" within two steps of a
        screen hit no partner confirmed; some, read before the update: "reproduced" (``confirm.reproduces``)."""
        step, replay = self._before_update, next((r for r in self.replays if r.active), None)
        if replay is not None and held_nonfinite(replay, index, ranks, self.seam.replay_inputs):
            who = ", ".join(map(str, ranks))
            return "bad_inputs", (), (f"the data, not a faulty device: the micro-batches of rank {who} held NaN/Inf "
                                      "values; the NaN/Inf local gradients")
        hit = replay.unconfirmed_hit if replay is not None else None
        hit = hit if len(ranks) == self.seam.world_size and hit and index - 2 <= hit[0] <= index else None
        grown = next(filter(None, (s.diverging(hit[0] if hit else index) for s in self.screens)), None)  # before it
        if grown is not None:
            return "diverging", (), (f"a diverging run, not a faulty device: the ranks' median loss had grown from 2^"
                                     f"{grown[0]:.0f} to 2^{grown[1]:.0f} over the steps before; the NaN/Inf local "
                                     "gradients")
        if hit is not None:
            who = ", ".join(map(str, hit[1]))
            return "after_screen_hit", hit[1], (
                f"every rank's gradients went NaN/Inf after rank {who}'s {hit[2]} the others' at step {hit[0]}, a "
                "screen hit no partner could confirm on the weights after its update: a fault there that the "
                "all-reduce spread, or a divergence its batch began; the first NaN/Inf local gradients")
        keep = next(iter(self.screen_verdicts.recording()), None)
        functions = self.seam.replay_functions(keep, step) if keep and step and step.index == index else None
        if len(ranks) < self.seam.world_size and functions and reproduces(keep, index, ranks, step.module, *functions):
            return "reproduced", (), ("the data or the model's numerics, not a faulty device: the partners' "
                                      "recomputation of the micro-batches gave NaN/Inf local gradients too")
        return None

    def _gradients(self, check: Any, run: Callable[[], Any], step: StepContext) -> Any:
        """A non-finite verdict; a rollback drops the coming update (its gradients are stale)."""
        out = self.delivery.deliver(check, run)
        if out is ROLLED_BACK:
            drop_step(step.module.parameters(), scaler_active=step.scaler_active)
        return out

    @_phase
    def resolve_gradients(self, step: StepContext, before: int | None = None) -> None:
        """Read the pending non-finite verdicts (of steps before ``before``, when given)."""
        for nf in self.nonfinite:
            pending = nf.pending_step
            if pending is not None and (before is None or pending < before):
                self._gradients(nf, nf.resolve, step)

    @_phase
    def resolve_comparison(self, step: StepContext) -> bool:
        """Read the pending weight comparison. When it healed or rolled back replicas (True), this step's gradients
        came from other weights: its replay is not run, and after a rollback its update is dropped."""
        acted = rolled = False
        for fp in self.fingerprints:
            failures = fp.stats.failures
            rolled = self.delivery.deliver(fp, fp.resolve, "heal") is ROLLED_BACK or rolled
            acted = acted or fp.stats.failures != failures
        if acted:
            for replay in self.replays:
                if replay.armed:
                    replay.disarm()
        if rolled:
            drop_step(step.module.parameters(), scaler_active=step.scaler_active)
        return acted

    @_phase
    def gradients(self, step: StepContext, now: bool = False) -> bool:
        """Hand this step's gradients to the non-finite checks (once per step): the verdict is read now when the policy
        needs it, when ``now`` or when a replay audits this step, else one step later. True: the update is dropped."""
        audited = now or any(r.armed for r in self.replays)
        dropped, self._before_update = False, step  # a verdict of this step read now: on its weights (``_witness``)
        for nf in self.nonfinite:
            nf.witness = self._witness
            if self._decided.get(id(nf), (None,))[0] != step.index:  # a second call of the step reads the first's

                def verdict(nf: Any = nf) -> bool:
                    return bool(nf.verdict(step.index, step.module.named_parameters(),
                                           scaler_active=step.scaler_active, now=audited))  # fmt: skip

                out = self._gradients(nf, verdict, step)
                self._decided[id(nf)] = (step.index, out is True or out is ROLLED_BACK)
            dropped = self._decided[id(nf)][1] or dropped
        self._before_update = None  # verdicts read later are read after their update: nothing to recompute them on
        return dropped

    def observe(self, step: StepContext) -> None:
        """Start this step's screen all_gather (every rank, right after the sync backward; once per step)."""
        if self._observed == step.index:
            return
        self._observed = step.index
        source = self._magnitudes
        for screen in self.screens:
            screen.observe(step.index, source.take_magnitudes() if source is not None else None, self.seam.loss())
        for check in self.step_checks:
            self.delivery.deliver(check, lambda c=check: c.after_backward(step), check.policy)

    @_phase
    def before_optimizer_step(self, step: StepContext, sync: bool = True) -> bool:
        """What every seam runs right before an optimizer step, in this order: on a synchronised step the screen's
        exchange started (``observe``), then the earlier steps' pending verdicts (non-finite, then the weight
        comparison; on accumulation steps too), then on a synchronised step this step's (``before_update``). True:
        the update is skipped. A later call for the same step (another SDC callback) gets the first one's answer."""
        if sync and self._planned is not None and self._planned[0] == step.index:
            return self._planned[1]
        if sync:
            self.observe(step)
        self.resolve_gradients(step, before=step.index)
        self.resolve_comparison(step)
        return self.before_update(step) if sync else False

    def before_update(self, step: StepContext) -> bool:
        """This step's verdicts, before its update (every rank, after the earlier steps'; once per step: a second
        call returns the first answer). True: the update is skipped on every rank."""
        if self._planned is not None and self._planned[0] == step.index:
            return self._planned[1]
        self.observe(step)  # where the seam has not: its all_gather starts right after backward, read below
        for matmul in self.matmuls:  # the step's products: sent now, read at the next step
            self.delivery.deliver(matmul, lambda m=matmul: m.verdict(step.index))
        skipped = self.gradients(step)
        if self.screen_verdicts.before_update(step, skipped):  # this step's, or the previous step's
            drop_step(step.module.parameters(), scaler_active=step.scaler_active)
            skipped = True
        for replay in self.replays:
            if not replay.armed:
                continue
            if skipped:
                replay.disarm()  # a step the gradient check dropped is not audited
            elif self._replay_verdict(replay, step, lambda r=replay: self.seam.audit(r, step)):
                # a transient fault (or rolled back, or explained by the weights): every rank drops this step
                drop_step(step.module.parameters(), scaler_active=step.scaler_active)
                skipped = True
        for check in self.step_checks:
            out = self.delivery.deliver(check, lambda c=check: c.before_update(step), check.policy)
            if out is True or out is ROLLED_BACK:
                drop_step(step.module.parameters(), scaler_active=step.scaler_active)
                skipped = True
        for audit in self.update_audits:  # last: the update's inputs as the optimizer will see them
            audit.before_update(step.index, step.optimizers[0])
        self._planned = (step.index, skipped)
        return skipped

    @_phase
    def after_update(self, step: StepContext, updated: bool) -> None:
        """After the update: the update audit's verdict, then, when the weights were updated, the comparison of the
        replicas' new weights started (read at the next step)."""
        for audit in self.update_audits:
            self.delivery.deliver(audit, lambda a=audit: a.audit(step.index), "raise")
        if updated:
            for fp in self.fingerprints:
                if fp.active and fp.due(step.update):
                    fp.start(step.index, step.module, step.optimizers)
        for check in self.step_checks:
            self.delivery.deliver(check, lambda c=check: c.after_update(step, updated), check.policy)

    def _replay_verdict(self, replay: Any, step: StepContext, run: Callable[[], Any],
                        skips: Callable[[ReplayMismatchError], bool] | None = None) -> bool:  # fmt: skip
        """Deliver a replay's verdict (``run``: True to drop the step, or raises): a disagreement is checked against
        the replicas' weights first, then ``skips`` may turn it into a dropped step. True: every rank drops the step."""

        def checked() -> bool:
            try:
                return bool(run())
            except ReplayMismatchError as symptom:
                if self._explained_by_weights(replay, step, symptom) or (skips is not None and skips(symptom)):
                    return True
                raise

        out = self.delivery.deliver(replay, checked, "skip_step")
        return out is ROLLED_BACK or bool(out)

    def _explained_by_weights(self, replay: Any, step: StepContext, symptom: ReplayMismatchError) -> bool:
        """Compare the replicas' current weights (every rank): a replica whose weights changed computes differently,
        so the weight fault is raised when they differ and are not healed; True when a heal or rollback covers every
        rank the replay named. Without a fingerprint check a one-off comparison does it (DDP only). Cost: one
        comparison, on a failing step only."""
        fp = next((fp for fp in self.fingerprints if fp.active), None)
        if fp is None and self.seam.world_size > 1 and not is_sharded(step.module):
            fp = WeightFingerprint(topology=replay.topology)
        if fp is None:
            return False
        now = max(step.index - 1, 0)  # the weights now: after the previous update
        replay.last_error = None  # a symptom until the weights are compared
        acted = self.delivery.deliver(fp, lambda: healed_by_comparison(fp, now, step.module, step.optimizers), "heal")
        if acted is ROLLED_BACK:
            acted = self.delivery.rolled_back
        if acted is not None and set(symptom.suspects) <= set(acted.suspects):
            return True
        replay.last_error = symptom
        return False

    @_phase
    def compare_now(self, step: StepContext, at_end: bool = False) -> bool:
        """Read the pending verdicts and compare the replicas' current weights at once, whatever the cadence (every
        rank; one host wait and one read of the weights), then each ``StepCheck``'s ``before_save`` (``at_end``: its
        ``at_end``). True when a heal or rollback changed the weights."""
        for matmul in self.matmuls:
            self.delivery.deliver(matmul, matmul.resolve)
        for nf in self.nonfinite:
            self._gradients(nf, nf.resolve, step)
        changed, last = self.screen_verdicts.resolve(step), max(step.index - 1, 0)  # verdicts read one step later
        for fp in self.fingerprints:
            if not fp.active:
                continue
            failures = fp.stats.failures
            self.delivery.deliver(fp, lambda f=fp: f.check_now(last, step.module, step.optimizers), "heal")
            changed = changed or fp.stats.failures != failures
        for check in self.step_checks:
            phase = check.at_end if at_end else check.before_save
            self.delivery.deliver(check, lambda p=phase: p(step), check.policy)
        return changed

    @_phase
    def before_save(self, step: StepContext, key: Any, at_end: bool = False) -> bool:
        """``compare_now`` before a checkpoint is written (every rank), once per ``key``: later calls with the same
        key get the first one's answer."""
        if self._saved is None or self._saved[0] != key:
            self._saved = (key, self.compare_now(step, at_end))
        return self._saved[1]

    def discard(self) -> None:
        """An exception leaves the loop: drop what is in flight without any collective."""
        self.screen_verdicts.discard()
        for check in self._checks():
            discard = getattr(check, "discard", None)
            if discard is not None:
                discard()


__all__ = ["ROLLED_BACK", "Delivery", "RolledBack", "Seam", "StepContext", "StepDriver"]
