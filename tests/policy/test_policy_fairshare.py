"""Fair share between users within a band, aging and per-user caps (docs/DESIGN.md, "Fair share and
aging"; iris/policy/fairshare.py).

What is proved here, each over random inputs:

- the planner and its reference agree with users, devices in use, any aging horizon and caps;
- a job's turn never depends on the jobs after it: removing one leaves every turn before its own,
  and what those turns placed, unchanged;
- smaller share first: of two users' equal jobs submitted together, the one whose user holds the
  smaller dominant share has its turn first;
- no more than a fair share while another waits: one tick, one band, equal one-chip jobs submitted
  within ``w`` ms. If user B still has a job waiting when the tick ends, then user A's chips after
  the tick are at most B's + 1 + ``w × T / H`` (``T`` the token's total, ``H`` the aging horizon): A
  holds at most one job more than B, plus what the spread of submit times lets aging give it;
- aging bounds every wait: one pool of ``C`` chips, one-chip jobs of one band that each run ``D``
  ticks, any arrivals and users. A job ``j`` submitted at tick ``t`` is placed by tick
  ``t + D × (⌊ahead(j) / C⌋ + 1)``, where ``ahead(j)`` counts the jobs not placed before tick ``t``
  that are other users' submitted no later than ``t + H``, or its own user's submitted before it:
  with bounded arrivals, a bounded number. (Why: at a tick where ``j`` waits, every chip is taken by
  jobs whose turn came before ``j``'s; a user's jobs take turns in submit order, and a share of at
  most 1 makes another user's job that goes first one submitted at most ``H`` after ``j``. Every
  chip frees within ``D`` ticks and goes to such a job again while ``j`` waits.) With several bands,
  the jobs of higher bands count too; with gangs of several sizes, a job that does not fit is
  passed over, and only backfill protection (not part of this) bounds its wait.
"""

from __future__ import annotations

from collections import Counter

import pytest
from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_factories import NOW, STALE, backend, gpu_attrs, h100, peer
from pydantic import ValidationError
from test_policy_properties import HOME, federations, job_shapes

from iris.config import QuotasConfig
from iris.policy import (
    Band,
    DeviceRequest,
    Disposition,
    FairShare,
    JobShape,
    PeerReport,
    Quotas,
    classify,
    plan,
    plan_reference,
)
from iris.policy.fairshare import Shares, account, federation_totals, fill_order, user_shares
from iris.policy.queue import dry_run, queue_positions
from iris.policy.reasons import ReasonCode
from iris.policy.reference import plan_turns

