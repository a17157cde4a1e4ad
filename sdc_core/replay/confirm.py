"""Confirming a screen hit: a partner recomputes the suspect's kept micro-batches (when the verdict is read: in the step
or one step later) before anyone is named. Per flagged rank: reproduced within ``REPRODUCED``: cleared; a value far
smaller on the partner and within the band of the other ranks (``_judge``): confirmed (``ReplayMismatchError``); else
unconfirmed, no verdict, and the replay audits the next step it can.

Cost: nothing on a step without a flag; on a flagged step, the transfer, one forward and backward per suspect on its
partner and two small collectives (collective re-runs: three)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from sdc_core.checks.reductions import log2_peaks_by_group, peaks
from sdc_core.checks.screen_rule import reference
from sdc_core.dist.payload import PayloadError
from sdc_core.dist.topology import Topology, all_gather_tensor, collective_device, is_distributed, owners_of
from sdc_core.errors import ReplayMismatchError
from sdc_core.replay.attribution import describe, replay_partners
from sdc_core.replay.state import Rerun

REPRODUCED = 1.0  # log2 units: a recomputed peak within a factor 2 of the owner's reproduces it
AFTER_UPDATE_GAP = 24.0  # log2: on the weights after the update, the least gradient gap that confirms (``_judge``)


def confirm_hits(replay: Any, result: Any, module: nn.Module, group_of: Callable[[str], int | None],
                 step_fn: Callable[[Any, int], torch.Tensor], to_device: Callable[[Any], Any],
                 context: Callable[[], AbstractContextManager[Any]], after_update: bool = False,
                 ) -> ReplayMismatchError | None:  # fmt: skip
    """Confirm the band hits of ``result`` by partner recomputation (every rank alike; ``after_update``: on the
    weights after the update): the verdict naming the confirmed ranks, or None."""
    step = result.step
    topo: Topology = replay.topology or Topology.gather()
    partners = replay_partners(topo, replay.groups)
    hits = [r for r in result.ranks if _escalated(result, r) and partners[r] != r]
    if not hits or not is_distributed():
        replay.kept.take(step)
        return None
    replay.stats.bump("screen_escalations")
    rows, note = _recompute(replay, topo, partners, step, hits, module, group_of, len(result.values[0]) - 1, step_fn,
                            to_device, context)  # fmt: skip
    confirmed, cleared = [], []
    for r in hits if rows is not None else ():  # None: a peer sent what is refused; no witness, no verdict
        *row, projected = rows[partners[r]].tolist()
        verdict = _judge(result, r, row, projected == 1.0, after_update)
        (confirmed if verdict == "confirmed" else cleared if verdict == "cleared" else []).append(r)
    replay.stats.bump("screen_cleared", len(cleared))
    if unconfirmed := [r for r in hits if r not in confirmed and r not in cleared]:  # a persisting fault shows there
        replay.stats.bump("screen_unconfirmed", len(unconfirmed))
        replay.audit_at = step + 2 if after_update else step + 1
        what = result.details[unconfirmed[0]]
        replay.unconfirmed_hit = (step, tuple(unconfirmed), f"{what.get('value')} 2^{what.get('excess', 0):.0f} above")
    if not confirmed:
        return None
    replay.stats.bump("screen_confirmed", len(confirmed))
    return _error(result, confirmed, partners, topo, note, "the weights after its update" if after_update else
                  "the same weights")  # fmt: skip


def reproduces(replay: Any, step: int, ranks: Sequence[int], module: nn.Module, *functions: Any) -> bool:
    """Whether the partners of ``ranks`` get non-finite gradients from those ranks' kept micro-batches of ``step`` too,
    on the weights the step computed with (every rank alike; ``functions``: ``step_fn, to_device, context``): then the
    batches give them (the data or the model's numerics), not the devices. False where nothing was kept or re-run."""
    topo: Topology = replay.topology or Topology.gather()
    partners = replay_partners(topo, replay.groups)
    if getattr(replay, "collective_reruns", False) or any(partners[r] == r for r in ranks):
        return False  # sharded models: not asked
    rows, _ = _recompute(replay, topo, partners, step, ranks, module, lambda name: 0, 1, *functions)
    return rows is not None and all(rows[partners[r], 0].item() == math.inf for r in ranks)


def held_nonfinite(replay: Any, step: int, ranks: Sequence[int], inputs: Callable[[Any], Any]) -> bool:
    """Every rank alike (one 4-byte all-reduce): whether each of ``ranks`` recorded micro-batches of ``step`` whose
    inputs (``inputs(batch)``) held NaN/Inf themselves, whatever the weights: bad data. Cost: a read of those inputs."""
    held = True
    if dist.get_rank() in ranks:
        leaves = [t for mb in replay.batches_of(step) for t in tree_leaves(inputs(mb.batch))]
        held = any(isinstance(t, torch.Tensor) and t.is_floating_point() and not t.isfinite().all() for t in leaves)
    flag = torch.tensor([float(held)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _recompute(replay: Any, topo: Topology, partners: Sequence[int], step: int, ranks: Sequence[int], module: nn.Module,
               group_of: Callable[[str], int | None], width: int, *functions: Any,
               ) -> tuple[torch.Tensor | None, str]:  # fmt: skip
    """Every rank alike: the ``partners`` of ``ranks`` re-run their kept micro-batches of ``step``. The gathered rows
    (world x (width + 2): groups' log2 peaks, loss's, 1.0 if projected; NaN: none), or None (refused payload); note."""
    kept = replay.kept.take(step)
    me, owner = topo.rank, owners_of(partners)[topo.rank]
    collective = bool(getattr(replay, "collective_reruns", False))  # sharded: every rank re-runs
    try:
        received = replay.exchange_batches({partners[me]: kept} if me in ranks or collective else {},
                                           [owner] if owner in ranks or collective else [])  # fmt: skip
    except PayloadError:  # raised on every rank together
        return None, ""
    mine = torch.full((width + 2,), float("nan"), dtype=torch.float64)
    note, batches = "", received.get(owner)
    if collective:
        batches, note = _agree(replay, batches)
    if isinstance(batches, list) and batches:
        try:
            replay.projected = False
            mine[:-1] = _recomputed_peaks(replay, Rerun(module, *functions), batches, group_of, width)
            mine[-1] = float(replay.projected)
        except Exception as err:  # every rank still meets at the gather below
            note = describe(err)
    elif isinstance(batches, str):
        note = batches
    return all_gather_tensor(mine.to(collective_device())).cpu(), note


def skips(replay: Any, error: ReplayMismatchError, can_skip: bool = True) -> bool:
    """Apply the policy to a confirmed screen hit (every rank alike): True when every rank drops the step
    (``skip_step``, ``can_skip`` and each named rank's first hit); False: raise it."""
    replay.stats.failures += 1
    strikes = replay.screen_strikes
    for r in error.suspects:
        strikes[r] = strikes.get(r, 0) + 1
    skip = can_skip and replay.config.on_failure == "skip_step" and all(strikes[r] == 1 for r in error.suspects)
    replay.last_error = error
    if skip:
        replay.stats.bump("skipped_steps")
        error.details["action"] = "every rank dropped the step (skip_step: the rank's first confirmed hit)"
    return skip


def _recomputed_peaks(replay: Any, rerun: Rerun, batches: list[Any], group_of: Callable[[str], int | None],
                      width: int) -> torch.Tensor:  # fmt: skip
    """Per group the log2 peak of the recomputed gradients (NaN: none), then the loss's: one host read."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def consume(name: str, grad: torch.Tensor) -> None:  # each gradient as produced, then freed
        g = group_of(name)
        if g is not None and 0 <= g < width:
            pairs.append((peaks([grad.detach()]), torch.tensor([g], device=grad.device)))

    loss = replay.recompute(rerun, batches, consume).detach().reshape(1)
    last = log2_peaks_by_group([(loss.abs(), torch.zeros(1, dtype=torch.long))], 1)
    groups = log2_peaks_by_group(pairs, width) if pairs else torch.full((width,), float("nan"), device=last.device)
    return torch.cat([groups, last.to(groups.device)]).double().cpu()


def _agree(replay: Any, batches: Any) -> tuple[Any, str]:
    """Collective re-runs: every rank re-runs its owner's micro-batches, or none does (one small all_reduce
    agrees); returns ``(batches, "")`` to re-run, or ``(None, why)``."""
    if not isinstance(batches, list):
        why = batches if isinstance(batches, str) else "no micro-batches received"
    else:
        why = replay.screen_ready(batches) if hasattr(replay, "screen_ready") else ""
    n = len(batches) if isinstance(batches, list) and not why else 0
    flags = torch.tensor([n, -n], dtype=torch.float64, device=collective_device())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    most, fewest = int(flags[0]), -int(flags[1])
    if fewest == most and most > 0:
        return batches, ""
    return None, why or "another rank could not re-run its partner's micro-batches"


def _escalated(result: Any, rank: int) -> bool:
    """A hit a partner can confirm: values above the band, or a non-finite loss from finite local gradients."""
    reason = result.details[rank].get("reason")
    if reason == "band":
        return True
    row = result.values[rank]
    return reason == "nonfinite" and row[-1] == math.inf and all(v != math.inf for v in row[:-1])


def _judge(
    result: Any, rank: int, recomputed: Sequence[float], projected: bool = False, after_update: bool = False
) -> str:
    """``"cleared"``, ``"confirmed"`` or ``"unconfirmed"`` for one flagged rank from its partner's row (``recomputed``,
    in ``result.values``' layout): confirmed only by a value the owner had larger by more than its band, the partner's
    within the band of the other ranks (``projected``, a loss outside the model whose output gradients the partner
    shares: any). After the update (``after_update``), which a hard batch's own update can fit (lower by any amount:
    2^5.7 at SGD lr 0.3, a loss 2^28 with weights grown to 1e9), only a backward no forward explains: a group
    ``AFTER_UPDATE_GAP`` above, the owner's loss in band, the partner's value in band on both sides (a huge input a
    normalisation kept from the loss: its own update makes its recomputed gradient fall far below the others')."""
    owner = result.values[rank]
    pairs = [(a, b) for a, b in zip(owner, recomputed, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if not pairs:
        return "unconfirmed"  # nothing recomputed (or nothing to compare)
    if all(a == b if math.isinf(a) or math.isinf(b) else abs(a - b) <= REPRODUCED for a, b in pairs):
        return "cleared"  # the partner reproduced the flagged values: the batch gives them
    ref, bands = reference(result.values, rank), result.bands[: len(owner)]
    if any(math.isinf(b) for b in recomputed) or (after_update and not owner[-1] - ref[-1] <= bands[-1]):
        return "unconfirmed"  # the partner's own values overflowed, or the owner's forward stood out too: no witness
    gaps = [*(max(w, AFTER_UPDATE_GAP) for w in bands[:-1]), math.inf] if after_update else bands  # no loss after it
    ref = [*ref[:-1], math.inf] if projected else ref  # a projected loss: any value of the partner's is a witness
    apart = (math.isfinite(b) and a - b > g and w >= (abs(b - m) if after_update else b - m)
             for a, b, m, w, g in zip(owner, recomputed, ref, bands, gaps, strict=True))
    return "confirmed" if any(apart) else "unconfirmed"


def _error(result: Any, ranks: list[int], partners: Sequence[int], topo: Topology, note: str,
           weights: str) -> ReplayMismatchError:  # fmt: skip
    """The verdict of confirmed screen hits (every rank builds the same)."""
    hits = [{"rank": r, "recomputed_by": partners[r], **result.details[r]} for r in ranks]
    first = hits[0]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    if first.get("reason") == "nonfinite":
        saw = f"loss non-finite at step {result.step} while its local gradients were finite"
        outcome = "got a finite loss within the band"
    else:
        saw = (f"{first.get('value')} out of band at step {result.step} (2^{first.get('excess', 0.0):.1f} above the "
               f"ranks' median, band 2^{first.get('band', 0.0):.1f})")
        outcome = "got values within the band of the other ranks, far smaller than its own"
    reason = (f"the every-step gradient screen saw {who}'s {saw}; rank {first['recomputed_by']} recomputed the same "
              f"micro-batches on {weights} and {outcome}: {who} computed that step wrongly")
    details: dict[str, Any] = {"source": "gradient_screen", "screen": hits,
                               "classification": "transient or persistent not told (one replay per escalation)"}
    if note:
        details["note"] = note
    return ReplayMismatchError(step=result.step, rank=ranks[0] if len(ranks) == 1 else None, suspects=tuple(ranks),
                               hosts=topo.hosts(ranks), details=details, reason=reason)  # fmt: skip
