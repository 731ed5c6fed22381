"""CPU capacity through the same gate and ledger as GPUs (issue 15; docs/DESIGN.md, "Vocabulary",
"Classification", "The ledger").

CPU is a token counted in slots, one per replica; a block that does not report ``cpu`` (an older
controller, a Ray backend) takes CPU jobs by shape, never as "0 free". A LOCAL classification
carries the placement to promote through the CAS, so a burst of submits cannot all run at home.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from budget import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_factories import EPOCH, NOW, STALE, backend, cpu_job, h100, job, peer

from iris.policy import (
    Availability,
    BackendReport,
    Band,
    Classification,
    Disposition,
    HeldByBand,
    JobShape,
    PeerReport,
    Placement,
    PlanResult,
    Reservation,
    WaitKind,
    classify,
    effective_capacity,
    gate,
    pick_backend,
    plan,
    plan_reference,
    working_capacity,
)
from iris.policy.reasons import ReasonCode
from iris.store import FederationStore, JobHandle, PromoteOutcome

HOME = "marin"
CPU_ATTRS = {"device-type": ["cpu"]}


def cpu_slots(
    backend_id: str,
    free: int,
    *,
    total: int | None = None,
    held: dict[Band, int] | None = None,
    epoch: int = EPOCH,
) -> BackendReport:
    """A process backend's block: ``cpu`` free and total (as ProcessBackend.report sends it)."""
    return BackendReport(
        backend_id=backend_id,
        advertised_attributes=CPU_ATTRS,
        availability=Availability(
            observation_epoch_ms=epoch,
            amounts={"cpu": free},
            total_amounts={"cpu": free + sum((held or {}).values()) if total is None else total},
            held_by_band=[HeldByBand(band=b, amounts={"cpu": n}) for b, n in (held or {}).items()],
        ),
    )


def without_cpu(backend_id: str) -> BackendReport:
    """A block that reports devices only (an older controller, Ray): no ``cpu`` token at all."""
    return backend(backend_id, CPU_ATTRS, free={"h100": 0})


def classify_at(
    shape: JobShape, *reports: PeerReport, reservations: list[Reservation] | None = None
) -> Classification:
    return classify(
        shape,
        home=HOME,
        reports=list(reports),
        now_ms=NOW,
        stale_after_ms=STALE,
        reservations=reservations or [],
    )


def tick(
    jobs: list[JobShape], *reports: PeerReport, reservations: list[Reservation] | None = None
) -> PlanResult:
    kwargs = {
        "home": HOME,
        "reports": list(reports),
        "reservations": reservations or [],
        "now_ms": NOW,
        "stale_after_ms": STALE,
    }
    result = plan(jobs, **kwargs)  # type: ignore[arg-type]
    assert result == plan_reference(jobs, **kwargs)  # type: ignore[arg-type]
    return result


def cpu_jobs(
    n: int, *, replicas: int = 1, band: Band = Band.INTERACTIVE, prefix: str = "u/c"
) -> list[JobShape]:
    return [cpu_job(f"{prefix}{i:03d}", replicas=replicas, band=band, submit_ms=i) for i in range(n)]


class TestGate:
    def test_cpu_fits_and_does_not_fit(self) -> None:
        b = cpu_slots("p", 3, total=8)
        assert effective_capacity("cw", b, "cpu", Band.INTERACTIVE) == 3
        assert gate(cpu_job(replicas=3).device) == ("cpu", 3)
        assert pick_backend(cpu_job(replicas=3), peer("cw", b)) == "p"
        # Four replicas need four slots: the backend is "full" for them (rank after shape-only).
        assert pick_backend(cpu_job(replicas=4), peer("cw", b, without_cpu("q"))) == "q"

    def test_a_block_without_cpu_is_shape_only_for_cpu_jobs_never_zero_free(self) -> None:
        b = without_cpu("old")
        assert effective_capacity("cw", b, "cpu", Band.PRODUCTION) is None
        cap = working_capacity("cw", b)
        assert cap is not None and not cap.verifies("cpu")
        # A device token left out of a block is still nothing free (unchanged).
        assert cap.verifies("a100") and effective_capacity("cw", b, "a100", Band.PRODUCTION) == 0

    def test_cpu_named_only_by_totals_or_held_is_verified_and_read_conservatively(self) -> None:
        totals_only = BackendReport(
            backend_id="b",
            advertised_attributes=CPU_ATTRS,
            availability=Availability(observation_epoch_ms=EPOCH, amounts={}, total_amounts={"CPU": 8}),
        )
        assert effective_capacity("cw", totals_only, "cpu", Band.PRODUCTION) == 0
        held = cpu_slots("b", 0, held={Band.BATCH: 4})
        assert effective_capacity("cw", held, "cpu", Band.INTERACTIVE) == 4
        assert effective_capacity("cw", held, "cpu", Band.BATCH) == 0

    def test_cpu_reservations_are_replayed_against_their_observation(self) -> None:
        b = cpu_slots("p", 16)
        charged = [
            Reservation(peer_id="cw", backend_id="p", observation_epoch_ms=EPOCH, amounts={"cpu": 10}),
            Reservation(peer_id="cw", backend_id="p", observation_epoch_ms=EPOCH - 1, amounts={"cpu": 10}),
        ]
        assert effective_capacity("cw", b, "cpu", Band.INTERACTIVE, charged) == 6


