"""What a tick reads of the jobs holding devices (docs/DESIGN.md, "Fair share and aging", "Backfill"):
every running job is read at every tick, so the policy counts them by kind (``Holdings``) and gathers
backfill's ends slot by slot (``Releases``). Here, over random jobs in use (duplicated ids, shapes
with and without their user, every kind of device, spellings the gate normalizes, jobs with and
without a known start), what each counts is what counting the jobs one by one, as the policy did
before, gives; and a tick with nothing queued decides nothing, whatever is in use."""

from __future__ import annotations

from bisect import insort

from hypothesis import given
from hypothesis import strategies as st
from policy_factories import NOW, STALE, h100, peer
from test_policy_properties import HOME, SETTINGS

from iris.policy import Backfill, Band, DeviceRequest, FairShare, JobShape, PlanResult, plan, plan_reference
from iris.policy.availability import gate
from iris.policy.backfill import Releases
from iris.policy.fairshare import Holdings, Shares, account, devices, held_devices, user_shares
from iris.policy.models import RunningOn

DEVICES = (
    DeviceRequest(type="gpu", variant="h100", count=1),
    DeviceRequest(type="gpu", variant="h100", count=8),
    DeviceRequest(type="gpu", variant="h100", count=2),
    DeviceRequest(type="gpu", variant="h100", count=2, replicas=3),
    DeviceRequest(type="GPU", variant=" H100 ", count=1),  # the gate's spelling: same token
    DeviceRequest(type="gpu", variant="a100", count=4),
    DeviceRequest(type="gpu", variant="auto", count=2),  # ungated: devices, no token
    DeviceRequest(type="tpu", variant="v5p", count=4),
    DeviceRequest(replicas=2),  # cpu: a token, no devices
    DeviceRequest(type=" CPU", replicas=1),
)


@st.composite
def jobs_in_use(draw: st.DrawFn) -> list[JobShape]:
    out: list[JobShape] = []
    for _ in range(draw(st.integers(0, 30))):
        prefix = draw(st.sampled_from(("alice", "bob", "carol")))
        # A few ids, so that some repeat (the first entry counts, whatever the others hold).
        job_id = f"{prefix}/r{draw(st.integers(0, 12))}"
        where = draw(
            st.one_of(
                st.none(),
                st.builds(
                    RunningOn,
                    peer_id=st.sampled_from(("cw-a", "cw-b")),
                    backend_id=st.sampled_from(("b0", "b1")),
                    # Some overdue by any limit (they end now), some not.
                    since_ms=st.sampled_from((NOW - 100 * 86_400_000, NOW - 3_600_000, NOW - 60_000, NOW)),
                ),
            )
        )
        out.append(
            JobShape(
                job_id=job_id,
                # A shape stored before shapes named their user counts its id's prefix; a user not
                # its own prefix is another account.
                user=draw(st.sampled_from(("", prefix, "dave"))),
                device=draw(st.sampled_from(DEVICES)),
                band=draw(st.sampled_from(list(Band))),
                time_limit_ms=draw(st.sampled_from((None, 1, 60_000, 7_200_000))),
                running_on=where,
            )
        )
    return out


def unique(in_use: list[JobShape]) -> list[JobShape]:
    seen: set[str] = set()
    out = []
    for job in in_use:
        if job.job_id not in seen:
            seen.add(job.job_id)
            out.append(job)
    return out


def held_one_by_one(in_use: list[JobShape]) -> list[tuple[str, list[tuple[Band, int]]]]:
    """Per user, the devices by band, each job added in turn (in the order they come)."""
    out: dict[str, dict[Band, int]] = {}
    for job in unique(in_use):
        n = devices(job)
        if n:
            per_band = out.setdefault(account(job), {})
            per_band[job.band] = per_band.get(job.band, 0) + n
    return [(user, list(bands.items())) for user, bands in out.items()]


def in_order(held: dict[str, dict[Band, int]]) -> list[tuple[str, list[tuple[Band, int]]]]:
    return [(user, list(bands.items())) for user, bands in held.items()]


@SETTINGS
@given(jobs_in_use())
def test_users_devices_and_shares_are_what_the_jobs_hold_one_by_one(in_use: list[JobShape]) -> None:
    reports = [peer("cw-a", h100("b0", 4, held={Band.BATCH: 12})), peer("cw-b", h100("b1", 0))]
    totals = {"h100": 16, "cpu": 8, "a100": 0}
    used: dict[str, dict[str, int]] = {}
    chips: dict[str, int] = {}
    by_band: dict[tuple[str, Band], int] = {}
    for job in unique(in_use):
        user = account(job)
        need = gate(job.device)
        if need is not None:
            per_token = used.setdefault(user, {})
            per_token[need[0]] = per_token.get(need[0], 0) + need[1]
        if n := devices(job):
            chips[user] = chips.get(user, 0) + n
            by_band[(user, job.band)] = by_band.get((user, job.band), 0) + n

    shares = Shares(in_use, totals, FairShare())
    assert (shares.used, shares.devices, shares.band_devices) == (used, chips, by_band)
    # The gauges and ``iris job list --shares``: the same users, in the same order.
    assert in_order(held_devices(in_use)) == held_one_by_one(in_use)
    assert in_order(Holdings(in_use).devices()) == held_one_by_one(in_use)
    h100_total = 16  # cw-a's 4 free and 12 held; cw-b's none
    expected = {
        user: min(1.0, used.get(user, {}).get("h100", 0) / h100_total) for user in sorted({*used, *chips})
    }
    assert user_shares(in_use, reports, FairShare()) == expected
    assert list(user_shares(in_use, reports, FairShare())) == sorted(expected)
    assert Holdings(in_use).shares(reports, FairShare()) == expected


@SETTINGS
@given(
    jobs_in_use(),
    st.sampled_from((Backfill(), Backfill(default_limit_ms={Band.BATCH: 1_000, Band.PRODUCTION: 5_000}))),
)
def test_backfills_ends_are_each_running_jobs_inserted_in_order(
    in_use: list[JobShape], settings: Backfill
) -> None:
    ends: dict[tuple[str, str, str], list[tuple[int, int]]] = {}
    for job in in_use:
        where, need = job.running_on, gate(job.device)
        if where is None or need is None or need[1] <= 0:
            continue
        end = max(where.since_ms + settings.limit_ms(job), NOW)
        insort(ends.setdefault((where.peer_id, where.backend_id, need[0]), []), (end, need[1]))
    assert Releases(in_use, settings, NOW).ends == ends


@SETTINGS
@given(jobs_in_use())
def test_a_tick_with_nothing_queued_decides_nothing_whatever_is_in_use(in_use: list[JobShape]) -> None:
    kwargs = {
        "home": HOME,
        "reports": [peer(HOME, h100("b0", 0)), peer("cw-a", h100("b0", 0))],
        "now_ms": NOW,
        "stale_after_ms": STALE,
        "in_use": in_use,
    }
    assert plan([], **kwargs) == PlanResult() == plan_reference([], **kwargs)  # type: ignore[arg-type]
