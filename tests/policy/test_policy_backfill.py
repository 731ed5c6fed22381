"""Backfill (docs/DESIGN.md, "Backfill"; iris/policy/backfill.py): devices are held for a job that
cannot start, on the backend where it can start soonest by the time limits of what runs there; a
later job takes them only if it gives them back by then, or fits in what is spare. The planner and
its reference agree on every hold and placement; in an event simulation where jobs run at most their
limits, no job started after a held one ever moves its start past the first one it was promised."""

from __future__ import annotations

import heapq
import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from policy_factories import NOW, STALE, cpu_backend, h100, job, peer
from test_policy_properties import HOME, SETTINGS, federations, job_shapes

from iris.config import BackfillConfig, ConfigError, load_config
from iris.policy import Backfill, Band, FairShare, JobShape, PeerReport, PlanResult, plan, plan_reference
from iris.policy.availability import gate
from iris.policy.models import RunningOn
from iris.policy.reasons import ReasonCode

MIN = 60_000
BackfillScenario = tuple[list[JobShape], list[PeerReport], list[JobShape], int | None]


def running(job_id: str, peer_id: str, count: int, since_ms: int, limit_ms: int) -> JobShape:
    shape = job(job_id, count=count)
    return shape.model_copy(
        update={
            "running_on": RunningOn(peer_id=peer_id, backend_id="b", since_ms=since_ms),
            "time_limit_ms": limit_ms,
        }
    )


def limited(
    job_id: str, count: int, limit_ms: int | None, submit_ms: int, band: Band = Band.BATCH
) -> JobShape:
    return job(job_id, count=count, band=band, submit_ms=submit_ms).model_copy(
        update={"time_limit_ms": limit_ms}
    )


def tick(
    jobs: list[JobShape],
    reports: list[PeerReport],
    in_use: list[JobShape],
    backfill: Backfill | None = None,
    now_ms: int = NOW,
    max_per_peer: int | None = None,
) -> PlanResult:
    kwargs = {
        "home": HOME,
        "reports": [peer(HOME, cpu_backend()), *reports],
        "now_ms": now_ms,
        "stale_after_ms": STALE,
        "in_use": in_use,
        "backfill": backfill,
        "max_per_peer": max_per_peer,
    }
    result = plan(jobs, **kwargs)  # type: ignore[arg-type]
    assert result == plan_reference(jobs, **kwargs)  # type: ignore[arg-type]
    return result


# ---- one peer of 8 H100: 6 busy (two jobs, ending in 10 and 30 minutes), 2 free ------------------

BUSY = [
    running("r/short", "cw-a", 4, since_ms=NOW - 50 * MIN, limit_ms=60 * MIN),  # ends in 10 min
    running("r/long", "cw-a", 2, since_ms=NOW - 30 * MIN, limit_ms=60 * MIN),  # ends in 30 min
]
CW_A = [peer("cw-a", h100("b", 2))]


def test_a_gang_that_cannot_start_gets_devices_held_where_it_starts_soonest() -> None:
    result = tick([limited("a/gang", 6, None, 1)], CW_A, BUSY)
    hold = result.hold_for("a/gang")
    assert hold is not None
    # 2 free + 4 back in 10 minutes = 6: held from then, none spare.
    assert (hold.peer_id, hold.backend_id, hold.token, hold.amount) == ("cw-a", "b", "h100", 6)
    assert (hold.start_ms, hold.spare) == (NOW + 10 * MIN, 0)
    explained = result.explain("a/gang")
    assert explained is not None and explained.code is ReasonCode.Reserved and explained.hold == hold
    assert explained.summary.endswith("; 6 h100 held for it on cw-a")


def test_a_job_that_ends_before_the_held_start_is_backfilled_ahead_of_the_gang() -> None:
    jobs = [
        limited("a/gang", 6, None, 1),
        limited("b/short", 2, 5 * MIN, 2),
        limited("c/long", 2, 60 * MIN, 3),
    ]
    result = tick(jobs, CW_A, BUSY)
    placed = result.placement_for("b/short")
    assert placed is not None and placed.ahead_of == "a/gang"
    assert "ahead of a/gang (backfill: its time limit ends before that job's reserved start)" in placed.reason
    # The long one would still hold 2 chips when the gang is due: it waits, and says the backend had
    # room only for jobs ahead of it (alone, it would have gone: Priority), with what is spare.
    assert result.placement_for("c/long") is None
    explained = result.explain("c/long")
    assert explained is not None and explained.code is ReasonCode.Priority
    verdict = explained.for_peer("cw-a")
    assert verdict is not None and (verdict.needed, verdict.available) == (2, 0)