class TestPlanner:
    def test_cpu_jobs_go_to_the_cpu_peer_with_room_when_home_is_full(self) -> None:
        result = tick(
            cpu_jobs(5), peer(HOME, cpu_slots("home-cpu", 0, total=16)), peer("cw", cpu_slots("p", 40))
        )
        assert [(p.peer_id, p.backend_id) for p in result.placements] == [("cw", "p")] * 5
        assert all(
            p.reserved == {"cpu": 1} and p.verified and p.observation_epoch_ms == EPOCH
            for p in result.placements
        )

    def test_home_comes_first_while_it_has_room(self) -> None:
        result = tick(cpu_jobs(6), peer(HOME, cpu_slots("home-cpu", 4)), peer("cw", cpu_slots("p", 40)))
        assert [p.peer_id for p in result.placements] == [HOME] * 4 + ["cw"] * 2

    def test_cpu_is_never_over_committed(self) -> None:
        jobs = cpu_jobs(10, replicas=2)
        result = tick(jobs, peer(HOME), peer("cw", cpu_slots("p", 7)))
        assert [p.reserved for p in result.placements] == [{"cpu": 2}] * 3
        # The first left waiting has slots held for it (backfill: the placed jobs' time limits say
        # when theirs come back); the rest wait behind it. Both read the one slot left.
        held, rest = result.waiting
        assert (held.job_ids, held.code) == ([jobs[3].job_id], ReasonCode.Reserved)
        assert rest.job_ids == [j.job_id for j in jobs[4:]]
        for group in (held, rest):
            verdict = next(v for v in group.verdicts if "cw" in v.peer_ids)
            assert (verdict.kind, verdict.token, verdict.needed, verdict.available) == (
                WaitKind.FULL,
                "cpu",
                2,
                1,
            )

    def test_ledger_reservations_count_against_cpu(self) -> None:
        ledger = [Reservation(peer_id="cw", backend_id="p", observation_epoch_ms=EPOCH, amounts={"cpu": 7})]
        result = tick(cpu_jobs(3), peer(HOME), peer("cw", cpu_slots("p", 8)), reservations=ledger)
        assert len(result.placements) == 1

    def test_backends_without_the_cpu_token_take_cpu_jobs_by_shape(self) -> None:
        # An older controller (or Ray) reports GPUs but no cpu: never "full", never reserved.
        jobs = cpu_jobs(30)
        result = tick(jobs, peer(HOME), peer("cw", without_cpu("old")))
        assert len(result.placements) == 30
        assert all(not p.verified and p.reserved == {} for p in result.placements)
        assert result.waiting == []

    def test_verified_cpu_room_ranks_before_shape_only_and_shape_only_takes_the_rest(self) -> None:
        result = tick(cpu_jobs(4), peer(HOME, without_cpu("old")), peer("cw", cpu_slots("p", 2)))
        assert [(p.peer_id, p.verified) for p in result.placements] == [
            ("cw", True),
            ("cw", True),
            (HOME, False),
            (HOME, False),
        ]

    def test_production_reclaims_batch_cpu_and_batch_reclaims_nothing(self) -> None:
        full = peer("cw", cpu_slots("p", 0, held={Band.BATCH: 2}))
        result = tick(
            cpu_jobs(1, band=Band.PRODUCTION, prefix="p") + cpu_jobs(1, band=Band.BATCH, prefix="b"), full
        )
        (placed,) = result.placements
        assert (placed.job_id, placed.preempts, placed.reserved) == ("p000", True, {"cpu": 1})

    def test_pinned_cpu_job_waits_while_its_peer_has_no_cpu_room(self) -> None:
        pinned = cpu_job("u/pinned", pin="cw")
        result = tick([pinned], peer(HOME, cpu_slots("home-cpu", 16)), peer("cw", cpu_slots("p", 0)))
        assert result.placements == []
        assert result.waiting[0].verdicts[0].kind is WaitKind.FULL


