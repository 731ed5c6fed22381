"""The promotion compare-and-swap (docs/DESIGN.md, "Promotion (the CAS)",
"3. No backend is over-committed"): outcomes, idempotency, bands, the ledger."""

from __future__ import annotations

import pytest
from store_factories import BACKEND, EPOCH, NOW, PEER, Stores, gpu_backend, handle, placement, report

from iris.policy.models import BackendReport, Band, Reservation
from iris.store import FederationStore, HandleState, PromoteOutcome, PromoteResult, StoreConflict


def test_promote_moves_the_handle_and_records_the_reservation(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("j1", band=Band.PRODUCTION))
    store.update_reasons({"j1": "waiting for capacity"})

    result = store.promote("j1", "inc-1", placement("j1"), NOW)

    assert result.outcome is PromoteOutcome.PROMOTED and result.promoted
    assert result.handle is not None
    assert result.handle.state is HandleState.PENDING_HANDOFF
    assert (result.handle.assigned_peer, result.handle.assigned_backend) == (PEER, BACKEND)
    assert result.handle.observation_epoch_ms == EPOCH
    assert result.handle.reason is None
    expected = Reservation(
        peer_id=PEER,
        backend_id=BACKEND,
        observation_epoch_ms=EPOCH,
        amounts={"h100": 8},
        band=Band.PRODUCTION,
        job_id="j1",
    )
    assert result.reservation == expected
    assert store.reservations() == [expected]
    assert store.get("j1") == result.handle
    assert store.queued() == []


def test_reservation_is_charged_to_the_latest_stored_observation(store: FederationStore) -> None:
    # The tick planned on EPOCH; the peer has reported since. Charging the old observation would
    # let the next tick spend the same GPUs again.
    store.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 500))])
    store.enqueue(handle("j1"))
    result = store.promote("j1", "inc-1", placement("j1", epoch=EPOCH), NOW)
    assert result.promoted and result.reservation is not None
    assert result.reservation.observation_epoch_ms == EPOCH + 500
    assert result.handle is not None and result.handle.observation_epoch_ms == EPOCH + 500