def test_a_job_that_fits_in_the_spare_devices_may_run_past_the_held_start() -> None:
    # 4 free now, 4 back in 10 minutes: a 6-chip gang is held from then with 2 spare.
    busy = [running("r/short", "cw-a", 4, since_ms=NOW - 50 * MIN, limit_ms=60 * MIN)]
    jobs = [
        limited("a/gang", 6, None, 1),
        limited("b/long", 2, 600 * MIN, 2),
        limited("c/long", 2, 600 * MIN, 3),
    ]
    result = tick(jobs, [peer("cw-a", h100("b", 4))], busy)
    hold = result.hold_for("a/gang")
    assert hold is not None and hold.start_ms == NOW + 10 * MIN
    first = result.placement_for("b/long")
    assert first is not None and first.ahead_of is None  # it took the spare, nothing the gang needs
    assert result.placement_for("c/long") is None and hold.spare == 0


def test_a_higher_band_is_never_held_back_by_a_lower_bands_hold() -> None:
    # Its turn comes first, every tick: the batch gang's hold does not exist yet when it goes.
    jobs = [limited("a/gang", 6, None, 1), limited("p/prod", 2, 600 * MIN, 2, band=Band.PRODUCTION)]
    result = tick(jobs, CW_A, BUSY)
    assert result.placement_for("p/prod") is not None
    assert result.hold_for("a/gang") is not None and result.hold_for("a/gang").start_ms == NOW + 30 * MIN  # type: ignore[union-attr]


def test_no_hold_where_nothing_is_known_to_end_and_none_with_backfill_off() -> None:
    # Busy devices whose jobs the tick does not know (run by someone else, or stored before jobs kept
    # where they run) never come back in its reckoning: nothing to hold, the small job goes.
    jobs = [limited("a/gang", 6, None, 1), limited("c/long", 2, 600 * MIN, 2)]
    result = tick(jobs, CW_A, [])
    assert result.holds == [] and result.placement_for("c/long") is not None
    result = tick(jobs, CW_A, BUSY, backfill=Backfill(enabled=False))
    assert result.holds == [] and result.placement_for("c/long") is not None
    explained = result.explain("a/gang")
    assert explained is not None and explained.code is ReasonCode.NoCapacity


def test_a_peer_at_its_per_tick_cap_holds_for_no_one() -> None:
    jobs = [limited("b/first", 2, None, 1), limited("a/gang", 6, None, 2)]
    result = tick(jobs, CW_A, BUSY, max_per_peer=1)
    assert result.placement_for("b/first") is not None and result.holds == []


def test_band_defaults_stand_in_for_a_missing_time_limit() -> None:
    settings = Backfill(default_limit_ms={Band.BATCH: 5 * MIN})
    jobs = [limited("a/gang", 6, None, 1), limited("b/unlimited", 2, None, 2)]
    # Its band's default (5 minutes) ends before the gang's start (10 minutes): backfilled.
    placed = tick(jobs, CW_A, BUSY, backfill=settings).placement_for("b/unlimited")
    assert placed is not None and placed.ahead_of == "a/gang"
    # With the shipped defaults (a day for batch), it would hold the gang's chips: it waits.
    assert tick(jobs, CW_A, BUSY).placement_for("b/unlimited") is None


# ---- the planner and its reference agree on random federations with running jobs ------------------


@st.composite
def backfill_scenarios(draw: st.DrawFn) -> BackfillScenario:
    reports, _ = draw(federations())
    ids = [r.peer_id for r in reports]
    queue = [draw(job_shapes(f"u{i % 3}/j{i}", ids)) for i in range(draw(st.integers(0, 10)))]
    in_use: list[JobShape] = []
    for i in range(draw(st.integers(0, 8))):
        shape = draw(job_shapes(f"u{i % 3}/r{i}", ids))
        where = draw(st.sampled_from(ids))
        in_use.append(
            shape.model_copy(
                update={
                    "running_on": RunningOn(
                        peer_id=where,
                        backend_id=f"b{draw(st.integers(0, 2))}",
                        since_ms=NOW - draw(st.sampled_from((0, MIN, 50 * MIN, 600 * MIN))),
                    )
                }
            )
        )
    return queue, reports, in_use, draw(st.sampled_from((None, None, 1, 2)))


@SETTINGS
@given(s=backfill_scenarios())
def test_planner_agrees_with_the_reference_on_holds_and_backfills(
    s: BackfillScenario,
) -> None:
    queue, reports, in_use, cap = s
    kwargs = {
        "home": HOME,
        "reports": reports,
        "now_ms": NOW,
        "stale_after_ms": STALE,
        "in_use": in_use,
        "max_per_peer": cap,
    }
    result = plan(queue, **kwargs)  # type: ignore[arg-type]
    assert result == plan_reference(queue, **kwargs)  # type: ignore[arg-type]
    # One hold per backend and token; every backfilled placement names a job held for.
    slots = [(h.peer_id, h.backend_id, h.token) for h in result.holds]
    assert len(slots) == len(set(slots))
    held = {h.job_id for h in result.holds}
    assert {p.ahead_of for p in result.placements if p.ahead_of is not None} <= held