class TestLocalPlacement:
    def test_a_local_cpu_job_reserves_its_slots_at_home(self) -> None:
        result = classify_at(
            cpu_job("u/c", replicas=3, band=Band.BATCH), peer(HOME, cpu_slots("home-cpu", 16))
        )
        assert result.disposition is Disposition.LOCAL
        assert result.placement == Placement(
            job_id="u/c",
            peer_id=HOME,
            backend_id="home-cpu",
            band=Band.BATCH,
            observation_epoch_ms=EPOCH,
            reserved={"cpu": 3},
            verified=True,
            reason="Runs at home on marin/home-cpu",
        )

    def test_home_without_cpu_room_queues_the_cpu_job(self) -> None:
        home = peer(HOME, cpu_slots("home-cpu", 2, total=16))
        result = classify_at(cpu_job(replicas=3), home, peer("cw", cpu_slots("p", 40)))
        assert result.disposition is Disposition.QUEUE and result.placement is None
        assert "home cluster marin has 2 of the 3 cpu needed free" in result.reason

    def test_lower_band_cpu_work_at_home_is_not_free_now(self) -> None:
        home = peer(HOME, cpu_slots("home-cpu", 0, held={Band.BATCH: 16}))
        result = classify_at(cpu_job(band=Band.PRODUCTION), home, peer("cw", cpu_slots("p", 4)))
        assert result.disposition is Disposition.QUEUE

    def test_classification_sees_the_ledger(self) -> None:
        home = peer(HOME, cpu_slots("home-cpu", 16))
        taken = [
            Reservation(peer_id=HOME, backend_id="home-cpu", observation_epoch_ms=EPOCH, amounts={"cpu": 16})
        ]
        assert classify_at(cpu_job(), home, reservations=taken).disposition is Disposition.QUEUE
        older = [taken[0].model_copy(update={"observation_epoch_ms": EPOCH - 1})]
        assert classify_at(cpu_job(), home, reservations=older).disposition is Disposition.LOCAL

    def test_home_without_the_cpu_token_runs_the_job_shape_only(self) -> None:
        result = classify_at(cpu_job(), peer(HOME, without_cpu("old")))
        assert result.disposition is Disposition.LOCAL
        p = result.placement
        assert p is not None and (p.backend_id, p.reserved, p.verified) == ("old", {}, False)
        assert p.observation_epoch_ms == EPOCH and p.reservation() is None

    def test_a_legacy_home_backend_runs_the_job_shape_only(self) -> None:
        result = classify_at(cpu_job(), peer(HOME, backend("legacy", CPU_ATTRS, legacy=True)))
        p = result.placement
        assert p is not None and (p.backend_id, p.reserved, p.observation_epoch_ms) == ("legacy", {}, None)

    def test_verified_room_is_chosen_before_shape_only_then_tightest(self) -> None:
        home = peer(HOME, without_cpu("a-old"), cpu_slots("b-big", 12), cpu_slots("c-tight", 2))
        result = classify_at(cpu_job(replicas=2), home)
        assert result.placement is not None and result.placement.backend_id == "c-tight"

    def test_a_local_gpu_job_reserves_its_chips(self) -> None:
        result = classify_at(job(count=4, replicas=2, band=Band.PRODUCTION), peer(HOME, h100("h100-home", 8)))
        p = result.placement
        assert p is not None and (p.backend_id, p.reserved, p.band) == (
            "h100-home",
            {"h100": 8},
            Band.PRODUCTION,
        )
        assert p.reservation() == Reservation(
            peer_id=HOME,
            backend_id="h100-home",
            observation_epoch_ms=EPOCH,
            amounts={"h100": 8},
            band=Band.PRODUCTION,
            job_id="alice/job",
        )

    def test_an_ungated_local_job_reserves_nothing(self) -> None:
        tpu = job(variant="tpu-v5p", device_type="tpu", count=4)
        home = peer(HOME, backend("tpu", {"device-type": ["tpu"], "device-variant": ["tpu-v5p"]}, free={}))
        p = classify_at(tpu, home).placement
        assert p is not None and (p.backend_id, p.reserved, p.verified) == ("tpu", {}, True)


