"""The stable code the tick gives a job it leaves waiting (docs/DESIGN.md, "Reason codes"): one per
situation, with a fixed precedence when a job's peers disagree, and the same from the planner and its
reference. ``Priority`` means exactly: alone in the queue, the job would have been placed."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from policy_factories import EPOCH, NOW, STALE, backend, cpu_backend, cpu_job, eq, gpu_attrs, h100, job, peer
from test_policy_properties import SETTINGS, Scenario, run, scenarios

from iris.policy import (
    Backfill,
    JobShape,
    PeerReport,
    PeerVerdict,
    Reservation,
    WaitKind,
    plan,
    plan_reference,
)
from iris.policy.explain import reason_code
from iris.policy.reasons import WAITING_CODES, ReasonCode

HOME = "marin"
NO_BACKFILL = Backfill(enabled=False)


def codes(
    jobs: list[JobShape],
    *reports: PeerReport,
    reservations: list[Reservation] | None = None,
    cap: int | None = None,
) -> dict[str, ReasonCode]:
    """Each waiting job's code, checked to be the same from the planner and the reference. Backfill
    off: it would hold devices for the first job left waiting (``Reserved``, which its own tests
    cover: tests/policy/test_policy_backfill.py) once this tick's placements say when they end."""
    found: list[dict[str, ReasonCode]] = []
    for planner in (plan, plan_reference):
        result = planner(
            jobs,
            home=HOME,
            reports=[peer(HOME, cpu_backend()), *reports],
            reservations=reservations or [],
            now_ms=NOW,
            stale_after_ms=STALE,
            max_per_peer=cap,
            backfill=NO_BACKFILL,
        )
        found.append({j: g.code for g in result.waiting for j in g.job_ids})
    assert found[0] == found[1]
    return found[0]


def full(peer_id: str, free: int = 4) -> PeerReport:
    return peer(peer_id, h100("b", free))


def roomy(peer_id: str, free: int = 8) -> PeerReport:
    return peer(peer_id, h100("b", free))


def down(peer_id: str) -> PeerReport:
    return peer(peer_id, reachable=False)


def stale(peer_id: str) -> PeerReport:
    return peer(peer_id, h100("b", 64), last_contact_ms=NOW - STALE - 1)


def a100_only(peer_id: str) -> PeerReport:
    return peer(peer_id, backend("a", gpu_attrs("a100"), free={"a100": 64}))


# ---- one situation, one code ---------------------------------------------------------------------


def test_every_candidate_full_is_no_capacity() -> None:
    assert codes([job("j")], full("cw-a"), full("cw-b")) == {"j": ReasonCode.NoCapacity}


def test_a_pinned_job_whose_peer_is_full_is_pinned_peer_full() -> None:
    # cw-b has room, but the job may only run on cw-a.
    assert codes([job("j", pin="cw-a")], full("cw-a"), roomy("cw-b", 64)) == {"j": ReasonCode.PinnedPeerFull}


def test_capacity_taken_this_tick_by_jobs_ahead_is_priority() -> None:
    # One 8-chip slot: the older job takes it, the younger one waits behind it.
    jobs = [job("old", submit_ms=1), job("young", submit_ms=2)]
    assert codes(jobs, roomy("cw-a", 8)) == {"young": ReasonCode.Priority}
    # A higher band goes first whatever its age.
    jobs = [job("batch", submit_ms=1, band=3), job("prod", submit_ms=2, band=1)]  # type: ignore[arg-type]
    assert codes(jobs, roomy("cw-a", 8)) == {"batch": ReasonCode.Priority}
    # Pinned likewise: its peer had room, a job ahead took it.
    pinned = [job("a", pin="cw-a", submit_ms=1), job("b", pin="cw-a", submit_ms=2)]
    assert codes(pinned, roomy("cw-a", 8)) == {"b": ReasonCode.Priority}


def test_a_per_tick_cap_is_priority_when_the_peer_had_room() -> None:
    jobs = [job("first", submit_ms=1), job("second", submit_ms=2)]
    assert codes(jobs, roomy("cw-a", 64), cap=1) == {"second": ReasonCode.Priority}
    # Capped and full besides: the cap is not why it waits.
    jobs = [job("small", count=4, submit_ms=1), job("big", count=8, submit_ms=2)]
    assert codes(jobs, roomy("cw-a", 6), cap=1) == {"big": ReasonCode.NoCapacity}
    # An ungated (CPU) job left behind by the cap on home.
    cpus = [cpu_job("c1", submit_ms=1), cpu_job("c2", submit_ms=2)]
    assert codes(cpus, cap=1) == {"c2": ReasonCode.Priority}