def test_retried_promotion_is_idempotent(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    store.enqueue(handle("j1"))
    first = store.promote("j1", "inc-1", placement("j1"), NOW)
    assert first.outcome is PromoteOutcome.PROMOTED

    again = store.promote("j1", "inc-1", placement("j1"), NOW + 5)
    assert again.outcome is PromoteOutcome.ALREADY_PROMOTED and again.promoted
    assert again.reservation == first.reservation
    assert len(store.reservations()) == 1

    assert store.set_state("j1", "inc-1", HandleState.HANDED_OFF) is not None
    later = store.promote("j1", "inc-1", placement("j1"), NOW + 10)
    assert later.outcome is PromoteOutcome.ALREADY_PROMOTED and later.promoted
    assert len(store.reservations()) == 1

    # Once the job has ended, no retry may present it as promoted again (never run twice).
    assert store.set_state("j1", "inc-1", HandleState.SUCCEEDED) is not None
    ended = store.promote("j1", "inc-1", placement("j1"), NOW + 20)
    assert ended.outcome is PromoteOutcome.NOT_QUEUED and not ended.promoted

    # A different target is not a retry of this promotion.
    other = store.promote("j1", "inc-1", placement("j1", backend="h100-b"), NOW)
    assert other.outcome is PromoteOutcome.NOT_QUEUED and not other.promoted
    assert "SUCCEEDED" in other.message


def test_a_reset_of_a_refused_handoff_is_answered_already_promoted_to_its_own_target_only(
    store: FederationStore,
) -> None:
    """An operator's reset of a HANDOFF_REJECTED run goes back to the task that sent the launch,
    where a run of the 2027-02 baseline runs its CAS (a local activity) again. The refused handle's
    own target answers ALREADY_PROMOTED, so the launch is sent again, without reviving the handle
    or charging anything; any other target, or a handle with a cancel, is refused as before."""
    store.save_reports([report(PEER, gpu_backend(free=16))])
    store.enqueue(handle("j1"))
    assert store.promote("j1", "inc-1", placement("j1"), NOW).outcome is PromoteOutcome.PROMOTED
    assert store.set_state("j1", "inc-1", HandleState.HANDOFF_REJECTED, "refused by the peer") is not None
    assert store.reservations() == []

    again = store.promote("j1", "inc-1", placement("j1"), NOW + 5)
    assert again.outcome is PromoteOutcome.ALREADY_PROMOTED and again.promoted, again
    assert again.handle is not None and again.handle.state is HandleState.HANDOFF_REJECTED
    assert store.reservations() == [] and store.get("j1") == again.handle

    other = store.promote("j1", "inc-1", placement("j1", backend="h100-b"), NOW + 5)
    assert other.outcome is PromoteOutcome.NOT_QUEUED and not other.promoted
    # Another incarnation of the job id is never this run's promotion.
    assert store.promote("j1", "inc-2", placement("j1"), NOW + 5).outcome is PromoteOutcome.NOT_FOUND

    store.save_reports([report(PEER, gpu_backend(free=16))])
    store.enqueue(handle("j2"))
    assert store.promote("j2", "inc-1", placement("j2"), NOW).outcome is PromoteOutcome.PROMOTED
    assert not store.record_cancel("j2", "stop").won
    assert store.set_state("j2", "inc-1", HandleState.HANDOFF_REJECTED, "refused") is not None
    cancelled = store.promote("j2", "inc-1", placement("j2"), NOW + 5)
    assert cancelled.outcome is PromoteOutcome.CANCELLED and not cancelled.promoted


def test_refusals(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8)), report("gcp-b", reachable=False)])

    missing = store.promote("nope", "inc-1", placement("nope"), NOW)
    assert missing.outcome is PromoteOutcome.NOT_FOUND and missing.handle is None

    store.enqueue(handle("j1"))
    stale = store.promote("j1", "inc-0", placement("j1"), NOW)
    assert stale.outcome is PromoteOutcome.NOT_FOUND and "inc-1" in stale.message

    unknown_backend = store.promote("j1", "inc-1", placement("j1", backend="a100-z"), NOW)
    assert unknown_backend.outcome is PromoteOutcome.UNKNOWN_BACKEND
    assert "a100-z" in unknown_backend.message
    unknown_peer = store.promote("j1", "inc-1", placement("j1", peer="nobody"), NOW)
    assert unknown_peer.outcome is PromoteOutcome.UNKNOWN_BACKEND
    unreachable = store.promote("j1", "inc-1", placement("j1", peer="gcp-b"), NOW)
    assert unreachable.outcome is PromoteOutcome.NO_CAPACITY and "unreachable" in unreachable.message

    too_big = store.promote("j1", "inc-1", placement("j1", need=9), NOW)
    assert too_big.outcome is PromoteOutcome.NO_CAPACITY and not too_big.promoted
    assert too_big.message == (
        f"{PEER}/{BACKEND} has 8 h100 left for band interactive after confirmed reservations; needs 9"
    )
    # None of the refusals above moved the job or charged anything.
    assert [h.job_id for h in store.queued()] == ["j1"]
    assert store.reservations() == []

    assert store.record_cancel("j1", "user").won
    cancelled = store.promote("j1", "inc-1", placement("j1"), NOW)
    assert cancelled.outcome is PromoteOutcome.CANCELLED and not cancelled.promoted

    store.enqueue(handle("late", deadline_ms=NOW))
    expired = store.promote("late", "inc-1", placement("late"), NOW)
    assert expired.outcome is PromoteOutcome.EXPIRED and not expired.promoted
    assert expired.handle is not None and expired.handle.state is HandleState.UNSCHEDULABLE
    assert store.get("late").state is HandleState.UNSCHEDULABLE  # type: ignore[union-attr]

    store.enqueue(handle("elsewhere"))
    assert store.promote("elsewhere", "inc-1", placement("elsewhere"), NOW).promoted
    # A promotion for another target while it is pending is a different decision: refused.
    not_queued = store.promote("elsewhere", "inc-1", placement("elsewhere", backend="h100-b"), NOW)
    assert not_queued.outcome is PromoteOutcome.NOT_QUEUED
    assert store.reservations()[0].job_id == "elsewhere"


def test_backend_that_stopped_reporting_capacity_is_refused(store: FederationStore) -> None:
    legacy = BackendReport(backend_id=BACKEND, advertised_attributes={"device-type": ["gpu"]})
    store.save_reports([report(PEER, legacy)])
    store.enqueue(handle("j1"))
    result = store.promote("j1", "inc-1", placement("j1"), NOW)
    assert result.outcome is PromoteOutcome.NO_CAPACITY
    newer_version = report(PEER, gpu_backend(free=8, version=99))
    store.save_reports([newer_version])
    assert store.promote("j1", "inc-1", placement("j1"), NOW).outcome is PromoteOutcome.NO_CAPACITY


