"""Hostile peers: several faulty ranks at once (issue 22, item 5).

The replay's attribution (``pick_referee``, ``evidence``, ``attribute``) over simulated comparisons for every
pair of faulty ranks in worlds of 4 to 8, and real ``torchrun`` runs (``tests/hostile_scenarios.py``)
with the same persistent fault on two ranks.

With three replicas, two ranks sharing one persistent fault give exactly the observations one
faulty third rank gives (the two agree with each other, the third with neither): no protocol can
tell them apart, so the 3-rank run checks that the verdict is an SDC error that says so.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from conftest import results, torchrun

from sdc_core.dist.topology import RankFacts, Topology, owners_of, ring_partners
from sdc_core.replay.attribution import attribute, evidence, referee_jobs

SCRIPT = Path(__file__).with_name("hostile_scenarios.py")


def _attribute(world: int, node_of: list[int], computes: Any) -> tuple[str, int | None, tuple[int, ...]]:
    """The replay's attribution protocol without tensor parallelism (``referee.attribute_step``) with
    ``computes(batch, rank)`` standing for the result rank ``rank`` gets for ``batch``'s owner.
    Returns ``("none" | "unreplayable" | "sdc", rank, suspects)``."""
    inverse = owners_of(ring_partners(node_of))
    mismatching = sorted(
        (inverse[q], q) for q in range(world) if computes(inverse[q], inverse[q]) != computes(inverse[q], q)
    )
    if not mismatching:
        return "none", None, ()
    facts = tuple(RankFacts(r, f"n{n}", node_rank=n, local_rank=0) for r, n in enumerate(node_of))
    topo = Topology(ranks=facts, rank=0)
    referees, _ = referee_jobs(mismatching, mismatching, topo)  # every disagreeing pair judged
    rulings = {(o, q): (computes(o, t) == computes(o, o), computes(o, t) == computes(o, q))
               for (o, q), t in referees.items() if t is not None}  # fmt: skip
    if len(mismatching) == world and not any(a or b for a, b in rulings.values()):
        return "unreplayable", None, ()
    rank, suspects, _ = attribute(world, *evidence(inverse, mismatching, referees, rulings))
    return "sdc", rank, suspects


def _layouts() -> list[tuple[int, list[int]]]:
    out = []
    for world in range(4, 9):
        out.append((world, [0] * world))
        if world % 2 == 0:
            out.append((world, [r // (world // 2) for r in range(world)]))
            out.append((world, [r % 2 for r in range(world)]))
    return out


@pytest.mark.parametrize(("world", "node_of"), _layouts(), ids=lambda v: str(v))
def test_shared_persistent_fault_never_names_a_healthy_rank(world: int, node_of: list[int]) -> None:
    """Faulty ranks compute the same wrong result for any batch (they agree with each other)."""
    wrong = {}
    for size in (1, 2, 3):
        for faulty in itertools.combinations(range(world), size):
            if size == 3 and world < 6:
                continue
            kind, rank, suspects = _attribute(world, node_of, lambda _b, r, f=faulty: r in f)
            ok = kind == "sdc" and (rank in faulty or rank is None)
            # (three neighbours in a row: the middle one only ever meets its faulty peers, and nothing shows it)
            ok = ok and (size == 3 or set(faulty) <= set(suspects))
            if size == 1:
                ok = ok and rank == faulty[0]
            if not ok:
                wrong[faulty] = (kind, rank, suspects)
    assert not wrong, f"faulty ranks -> (verdict, named, suspects), partners {ring_partners(node_of)}: {wrong}"


@pytest.mark.parametrize("world", range(3, 9))
def test_rank_dependent_step_stays_unreplayable(world: int) -> None:
    """Every replay differs from every other computation: no referee agrees with anyone."""
    assert _attribute(world, [0] * world, lambda b, r: (b, r))[0] == "unreplayable"


def _errors(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    rows = results(out, scenario, world)
    errors = [r["error"] for r in rows]
    assert all(e is not None for e in errors), f"{scenario}: not every rank raised: {errors}"
    assert len({(e["type"], e["rank"], e["step"], tuple(e["suspects"])) for e in errors}) == 1, errors
    assert all(r["incidents"] for r in rows), f"{scenario}: no incident written"
    return errors


@pytest.mark.slow
def test_two_ranks_share_a_persistent_fault(tmp_path: Path) -> None:
    """4 ranks: faulty neighbours (1, 2), faulty ranks in turn (0, 2: every pair disagrees), the
    latter with ``on_unreplayable="warn"`` too; 3 ranks: (1, 2). An SDC verdict on every rank at
    the same step, every faulty rank a suspect, no healthy rank named."""
    four = ["1+2:module", "0+2:module", "0+2:matmul:warn"]
    torchrun(SCRIPT, tmp_path / "four", four, 4, timeout=400)
    for scenario in four:
        err = _errors(tmp_path / "four", scenario, 4)[0]
        faulty = {int(r) for r in scenario.split(":")[0].split("+")}
        assert err["type"] == "ReplayMismatchError", f"{scenario}: {err['message']}"
        assert err["rank"] is None and faulty <= set(err["suspects"]), f"{scenario}: {err['message']}"
        assert err["step"] == 1 and "several ranks disagree" in err["message"], err["message"]
        assert err["details"]["several_ranks"] is True
    torchrun(SCRIPT, tmp_path / "three", "1+2:module", 3, timeout=300)
    err = _errors(tmp_path / "three", "1+2:module", 3)[0]
    assert err["type"] == "ReplayMismatchError" and err["step"] == 1, err["message"]
    # indistinguishable from rank 0 alone being faulty: the verdict names it and says what else fits
    assert "the two others sharing one persistent fault would look the same" in err["message"], err["message"]


def test_replay_config_allow_pickled_batches() -> None:
    import sdc_core
    from sdc_core.dist.payload import PayloadError
    from sdc_core.replay.ring import ReplayConfig

    assert sdc_core.PayloadError is PayloadError and "PayloadError" in sdc_core.__all__
    assert ReplayConfig().allow_pickled_batches is None  # the environment decides
    assert ReplayConfig(allow_pickled_batches=True).allow_pickled_batches is True
    with pytest.raises(ValueError, match="allow_pickled_batches must be True, False or None, got 'yes'"):
        ReplayConfig(allow_pickled_batches="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_pickled_batch_from_a_peer(tmp_path: Path) -> None:
    """A rank that sends its batch pickled to partners that refuse it: ``ReplayUnavailableError``
    on every rank at the same step (not a ``PayloadError`` escaping the audit); with
    ``allow_pickled_batches=True`` on every rank the same batches are replayed."""
    torchrun(SCRIPT, tmp_path, "pickle:hostile,pickle:trusted", 3, timeout=300)
    hostile = [r["error"] for r in results(tmp_path, "pickle:hostile", 3)]
    assert all(e is not None and e["type"] == "ReplayUnavailableError" and e["step"] == 0 for e in hostile), hostile
    assert len({e["message"] for e in hostile}) == 1
    assert "rank 2 refused the payload of rank 1: it holds a pickled object" in hostile[0]["message"]
    trusted = results(tmp_path, "pickle:trusted", 3)
    assert all(r["error"] is None and r["stats"]["runs"] == 4 for r in trusted), trusted