SETTINGS = settings(max_examples=scaled(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
USERS = ("alice", "bob", "carol")


def one_chip(
    job_id: str, *, user: str = "", submit_ms: int = 0, band: Band = Band.BATCH, n: int = 1
) -> JobShape:
    return JobShape(
        job_id=job_id,
        user=user,
        device=DeviceRequest(type="gpu", variant="h100", count=n),
        band=band,
        submit_ms=submit_ms,
    )


def pool(free: int, *, total: int | None = None) -> list[PeerReport]:
    """One home cluster with one h100 backend: ``free`` idle of ``total`` chips."""
    b = backend("b0", gpu_attrs("h100"), free={"h100": free})
    assert b.availability is not None
    if total is not None:
        b.availability.total_amounts = {"h100": total}
    return [peer(HOME, b)]


def tick(jobs, reports, *, in_use=(), policy=None):  # type: ignore[no-untyped-def]
    return plan(
        jobs,
        home=HOME,
        reports=reports,
        now_ms=NOW,
        stale_after_ms=STALE,
        in_use=in_use,
        fair_share=policy,
    )


# --- the planner agrees with its reference ---


@st.composite
def fair_scenarios(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    reports, reservations = draw(federations())
    ids = [r.peer_id for r in reports]
    jobs = []
    for i in range(draw(st.integers(0, 16))):
        shape = draw(job_shapes(f"{draw(st.sampled_from(USERS))}/job-{i}", ids))
        # Some shapes name their user, older ones leave it to the job id's prefix.
        user = draw(st.sampled_from(("", account(shape))))
        jobs.append(shape.model_copy(update={"user": user, "submit_ms": draw(st.integers(0, 5_000))}))
    in_use = [
        draw(job_shapes(f"{draw(st.sampled_from(USERS))}/running-{i}", ids))
        for i in range(draw(st.integers(0, 6)))
    ]
    quotas = Quotas(
        max_devices_per_user=draw(st.sampled_from((None, None, 4, 8, 16))),
        per_band=draw(st.dictionaries(st.sampled_from(list(Band)), st.integers(1, 16), max_size=2)),
    )
    policy = FairShare(aging_horizon_ms=draw(st.sampled_from((0, 1_000, 600_000))), quotas=quotas)
    cap = draw(st.sampled_from((None, None, 1, 2, 3)))
    return jobs, reports, reservations, cap, in_use, policy


def tick_args(reports, reservations, cap, in_use, policy):  # type: ignore[no-untyped-def]
    """The tick's keyword arguments for one drawn scenario (planner and reference alike)."""
    return dict(
        home=HOME,
        reports=reports,
        reservations=reservations,
        now_ms=NOW,
        stale_after_ms=STALE,
        max_per_peer=cap,
        in_use=in_use,
        fair_share=policy,
    )


@SETTINGS
@given(fair_scenarios())
def test_planner_agrees_with_the_reference_under_fair_share(s) -> None:  # type: ignore[no-untyped-def]
    jobs, reports, reservations, cap, in_use, policy = s
    args = tick_args(reports, reservations, cap, in_use, policy)
    result = plan(jobs, **args)  # type: ignore[arg-type]
    assert result == plan_reference(jobs, **args)  # type: ignore[arg-type]
    outcomes = [p.job_id for p in result.placements] + result.expired
    outcomes += [j for g in result.waiting for j in g.job_ids]
    assert sorted(outcomes) == sorted({j.job_id for j in jobs})


@SETTINGS
@given(fair_scenarios(), st.data())
def test_removing_a_job_changes_nothing_for_the_jobs_whose_turn_came_before_it(s, data) -> None:  # type: ignore[no-untyped-def]
    """A job's turn never depends on the jobs after it: the tick up to its turn is the same without it."""
    jobs, reports, reservations, cap, in_use, policy = s
    if not jobs:
        return
    args = tick_args(reports, reservations, cap, in_use, policy)
    before, turns = plan_turns(jobs, **args)  # type: ignore[arg-type]
    removed = data.draw(st.sampled_from(turns))
    after, turns_after = plan_turns([j for j in jobs if j.job_id != removed], **args)  # type: ignore[arg-type]
    cut = turns.index(removed)
    assert turns_after[:cut] == turns[:cut]
    ahead = set(turns[:cut])
    assert [p for p in before.placements if p.job_id in ahead] == [
        p for p in after.placements if p.job_id in ahead
    ]


def test_no_fair_share_is_the_fifo_order() -> None:
    jobs = [one_chip(f"{u}/j{i}", submit_ms=i * 10 + k) for i in range(5) for k, u in enumerate(USERS)]
    running = [one_chip("alice/big", n=8)]
    result = tick(jobs, pool(6, total=16), in_use=running, policy=FairShare(aging_horizon_ms=0))
    fifo = sorted(jobs, key=lambda j: (j.submit_ms, j.job_id))
    assert [p.job_id for p in result.placements] == [j.job_id for j in fifo[:6]]


# --- smaller share first ---


@SETTINGS
@given(
    st.integers(0, 16),
    st.integers(0, 16),
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.integers(1, 3_600_000),
)
def test_of_two_equal_jobs_the_user_with_the_smaller_share_goes_first(
    held_a: int, held_b: int, submit: int, other: int, horizon: int
) -> None:
    running = [one_chip(f"alice/run-{i}") for i in range(held_a)] + [
        one_chip(f"bob/run-{i}") for i in range(held_b)
    ]
    # Both submitted at the same time; B's job also once a moment later and once earlier.
    a = one_chip("alice/next", submit_ms=submit)
    b = one_chip("bob/next", submit_ms=submit)
    result = tick([b, a], pool(1, total=40), in_use=running, policy=FairShare(aging_horizon_ms=horizon))
    (placed,) = result.placements
    if held_a < held_b:
        assert placed.job_id == "alice/next"
    elif held_b < held_a:
        assert placed.job_id == "bob/next"
    else:
        assert placed.job_id == "alice/next"  # equal shares: the job id breaks the tie
    # The general rule: the smaller virtual submit time (submit + horizon × share) goes first.
    late = one_chip("bob/next", submit_ms=other)
    result = tick([late, a], pool(1, total=40), in_use=running, policy=FairShare(aging_horizon_ms=horizon))
    va = (submit + horizon * (held_a / 40), submit, "alice/next")
    vb = (other + horizon * (held_b / 40), other, "bob/next")
    assert result.placements[0].job_id == min(va, vb)[2]


def test_progressive_filling_alternates_users_within_one_tick() -> None:
    # Alice queued 500 jobs before Bob's 5; 10 chips free of 40: they alternate, Alice first.
    jobs = [one_chip(f"alice/j{i:03d}", submit_ms=i) for i in range(500)]
    jobs += [one_chip(f"bob/j{i}", submit_ms=600 + i) for i in range(5)]
    result = tick(jobs, pool(10, total=40))
    users = [p.job_id.split("/")[0] for p in result.placements]
    assert users == ["alice", "bob"] * 5
    # Without fair share Alice's backlog takes every chip.
    fifo = tick(jobs, pool(10, total=40), policy=FairShare(aging_horizon_ms=0))
    assert {p.job_id.split("/")[0] for p in fifo.placements} == {"alice"}


@SETTINGS
@given(
    st.integers(1, 20),
    st.integers(0, 10),
    st.integers(0, 10),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 5_000),
    st.sampled_from((1_000, 60_000, 600_000)),
    st.randoms(use_true_random=False),
)
def test_a_heavy_submitter_gets_no_more_than_its_share_while_another_waits(
    free: int,
    held_a: int,
    held_b: int,
    queued_a: int,
    queued_b: int,
    window: int,
    horizon: int,
    rnd,  # type: ignore[no-untyped-def]
) -> None:
    total = 40
    running = [one_chip(f"alice/run-{i}") for i in range(held_a)]
    running += [one_chip(f"bob/run-{i}") for i in range(held_b)]
    jobs = [one_chip(f"alice/j{i}", submit_ms=rnd.randint(0, window)) for i in range(queued_a)]
    jobs += [one_chip(f"bob/j{i}", submit_ms=rnd.randint(0, window)) for i in range(queued_b)]
    result = tick(jobs, pool(free, total=total), in_use=running, policy=FairShare(aging_horizon_ms=horizon))
    placed = Counter(p.job_id.split("/")[0] for p in result.placements)
    assert sum(placed.values()) == min(free, len(jobs))
    after_a, after_b = held_a + placed["alice"], held_b + placed["bob"]
    allowance = window * total / horizon + 1e-9
    # Of two users still waiting, the one that was placed anything ends at most one job (plus the
    # aging allowance) above the other.
    if placed["alice"] and placed["bob"] < queued_b:
        assert after_a <= after_b + 1 + allowance
    if placed["bob"] and placed["alice"] < queued_a:
        assert after_b <= after_a + 1 + allowance


# --- aging bounds every wait ---


@settings(SETTINGS, max_examples=scaled(60))
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from((1_000, 3_000, 10_000)),
    st.lists(
        st.lists(st.sampled_from(("heavy", "heavy", "heavy", "light", "other")), max_size=4), max_size=30
    ),
)
def test_aging_bounds_every_wait(chips: int, duration: int, horizon: int, arrivals: list[list[str]]) -> None:
    """The simulation of the module docstring's bound: ticks 1 s apart, the real planner each tick."""
    policy = FairShare(aging_horizon_ms=horizon)
    running: dict[str, tuple[JobShape, int]] = {}  # job id -> (shape, tick it ends)
    queue: dict[str, JobShape] = {}
    submitted: dict[str, int] = {}
    placed_at: dict[str, int] = {}
    horizon_ticks = horizon // 1000
    t = 0
    while t < len(arrivals) or queue:
        for job_id in [j for j, (_, end) in running.items() if end <= t]:
            del running[job_id]
        for k, user in enumerate(arrivals[t] if t < len(arrivals) else ()):
            job = one_chip(f"{user}/t{t}-{k}", submit_ms=t * 1000)
            queue[job.job_id] = job
            submitted[job.job_id] = t
        b = backend("b0", gpu_attrs("h100"), free={"h100": chips - len(running)}, epoch=t)
        assert b.availability is not None
        b.availability.total_amounts = {"h100": chips}
        result = plan(
            list(queue.values()),
            home=HOME,
            reports=[peer(HOME, b, last_contact_ms=t * 1000)],
            now_ms=t * 1000,
            stale_after_ms=STALE,
            in_use=[shape for shape, _ in running.values()],
            fair_share=policy,
        )
        for p in result.placements:
            running[p.job_id] = (queue.pop(p.job_id), t + duration)
            placed_at[p.job_id] = t
        t += 1
        assert t < 10_000, "the queue never drained"
    for job_id, at in submitted.items():
        # The jobs whose turn may come before its own, not placed before its tick (waiting then,
        # or arriving later): another user's submitted by t + H, its own user's submitted before it.
        user = job_id.split("/")[0]
        ahead = [
            other
            for other, s in submitted.items()
            if placed_at[other] >= at
            and (
                (other.split("/")[0] != user and s <= at + horizon_ticks)
                or (other.split("/")[0] == user and (s, other) < (at, job_id))
            )
        ]
        assert placed_at[job_id] - at <= duration * (len(ahead) // chips + 1)


# --- caps ---


def test_a_user_at_its_cap_waits_with_user_quota_and_others_go_on() -> None:
    policy = FairShare(quotas=Quotas(max_devices_per_user=8))
    running = [one_chip("alice/run", n=6)]
    jobs = [one_chip("alice/next", n=4, submit_ms=0), one_chip("bob/next", n=4, submit_ms=1)]
    result = tick(jobs, pool(16), in_use=running, policy=policy)
    assert [p.job_id for p in result.placements] == ["bob/next"]
    why = result.explain("alice/next")
    assert why is not None and why.code is ReasonCode.UserQuota and not why.verdicts
    assert why.summary == "Queued: user alice is at its cap of 8 devices in use (needs 4)"
    # Room within the cap: placed.
    assert [
        p.job_id
        for p in tick([one_chip("alice/two", n=2)], pool(16), in_use=running, policy=policy).placements
    ]


def test_the_cap_counts_what_the_tick_placed_and_the_band_cap_only_its_band() -> None:
    policy = FairShare(quotas=Quotas(per_band={Band.BATCH: 4}))
    jobs = [one_chip(f"alice/b{i}", n=2, submit_ms=i) for i in range(3)]
    jobs.append(one_chip("alice/i0", n=4, band=Band.INTERACTIVE, submit_ms=9))
    result = tick(jobs, pool(16), policy=policy)
    assert sorted(p.job_id for p in result.placements) == ["alice/b0", "alice/b1", "alice/i0"]
    why = result.explain("alice/b2")
    assert why is not None and why.code is ReasonCode.UserQuota
    assert why.summary == "Queued: user alice is at its cap of 4 devices in use at band batch (needs 2)"


def test_a_job_larger_than_the_cap_says_so_and_cpu_jobs_are_not_capped() -> None:
    policy = FairShare(quotas=Quotas(max_devices_per_user=4))
    big = one_chip("alice/big", n=8)
    cpu = JobShape(job_id="alice/cpu", device=DeviceRequest(replicas=2))
    reports = [peer(HOME, h100("b0", 16), backend("cpu", {"device-type": ["cpu"]}, free={"cpu": 4}))]
    result = tick([big, cpu], reports, policy=policy)
    assert [p.job_id for p in result.placements] == ["alice/cpu"]
    why = result.explain("alice/big")
    assert why is not None and why.summary == "Queued: needs 8 devices, more than the cap of 4 per user"


def test_quotas_config() -> None:
    q = QuotasConfig.model_validate({"max_devices_per_user": 32, "per_band": {"batch": 16}})
    assert q.policy() == Quotas(max_devices_per_user=32, per_band={Band.BATCH: 16})
    assert QuotasConfig().policy() == Quotas() and not Quotas().any
    with pytest.raises(ValidationError):
        QuotasConfig.model_validate({"per_band": {"urgent": 4}})
    with pytest.raises(ValidationError):
        QuotasConfig.model_validate({"per_band": {"batch": 0}})
    with pytest.raises(ValidationError):
        QuotasConfig.model_validate({"max_devices": 4})


# --- shares, totals and the queue as jobs see it ---


def test_the_share_is_the_dominant_token_over_known_totals_at_most_one() -> None:
    reports = [
        peer(HOME, h100("b0", 8, held={Band.BATCH: 8})),
        peer("cw", backend("a", gpu_attrs("a100"), free={"a100": 4})),
    ]
    totals = federation_totals(reports)
    assert totals == {"h100": 16, "a100": 4}
    a100 = JobShape(job_id="bob/a", device=DeviceRequest(type="gpu", variant="a100", count=2))
    tpu = JobShape(job_id="carol/t", device=DeviceRequest(type="tpu", variant="v5p", count=4))
    shares = Shares([one_chip("alice/r", n=4), a100, tpu, one_chip("dave/r", n=64)], totals, FairShare())
    assert shares.share("alice") == 0.25
    assert shares.share("bob") == 0.5
    assert shares.share("carol") == 0.0  # ungated: no token, no share (a quota still counts it)
    assert shares.devices["carol"] == 4
    assert shares.share("dave") == 1.0
    assert account(JobShape(job_id="eve/x")) == "eve"
    assert account(JobShape(job_id="eve/x", user="eve@example.com")) == "eve@example.com"


def test_queue_positions_follow_the_fill_order() -> None:
    jobs = [one_chip(f"alice/j{i}", submit_ms=i) for i in range(3)]
    jobs.append(one_chip("bob/j0", submit_ms=10))
    reports = pool(0, total=4)
    order = [j.job_id for j in fill_order(jobs, reports=reports)]
    assert order == ["alice/j0", "bob/j0", "alice/j1", "alice/j2"]
    positions = queue_positions(jobs, reports=reports)
    assert positions["bob/j0"].position == 2 and positions["alice/j2"].position == 4
    # Bob already holding the whole pool: last.
    held = [one_chip("bob/run", n=4)]
    positions = queue_positions(jobs, reports=reports, in_use=held)
    assert positions["bob/j0"].position == 4
    # Plain FIFO with no horizon.
    positions = queue_positions(jobs, reports=reports, fair_share=FairShare(aging_horizon_ms=0))
    assert positions["bob/j0"].position == 4


def test_dry_run_pinned_copies_do_not_spend_each_others_cap() -> None:
    policy = FairShare(quotas=Quotas(max_devices_per_user=8))
    reports = [peer(HOME, h100("b0", 0)), peer("cw-a", h100("b0", 8)), peer("cw-b", h100("b0", 8))]
    job = one_chip("alice/new", n=8)
    report = dry_run(
        job, home=HOME, reports=reports, queue=[], now_ms=NOW, stale_after_ms=STALE, fair_share=policy
    )
    assert report.placement is not None
    outlooks = {p: v.outlook.value for v in report.verdicts for p in v.peer_ids}
    assert outlooks["cw-a"] in ("chosen", "fits") and outlooks["cw-b"] in ("chosen", "fits")
    capped = dry_run(
        job,
        home=HOME,
        reports=reports,
        queue=[],
        now_ms=NOW,
        stale_after_ms=STALE,
        fair_share=policy,
        in_use=[one_chip("alice/run", n=4)],
    )
    assert capped.placement is None and capped.code is ReasonCode.UserQuota


def test_a_job_home_could_run_at_once_is_queued_when_its_user_is_at_a_cap() -> None:
    quotas = Quotas(max_devices_per_user=8)
    reports = [peer(HOME, h100("b0", 16))]
    job = one_chip("alice/next", n=4)

    def classified(held: dict[str, dict[Band, int]], pin: str | None = None):  # type: ignore[no-untyped-def]
        shape = job.model_copy(update={"target_cluster": pin})
        return classify(
            shape, home=HOME, reports=reports, now_ms=NOW, stale_after_ms=STALE, held=held, quotas=quotas
        )

    assert classified({}).disposition is Disposition.LOCAL
    assert classified({"alice": {Band.INTERACTIVE: 4}}).disposition is Disposition.LOCAL
    capped = classified({"alice": {Band.INTERACTIVE: 6}})
    assert (
        capped.disposition is Disposition.QUEUE and capped.pinned_cluster is None and capped.placement is None
    )
    assert capped.reason == "Queued: user alice is at its cap of 8 devices in use (needs 4)"
    pinned = classified({"alice": {Band.BATCH: 6}}, pin=HOME)
    assert pinned.disposition is Disposition.QUEUE and pinned.pinned_cluster == HOME
    # Another user's devices are not alice's.
    assert classified({"bob": {Band.BATCH: 16}}).disposition is Disposition.LOCAL
    # The dry-run says the same, and the tick's code for the wait.
    report = dry_run(
        job,
        home=HOME,
        reports=reports,
        queue=[],
        now_ms=NOW,
        stale_after_ms=STALE,
        in_use=[one_chip("alice/run", n=6)],
        fair_share=FairShare(quotas=quotas),
    )
    assert report.disposition is Disposition.QUEUE and report.placement is None
    assert report.code is ReasonCode.UserQuota


def test_user_shares_lists_each_user_holding_devices_with_its_dominant_share() -> None:
    reports = [peer(HOME, h100("b0", 8, held={Band.BATCH: 8}))]
    tpu = JobShape(job_id="carol/t", device=DeviceRequest(type="tpu", variant="v5p", count=4))
    assert user_shares([one_chip("alice/r", n=4), one_chip("bob/r", n=2), tpu], reports, FairShare()) == {
        "alice": 0.25,
        "bob": 0.125,
        "carol": 0.0,  # ungated: devices held, no token to measure a share on
    }