def test_shape_only_and_forced_placements_reserve_nothing(store: FederationStore) -> None:
    store.enqueue(handle("legacy"))
    result = store.promote("legacy", "inc-1", placement("legacy", need=0, epoch=None), NOW)
    assert result.outcome is PromoteOutcome.PROMOTED and result.reservation is None
    store.enqueue(handle("forced", target="tpu-peer"))
    forced = store.promote("forced", "inc-1", placement("forced", peer="tpu-peer", backend="", need=0), NOW)
    assert forced.promoted and forced.handle is not None
    assert forced.handle.assigned_peer == "tpu-peer" and forced.handle.assigned_backend is None
    assert store.promote(
        "forced", "inc-1", placement("forced", peer="tpu-peer", backend="", need=0), NOW
    ).outcome is (PromoteOutcome.ALREADY_PROMOTED)
    assert store.reservations() == []


def test_pin_is_never_violated(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("pinned", target="gcp-b"))
    with pytest.raises(StoreConflict, match="pinned to gcp-b"):
        store.promote("pinned", "inc-1", placement("pinned"), NOW)
    assert store.get("pinned").state is HandleState.QUEUED_HANDOFF  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="placement is for job"):
        store.promote("pinned", "inc-1", placement("other"), NOW)


def test_two_jobs_for_one_backends_eight_gpus(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("a", submit_ms=1))
    store.enqueue(handle("b", submit_ms=2))

    assert store.promote("a", "inc-1", placement("a"), NOW).outcome is PromoteOutcome.PROMOTED
    lost = store.promote("b", "inc-1", placement("b"), NOW)
    assert lost.outcome is PromoteOutcome.NO_CAPACITY
    assert "has 0 h100 left for band interactive" in lost.message and lost.message.endswith("needs 8")
    assert [h.job_id for h in store.queued()] == ["b"]

    # Job a is handed off, and the peer's next observation already reflects it; pruning frees the
    # ledger for it.
    assert store.set_state("a", "inc-1", HandleState.HANDED_OFF) is not None
    newer = [report(PEER, gpu_backend(free=8, epoch=EPOCH + 1000))]
    store.save_reports(newer)
    assert store.prune_reservations(store.load_reports()) == 1
    assert store.reservations() == []
    won = store.promote("b", "inc-1", placement("b", epoch=EPOCH + 1000), NOW)
    assert won.outcome is PromoteOutcome.PROMOTED
    assert won.reservation is not None and won.reservation.observation_epoch_ms == EPOCH + 1000


def test_effective_capacity_reclaims_only_lower_bands(store: FederationStore) -> None:
    # Nothing idle; 8 held by batch work and 8 by interactive work.
    store.save_reports([report(PEER, gpu_backend(free=0, held={Band.BATCH: 8, Band.INTERACTIVE: 8}))])
    jobs = {
        "batch": Band.BATCH,
        "inter-1": Band.INTERACTIVE,
        "inter-2": Band.INTERACTIVE,
        "prod-1": Band.PRODUCTION,
        "prod-2": Band.PRODUCTION,
    }
    for job_id, band in jobs.items():
        store.enqueue(handle(job_id, band=band))

    def promote(job_id: str) -> PromoteResult:
        return store.promote(job_id, "inc-1", placement(job_id, band=jobs[job_id]), NOW)

    batch = promote("batch")
    assert batch.outcome is PromoteOutcome.NO_CAPACITY
    assert "has 0 h100 left for band batch" in batch.message
    assert promote("inter-1").outcome is PromoteOutcome.PROMOTED  # reclaims the batch 8
    inter = promote("inter-2")  # the rest is held at its own band
    assert (
        inter.outcome is PromoteOutcome.NO_CAPACITY
        and "has 0 h100 left for band interactive" in inter.message
    )
    assert promote("prod-1").outcome is PromoteOutcome.PROMOTED  # reclaims the interactive 8
    assert promote("prod-2").outcome is PromoteOutcome.NO_CAPACITY
    assert sorted(r.job_id for r in store.reservations()) == ["inter-1", "prod-1"]


