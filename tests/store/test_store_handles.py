"""Queue handles: enqueue idempotency, incarnations, ordering, state changes, requeue, expiry."""

from __future__ import annotations

import pytest
from store_factories import NOW, PEER, gpu_backend, handle, placement, report

from iris.policy.models import Band
from iris.store import (
    CANCELLED_BEFORE_HANDOFF,
    FederationStore,
    HandleState,
    JobHandle,
    PromoteOutcome,
    StoreConflict,
)


def test_enqueue_is_idempotent_per_incarnation(store: FederationStore) -> None:
    first = store.enqueue(handle("j1", submit_ms=5, deadline_ms=NOW + 10))
    assert first.state is HandleState.QUEUED_HANDOFF
    assert (first.band, first.submit_ms, first.deadline_ms) == (Band.INTERACTIVE, 5, NOW + 10)
    assert store.enqueue(handle("j1", submit_ms=5, deadline_ms=NOW + 10)) == first
    assert store.get("j1") == first

    # A retried enqueue after the job moved on must not drag it back to the queue.
    store.save_reports([report(PEER, gpu_backend(free=8))])
    assert store.promote("j1", "inc-1", placement("j1"), NOW).promoted
    again = store.enqueue(handle("j1", submit_ms=5, deadline_ms=NOW + 10))
    assert again.state is HandleState.PENDING_HANDOFF
    assert again.assigned_peer == PEER
    assert len(store.reservations()) == 1


def test_enqueue_ignores_caller_state_fields(store: FederationStore) -> None:
    stale = handle("j1").model_copy(
        update={"state": HandleState.HANDED_OFF, "assigned_peer": "x", "cancel_requested": True}
    )
    stored = store.enqueue(stale)
    assert stored.state is HandleState.QUEUED_HANDOFF
    assert stored.assigned_peer is None and not stored.cancel_requested