class TestPinnedHome:
    def test_pinned_home_job_reserves_like_prefer_local(self) -> None:
        result = classify_at(cpu_job(pin=HOME, replicas=2), peer(HOME, cpu_slots("home-cpu", 16)))
        assert (result.disposition, result.pinned_cluster) == (Disposition.LOCAL, HOME)
        assert result.reason == f"Pinned to the home cluster {HOME}"
        p = result.placement
        assert p is not None and (p.peer_id, p.backend_id, p.reserved) == (HOME, "home-cpu", {"cpu": 2})

    def test_pinned_home_job_reserves_even_when_home_is_full(self) -> None:
        # The CAS refuses it and the job waits in the queue, pinned to home, for the tick.
        result = classify_at(cpu_job(pin=HOME), peer(HOME, cpu_slots("home-cpu", 0, total=16)))
        p = result.placement
        assert result.disposition is Disposition.LOCAL
        assert p is not None and (p.backend_id, p.reserved, p.verified) == ("home-cpu", {"cpu": 1}, True)

    def test_pinned_home_prefers_shape_only_to_a_full_verified_backend(self) -> None:
        home = peer(HOME, cpu_slots("a-full", 0), without_cpu("b-old"))
        p = classify_at(cpu_job(pin=HOME), home).placement
        assert p is not None and (p.backend_id, p.reserved) == ("b-old", {})

    def test_a_stale_home_is_not_trusted_for_capacity(self) -> None:
        stale = peer(HOME, cpu_slots("home-cpu", 16), last_contact_ms=NOW - STALE - 1)
        p = classify_at(cpu_job(pin=HOME), stale).placement
        assert p is not None and (p.backend_id, p.reserved, p.verified) == ("home-cpu", {}, False)
        assert "stale" in p.reason

    def test_an_unreachable_home_uses_its_configured_backends(self) -> None:
        down = peer(HOME, reachable=False)
        configured = {HOME: [without_cpu("configured-cpu")]}
        result = classify(
            cpu_job(pin=HOME),
            home=HOME,
            reports=[down],
            now_ms=NOW,
            stale_after_ms=STALE,
            configured=configured,
        )
        p = result.placement
        assert p is not None and (p.backend_id, p.reserved, p.forced) == ("configured-cpu", {}, False)

    def test_a_home_without_the_shape_is_force_routed(self) -> None:
        p = classify_at(job(variant="b200", pin=HOME), peer(HOME, cpu_slots("home-cpu", 16))).placement
        assert p is not None and (p.backend_id, p.forced, p.reserved) == ("", True, {})


# --- The burst (issue 15): 100 CPU jobs, 16 home slots, a CPU peer with room ---------------------


def burst_reports(home_slots: int, peer_slots: int) -> list[PeerReport]:
    return [peer(HOME, cpu_slots("home-cpu", home_slots)), peer("cw", cpu_slots("p", peer_slots))]


def submit(store: FederationStore, shape: JobShape, decision: Classification) -> PromoteOutcome | None:
    """What the workflow does with a decision: enqueue, and promote a LOCAL one with its placement."""
    store.enqueue(JobHandle(job_id=shape.job_id, incarnation=f"{shape.job_id}@0", shape=shape))
    if decision.disposition is not Disposition.LOCAL:
        return None
    assert decision.placement is not None
    return store.promote(shape.job_id, f"{shape.job_id}@0", decision.placement, NOW).outcome


def place_the_queue(store: FederationStore) -> list[Placement]:
    """One tick over the queue and the ledger, each placement promoted through the CAS."""
    queued = [h.shape for h in store.queued()]
    result = plan(
        queued,
        home=HOME,
        reports=store.load_reports(),
        reservations=store.reservations(),
        now_ms=NOW,
        stale_after_ms=STALE,
    )
    for p in result.placements:
        assert store.promote(p.job_id, f"{p.job_id}@0", p, NOW).outcome is PromoteOutcome.PROMOTED
    return result.placements


def charged(store: FederationStore, peer_id: str) -> int:
    return sum(r.amounts.get("cpu", 0) for r in store.reservations() if r.peer_id == peer_id)


