"""The rare path of a ring replay audit: referees for the pairs that still disagree, and the verdict.

Collectives: one gather of the "where" texts, one exchange of the disputed batches (when there are referees), one gather
of the rulings and, with a rank named, one of its re-run's outcome; every rank enters each, in this order, on every
path. Cost: one referee replay per disagreeing pair and one re-run by a named rank."""

from __future__ import annotations

from typing import Any

from sdc_core.dist.topology import all_gather_objects
from sdc_core.errors import ReplayMismatchError
from sdc_core.replay.attribution import (
    SEVERAL,
    attribute,
    every_pair_message,
    evidence,
    explain,
    group_index,
    mismatch_reason,
    referee_jobs,
    referee_sends,
    ruling_note,
    settle,
    unchecked,
)
from sdc_core.replay.audit import Pair, StepAudit, any_rank, attempt
from sdc_core.replay.compare import disagree

Rulings = dict[Pair, tuple[bool, bool]]  # (o, q) -> (the referee agrees with the owner, with the replayer)


def attribute_step(run: StepAudit) -> bool:
    """Referee every disputed pair of ``run`` and name who is faulty (every rank alike): raises, or returns True
    when the step is dropped."""
    topo, world = run.topo, run.world
    where = run.compare(run.received["digest"], run.mine)[2] if run.mine is not None else ""
    wheres = all_gather_objects(where)
    if run.groups and run.every_pair is None:  # tensor parallel: pairs no culprit explains get a referee group
        culprits, disputed = explain(run.rings, run.partners, run.mismatching)
    else:  # every disagreeing pair gets a referee
        culprits, disputed = set(), sorted(run.mismatching)
    referees, assignments = referee_jobs(disputed, run.mismatching, topo, run.groups)
    refereed = _referee_round(run, referees, assignments)
    if isinstance(refereed, bool):
        return refereed
    if run.every_pair is not None and not any(a or b for a, b in refereed.values()):
        run.done()
        return run.unreplayable(every_pair_message(run.step, topo, run.every_pair, run.advice))
    compared = evidence(run.inverse, run.mismatching, referees, refereed)
    if run.groups:
        rank, suspects, notes = settle(run.rings, culprits, disputed, refereed)
    else:  # the fewest faulty ranks that explain every comparison (``attribute``)
        rank, suspects, explanations = attribute(world, *compared)
        notes = {f"{o}->{q}": ruling_note(refereed.get((o, q))) for o, q in disputed}
        if rank is None and world > 2:
            notes |= {"attribution": SEVERAL, "explanations": explanations}
    notes["unchecked"] = unchecked(suspects, *compared)
    classification = _classify(run, rank) if rank is not None else None
    run.stats.failures += 1
    run.done()
    return _verdict(run, rank, suspects, notes, referees, wheres, classification)


def _referee_round(
    run: StepAudit, referees: dict[Pair, int | None], assignments: list[tuple[int, int, int]]
) -> bool | Rulings:
    """The referees' replays (one exchange, one gather): the rulings, or the audit's result on a failure."""
    me, world = run.me, run.world
    sends, recv_from = referee_sends(assignments, me, run.micro, run.own, run.mine)
    got = run.exchange(sends, recv_from) if referees else {}
    my_rulings: Rulings = {}
    my_failure = ""
    jobs = [(o, q) for o, q, t in assignments if t == me]
    rounds = len(jobs)
    if run.collective_reruns:  # replays are collective: every rank replays in every referee round
        for o, q in jobs:
            err = attempt(lambda o=o: run.prepare(got[o]))[1]
            my_failure = my_failure or (f"refereeing {o}->{q}: {err}" if err else "")
        if any_rank(bool(my_failure)):
            return run.failed(all_gather_objects(my_failure))
        assigned = [t for _, _, t in assignments]
        rounds = max(assigned.count(r) for r in range(world))
    for i in range(rounds):
        if i >= len(jobs):  # collective re-runs: no pair for this rank in this round; its replay joins the others'
            attempt(lambda: run.replay(run.micro))
            continue
        o, q = jobs[i]
        ref, err = attempt(lambda o=o: run.replay_payload(got[o]))
        if ref is None:
            my_failure = f"refereeing {o}->{q}: {err}"
            continue
        if (o, q) in referees:  # a tensor-parallel peer's job that agreed: its replay served the group
            gap = run.compare(got[o]["digest"], got[q]["replay"])[1]
            with_owner = not run.differs(got[o]["digest"], ref, o, me, scale=gap)
            my_rulings[(o, q)] = (with_owner, not run.differs(got[q]["replay"], ref, q, me, scale=gap))
    gathered = all_gather_objects((my_rulings, my_failure))
    if any(f for _, f in gathered):
        return run.failed([f for _, f in gathered])
    return {pair: ruling for part, _ in gathered for pair, ruling in part.items()}