def test_new_incarnation_replaces_terminal_handle_only(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    store.enqueue(handle("j1", "inc-1"))
    assert store.promote("j1", "inc-1", placement("j1"), NOW).promoted

    with pytest.raises(StoreConflict, match="still PENDING_HANDOFF"):
        store.enqueue(handle("j1", "inc-2"))
    assert store.get("j1").incarnation == "inc-1"  # type: ignore[union-attr]

    store.record_cancel("j1", "user asked")
    assert store.set_state("j1", "inc-1", HandleState.KILLED, "stopped on peer") is not None
    fresh = store.enqueue(handle("j1", "inc-2", submit_ms=9))
    assert fresh.incarnation == "inc-2"
    assert fresh.state is HandleState.QUEUED_HANDOFF
    assert not fresh.cancel_requested and fresh.cancel_reason is None
    assert fresh.assigned_peer is None and fresh.submit_ms == 9
    assert store.reservations() == []
    # The old incarnation can no longer touch the new one.
    assert store.set_state("j1", "inc-1", HandleState.FAILED) is None
    assert store.promote("j1", "inc-1", placement("j1"), NOW).outcome is PromoteOutcome.NOT_FOUND


def test_queued_is_ordered_by_band_submit_time_then_id(store: FederationStore) -> None:
    jobs = [
        handle("b-batch-early", band=Band.BATCH, submit_ms=1),
        handle("z-prod-late", band=Band.PRODUCTION, submit_ms=50),
        handle("c-inter", band=Band.INTERACTIVE, submit_ms=10),
        handle("a-inter", band=Band.INTERACTIVE, submit_ms=10),
        handle("y-prod-early", band=Band.PRODUCTION, submit_ms=2),
        handle("gone", band=Band.PRODUCTION, submit_ms=0),
    ]
    for h in jobs:
        store.enqueue(h)
    store.record_cancel("gone", "no longer needed")
    assert [h.job_id for h in store.queued()] == [
        "y-prod-early",
        "z-prod-late",
        "a-inter",
        "c-inter",
        "b-batch-early",
    ]
    assert store.get("missing") is None
    assert [h.job_id for h in store.handles([HandleState.KILLED])] == ["gone"]


def test_handle_must_agree_with_its_shape() -> None:
    with pytest.raises(ValueError, match="shape is for job"):
        JobHandle(job_id="a", incarnation="i", shape=handle("b").shape)
    with pytest.raises(ValueError, match="must match"):
        JobHandle(job_id="a", incarnation="i", shape=handle("a").shape, band=Band.BATCH)
    assert HandleState.KILLED.terminal and not HandleState.HANDOFF_FAILED.terminal


def test_set_state_rules(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    store.enqueue(handle("j1"))
    with pytest.raises(StoreConflict, match="still queued"):
        store.set_state("j1", "inc-1", HandleState.HANDED_OFF)
    with pytest.raises(ValueError):
        store.set_state("j1", "inc-1", HandleState.PENDING_HANDOFF)
    assert store.set_state("j1", "stale", HandleState.FAILED) is None
    assert store.set_state("nope", "inc-1", HandleState.FAILED) is None

    assert store.promote("j1", "inc-1", placement("j1"), NOW).promoted
    failed = store.set_state("j1", "inc-1", HandleState.HANDOFF_FAILED, "peer down")
    assert failed is not None and failed.state is HandleState.HANDOFF_FAILED and failed.reason == "peer down"
    assert len(store.reservations()) == 1  # parked, not released
    handed = store.set_state("j1", "inc-1", HandleState.HANDED_OFF)
    assert handed is not None and handed.state is HandleState.HANDED_OFF and handed.reason == "peer down"
    done = store.set_state("j1", "inc-1", HandleState.SUCCEEDED, "exit 0")
    assert done is not None and done.state is HandleState.SUCCEEDED
    assert store.reservations() == []
    # Terminal is final.
    later = store.set_state("j1", "inc-1", HandleState.FAILED, "late mirror")
    assert later is not None and later.state is HandleState.SUCCEEDED and later.reason == "exit 0"

    # A queued job may end directly (e.g. parked by a missing artifact then failed).
    store.enqueue(handle("j2"))
    ended = store.set_state("j2", "inc-1", HandleState.FAILED, "artifact missing")
    assert ended is not None and ended.state is HandleState.FAILED


def test_requeue_returns_a_promoted_job_to_the_queue(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("j1"))
    assert not store.requeue("j1", "inc-1")  # still queued
    assert store.promote("j1", "inc-1", placement("j1"), NOW).promoted
    assert not store.requeue("j1", "other-incarnation")
    assert store.set_state("j1", "inc-1", HandleState.HANDOFF_FAILED, "gave up") is not None

    assert store.requeue("j1", "inc-1")
    back = store.get("j1")
    assert back is not None and back.state is HandleState.QUEUED_HANDOFF
    assert (back.assigned_peer, back.assigned_backend, back.observation_epoch_ms) == (None, None, None)
    assert store.reservations() == []
    # The capacity it held is free again, and it can be promoted afresh.
    assert store.promote("j1", "inc-1", placement("j1"), NOW).outcome is PromoteOutcome.PROMOTED

    # An operator replay never resurrects a cancelled job.
    assert not store.record_cancel("j1", "stop").won
    assert not store.requeue("j1", "inc-1")
    assert store.set_state("j1", "inc-1", HandleState.KILLED) is not None
    assert not store.requeue("j1", "inc-1")


def test_expire_due_only_touches_queued_jobs_past_their_deadline(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("past", deadline_ms=NOW - 1))
    store.enqueue(handle("exactly", deadline_ms=NOW))
    store.enqueue(handle("future", deadline_ms=NOW + 1))
    store.enqueue(handle("none"))
    store.enqueue(handle("promoted", deadline_ms=NOW + 1))
    assert store.promote("promoted", "inc-1", placement("promoted"), NOW).promoted

    # The planner's boundary: a deadline that has been reached is past.
    assert store.expire_due(NOW) == ["exactly", "past"]
    for job_id in ("past", "exactly"):
        h = store.get(job_id)
        assert h is not None and h.state is HandleState.UNSCHEDULABLE and h.reason
    assert store.expire_due(NOW) == []
    assert store.expire_due(NOW + 10) == ["future"]
    promoted = store.get("promoted")
    assert promoted is not None and promoted.state is HandleState.PENDING_HANDOFF
    assert [h.job_id for h in store.queued()] == ["none"]
    # An expired job is never promoted.
    result = store.promote("past", "inc-1", placement("past"), NOW)
    assert result.outcome is PromoteOutcome.EXPIRED and not result.promoted


def test_expire_one_job(store: FederationStore) -> None:
    store.enqueue(handle("j1", deadline_ms=NOW))
    store.enqueue(handle("j2"))
    assert not store.expire("j1", "inc-1", NOW - 1)  # not yet
    assert not store.expire("j1", "stale", NOW)
    assert not store.expire("j2", "inc-1", NOW)  # no deadline
    assert not store.expire("missing", "inc-1", NOW)
    assert store.expire("j1", "inc-1", NOW)
    assert not store.expire("j1", "inc-1", NOW)  # already expired
    h = store.get("j1")
    assert h is not None and h.state is HandleState.UNSCHEDULABLE


def test_cancel_outcomes_by_state(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    unknown = store.record_cancel("never-queued", "oops")
    assert unknown.won and unknown.state is HandleState.KILLED

    store.enqueue(handle("queued"))
    won = store.record_cancel("queued", "user")
    assert won.won and won.state is HandleState.KILLED and won.message == CANCELLED_BEFORE_HANDOFF
    h = store.get("queued")
    assert h is not None and h.cancel_requested and h.cancel_reason == "user"
    # A retried cancel activity gets the same answer.
    assert store.record_cancel("queued", "user").won

    store.enqueue(handle("pending"))
    assert store.promote("pending", "inc-1", placement("pending"), NOW).promoted
    lost = store.record_cancel("pending", "user")
    assert not lost.won and lost.state is HandleState.PENDING_HANDOFF
    assert PEER in lost.message
    h = store.get("pending")
    assert h is not None and h.cancel_requested and h.state is HandleState.PENDING_HANDOFF
    assert len(store.reservations()) == 1
    assert not store.record_cancel("pending", "again").won
    assert store.get("pending").cancel_reason == "user"  # type: ignore[union-attr]

    store.enqueue(handle("done"))
    assert store.set_state("done", "inc-1", HandleState.SUCCEEDED) is not None
    finished = store.record_cancel("done", "too late")
    assert not finished.won and finished.state is HandleState.SUCCEEDED


def test_in_use_is_the_shapes_of_the_promoted_and_handed_off_jobs(store: FederationStore) -> None:
    """What the tick's fair share counts (docs/DESIGN.md, "Fair share and aging"): a shape stored
    with its user keeps it; one stored before shapes named theirs reads back with none."""
    store.save_reports([report(PEER, gpu_backend(free=32))])
    for job_id in ("alice/queued", "alice/promoted", "bob/handed", "bob/parked", "carol/done"):
        h = handle(job_id, gpus=4)
        store.enqueue(
            h.model_copy(update={"shape": h.shape.model_copy(update={"user": job_id.split("/")[0]})})
        )
    for job_id in ("alice/promoted", "bob/handed", "bob/parked", "carol/done"):
        assert store.promote(job_id, "inc-1", placement(job_id, need=4), NOW).promoted
    store.set_state("bob/handed", "inc-1", HandleState.HANDED_OFF)
    store.set_state("bob/parked", "inc-1", HandleState.HANDOFF_FAILED, "peer down")
    store.set_state("carol/done", "inc-1", HandleState.SUCCEEDED, "exit 0")
    held = store.in_use()
    assert [(s.job_id, s.user, s.device.count) for s in held] == [
        ("alice/promoted", "alice", 4),
        ("bob/handed", "bob", 4),
    ]
    # A shape stored without a user (an older worker's) reads back with an empty one.
    old = handle("dave/old", gpus=2)
    payload = old.shape.model_dump(exclude={"user"})
    assert "user" not in payload
    assert JobHandle(job_id="dave/old", incarnation="inc-1", shape=payload).shape.user == ""  # type: ignore[arg-type]


def test_in_use_reads_every_change_of_a_holding_job_and_forgets_the_jobs_that_stop(
    store: FederationStore,
) -> None:
    """Each tick reads every running job, so ``in_use`` keeps the shapes it parsed for the next call;
    a row that changed in any column it reads is read anew: the handoff moves ``running_on``'s
    start, a promotion elsewhere its peer (at the same ``updated_ms`` as before), a new incarnation
    its shape (same peer, backend and ``updated_ms``); a job that stops holding devices is gone."""
    other = "cw-us-west-01b"
    store.save_reports([report(PEER, gpu_backend(free=32)), report(other, gpu_backend(free=32))])
    store.enqueue(handle("alice/a", gpus=4))
    store.enqueue(handle("bob/b", gpus=2))
    store.enqueue(handle("carol/queued", gpus=1))

    def held() -> list[tuple[str, int, str | None, int | None]]:
        return [
            (
                s.job_id,
                s.device.count,
                s.running_on.peer_id if s.running_on else None,
                s.running_on.since_ms if s.running_on else None,
            )
            for s in store.in_use()
        ]

    assert store.promote("alice/a", "inc-1", placement("alice/a", need=4), NOW).promoted
    assert store.promote("bob/b", "inc-1", placement("bob/b", need=2), NOW).promoted
    first = store.in_use()
    assert held() == [("alice/a", 4, PEER, NOW), ("bob/b", 2, PEER, NOW)]
    # Unchanged: the shapes the last call parsed (shared; nobody changes them).
    assert [a is b for a, b in zip(store.in_use(), first, strict=True)] == [True, True]

    # Requeued and promoted to another peer before the next read, with the very ``updated_ms`` of
    # the first promotion.
    assert store.requeue("alice/a", "inc-1")
    assert store.promote("alice/a", "inc-1", placement("alice/a", peer=other, need=4), NOW).promoted
    assert held() == [("alice/a", 4, other, NOW), ("bob/b", 2, PEER, NOW)]

    # Ended, and a new incarnation of another shape promoted to the same place at the same time.
    assert store.set_state("alice/a", "inc-1", HandleState.SUCCEEDED) is not None
    store.enqueue(handle("alice/a", "inc-2", gpus=8))
    assert store.promote("alice/a", "inc-2", placement("alice/a", peer=other, need=8), NOW).promoted
    assert held() == [("alice/a", 8, other, NOW), ("bob/b", 2, PEER, NOW)]

    # The handoff: the same peer, since the handoff's time.
    assert store.set_state("alice/a", "inc-2", HandleState.HANDED_OFF) is not None
    handed = store.get("alice/a")
    assert handed is not None and handed.updated_ms != NOW
    assert held() == [("alice/a", 8, other, handed.updated_ms), ("bob/b", 2, PEER, NOW)]

    # Requeued, parked: holding nothing, gone.
    assert store.requeue("bob/b", "inc-1")
    assert held() == [("alice/a", 8, other, handed.updated_ms)]
    assert store.set_state("alice/a", "inc-2", HandleState.HANDOFF_FAILED, "peer down") is not None
    assert held() == []