def test_ledger_is_per_backend_and_observation(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend("h100-a", free=8), gpu_backend("h100-b", free=8))])
    for job_id in ("a", "b", "c"):
        store.enqueue(handle(job_id))
    assert store.promote("a", "inc-1", placement("a", backend="h100-a"), NOW).promoted
    assert store.promote("b", "inc-1", placement("b", backend="h100-b"), NOW).promoted
    assert (
        store.promote("c", "inc-1", placement("c", backend="h100-a"), NOW).outcome
        is PromoteOutcome.NO_CAPACITY
    )
    assert store.release("a") == 1 and store.release("a") == 0
    assert store.promote("c", "inc-1", placement("c", backend="h100-a"), NOW).promoted


def test_prune_keeps_current_and_unreachable_reservations(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8)), report("gcp-b", gpu_backend(free=8))])
    store.enqueue(handle("on-cw"))
    store.enqueue(handle("on-gcp"))
    assert store.promote("on-cw", "inc-1", placement("on-cw"), NOW).promoted
    assert store.promote("on-gcp", "inc-1", placement("on-gcp", peer="gcp-b"), NOW).promoted

    assert store.prune_reservations(store.load_reports()) == 0
    for job_id in ("on-cw", "on-gcp"):
        assert store.set_state(job_id, "inc-1", HandleState.HANDED_OFF) is not None
    # gcp-b goes dark: its reservation stays (its observation may still be current when it returns).
    store.save_reports([report("gcp-b", reachable=False)])
    assert store.prune_reservations(store.load_reports()) == 0
    store.save_reports([report(PEER, gpu_backend(free=0, epoch=EPOCH + 1))])
    assert store.prune_reservations(store.load_reports()) == 1
    assert [r.job_id for r in store.reservations()] == ["on-gcp"]


def test_prune_with_an_older_view_keeps_newer_charges(store: FederationStore) -> None:
    old_view = [report(PEER, gpu_backend(free=8))]
    store.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 5))])
    store.enqueue(handle("a"))
    assert store.promote("a", "inc-1", placement("a"), NOW).promoted
    # A tick that loaded EPOCH before the newer report landed must not free what "a" spent.
    assert store.prune_reservations(old_view) == 0
    assert store.prune_reservations(store.load_reports()) == 0
    assert store.set_state("a", "inc-1", HandleState.HANDED_OFF) is not None
    assert store.prune_reservations([report(PEER, gpu_backend(free=8, epoch=EPOCH + 6))]) == 1


def test_a_job_promoted_but_not_yet_handed_off_keeps_its_charge_across_observations(
    store: FederationStore,
) -> None:
    """Its cluster cannot count it before receiving it: the reservation moves to the newer
    observation instead of leaving the ledger, so its capacity is not offered twice."""
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("a", submit_ms=1))
    store.enqueue(handle("b", submit_ms=2))
    assert store.promote("a", "inc-1", placement("a"), NOW).promoted
    # Another change on the backend (not job a, which has not arrived yet): a new observation.
    store.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 7))])
    assert store.prune_reservations(store.load_reports()) == 0
    assert [(r.job_id, r.observation_epoch_ms) for r in store.reservations()] == [("a", EPOCH + 7)]
    lost = store.promote("b", "inc-1", placement("b", epoch=EPOCH + 7), NOW)
    assert lost.outcome is PromoteOutcome.NO_CAPACITY
    # Once a is handed off and a later observation counts it, its charge leaves the ledger.
    assert store.set_state("a", "inc-1", HandleState.HANDED_OFF) is not None
    store.save_reports([report(PEER, gpu_backend(free=0, epoch=EPOCH + 8))])
    assert store.prune_reservations(store.load_reports()) == 1
    assert store.reservations() == []


def test_ledger_survives_reopening(stores: Stores) -> None:
    first = stores.open()
    first.save_reports([report(PEER, gpu_backend(free=8))])
    first.enqueue(handle("a"))
    first.enqueue(handle("b"))
    assert first.promote("a", "inc-1", placement("a"), NOW).promoted
    first.close()
    stores.opened.remove(first)

    second = stores.open()
    assert [r.job_id for r in second.reservations()] == ["a"]
    assert second.promote("b", "inc-1", placement("b"), NOW).outcome is PromoteOutcome.NO_CAPACITY