# ---- EASY's promise, by simulation -----------------------------------------------------------------


def simulate(seed: int) -> list[tuple[str, int, int]]:
    """One 16-chip backend, batch jobs of 1 to 16 chips arriving over time, each with a time limit
    and running a random part of it; a tick at every arrival and end, FIFO (no fair share: the order
    is the promise's reference). Returns, for each job ever held, (job, its first promised start,
    its actual start)."""
    rng = random.Random(seed)
    total = 16
    arrivals = []
    t = NOW
    for i in range(40):
        t += rng.choice((0, 0, MIN, 5 * MIN))
        count = rng.choice((1, 1, 2, 2, 4, 8, 12, 16))
        limit = rng.choice((5, 10, 30, 60, 120)) * MIN
        arrivals.append((t, f"u/j{i:02d}", count, limit, max(1, int(limit * rng.uniform(0.2, 1.0)))))
    queue: dict[str, JobShape] = {}
    runs: dict[str, JobShape] = {}
    duration = {job_id: d for _, job_id, _, _, d in arrivals}
    ends: list[tuple[int, str]] = []
    promised: dict[str, int] = {}
    started: dict[str, int] = {}
    now = NOW
    ai = 0
    settings = Backfill()
    fifo = FairShare(aging_horizon_ms=0)

    while ai < len(arrivals) or ends or queue:
        next_arrival = arrivals[ai][0] if ai < len(arrivals) else None
        candidates = [e for e in (next_arrival, ends[0][0] if ends else None) if e is not None]
        if not candidates:
            break
        now = min(candidates)
        while ends and ends[0][0] <= now:
            _, done = heapq.heappop(ends)
            del runs[done]
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            at, job_id, count, limit, _ = arrivals[ai]
            queue[job_id] = limited(job_id, count, limit, at)
            ai += 1
        busy = sum(gate(j.device)[1] for j in runs.values())  # type: ignore[index]
        result = plan(
            list(queue.values()),
            home=HOME,
            reports=[
                peer(HOME, cpu_backend(), last_contact_ms=now),
                peer("cw-a", h100("b", total - busy), last_contact_ms=now),
            ],
            now_ms=now,
            stale_after_ms=STALE,
            in_use=list(runs.values()),
            fair_share=fifo,
            backfill=settings,
        )
        for hold in result.holds:
            promised.setdefault(hold.job_id, hold.start_ms)
        for p in result.placements:
            shape = queue.pop(p.job_id)
            runs[p.job_id] = shape.model_copy(
                update={"running_on": RunningOn(peer_id=p.peer_id, backend_id=p.backend_id, since_ms=now)}
            )
            started[p.job_id] = now
            heapq.heappush(ends, (now + duration[p.job_id], p.job_id))
    assert not queue, f"seed {seed}: {sorted(queue)} never started"
    return [(job_id, at, started[job_id]) for job_id, at in promised.items()]


def test_no_held_job_starts_later_than_it_was_first_promised() -> None:
    held = 0
    for seed in range(40):
        for job_id, promised, actual in simulate(seed):
            held += 1
            assert actual <= promised, (seed, job_id, promised, actual)
    assert held > 40  # the simulation does hold: the check is not vacuous


# ---- the config ---------------------------------------------------------------------------------


def test_the_backfill_table_gives_the_ticks_settings_and_refuses_what_cannot_work(tmp_path: Path) -> None:
    assert load_config().backfill_policy() == Backfill()  # config/clusters.toml sets none
    table = BackfillConfig.model_validate({"default_limit_s": {"batch": 1800}})
    assert table.policy().default_limit_ms[Band.BATCH] == 1_800_000
    assert table.policy().default_limit_ms[Band.INTERACTIVE] == 4 * 3_600_000
    assert not BackfillConfig(enabled=False).policy().enabled
    for bad, message in (
        ({"default_limit_s": {"urgent": 60}}, "unknown band 'urgent'"),
        ({"default_limit_s": {"batch": 0}}, "the default time limit of band batch must be at least 1 s"),
        ({"default_limit_s": {"batch": float("inf")}}, "must be at least 1 s"),
        ({"max_s": 60}, "max_s"),
    ):
        path = tmp_path / "clusters.json"
        path.write_text(json.dumps({**load_config().model_dump(mode="json"), "backfill": bad}))
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert message in str(refused.value), refused.value
