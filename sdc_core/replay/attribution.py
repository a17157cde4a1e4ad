"""What the ranks of a ring replay exchange, and who is faulty: a rank is named only when it is the one smallest
explanation of every comparison; the ``*_message`` functions word the verdicts. Cost: pure functions on world-size
lists; no communication here."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from sdc_core.dist.topology import TRANSFER_ERROR, Topology, group_ring_partners
from sdc_core.replay.state import MicroBatch, StateCapture


def explain(
    world: int, partners: Sequence[int], mismatching: Iterable[tuple[int, int]]
) -> tuple[set[int], list[tuple[int, int]]]:
    """``(culprits, disputed)``: ranks that disagree both as owner and as replayer (three or more ranks),
    and the disagreeing ``(owner, replayer)`` pairs no culprit explains, which need a referee."""
    pairs = set(mismatching)
    culprits = {o for o, _ in pairs} & {q for _, q in pairs} if world > 2 else set()
    disputed = sorted((o, q) for o, q in pairs if o not in culprits and q not in culprits)
    return culprits, disputed


def pick_referee(
    owner: int, replayer: int, world: int, node_of: Sequence[int], busy: set[int], load: dict[int, int] | None = None
) -> int | None:
    """A third rank for a disputed pair, preferably not in any disagreement, on another node and with the
    fewest pairs to judge already (``load``, updated); None when ``world < 3``."""
    candidates = [r for k in range(1, world) if (r := (replayer + k) % world) not in (owner, replayer)]
    if not candidates:
        return None
    load = {} if load is None else load
    picked = min(candidates, key=lambda r: (r in busy, node_of[r] in (node_of[owner], node_of[replayer]),
                                             load.get(r, 0)))  # fmt: skip
    load[picked] = load.get(picked, 0) + 1
    return picked


def settle(
    world: int,
    culprits: set[int],
    disputed: Sequence[tuple[int, int]],
    referee_says: dict[tuple[int, int], tuple[bool, bool]],
) -> tuple[int | None, tuple[int, ...], dict[str, Any]]:
    """Final attribution of a ring of tensor-parallel groups or of the update audit: ``(rank, suspects, notes)``.

    ``referee_says[(owner, replayer)] = (agrees_with_owner, agrees_with_replayer)``. A rank is named only when it
    is the one suspect left (of more than two); else every rank of a disagreeing pair is a suspect. One referee
    per pair: a faulty referee that computes what a faulty owner computed makes the replayer the suspect (the
    replay without tensor parallelism weighs every comparison instead: ``attribute``)."""
    suspects = set(culprits)
    notes: dict[str, Any] = {}
    for o, q in disputed:
        verdict = referee_says.get((o, q))
        notes[f"{o}->{q}"] = ruling_note(verdict)
        if verdict == (True, False):
            suspects.add(q)
        elif verdict == (False, True):
            suspects.add(o)
        else:
            suspects.update((o, q))
    ordered = tuple(sorted(suspects))
    return (ordered[0] if len(ordered) == 1 and world > 2 else None), ordered, notes


SEVERAL = "several ranks disagree: no single faulty rank explains every disagreement"


def ruling_note(verdict: tuple[bool, bool] | None) -> str:
    """What a referee's ``(agrees_with_owner, agrees_with_replayer)`` says, in words."""
    if verdict is None:
        return "no referee"
    if verdict == (True, False):
        return "referee agrees with the owner: the replayer is faulty"
    if verdict == (False, True):
        return "referee agrees with the replayer: the owner is faulty"
    return "referee agrees with " + ("both" if verdict[0] else "neither")