def test_a_burst_of_cpu_jobs_runs_16_at_home_and_the_rest_on_the_peer(tmp_path: Path) -> None:
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        reports = burst_reports(16, 200)
        store.save_reports(reports)
        outcomes: dict[str, PromoteOutcome | None] = {}
        for shape in cpu_jobs(100):
            # Each submit classifies with the ledger as it is now: earlier LOCAL promotions count.
            decision = classify_at(shape, *reports, reservations=store.reservations())
            outcomes[shape.job_id] = submit(store, shape, decision)
        local = [j for j, o in outcomes.items() if o is PromoteOutcome.PROMOTED]
        assert len(local) == 16 and charged(store, HOME) == 16
        assert [o for o in outcomes.values() if o is not None and o is not PromoteOutcome.PROMOTED] == []
        assert len(store.queued()) == 84

        placed = place_the_queue(store)
        assert len(placed) == 84 and {p.peer_id for p in placed} == {"cw"}
        assert store.queued() == [] and charged(store, "cw") == 84 and charged(store, HOME) == 16
    finally:
        store.close()


def test_concurrent_submits_that_all_saw_home_free_are_held_to_its_slots_by_the_cas(tmp_path: Path) -> None:
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        reports = burst_reports(16, 200)
        store.save_reports(reports)
        jobs = cpu_jobs(100)
        # Every classification ran before any promotion: all of them saw home free.
        decisions = [classify_at(shape, *reports, reservations=[]) for shape in jobs]
        assert all(d.disposition is Disposition.LOCAL for d in decisions)
        outcomes = [submit(store, shape, d) for shape, d in zip(jobs, decisions, strict=True)]
        assert outcomes.count(PromoteOutcome.PROMOTED) == 16
        assert outcomes.count(PromoteOutcome.NO_CAPACITY) == 84
        assert charged(store, HOME) == 16
        # Refused, they wait in the queue with home as a candidate; the tick puts them on the peer.
        placed = place_the_queue(store)
        assert len(placed) == 84 and {p.peer_id for p in placed} == {"cw"}
        assert store.queued() == []
    finally:
        store.close()


def test_the_cas_refuses_a_cpu_reservation_once_home_stops_reporting_cpu(tmp_path: Path) -> None:
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    try:
        home = peer(HOME, cpu_slots("home-cpu", 16))
        decision = classify_at(cpu_job("u/c"), home)
        store.save_reports([peer(HOME, without_cpu("home-cpu"))])
        assert submit(store, cpu_job("u/c"), decision) is PromoteOutcome.NO_CAPACITY
        assert [h.job_id for h in store.queued()] == ["u/c"]
    finally:
        store.close()


@st.composite
def bursts(draw: st.DrawFn) -> tuple[int, int, list[int], list[int]]:
    """(home slots, peer slots, replicas per job, ledger snapshot lag per job)."""
    n = draw(st.integers(1, 40))
    replicas = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    # How many earlier submits' promotions a submit's classification did not see yet (concurrency).
    lag = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return draw(st.integers(0, 20)), draw(st.integers(0, 60)), replicas, lag


@settings(max_examples=scaled(40), deadline=None)
@given(bursts())
def test_no_interleaving_of_submits_over_commits_home_or_the_peer(
    burst: tuple[int, int, list[int], list[int]],
) -> None:
    home_slots, peer_slots, replicas, lag = burst
    with tempfile.TemporaryDirectory() as d:
        store = FederationStore(f"sqlite:///{Path(d) / 'federation.db'}")
        try:
            reports = burst_reports(home_slots, peer_slots)
            store.save_reports(reports)
            snapshots: list[list[Reservation]] = []
            for i, r in enumerate(replicas):
                shape = cpu_job(f"u/c{i:03d}", replicas=r, submit_ms=i)
                snapshots.append(store.reservations())
                seen = snapshots[max(0, i - lag[i])]
                submit(store, shape, classify_at(shape, *reports, reservations=seen))
                assert charged(store, HOME) <= home_slots
            place_the_queue(store)
            assert charged(store, HOME) <= home_slots and charged(store, "cw") <= peer_slots
            # Whatever still waits did not fit anywhere that had room left for it.
            left_home = home_slots - charged(store, HOME)
            left_peer = peer_slots - charged(store, "cw")
            assert all(h.shape.device.replicas > max(left_home, left_peer) for h in store.queued())
        finally:
            store.close()