def test_capacity_the_ledger_holds_is_no_capacity_not_priority() -> None:
    # Promotions of earlier ticks hold the 8 chips of this observation: nobody ahead in this tick.
    held = Reservation(peer_id="cw-a", backend_id="b", observation_epoch_ms=EPOCH, amounts={"h100": 8})
    assert codes([job("j")], roomy("cw-a", 8), reservations=[held]) == {"j": ReasonCode.NoCapacity}


def test_a_pinned_peer_without_the_shape_waits_only_for_the_cap() -> None:
    # Force-routed when its turn comes; held back here by the cap, so Priority.
    jobs = [job("first", pin="cw-a", submit_ms=1), job("second", pin="cw-a", submit_ms=2)]
    assert codes(jobs, a100_only("cw-a"), cap=1) == {"second": ReasonCode.Priority}


def test_peers_that_do_not_answer() -> None:
    assert codes([job("j")], down("cw-a")) == {"j": ReasonCode.PeerUnreachable}
    assert codes([job("j", pin="cw-a")], down("cw-a"), roomy("cw-b")) == {"j": ReasonCode.PeerUnreachable}


def test_peers_whose_reports_are_stale() -> None:
    assert codes([job("j")], stale("cw-a")) == {"j": ReasonCode.PeerStale}
    assert codes([job("j", pin="cw-a")], stale("cw-a"), roomy("cw-b")) == {"j": ReasonCode.PeerStale}


def test_no_candidate_with_the_shape_is_shape_mismatch() -> None:
    assert codes([job("j")], a100_only("cw-a")) == {"j": ReasonCode.ShapeMismatch}
    # A pin to a cluster the tick does not know.
    assert codes([job("j", pin="ghost")], roomy("cw-a")) == {"j": ReasonCode.ShapeMismatch}


# ---- mixed verdicts: the precedence -------------------------------------------------------------


def test_full_beats_down_stale_and_shape() -> None:
    # A peer that answers with the shape decides, whatever else is down, stale or different.
    others = (down("cw-b"), stale("cw-c"), a100_only("cw-d"))
    assert codes([job("j")], full("cw-a"), *others) == {"j": ReasonCode.NoCapacity}
    assert codes([job("j", pin="cw-a")], full("cw-a"), *others) == {"j": ReasonCode.PinnedPeerFull}


def test_down_beats_stale_beats_shape() -> None:
    assert codes([job("j")], down("cw-b"), stale("cw-c"), a100_only("cw-d")) == {
        "j": ReasonCode.PeerUnreachable
    }
    assert codes([job("j")], stale("cw-c"), a100_only("cw-d")) == {"j": ReasonCode.PeerStale}


def test_priority_beats_full_elsewhere() -> None:
    jobs = [job("old", submit_ms=1), job("young", submit_ms=2)]
    assert codes(jobs, roomy("cw-a", 8), full("cw-b"), down("cw-c")) == {"young": ReasonCode.Priority}


def test_reason_code_precedence_on_verdicts() -> None:
    def v(kind: WaitKind) -> PeerVerdict:
        return PeerVerdict(kind=kind, peer_ids=[kind.value], message=kind.value)

    order = [WaitKind.FULL, WaitKind.UNREACHABLE, WaitKind.STALE, WaitKind.NO_SHAPE]
    expected = [
        ReasonCode.NoCapacity,
        ReasonCode.PeerUnreachable,
        ReasonCode.PeerStale,
        ReasonCode.ShapeMismatch,
    ]
    for i, code in enumerate(expected):
        # Every kind after this one in the order is present too: the first one present decides.
        verdicts = [v(k) for k in order[i:]]
        assert reason_code(None, verdicts, alone_fits=False) is code
        assert reason_code(None, verdicts[::-1], alone_fits=False) is code
        assert reason_code(None, verdicts, alone_fits=True) is ReasonCode.Priority
    assert reason_code("cw-a", [v(WaitKind.FULL)], alone_fits=False) is ReasonCode.PinnedPeerFull
    assert reason_code("cw-a", [v(WaitKind.PER_TICK_CAP)], alone_fits=False) is ReasonCode.PinnedPeerFull
    assert reason_code(None, [v(WaitKind.UNKNOWN_PEER)], alone_fits=False) is ReasonCode.ShapeMismatch
    assert reason_code(None, [], alone_fits=False) is ReasonCode.ShapeMismatch


