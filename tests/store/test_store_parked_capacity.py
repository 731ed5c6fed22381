"""A parked job frees its capacity, and takes it again through the CAS when replayed in place
(docs/DESIGN.md, "Errors, retries and parking", "The ledger"; issue 27): ``set_state(HANDOFF_FAILED,
release=True)`` deletes the reservation, ``promote(retake=True)`` charges it again, or refuses when
another job took the capacity meanwhile, never over-committing the backend."""

from __future__ import annotations

import pytest
from store_factories import BACKEND, EPOCH, NOW, PEER, gpu_backend, handle, placement, report

from iris.store import FederationStore, HandleState, PromoteOutcome


def parked(store: FederationStore, job_id: str, *, release: bool) -> None:
    """``job_id`` promoted onto the peer's 8 H100 (reserving all 8), then parked."""
    store.enqueue(handle(job_id))
    assert store.promote(job_id, "inc-1", placement(job_id), NOW).promoted
    assert store.set_state(job_id, "inc-1", HandleState.HANDOFF_FAILED, "artifact missing", release=release)


def charged(store: FederationStore) -> dict[str, int]:
    return {r.job_id: sum(r.amounts.values()) for r in store.reservations()}


def test_a_park_that_releases_frees_the_backend_for_the_next_job(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "parked", release=True)

    assert charged(store) == {}
    got = store.get("parked")
    assert got is not None and got.state is HandleState.HANDOFF_FAILED and got.reason == "artifact missing"
    # The same observation (nothing started on the peer): the next 8-GPU job takes it.
    store.enqueue(handle("next"))
    assert store.promote("next", "inc-1", placement("next"), NOW).outcome is PromoteOutcome.PROMOTED
    assert charged(store) == {"next": 8}


def test_a_park_that_does_not_release_keeps_the_reservation(store: FederationStore) -> None:
    """The launch's outcome is unknown (it may run there): the capacity stays held."""
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "maybe-running", release=False)

    assert charged(store) == {"maybe-running": 8}
    store.enqueue(handle("next"))
    refused = store.promote("next", "inc-1", placement("next"), NOW)
    assert refused.outcome is PromoteOutcome.NO_CAPACITY
    # Released later, once its cluster confirms it never received the job.
    assert store.set_state("maybe-running", "inc-1", HandleState.HANDOFF_FAILED, "confirmed", release=True)
    assert charged(store) == {}


def test_only_a_park_releases(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("j"))
    assert store.promote("j", "inc-1", placement("j"), NOW).promoted
    for state in (HandleState.HANDED_OFF, HandleState.SUCCEEDED):
        with pytest.raises(ValueError, match="only a parked job"):
            store.set_state("j", "inc-1", state, release=True)
    assert charged(store) == {"j": 8}


def test_a_replay_in_place_takes_the_capacity_again(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "j", release=True)

    result = store.promote("j", "inc-1", placement("j"), NOW + 1, retake=True)

    assert result.outcome is PromoteOutcome.PROMOTED, result.message
    assert result.handle is not None and result.handle.state is HandleState.PENDING_HANDOFF
    assert (result.handle.assigned_peer, result.handle.assigned_backend) == (PEER, BACKEND)
    assert result.reservation is not None and result.reservation.observation_epoch_ms == EPOCH
    assert charged(store) == {"j": 8}
    # A retried retake is the same promotion: charged once.
    again = store.promote("j", "inc-1", placement("j"), NOW + 2, retake=True)
    assert again.outcome is PromoteOutcome.ALREADY_PROMOTED
    assert charged(store) == {"j": 8}


def test_a_replay_in_place_cannot_over_commit_what_another_job_took(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "parked", release=True)
    store.enqueue(handle("next"))
    assert store.promote("next", "inc-1", placement("next"), NOW).promoted

    refused = store.promote("parked", "inc-1", placement("parked"), NOW + 1, retake=True)

    assert refused.outcome is PromoteOutcome.NO_CAPACITY and not refused.promoted
    assert "has 0 h100 left" in refused.message
    got = store.get("parked")
    assert got is not None and got.state is HandleState.HANDOFF_FAILED  # still parked, not charged
    assert charged(store) == {"next": 8}
    # The replay goes back to the queue instead; from there the CAS places it once there is room.
    assert store.requeue("parked", "inc-1")
    assert store.set_state("next", "inc-1", HandleState.SUCCEEDED)
    assert store.promote("parked", "inc-1", placement("parked"), NOW + 2).outcome is PromoteOutcome.PROMOTED


def test_a_retake_of_a_job_that_kept_its_reservation_charges_nothing_more(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "kept", release=False)

    result = store.promote("kept", "inc-1", placement("kept"), NOW + 1, retake=True)

    assert result.outcome is PromoteOutcome.PROMOTED
    assert charged(store) == {"kept": 8}


def test_a_retake_refuses_another_cluster_and_a_cancelled_job(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8)), report("cw-other", gpu_backend(free=8))])
    parked(store, "j", release=True)

    elsewhere = store.promote("j", "inc-1", placement("j", peer="cw-other"), NOW, retake=True)
    assert elsewhere.outcome is PromoteOutcome.NOT_QUEUED and "parked on" in elsewhere.message

    store.record_cancel("j", "give up")
    cancelled = store.promote("j", "inc-1", placement("j"), NOW, retake=True)
    assert cancelled.outcome is PromoteOutcome.CANCELLED
    assert charged(store) == {}


def test_without_retake_a_parked_handle_is_only_a_retried_promotion(store: FederationStore) -> None:
    """The tick's CAS (no retake) never revives a parked job's charge: ALREADY_PROMOTED, nothing
    charged, as before."""
    store.save_reports([report(PEER, gpu_backend(free=8))])
    parked(store, "j", release=True)

    result = store.promote("j", "inc-1", placement("j"), NOW)

    assert result.outcome is PromoteOutcome.ALREADY_PROMOTED
    assert charged(store) == {}
