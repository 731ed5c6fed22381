"""Handoff pacing (docs/DESIGN.md, "Handoff pacing"): each cluster's token bucket, the limits one
tick applies, and the planner honouring them exactly as the reference does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from policy_factories import NOW, STALE, backend, peer
from test_policy_properties import HOME, SETTINGS, federations, job_shapes

from iris.policy import DeviceRequest, HandoffPace, JobShape, PeerLimits, PlanResult, plan, plan_reference
from iris.policy.explain import cap_message, pace_message
from iris.policy.models import WaitKind
from iris.policy.pacing import held_by_cap


def test_a_bucket_starts_full_refills_at_its_rate_and_holds_one_second_at_most() -> None:
    pace = HandoffPace(per_s=10)
    assert pace.allowance(["a"], 0.0) == {"a": 10}
    pace.spend({"a": 10}, 0.0)
    assert pace.allowance(["a"], 0.0) == {"a": 0}
    assert pace.allowance(["a"], 0.35) == {"a": 3}
    # A long quiet spell refills one second's worth, no more.
    assert pace.allowance(["a"], 60.0) == {"a": 10}
    # Each cluster has its own bucket.
    assert pace.allowance(["b"], 60.0) == {"b": 10}


def test_a_slow_rate_still_allows_one_handoff() -> None:
    pace = HandoffPace(per_s=0.5)
    assert pace.allowance(["a"], 0.0) == {"a": 1}
    pace.spend({"a": 1}, 0.0)
    assert pace.allowance(["a"], 1.0) == {"a": 0}
    assert pace.allowance(["a"], 2.0) == {"a": 1}


def test_spending_more_than_the_bucket_holds_leaves_it_empty_not_negative() -> None:
    pace = HandoffPace(per_s=4)
    pace.spend({"a": 9}, 0.0)
    assert pace.allowance(["a"], 0.25) == {"a": 1}


def test_a_clock_that_goes_back_adds_nothing() -> None:
    pace = HandoffPace(per_s=4)
    pace.spend({"a": 4}, 10.0)
    assert pace.allowance(["a"], 9.0) == {"a": 0}
    assert pace.allowance(["a"], 10.5) == {"a": 2}


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HandoffPace(per_s=0)


@SETTINGS
@given(
    st.floats(0.5, 200),
    st.lists(st.tuples(st.floats(0, 3), st.integers(0, 400)), min_size=1, max_size=40),
)
def test_no_window_sends_more_than_the_burst_plus_the_rate(
    per_s: float, ticks: list[tuple[float, int]]
) -> None:
    """Whatever the ticks' timing and wishes, a tick that sends what its allowance says sends, over
    any window [a, b], at most one burst plus the rate × (b - a)."""
    pace = HandoffPace(per_s=per_s)
    sent: list[tuple[float, int]] = []
    now = 0.0
    for gap, wish in ticks:
        now += gap
        n = min(wish, pace.allowance(["a"], now)["a"])
        pace.spend({"a": n}, now)
        sent.append((now, n))
    for i, (a, _) in enumerate(sent):
        total = 0
        for b, n in sent[i:]:
            total += n
            assert total <= pace.burst + per_s * (b - a) + 1e-6


def test_the_lower_of_cap_and_allowance_binds_and_names_itself() -> None:
    limits = PeerLimits(max_per_peer=8, allowance={"paced": 3, "roomy": 20})
    assert limits.limit("paced") == 3 and limits.message("paced") == pace_message()
    assert limits.limit("roomy") == 8 and limits.message("roomy") == cap_message(8)
    assert limits.limit("unpaced") == 8
    assert PeerLimits(allowance={"a": 2}).limit("b") is None
    assert limits.reached("paced", 3) and not limits.reached("paced", 2)
    assert not PeerLimits().reached("a", 10_000)


def _sweep(n: int, *, max_per_peer: int | None = None, allowance: dict[str, int]) -> PlanResult:
    """One tick over ``n`` one-GPU jobs, two peers with 64 H100 each (home has no GPU)."""
    gpu = {"device-type": ["gpu"], "device-variant": ["h100"]}
    reports = [
        peer(HOME),
        peer("cw-a", backend("h100-a", gpu, free={"h100": 64})),
        peer("cw-b", backend("h100-b", gpu, free={"h100": 64})),
    ]
    jobs = [
        JobShape(job_id=f"j{i:03d}", submit_ms=i, device=DeviceRequest(type="gpu", variant="h100", count=1))
        for i in range(n)
    ]
    return plan(
        jobs,
        home=HOME,
        reports=reports,
        now_ms=NOW,
        stale_after_ms=STALE,
        max_per_peer=max_per_peer,
        allowance=allowance,
    )


def test_a_tick_sends_a_paced_cluster_its_allowance_and_the_rest_elsewhere() -> None:
    result = _sweep(12, allowance={"cw-a": 3, "cw-b": 5})
    by_peer: dict[str, int] = {}
    for p in result.placements:
        by_peer[p.peer_id] = by_peer.get(p.peer_id, 0) + 1
    assert by_peer == {"cw-a": 3, "cw-b": 5}
    (group,) = result.waiting
    assert len(group.job_ids) == 4
    peers = [v for v in group.verdicts if HOME not in v.peer_ids]  # home has no GPU backend
    assert {v.kind for v in peers} == {WaitKind.PER_TICK_CAP}
    assert {v.message for v in peers} == {pace_message()}
    assert "handoff rate reached on cw-a, cw-b (paced)" in group.summary
    # Waiting on the pace alone: the next tick comes after the interval, not at once.
    assert not held_by_cap(result)


def test_an_empty_bucket_takes_nothing_this_tick() -> None:
    result = _sweep(4, allowance={"cw-a": 0, "cw-b": 0})
    assert result.placements == []
    assert [len(g.job_ids) for g in result.waiting] == [4]


def test_a_cap_below_the_allowance_binds_and_asks_for_another_tick() -> None:
    result = _sweep(12, max_per_peer=2, allowance={"cw-a": 3, "cw-b": 5})
    assert len(result.placements) == 4
    peers = [v for g in result.waiting for v in g.verdicts if HOME not in v.peer_ids]
    assert {v.message for v in peers} == {cap_message(2)}
    assert held_by_cap(result)


@SETTINGS
@given(st.data())
def test_planner_agrees_with_the_reference_under_pacing(data: st.DataObject) -> None:
    reports, reservations = data.draw(federations())
    ids = [r.peer_id for r in reports]
    jobs = [data.draw(job_shapes(f"job-{i}", ids)) for i in range(data.draw(st.integers(0, 16)))]
    cap = data.draw(st.sampled_from((None, None, 2, 3)))
    allowance = {p: data.draw(st.integers(0, 4)) for p in ids if data.draw(st.booleans())}
    kwargs = {
        "home": HOME,
        "reports": reports,
        "reservations": reservations,
        "now_ms": NOW,
        "stale_after_ms": STALE,
        "max_per_peer": cap,
        "allowance": allowance,
    }
    result = plan(jobs, **kwargs)  # type: ignore[arg-type]
    assert result == plan_reference(jobs, **kwargs)  # type: ignore[arg-type]
    placed: dict[str, int] = {}
    for p in result.placements:
        placed[p.peer_id] = placed.get(p.peer_id, 0) + 1
    limits = PeerLimits(cap, allowance)
    for peer_id, n in placed.items():
        limit = limits.limit(peer_id)
        assert limit is None or n <= limit
