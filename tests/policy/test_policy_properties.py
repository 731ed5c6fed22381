"""Property tests of the tick over random federations and queues (docs/DESIGN.md, "The tick",
"3. No backend is over-committed", "4. No job is split across backends; a pin is never violated")."""

from __future__ import annotations

import random
from collections import defaultdict

from budget import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_factories import EPOCH, NOW, STALE, backend, peer

from iris.policy import (
    BackendReport,
    Band,
    Classification,
    Constraint,
    DeviceRequest,
    Disposition,
    JobShape,
    Op,
    PeerReport,
    PlanResult,
    Reservation,
    classify,
    job_constraints,
    matches,
    pick_backend,
    plan,
    plan_reference,
)
from iris.policy.availability import Capacity, PeerStatus, gate, peer_status, replay, working_capacity

SETTINGS = settings(max_examples=scaled(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
VARIANTS = ("h100", "a100")
REGIONS = ("east", "west")
HOME = "marin"


@st.composite
def backend_reports(draw: st.DrawFn, backend_id: str) -> BackendReport:
    kind = draw(st.sampled_from(("gpu", "gpu", "gpu", "gpu", "cpu")))
    attrs: dict[str, list[str]] = {"region": [draw(st.sampled_from(REGIONS))]}
    # Whether the block reports CPU slots (a process backend does; Ray and older controllers do not).
    cpu: tuple[str, ...] = ("cpu",) if draw(st.booleans()) else ()
    if kind == "gpu":
        variant = draw(st.sampled_from(VARIANTS))
        attrs.update({"device-type": ["gpu"], "device-variant": [variant]})
        tokens: tuple[str, ...] = (variant, *cpu)
    else:
        attrs["device-type"] = ["cpu"]
        tokens = cpu
    if draw(st.booleans()):
        attrs["preemptible"] = ["true"]
    block = draw(st.sampled_from(("v1",) * 6 + ("legacy", "newer")))
    if block == "legacy":
        return backend(backend_id, attrs, legacy=True)
    free = {t: draw(st.integers(0, 32)) for t in tokens}
    held = {
        band: {t: draw(st.integers(0, 16)) for t in tokens}
        for band in draw(st.lists(st.sampled_from(list(Band)), unique=True, max_size=3))
    }
    return backend(backend_id, attrs, free=free, held=held, version=1 if block == "v1" else 2)


@st.composite
def federations(draw: st.DrawFn) -> tuple[list[PeerReport], list[Reservation]]:
    ids = [HOME] + [f"cw-{i}" for i in range(draw(st.integers(1, 3)))]
    reports: list[PeerReport] = []
    for pid in ids:
        names = draw(st.permutations(["b0", "b1", "b2"]))[: draw(st.integers(0, 3))]
        backends = [draw(backend_reports(name)) for name in names]
        state = draw(st.sampled_from(("ok",) * 6 + ("down", "stale")))
        reports.append(
            peer(
                pid,
                *backends,
                reachable=state != "down",
                last_contact_ms=NOW - STALE - 1 if state == "stale" else NOW - 10,
            )
        )
    reservations: list[Reservation] = []
    for _ in range(draw(st.integers(0, 4))):
        reservations.append(
            Reservation(
                peer_id=draw(st.sampled_from(ids)),
                backend_id=f"b{draw(st.integers(0, 2))}",
                observation_epoch_ms=draw(st.sampled_from((EPOCH, EPOCH - 1))),
                amounts={draw(st.sampled_from((*VARIANTS, "cpu"))): draw(st.integers(1, 12))},
                band=draw(st.sampled_from((None, *Band))),
            )
        )
    return reports, reservations


@st.composite
def job_shapes(draw: st.DrawFn, job_id: str, peer_ids: list[str]) -> JobShape:
    kind = draw(st.sampled_from(("gpu",) * 6 + ("cpu", "auto", "tpu")))
    if kind == "gpu":
        device = DeviceRequest(
            type="gpu",
            variant=draw(st.sampled_from(VARIANTS)),
            count=draw(st.integers(1, 8)),
            replicas=draw(st.integers(1, 3)),
        )
    elif kind == "auto":
        device = DeviceRequest(type="gpu", variant="auto", count=draw(st.integers(1, 8)))
    elif kind == "tpu":
        device = DeviceRequest(type="tpu", variant="tpu-v5p", count=4)
    else:
        device = DeviceRequest(replicas=draw(st.integers(1, 4)))
    constraints = draw(
        st.lists(
            st.sampled_from(
                (
                    Constraint(key="region", op=Op.EQ, values=("east",)),
                    Constraint(key="Region", op=Op.IN, values=("WEST", "north")),
                    Constraint(key="preemptible", op=Op.NOT_EXISTS),
                    Constraint(key="preemptible", op=Op.NE, values=("true",)),
                    Constraint(key="team", op=Op.EQ, values=("ignored",)),
                )
            ),
            max_size=draw(st.sampled_from((0, 0, 1, 2))),
            unique=True,
        )
    )
    pin = draw(st.sampled_from([None] * 8 + [*peer_ids, "ghost", "CW-0"]))
    return JobShape(
        job_id=job_id,
        constraints=tuple(constraints),
        device=device,
        band=draw(st.sampled_from(list(Band))),
        target_cluster=pin,
        submit_ms=draw(st.integers(0, 5)),
        deadline_ms=draw(st.sampled_from((None, None, None, NOW, NOW + 1))),
        # Backfill's time limits: a few values, so some end before a hold's start and some after.
        time_limit_ms=draw(st.sampled_from((None, None, 60_000, 600_000, 7_200_000))),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[JobShape], list[PeerReport], list[Reservation], int | None]:
    reports, reservations = draw(federations())
    ids = [r.peer_id for r in reports]
    jobs = [draw(job_shapes(f"job-{i}", ids)) for i in range(draw(st.integers(0, 16)))]
    cap = draw(st.sampled_from((None, None, 1, 2, 3)))
    return jobs, reports, reservations, cap


Scenario = tuple[list[JobShape], list[PeerReport], list[Reservation], int | None]


def run(s: Scenario, jobs: list[JobShape] | None = None) -> PlanResult:
    queue, reports, reservations, cap = s
    return plan(
        queue if jobs is None else jobs,
        home=HOME,
        reports=reports,
        reservations=reservations,
        now_ms=NOW,
        stale_after_ms=STALE,
        max_per_peer=cap,
    )


def backend_of(reports: list[PeerReport], peer_id: str, backend_id: str) -> BackendReport:
    report = next(r for r in reports if r.peer_id == peer_id)
    return next(b for b in report.backends if b.backend_id == backend_id)


@SETTINGS
@given(scenarios())
def test_planner_agrees_with_the_reference(s: Scenario) -> None:
    jobs, reports, reservations, cap = s
    expected = plan_reference(
        jobs,
        home=HOME,
        reports=reports,
        reservations=reservations,
        now_ms=NOW,
        stale_after_ms=STALE,
        max_per_peer=cap,
    )
    assert run(s) == expected


@SETTINGS
@given(scenarios())
def test_every_job_has_exactly_one_outcome(s: Scenario) -> None:
    result = run(s)
    placed = [p.job_id for p in result.placements]
    waiting = [j for g in result.waiting for j in g.job_ids]
    outcomes = placed + result.expired + waiting
    assert len(outcomes) == len(set(outcomes))
    assert sorted(outcomes) == sorted(j.job_id for j in s[0])
    expired = set(result.expired)
    assert all(j.job_id in expired for j in s[0] if j.deadline_ms is not None and j.deadline_ms <= NOW)


@settings(SETTINGS, max_examples=scaled(400))
@given(scenarios())
def test_no_backend_is_over_committed(s: Scenario) -> None:
    _, reports, reservations, _ = s
    result = run(s)
    charged: dict[tuple[str, str, str], list[tuple[Band, int]]] = defaultdict(list)
    for p in result.placements:
        for token, amount in p.reserved.items():
            charged[(p.peer_id, p.backend_id, token)].append((p.band, amount))
    for (peer_id, backend_id, token), takes in charged.items():
        block = backend_of(reports, peer_id, backend_id).availability
        assert block is not None
        free = block.amounts.get(token, 0)
        held = {h.band: h.amounts.get(token, 0) for h in block.held_by_band}
        confirmed = [
            r
            for r in reservations
            if (r.peer_id, r.backend_id, r.observation_epoch_ms)
            == (peer_id, backend_id, block.observation_epoch_ms)
        ]
        ledger = sum(r.amounts.get(token, 0) for r in confirmed)
        # Free plus everything reclaimable bounds this tick, and this tick and what the ledger
        # took together. (A generated ledger need not be one the CAS could have written: a batch
        # reservation on a backend whose room is all held by interactive work takes nothing, and
        # that room stays reclaimable by production work.)
        assert sum(a for _, a in takes) <= free + sum(held.values())
        left = Capacity.from_block(block)
        replay(left, confirmed)
        assert sum(a for _, a in takes) <= left.effective(token, None)
        if all(r.band is None for r in confirmed):
            assert sum(a for _, a in takes) + ledger <= free + sum(held.values())
        if not ledger:
            # Jobs of band B or lower priority only reach idle capacity and bands below B.
            for threshold in Band:
                used = sum(a for band, a in takes if band >= threshold)
                assert used <= free + sum(n for band, n in held.items() if band > threshold)


@SETTINGS
@given(scenarios())
def test_placements_respect_pins_shape_reachability_and_cap(s: Scenario) -> None:
    jobs, reports, _, cap = s
    by_id = {j.job_id: j for j in jobs}
    status = {r.peer_id: peer_status(r, NOW, STALE) for r in reports}
    result = run(s)
    per_peer: dict[str, int] = defaultdict(int)
    for p in result.placements:
        job = by_id[p.job_id]
        per_peer[p.peer_id] += 1
        assert status[p.peer_id] is PeerStatus.OK
        if job.target_cluster:
            assert p.peer_id.lower() == job.target_cluster.lower()
        if p.forced:
            assert job.target_cluster and p.backend_id == ""
            report = next(r for r in reports if r.peer_id == p.peer_id)
            assert not any(matches(job_constraints(job), b.advertised_attributes) for b in report.backends)
        else:
            chosen = backend_of(reports, p.peer_id, p.backend_id)
            assert matches(job_constraints(job), chosen.advertised_attributes)
            need = gate(job.device)
            assert p.reserved == ({need[0]: need[1]} if need and p.verified else {})
    if cap is not None:
        assert all(n <= cap for n in per_peer.values())


@SETTINGS
@given(scenarios(), st.randoms(use_true_random=False))
def test_same_input_same_output(s: Scenario, rnd: random.Random) -> None:
    shuffled = list(s[0])
    rnd.shuffle(shuffled)
    assert run(s) == run(s) == run(s, shuffled)


@SETTINGS
@given(scenarios(), st.data())
def test_removing_a_job_never_worsens_jobs_ahead_of_it(s: Scenario, data: st.DataObject) -> None:
    jobs = s[0]
    if not jobs:
        return
    removed = data.draw(st.sampled_from(jobs))
    rest = [j for j in jobs if j.job_id != removed.job_id]
    before, after = run(s), run(s, rest)
    order = sorted(jobs, key=lambda j: (j.band, j.submit_ms, j.job_id))
    position = {j.job_id: i for i, j in enumerate(order)}
    cut = position[removed.job_id]
    # Jobs ahead in band order see exactly the same tick.
    assert [p for p in before.placements if position[p.job_id] < cut] == [
        p for p in after.placements if position[p.job_id] < cut
    ]
    placed_before = {p.job_id for p in before.placements}
    if removed.job_id not in placed_before:
        # A job that took nothing changes nothing for anyone.
        assert before.placements == after.placements
    # Compared in band order, the first job whose outcome changes is better off: it finds at least
    # the room it had before. (Later jobs may lose out to it: greedy placement is not monotone for
    # every job, only lexicographically.)
    where_before = {p.job_id: (p.peer_id, p.backend_id) for p in before.placements}
    where_after = {p.job_id: (p.peer_id, p.backend_id) for p in after.placements}
    for job in order[cut + 1 :]:
        if where_before.get(job.job_id) != where_after.get(job.job_id):
            assert job.job_id in where_after
            break


@SETTINGS
@given(scenarios())
def test_classification_is_consistent_with_reports(s: Scenario) -> None:
    jobs, reports, reservations, _ = s
    for job in jobs:
        result: Classification = classify(
            job, home=HOME, reports=reports, now_ms=NOW, stale_after_ms=STALE, reservations=reservations
        )
        assert result.reason
        if job.target_cluster:
            known = {r.peer_id.lower() for r in reports}
            expected = Disposition.REJECT if job.target_cluster.lower() not in known else None
            if expected is not None:
                assert result.disposition is expected
            continue
        home = next(r for r in reports if r.peer_id == HOME)
        # Rejected exactly when no backend anywhere has the shape (docs/DESIGN.md,
        # "Classification"): one on a cluster that is unreachable or stale now still exists, and the
        # job waits for it.
        known = [b for r in reports for b in r.backends]
        can_host = any(matches(job_constraints(job), b.advertised_attributes) for b in known)
        assert (result.disposition is Disposition.REJECT) == (not can_host)
        if result.disposition is Disposition.LOCAL:
            assert peer_status(home, NOW, STALE) is PeerStatus.OK
            assert pick_backend(job, home, reservations) is not None
            # The placement to promote: a home backend of the job's shape, reserving the gate
            # exactly when home's block verifies it, and only what is idle after the ledger.
            p = result.placement
            assert p is not None and (p.job_id, p.peer_id, p.band) == (job.job_id, HOME, job.band)
            chosen = backend_of(reports, HOME, p.backend_id)
            assert matches(job_constraints(job), chosen.advertised_attributes)
            need = gate(job.device)
            cap = working_capacity(HOME, chosen, reservations)
            assert p.verified == (cap is not None and (need is None or cap.verifies(need[0])))
            assert p.reserved == ({need[0]: need[1]} if need and p.verified else {})
            if need and p.verified:
                assert cap is not None and cap.idle(need[0]) >= need[1]
            block = chosen.availability
            expected_epoch = block.observation_epoch_ms if block is not None and block.version == 1 else None
            assert p.observation_epoch_ms == expected_epoch
        else:
            assert result.placement is None