def _classify(run: StepAudit, rank: int) -> str | None:
    """The named rank re-runs what disagreed (one gather): ``"persistent"``, ``"transient"`` or ``"unknown (...)"``."""
    me, table = run.me, run.table
    group_of = group_index(run.groups, run.world)
    mine_again = None
    as_owner = (rank, run.partners[rank]) in run.mismatching

    def again_() -> Any:
        return run.replay(run.micro) if as_owner else run.replay_payload(run.received)

    if me == rank:
        again, err = attempt(again_)
        before = run.own if as_owner else run.mine
        if again is None:
            mine_again = f"unknown ({err.split(':')[0]})"
        else:
            gap = max((table[q][1] for q in range(run.world) if rank in (run.inverse[q], q)), default=0.0)
            persistent = before is not None and not run.differs(before, again, me, scale=gap)
            mine_again = "persistent" if persistent else "transient"
    elif run.collective_reruns and group_of[me] == group_of[rank]:  # its tensor-parallel peers re-run the same
        attempt(again_)
    elif run.collective_reruns:  # the suspect's re-run is collective: the others replay alongside
        attempt(lambda: run.replay(run.micro))
    return all_gather_objects(mine_again)[rank]


def _verdict(
    run: StepAudit, rank: int | None, suspects: tuple[int, ...], notes: dict[str, Any],
    referees: dict[Pair, int | None], wheres: list[Any], classification: str | None,
) -> bool:  # fmt: skip
    """The verdict every rank builds alike (``run.error``): raised, or True when the step is dropped."""
    table, inverse, partners, world, topo = run.table, run.inverse, run.partners, run.world, run.topo
    tol, config, calibration = run.tolerance, run.config, run.calibration
    group_of = group_index(run.groups, world)
    not_checked = notes.pop("unchecked", [])  # ranks compared only with suspects: a fault there was not visible
    bad = [q for q in range(world) if disagree(bool(table[q][0]), table[q][1], run.tol_for(inverse[q], q))]
    worst = max((table[q][1] for q in bad), default=0.0)
    details = {
        "mismatching_pairs": [list(p) for p in run.mismatching],
        "differences": {inverse[q]: table[q][1] for q in bad},
        "where": {inverse[q]: wheres[q] for q in bad},
        "self_replay": {q: "reproduced" if not disagree(bool(table[q][4]), table[q][5], tol) else "differed"
                        for q in range(world) if table[q][3]},
        "partners": list(partners),
        "referees": {f"{o}->{q}": t for (o, q), t in referees.items()},
        "rulings": notes,
        "exact": config.exact,
        "exact_audits": calibration.exact_audits,
        "tolerance": tol,
        "rtol": config.rtol,
        "deterministic": calibration.mode(config),
        "node_ranks": topo.node_ranks(suspects),
        "world_size": world,
        "classification": classification,
        **({"several_ranks": True} if "attribution" in notes else {}),
        "not_checked": not_checked,
        "checked": "every rank outside the suspects and not_checked matched, or was judged against, a rank "
                   "outside the suspects: a fault there changed nothing this audit compared",
        **({"tensor_parallel_groups": [list(g) for g in run.groups]} if run.groups else {}),
    }  # fmt: skip
    reproduced = all(r[3] and not disagree(bool(r[4]), r[5], tol) for r in table)
    where_worst = (wheres[partners[rank]] or wheres[rank]) if rank is not None else ""
    one_group = bool(run.groups) and len({group_of[r] for r in suspects}) == 1
    reason = mismatch_reason(rank, world, run.rings, run.mismatching, suspects, worst, where_worst, classification,
                             reproduced, one_group)  # fmt: skip
    skip = config.on_failure == "skip_step" and classification == "transient"
    if skip:
        details["action"] = "step skipped on every rank"
    run.error = ReplayMismatchError(
        step=run.step, rank=rank, suspects=suspects, hosts=topo.hosts(suspects), details=details, reason=reason)
    if not skip:
        raise run.error
    run.stats.bump("skipped_steps")
    return True