def test_a_handed_off_job_keeps_its_charge_until_an_observation_counts_it(
    store: FederationStore,
) -> None:
    """A report taken before the cluster accepted the job but stored after the handoff does not
    count the job: dropping its reservation then would offer its capacity twice (a burst of jobs
    run at home waited there for slots)."""
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("a", submit_ms=1))
    store.enqueue(handle("b", submit_ms=2))
    assert store.promote("a", "inc-1", placement("a"), NOW).promoted
    # The cluster accepted job a at EPOCH + 10 by its own clock.
    assert store.set_state("a", "inc-1", HandleState.HANDED_OFF, counted_from_ms=EPOCH + 10) is not None
    # An observation from before the acceptance arrives late: the charge moves to it.
    store.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 9))])
    assert store.prune_reservations(store.load_reports()) == 0
    assert [(r.job_id, r.observation_epoch_ms) for r in store.reservations()] == [("a", EPOCH + 9)]
    assert (
        store.promote("b", "inc-1", placement("b", epoch=EPOCH + 9), NOW).outcome
        is PromoteOutcome.NO_CAPACITY
    )
    # The first observation that counts job a frees the ledger.
    store.save_reports([report(PEER, gpu_backend(free=0, epoch=EPOCH + 10))])
    assert store.prune_reservations(store.load_reports()) == 1
    assert store.reservations() == []


def test_a_promotion_before_the_prune_still_counts_charges_the_new_observation_cannot(
    store: FederationStore,
) -> None:
    """The tick stores a report, then prunes: a promotion between the two must count the charges
    still on the older observation whose jobs the new one cannot count (it over-committed home's
    CPU slots in a burst: a job ran at home only after waiting for a slot)."""
    store.save_reports([report(PEER, gpu_backend(free=16))])
    for job_id in ("a", "b", "c"):
        store.enqueue(handle(job_id))
    assert store.promote("a", "inc-1", placement("a"), NOW).promoted  # not yet handed off
    assert store.promote("b", "inc-1", placement("b"), NOW).promoted
    assert store.set_state("b", "inc-1", HandleState.HANDED_OFF, counted_from_ms=EPOCH + 5) is not None
    # A new observation, taken before either job arrived, is stored; no prune has run yet.
    store.save_reports([report(PEER, gpu_backend(free=16, epoch=EPOCH + 3))])
    refused = store.promote("c", "inc-1", placement("c", epoch=EPOCH + 3), NOW)
    assert refused.outcome is PromoteOutcome.NO_CAPACITY, refused.message
    # An observation as new as b's acceptance counts b: only a's charge is left against it.
    store.save_reports([report(PEER, gpu_backend(free=16, epoch=EPOCH + 6))])
    assert store.promote("c", "inc-1", placement("c", epoch=EPOCH + 6), NOW).promoted


def test_a_charge_carried_to_an_observation_that_counts_the_job_leaves_once_it_is_handed_off(
    store: FederationStore,
) -> None:
    """A promoted job's charge moves to a newer observation while home has not yet recorded the
    handoff, though the cluster accepted the job before that observation was taken. Once the
    handoff records when (``counted_from_ms``), that same observation counts the job: its charge
    leaves the ledger at the next prune, without waiting for another change on the cluster.
    Kept, it counted the job twice, and a peer that changed no more looked full for ever
    (1,000 jobs over two peers: 19 left queued beside 31 free devices)."""
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("a", submit_ms=1))
    store.enqueue(handle("b", submit_ms=2))
    assert store.promote("a", "inc-1", placement("a"), NOW).promoted
    # The cluster accepts a at EPOCH + 5 by its clock; its observation at EPOCH + 7 counts it,
    # but home still shows a promoted: the charge is carried to EPOCH + 7.
    store.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 7))])
    assert store.prune_reservations(store.load_reports()) == 0
    assert [(r.job_id, r.observation_epoch_ms) for r in store.reservations()] == [("a", EPOCH + 7)]
    assert store.set_state("a", "inc-1", HandleState.HANDED_OFF, counted_from_ms=EPOCH + 5) is not None
    # No newer observation: the one stored counts a, so a's charge goes.
    assert store.prune_reservations(store.load_reports()) == 1
    assert store.reservations() == []
    won = store.promote("b", "inc-1", placement("b", epoch=EPOCH + 7), NOW)
    assert won.promoted, won.message
    # A handed-off job the stored observation cannot count yet keeps its charge.
    assert store.set_state("b", "inc-1", HandleState.HANDED_OFF, counted_from_ms=EPOCH + 8) is not None
    assert store.prune_reservations(store.load_reports()) == 0
    assert [r.job_id for r in store.reservations()] == ["b"]