def test_jobs_with_the_same_verdicts_but_different_codes_are_not_merged() -> None:
    # cw-a: 8 free in the east, none in the west. The east job takes the east chips; then the
    # unconstrained job and the west job both end the tick "full on cw-a (needs 8 h100), 0
    # available", but only the unconstrained one had room before the east job took it.
    cw_a = peer(
        "cw-a",
        backend("e", gpu_attrs("h100", region="east"), free={"h100": 8}),
        backend("w", gpu_attrs("h100", region="west"), free={"h100": 0}),
    )
    jobs = [
        job("east", submit_ms=1, constraints=(eq("region", "east"),)),
        job("any", submit_ms=2),
        job("west", submit_ms=3, constraints=(eq("region", "west"),)),
    ]
    for planner in (plan, plan_reference):
        result = planner(
            jobs,
            home=HOME,
            reports=[peer(HOME, cpu_backend()), cw_a],
            now_ms=NOW,
            stale_after_ms=STALE,
            backfill=NO_BACKFILL,
        )
        assert result.placement_for("east") is not None
        waiting = {j: g for g in result.waiting for j in g.job_ids}
        assert waiting["any"].summary == waiting["west"].summary
        assert [v.message for v in waiting["any"].verdicts] == [v.message for v in waiting["west"].verdicts]
        assert (waiting["any"].code, waiting["west"].code) == (ReasonCode.Priority, ReasonCode.NoCapacity)
        assert len(result.waiting) == 2


def test_every_waiting_code_is_a_waiting_code() -> None:
    produced = {
        ReasonCode.NoCapacity,
        ReasonCode.PinnedPeerFull,
        ReasonCode.Priority,
        ReasonCode.UserQuota,
        ReasonCode.PeerUnreachable,
        ReasonCode.PeerStale,
        ReasonCode.ShapeMismatch,
    }
    assert produced <= WAITING_CODES
    assert all(c.waiting for c in produced)
    assert not ReasonCode.Succeeded.waiting and not ReasonCode.HandoffRefused.waiting


# ---- properties over random federations and queues -----------------------------------------------


@SETTINGS
@given(s=scenarios())
def test_priority_means_placed_if_it_were_alone_in_the_queue(s: Scenario) -> None:
    queue, _, _, _ = s
    result = run(s)
    by_id = {j.job_id: j for j in queue}
    for group in result.waiting:
        if group.code is ReasonCode.Reserved:  # held for (backfill), whether it fitted alone or not
            assert all(result.hold_for(job_id) is not None for job_id in group.job_ids)
            continue
        for job_id in group.job_ids:
            alone = run(s, [by_id[job_id]])
            placed_alone = alone.placement_for(job_id) is not None
            assert placed_alone == (group.code is ReasonCode.Priority), (job_id, group.code, group.summary)


@SETTINGS
@given(s=scenarios())
def test_each_code_is_the_verdicts_precedence(s: Scenario) -> None:
    queue, _, _, _ = s
    result = run(s)
    by_id = {j.job_id: j for j in queue}
    for group in result.waiting:
        kinds = {v.kind for v in group.verdicts}
        code = group.code
        assert code in WAITING_CODES and code is not ReasonCode.Pending
        held = [result.hold_for(j) is not None for j in group.job_ids]
        assert held == [code is ReasonCode.Reserved] * len(held)
        if code in (ReasonCode.Priority, ReasonCode.Reserved):
            continue
        answered = kinds & {WaitKind.FULL, WaitKind.PER_TICK_CAP}
        pinned = {bool(by_id[j].target_cluster) for j in group.job_ids}
        if code in (ReasonCode.NoCapacity, ReasonCode.PinnedPeerFull):
            assert answered
            assert pinned == {code is ReasonCode.PinnedPeerFull}
        elif code is ReasonCode.PeerUnreachable:
            assert not answered and WaitKind.UNREACHABLE in kinds
        elif code is ReasonCode.PeerStale:
            assert not answered and WaitKind.UNREACHABLE not in kinds and WaitKind.STALE in kinds
        else:
            assert code is ReasonCode.ShapeMismatch
            assert kinds <= {WaitKind.NO_SHAPE, WaitKind.UNKNOWN_PEER}


# ---- the documentation -----------------------------------------------------------------------------


def test_the_design_table_lists_exactly_the_codes() -> None:
    design = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    section = design.split("\n### Reason codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = [row.split("|")[1].strip().strip("`") for row in rows]
    assert len(listed) == len(set(listed)), "a code is listed twice"
    assert set(listed) == {code.value for code in ReasonCode}
    # Each row says what the code means, where it appears and what produces it.
    assert all(len([c for c in row.split("|")[1:-1] if c.strip()]) == 4 for row in rows)