def evidence(
    inverse: Sequence[int],
    mismatching: Iterable[tuple[int, int]],
    referees: dict[tuple[int, int], int | None],
    rulings: dict[tuple[int, int], tuple[bool, bool]],
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every comparison of an audit as ``(disagreeing, agreeing)`` pairs of ranks: each replay pair, and each
    referee against either side of the pair it judged."""
    mism = set(mismatching)
    disagreeing = [(o, q) for q, o in enumerate(inverse) if (o, q) in mism]
    agreeing = [(o, q) for q, o in enumerate(inverse) if (o, q) not in mism]
    for (o, q), (with_owner, with_replayer) in sorted(rulings.items()):
        t = referees.get((o, q))
        if t is None:
            continue
        (agreeing if with_owner else disagreeing).append((o, t))
        (agreeing if with_replayer else disagreeing).append((q, t))
    return disagreeing, agreeing

MAX_EXPLAINED = 4  # explanations of one part needing more faulty ranks than this are not enumerated (all suspect)
_MAX_INVOLVED = 24  # ranks in one part's disagreements beyond which its covers are not enumerated
_MAX_GROUPS = 16  # groups of agreeing ranks in one part beyond which its persistent explanation is not enumerated


def attribute(
    world: int, disagreeing: Iterable[tuple[int, int]], agreeing: Iterable[tuple[int, int]]
) -> tuple[int | None, tuple[int, ...], list[list[int]]]:
    """Who is faulty, from every comparison of one audit: ``(rank, suspects, explanations)``.

    Two readings are weighed by their smallest explanations, per connected part of the disagreements: any fault
    (a set of ranks touching every disagreement) and persistent faults (agreeing ranks are both healthy or share
    one fault; fewer than half the ranks). A rank is named alone only when it is the one smallest explanation of
    both; otherwise every rank of any smallest explanation is a suspect (with two ranks, both).

    Guarantee (``tests/test_attribution_sim.py``): while the faulty ranks are fewer than the healthy ones, no
    healthy rank is named alone and every faulty rank that disagreed with a healthy one, or agreed with a faulty
    one, is a suspect. Cost: linear in the world, then bounded per part (``MAX_EXPLAINED``, ``_MAX_*``)."""
    bad = sorted({(min(a, b), max(a, b)) for a, b in disagreeing if a != b})
    if not bad:
        return None, (), []
    group = _Groups(world, [(a, b) for a, b in agreeing if a != b])
    suspects: set[int] = set()
    every: set[tuple[int, ...]] = set()
    parts = _parts(bad, lambda r: r)
    covers = [_covers(part) for part in parts]
    persistent = [_persistent(world, part, group) for part in _parts(bad, group.persistent_node)]
    consistent = all(persistent)  # a part no persistent fault explains rules the reading out
    for part, found in zip(parts, covers, strict=True):
        suspects |= set().union(*found) if found else {r for pair in part for r in pair}
        every |= {tuple(sorted(h)) for h in found}
    if consistent:
        for found in persistent:
            suspects |= set().union(*found)
            every |= {tuple(sorted(h)) for h in found}
    rank = None
    if world > 2 and len(covers) == 1 and len(covers[0]) == 1 and len(covers[0][0]) == 1:
        (alone,) = covers[0][0]
        if not consistent or all(h == {alone} for found in persistent for h in found):
            rank = alone
    return rank, tuple(sorted(suspects)), [list(h) for h in sorted(every)]


class _Groups:
    """Ranks joined by agreeing comparisons (union-find), and which groups hold half the world."""

    def __init__(self, world: int, good: Sequence[tuple[int, int]]) -> None:
        self.parent: dict[int, int] = {}
        for a, b in good:
            self.parent[self.find(a)] = self.find(b)
        self.members: dict[int, list[int]] = {}
        for r in range(world):
            self.members.setdefault(self.find(r), []).append(r)
        self.world = world

    def find(self, x: int) -> int:
        return _find(self.parent, x)

    def large(self, g: int) -> bool:
        """Half the ranks or more: never part of a persistent explanation."""
        return 2 * len(self.members[g]) >= self.world

    def persistent_node(self, r: int) -> int | None:
        """The node ``r`` stands for in the persistent reading's parts (None: a large group links none)."""
        g = self.find(r)
        return None if self.large(g) else g


def _parts(bad: Sequence[tuple[int, int]], node: Any) -> list[list[tuple[int, int]]]:
    """``bad`` split into connected parts, linked by a shared ``node(rank)`` (None links nothing), sorted."""
    parent: dict[Any, Any] = {}
    keys = []
    for i, (a, b) in enumerate(bad):
        ends = [n for n in (node(a), node(b)) if n is not None] or [("pair", i)]
        for e in ends[1:]:
            parent[_find(parent, e)] = _find(parent, ends[0])
        keys.append(ends[0])
    parts: dict[Any, list[tuple[int, int]]] = {}
    for pair, k in zip(bad, keys, strict=True):
        parts.setdefault(_find(parent, k), []).append(pair)
    return sorted(parts.values())


def _find(parent: dict[Any, Any], x: Any) -> Any:
    """The root of ``x`` in the union-find forest ``parent`` (a new ``x`` is its own root)."""
    parent.setdefault(x, x)
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _covers(bad: Sequence[tuple[int, int]]) -> list[set[int]]:
    """The smallest sets of ranks touching every pair of ``bad`` (empty: too many to enumerate)."""
    involved = sorted({r for pair in bad for r in pair})
    if len(involved) > _MAX_INVOLVED:
        return []
    for size in range(1, min(MAX_EXPLAINED, len(involved)) + 1):
        found = [set(c) for c in itertools.combinations(involved, size) if all(a in c or b in c for a, b in bad)]
        if found:
            return found
    return []


def _persistent(world: int, bad: Sequence[tuple[int, int]], groups: _Groups) -> list[set[int]]:
    """The smallest explanations of one part under persistent faults (empty: none, or too many groups)."""
    find = groups.find
    forced = {find(a) for a, b in bad if find(a) == find(b)}  # disagrees with a rank it also agrees with
    edges = {(find(a), find(b)) for a, b in bad if find(a) != find(b)}
    touched = sorted(forced | {g for e in edges for g in e if not groups.large(g)})
    if len(touched) > _MAX_GROUPS:
        return []
    best: int | None = None
    found: list[set[int]] = []
    for size in range(len(touched) + 1):
        for chosen in itertools.combinations(touched, size):
            pick = set(chosen)
            if not forced <= pick or not all(a in pick or b in pick for a, b in edges):
                continue
            ranks = sum(len(groups.members[g]) for g in pick)
            if 2 * ranks >= world or (best is not None and ranks > best):
                continue
            h = {r for g in pick for r in groups.members[g]}
            if best is None or ranks < best:
                best, found = ranks, [h]
            else:
                found.append(h)
    return found


def unchecked(
    suspects: Iterable[int], disagreeing: Iterable[tuple[int, int]], agreeing: Iterable[tuple[int, int]]
) -> list[int]:
    """Ranks outside ``suspects`` compared only with suspects at this audit: a fault of theirs was not seen."""
    sus = set(suspects)
    pairs = [*disagreeing, *agreeing]
    checked = {r for a, b in pairs if a not in sus and b not in sus for r in (a, b)}
    return sorted({r for pair in pairs for r in pair} - sus - checked)


def describe(err: BaseException) -> str:
    """``"Type: message"`` of an exception, as the replay's failure texts quote it."""
    return f"{type(err).__name__}: {err}"


DEFAULT_ADVICE = (
    "Expose state the capture cannot see with the StateCapture's get_state/load_state hooks, or replay "
    "a side-effect free step function (RingReplay.audit's step_fn)"
)  # the core's own terms; each adapter sets RingReplay.advice in its users' terms


def _cause(failures: Sequence[str], advice: str) -> str:
    """The likely cause and fix of replay failures, from their messages."""
    text = " ".join(failures)
    if "CollectiveInReplay" in text:
        return (
            "the training step communicates (a torch.distributed collective inside it, e.g. self.all_gather, "
            "accelerator.gather, a metric synced on step): a replay runs on one rank only and cannot take part in "
            "a collective. Replay a step without communication, or turn the audit off. " + advice)
    if "use_reentrant" in text:
        return (
            "activation checkpointing with use_reentrant=True does not support torch.autograd.grad, which the "
            "replay uses: pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it is also torch's "
            "recommended setting)")
    if "before the backward of its previous forward" in text:  # a partner's backward per forward rounds differently
        return ("two views of a batch through the model before one backward, or a training-mode forward never "
                "back-propagated (run it in eval mode or under no_grad): compute the loss in SDCHooks.replayable(fn)")
    if "differs between the owner and the replayer" in text or "in place, which the capture" in text:
        return "the step's state is too large to capture. " + advice
    return advice


def replay_partners(topo: Topology, groups: Sequence[tuple[int, ...]] | None) -> tuple[int, ...]:
    """``partners[r]``: the rank replaying rank ``r``'s batch (over the data-parallel ``groups`` when set)."""
    if not groups:
        return topo.partners()
    return group_ring_partners(list(groups), [f.node_rank for f in topo.ranks])


def group_index(groups: Sequence[tuple[int, ...]] | None, world: int) -> list[int]:
    """The data-parallel group index of every rank (each rank its own without ``groups``)."""
    if not groups:
        return list(range(world))
    index = {r: g for g, members in enumerate(groups) for r in members}
    return [index.get(r, 0) for r in range(world)]


def referee_jobs(
    disputed: Sequence[tuple[int, int]],
    mismatching: Sequence[tuple[int, int]],
    topo: Topology,
    groups: Sequence[tuple[int, ...]] | None = None,
) -> tuple[dict[tuple[int, int], int | None], list[tuple[int, int, int]]]:
    """The referee of each disputed pair, and every ``(owner, replayer, referee)`` replay job (with tensor-parallel
    ``groups``, a whole third group, rank ``(C, t)`` replaying what ``(A, t)`` computed)."""
    world = topo.world_size
    node_of = [f.node_rank for f in topo.ranks]
    busy = {r for pair in mismatching for r in pair}
    if not groups:
        load: dict[int, int] = {}
        referees = {pair: pick_referee(*pair, world, node_of, busy, load) for pair in disputed}
        return referees, [(o, q, t) for (o, q), t in referees.items() if t is not None]
    group_of = group_index(groups, world)
    group_node = [node_of[g[0]] for g in groups]
    busy_groups = {group_of[r] for r in busy}
    by_pair: dict[tuple[int, int], int | None] = {}
    group_load: dict[int, int] = {}
    for o, q in disputed:
        a, b = group_of[o], group_of[q]
        if (a, b) not in by_pair:
            by_pair[(a, b)] = pick_referee(a, b, len(groups), group_node, busy_groups, group_load)
    referees = {}
    for o, q in disputed:
        c = by_pair[(group_of[o], group_of[q])]
        referees[(o, q)] = None if c is None else groups[c][groups[group_of[o]].index(o)]
    jobs = [(groups[a][t], groups[b][t], groups[c][t]) for (a, b), c in sorted(by_pair.items()) if c is not None
            for t in range(len(groups[a]))]  # fmt: skip
    return referees, jobs


def for_transfer(micro: Sequence[MicroBatch]) -> list[MicroBatch]:
    """``micro`` as it travels: large frozen tensors of each state replaced by their digest."""
    return [MicroBatch(**{**vars(mb), "state": StateCapture.for_transfer(mb.state)}) for mb in micro]


def send_payload(micro: list[MicroBatch], digest: Any) -> tuple[dict[str, Any], str]:
    """What an owner sends, and why building it failed (""); on a failure the partner still gets a message."""
    try:
        return {"micro": for_transfer(micro), "digest": digest}, ""
    except Exception as err:
        why = describe(err)
        sent = {TRANSFER_ERROR: f"the owner could not send its micro-batches: {why}"}
        return sent, f"preparing its micro-batches: {why}"


def received_batches(payload: dict[str, Any], own_states: list[Any]) -> list[MicroBatch]:
    """A received payload's micro-batches, states resolved; ``RuntimeError`` when the owner could not send."""
    if TRANSFER_ERROR in payload:
        raise RuntimeError(payload[TRANSFER_ERROR])
    return [MicroBatch(**{**vars(mb), "state": StateCapture.resolve(mb.state, own_states)}) for mb in payload["micro"]]


def referee_sends(
    assignments: Sequence[tuple[int, int, int]], me: int, micro: Sequence[MicroBatch], own: Any, mine: Any
) -> tuple[dict[int, Any], list[int]]:
    """``(sends, recv_from)`` of rank ``me`` for the referee round: both sides of a pair send to its referee."""
    sends: dict[int, Any] = {}
    recv_from: list[int] = []
    for o, q, t in assignments:
        if me == o:
            sends.setdefault(t, {}).update(micro=for_transfer(micro), digest=own)
        if me == q:
            sends.setdefault(t, {}).update(replay=mine)
        if me == t:
            recv_from += [r for r in (o, q) if r not in recv_from]
    return {d: v for d, v in sends.items() if d != me}, recv_from


def failed_message(step: int, failures: Sequence[str], inverse: Sequence[int], advice: str) -> str:
    """The ``ReplayUnavailableError`` text for replays that raised (after ``RingReplay.label``)."""
    ranks: dict[str, list[int]] = {}  # each text once, with the ranks that reported it
    for r, f in enumerate(failures):
        if f:
            ranks.setdefault(f, []).append(r)
    listed = "; ".join(f"rank {rs[0]} replaying rank {inverse[rs[0]]}: {f}" if len(rs) == 1 else
                       f"ranks {', '.join(map(str, rs))}, each replaying its owner: {f}" for f, rs in ranks.items())
    return (
        f"could not replay at step {step}: {listed}. Likely cause and fix: "
        f"{_cause([f for f in failures if f], advice)}.")


def unreproducible_message(
    step: int, ranks: Sequence[int], worst: float, wheres: Sequence[str], tolerance: float, exact: Any, advice: str
) -> str:
    """The ``ReplayUnavailableError`` text for ranks that could not reproduce their own result."""
    how = (
        "compares bit for bit (exact=True): use exact='auto' to allow measured noise, or make the step "
        "deterministic (torch.use_deterministic_algorithms(True))"
        if exact is True
        else "is nondeterministic (e.g. GPU atomics beyond rtol) or reads state the replay does not capture "
        "(an object that is neither a tensor nor a plain Python value, a global, an iterator)")
    return (
        f"cannot trust its replay at step {step}: ranks {list(ranks)} could not reproduce "
        f"their own result on their own device (largest difference {worst:.3g} in "
        f"{', '.join(sorted({wheres[q] or 'loss' for q in ranks}))}; tolerance "
        f"{tolerance:.3g}). This is not evidence of a faulty device: the step {how}. {advice}.")


def every_pair_message(step: int, topo: Topology, first: bool, advice: str) -> str:
    """The ``ReplayUnavailableError`` text when every replay pair disagrees."""
    differ = ""
    if len({(f.device, f.versions) for f in topo.ranks}) > 1:
        listed = "; ".join(f"rank {f.rank}: {f.device} {dict(f.versions)}" for f in topo.ranks)
        differ = f" The ranks do run different devices or software: {listed}."
    when = "at its first audit" if first else ""
    return (
        f"cannot trust its replay at step {step}: every replay pair disagrees {when} while "
        "each rank reproduces its own result on its own device, so the replay does not compute what the "
        "owners computed: the step depends on the rank (its rank, e.g. self.global_rank or "
        "torch.distributed.get_rank(), per-rank data outside the batch, "
        "a loss computed from values the replay does not receive) or the ranks compute differently."
        f"{differ} {advice}."
    ).replace("  ", " ")


def mismatch_reason(
    rank: int | None, world: int, rings: int, mismatching: Sequence[tuple[int, int]], suspects: Sequence[int],
    worst: float, where: str, classification: Any, reproduced: bool, one_group: bool,
) -> str:  # fmt: skip
    """Why a ``ReplayMismatchError`` names ``rank`` (or only ``suspects``), in words."""
    note = " while each rank reproduces its own result on its own device" if reproduced else ""
    if rank is not None:
        caveat = (
            "; with three replicas, the two others sharing one persistent fault would look the same"
            if rings == 3 and classification == "persistent"
            else "")
        return (
            f"its results disagree with its partners' replays "
            f"(largest difference {worst:.3g} in {where}; the fault is {classification}{caveat})")
    if world == 2:
        return (
            f"the two replicas disagree on a replayed batch{note}; "
            "with two replicas no third opinion can tell which is wrong")
    if rings == 2:
        return (
            f"the two data-parallel groups disagree on a replayed batch{note}; with two groups no third "
            "opinion can tell which of each disagreeing pair (same tensor-parallel coordinate) is wrong")
    reason = (
        f"several ranks disagree: {len(mismatching)} of {world} replay pairs disagree{note}, and no single rank "
        "explains them all")
    if one_group and len(suspects) > 1:
        reason += (
            "; the suspects are one tensor-parallel group: a fault before one of its collectives reaches "
            "every peer, so the group is named")
    return reason
