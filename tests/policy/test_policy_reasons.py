"""The pending reason a waiting job is signalled is a function of the situation's substance
(docs/DESIGN.md, "The tick"): which peers wait for what and the job's need. Free counts, held
amounts, observations, a peer's error text, report order and queue position move without changing
it, so the tick's ``explain`` goes out once per change of substance, not once per tick."""

from __future__ import annotations

import random

from budget import scaled
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from policy_factories import EPOCH, NOW, STALE, backend, cpu_backend, gpu_attrs, job, peer

from iris.policy import BackendReport, Band, PeerReport, plan, plan_reference
from iris.policy.availability import Capacity, usable_block
from iris.policy.explain import _SUMMARY_ORDER, summarize
from iris.policy.models import PeerVerdict, WaitKind

SETTINGS = settings(max_examples=scaled(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOME = "marin"
NEED = 8
# What each peer is, for the whole test: the substance the job's reason must be a function of.
SITUATIONS = ("full", "down", "stale", "a100-only")


@st.composite
def full_backend(draw: st.DrawFn, backend_id: str, band: Band, tick: int) -> BackendReport:
    """An h100 backend whose numbers are random but where a ``band`` job needing NEED never fits."""
    free = draw(st.integers(0, NEED - 1))
    held = {b: {"h100": draw(st.integers(0, 16))} for b in draw(st.sets(st.sampled_from(list(Band))))}
    report = backend(
        backend_id,
        gpu_attrs("h100"),
        free={"h100": free},
        held=held,
        epoch=EPOCH + draw(st.integers(0, 10_000)) + tick,
    )
    block = usable_block(report)
    assert block is not None
    assume(Capacity.from_block(block).effective("h100", band) < NEED)
    return report


@st.composite
def federation(draw: st.DrawFn, situations: dict[str, str], band: Band, tick: int) -> list[PeerReport]:
    """One tick's reports: each peer in its situation, with fresh random numbers and error text."""
    reports = [peer(HOME, cpu_backend())]
    for peer_id, situation in situations.items():
        if situation == "down":
            error = draw(st.sampled_from(("connect: refused", "timed out", "UNAVAILABLE: 503")))
            reports.append(
                PeerReport(peer_id=peer_id, reachable=False, error=f"{error} ({draw(st.integers(0, 999))})")
            )
            continue
        if situation == "a100-only":
            a100 = {"a100": draw(st.integers(0, 64))}
            backends = [backend("a", gpu_attrs("a100"), free=a100, epoch=EPOCH + tick)]
        else:
            count = draw(st.integers(1, 3))
            backends = [draw(full_backend(f"b{i}", band, tick)) for i in range(count)]
        last = (
            NOW - STALE - 1 - draw(st.integers(0, 60_000))
            if situation == "stale"
            else NOW - draw(st.integers(0, 9_000))
        )
        reports.append(peer(peer_id, *backends, last_contact_ms=last))
    order = draw(st.permutations(reports))
    return list(order)


@SETTINGS
@given(data=st.data())
def test_a_waiting_jobs_reason_stays_the_same_while_capacity_fluctuates(data: st.DataObject) -> None:
    peers = [f"cw-{c}" for c in "abcde"][: data.draw(st.integers(1, 5))]
    situations = {p: data.draw(st.sampled_from(SITUATIONS)) for p in peers}
    band = data.draw(st.sampled_from(list(Band)))
    # (A job pinned to a peer without its shape is force-routed there, not left waiting.)
    pinned = data.draw(st.sampled_from([None, *(p for p in peers if situations[p] != "a100-only")]))
    waiting = job("alice/waiting", count=NEED, band=band, pin=pinned, submit_ms=5)

    reasons: set[str] = set()
    for tick in range(4):
        reports = data.draw(federation(situations, band, tick))
        # Other jobs ahead of it in the queue, more or fewer each tick (its position moves).
        ahead = [
            job(f"alice/ahead-{i}", count=64, band=Band.PRODUCTION, submit_ms=i) for i in range(tick * 3)
        ]
        jobs = [*ahead, waiting]
        random.Random(tick).shuffle(jobs)
        for planner in (plan, plan_reference):
            result = planner(jobs, home=HOME, reports=reports, now_ms=NOW, stale_after_ms=STALE)
            explanation = result.explain(waiting.job_id)
            assert explanation is not None, "a job that fits nowhere waits"
            reasons.add(explanation.summary)
    assert len(reasons) == 1, reasons


def test_a_change_of_substance_changes_the_reason() -> None:
    waiting = job("alice/waiting", count=NEED)
    h100 = backend("b", gpu_attrs("h100"), free={"h100": 2}, epoch=EPOCH)
    roomy = backend("b", gpu_attrs("h100"), free={"h100": 64}, epoch=EPOCH)

    def reason(*reports: PeerReport) -> str | None:
        result = plan(
            [waiting],
            home=HOME,
            reports=[peer(HOME, cpu_backend()), *reports],
            now_ms=NOW,
            stale_after_ms=STALE,
        )
        explanation = result.explain(waiting.job_id)
        return None if explanation is None else explanation.summary

    queued = "Queued for a federation peer to report free capacity: "
    home = "no matching backend on marin"
    assert (
        reason(peer("cw-a", h100), peer("cw-b", h100)) == f"{queued}full on cw-a, cw-b (needs 8 h100); {home}"
    )
    assert reason(peer("cw-a", h100), peer("cw-b", reachable=False)) == (
        f"{queued}full on cw-a (needs 8 h100); {home}; cw-b unreachable"
    )
    assert reason(peer("cw-a", h100), peer("cw-b", h100, last_contact_ms=NOW - STALE - 1)) == (
        f"{queued}full on cw-a (needs 8 h100); {home}; stale report from cw-b"
    )
    # Room appears: the job is placed, no reason at all.
    assert reason(peer("cw-a", h100), peer("cw-b", roomy)) is None
    # A bigger need is another situation.
    bigger = job("alice/waiting", count=16)
    result = plan(
        [bigger],
        home=HOME,
        reports=[peer(HOME, cpu_backend()), peer("cw-a", h100)],
        now_ms=NOW,
        stale_after_ms=STALE,
    )
    explanation = result.explain(bigger.job_id)
    assert explanation is not None and "(needs 16 h100)" in explanation.summary


def test_summarize_ignores_verdict_order_amounts_and_messages() -> None:
    def verdicts(available: tuple[int, int], error: str) -> list[PeerVerdict]:
        return [
            PeerVerdict(
                kind=WaitKind.FULL,
                peer_ids=["cw-b"],
                message=f"full: {available[0]}",
                token="h100",
                needed=8,
                available=available[0],
            ),
            PeerVerdict(kind=WaitKind.UNREACHABLE, peer_ids=["cw-c"], message=f"unreachable: {error}"),
            PeerVerdict(
                kind=WaitKind.FULL,
                peer_ids=["cw-a"],
                message=f"full: {available[1]}",
                token="h100",
                needed=8,
                available=available[1],
            ),
            PeerVerdict(kind=WaitKind.UNREACHABLE, peer_ids=["cw-d"], message="unreachable"),
        ]

    one = summarize(None, verdicts((0, 7), "refused"))
    queued = "Queued for a federation peer to report free capacity: "
    assert one == f"{queued}full on cw-a, cw-b (needs 8 h100); cw-c, cw-d unreachable"
    assert summarize(None, list(reversed(verdicts((3, 3), "timed out after 5.01s")))) == one
    # Many peers are counted, whatever order they come in.
    many = [PeerVerdict(kind=WaitKind.STALE, peer_ids=[f"p{i}"], message="stale") for i in range(5)]
    assert (
        summarize("p0", many)
        == summarize("p0", many[::-1])
        == "Queued for peer p0 to report free capacity: stale report from 5 peers"
    )


def test_every_kind_of_verdict_has_a_place_in_the_summary() -> None:
    assert sorted(_SUMMARY_ORDER) == sorted(WaitKind)
    assert len(set(_SUMMARY_ORDER)) == len(_SUMMARY_ORDER)
