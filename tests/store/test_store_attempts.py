"""What issue 15 added to the store: the fences table (migration 2), abandoning the handle of a
closed workflow, and requeueing a handed-off job for its next attempt."""

from __future__ import annotations

import pytest
from sqlalchemy import Connection, create_engine, text
from store_factories import NOW, PEER, Stores, gpu_backend, handle, placement, report

from iris.store import MIGRATIONS, FederationStore, HandleState, JobHandle, PromoteOutcome
from iris.store.schema import migrate, recorded_versions

ABANDONED = "its workflow closed"


def _raw(stores: Stores) -> Connection:
    args = {"options": f"-csearch_path={stores.schema}"} if stores.schema else {}
    return create_engine(stores.url, connect_args=args).connect()


def _live(store: FederationStore, job_id: str, state: HandleState, *, gpus: int = 8) -> JobHandle:
    """A handle of ``job_id`` in ``state`` (promoted with a reservation unless QUEUED_HANDOFF)."""
    store.enqueue(handle(job_id, gpus=gpus))
    if state is not HandleState.QUEUED_HANDOFF:
        assert store.promote(job_id, "inc-1", placement(job_id, need=gpus), NOW).promoted
        if state is not HandleState.PENDING_HANDOFF:
            assert store.set_state(job_id, "inc-1", state) is not None
    got = store.get(job_id)
    assert got is not None and got.state is state
    return got


def _reserved(store: FederationStore) -> set[str]:
    return {r.job_id for r in store.reservations()}


# ---- migrations 2 and 3 -----------------------------------------------------------------------


def test_migrations_apply_to_a_store_created_at_schema_1(stores: Stores) -> None:
    # A database as the code before issue 15 left it: migration 1 only, with a job in it.
    old = handle("old")
    with _raw(stores) as conn:
        with conn.begin():
            if stores.schema:
                conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{stores.schema}"')
        with conn.begin():
            assert migrate(conn, MIGRATIONS[:1]) == [1]
            conn.execute(
                text(
                    "INSERT INTO job_handles (job_id, incarnation, state, shape, band, submit_ms,"
                    " cancel_requested, updated_ms) VALUES ('old', 'inc-1', 'QUEUED_HANDOFF', :shape,"
                    " :band, 0, FALSE, 0)"
                ),
                {"shape": old.shape.model_dump_json(), "band": int(old.band)},
            )
            conn.execute(
                text(
                    "INSERT INTO reservations (job_id, peer_id, backend_id, observation_epoch_ms,"
                    " amounts, band, created_ms) VALUES ('old', :peer, 'b', 5, '{\"h100\": 8}', 2, 0)"
                ),
                {"peer": PEER},
            )
        with conn.begin():
            assert recorded_versions(conn) == [1]
            tables = _tables(conn, stores)
        assert "fences" not in tables

    store = stores.open()
    assert store.schema_versions() == [1, 2, 3, 4] == [m.version for m in MIGRATIONS]
    assert store.get("old") == old.model_copy(update={"updated_ms": 0})
    store.add_fence("old", "n1", PEER)
    assert [(f.job_id, f.nonce, f.cluster) for f in store.fences()] == [("old", "n1", PEER)]
    # The reservation written before migration 3 is kept; it has no acceptance time yet.
    assert [(r.job_id, r.amounts) for r in store.reservations()] == [("old", {"h100": 8})]
    # Opening again applies nothing more.
    assert stores.open().schema_versions() == [1, 2, 3, 4]


def _tables(conn: Connection, stores: Stores) -> set[str]:
    if stores.schema:
        rows = conn.execute(
            text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
            {"s": stores.schema},
        )
    else:
        rows = conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'"))
    return {r[0] for r in rows}


# ---- fences ----------------------------------------------------------------------------------


def test_fences_are_added_once_listed_oldest_first_and_removed(stores: Stores) -> None:
    store = stores.open()
    assert store.fences() == []
    store.add_fence("j1", "n1", "cw-a")
    store.add_fence("j1", "n1", "cw-a")  # the same attempt again: still one fence
    store.add_fence("j1", "n1", "cw-b")  # (job, nonce) is the key: the first cluster stays
    store.add_fence("j1", "n2", "cw-b")  # another attempt of the same job
    store.add_fence("j2", "n1", "cw-a")
    fences = store.fences()
    assert sorted((f.job_id, f.nonce, f.cluster) for f in fences) == [
        ("j1", "n1", "cw-a"),
        ("j1", "n2", "cw-b"),
        ("j2", "n1", "cw-a"),
    ]
    assert [f.created_ms for f in fences] == sorted(f.created_ms for f in fences)
    assert len(store.fences(limit=2)) == 2

    # Another worker on the same database sees them, and removing is idempotent.
    other = stores.open()
    other.remove_fence("j1", "n1")
    other.remove_fence("j1", "n1")
    other.remove_fence("ghost", "n9")
    assert sorted((f.job_id, f.nonce) for f in store.fences()) == [("j1", "n2"), ("j2", "n1")]
    store.remove_fence("j1", "n2")
    store.remove_fence("j2", "n1")
    assert store.fences() == []
    # A fence removed can be added again (an attempt fenced anew).
    store.add_fence("j1", "n1", "cw-a")
    assert [(f.job_id, f.nonce) for f in store.fences()] == [("j1", "n1")]


def test_fences_survive_reopening(stores: Stores) -> None:
    stores.open().add_fence("j1", "n1", "cw-a")
    stores.close_all()
    assert [(f.job_id, f.nonce, f.cluster) for f in stores.open().fences()] == [("j1", "n1", "cw-a")]


# ---- abandon ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        HandleState.QUEUED_HANDOFF,
        HandleState.PENDING_HANDOFF,
        HandleState.HANDED_OFF,
        HandleState.HANDOFF_FAILED,
    ],
)
def test_abandon_ends_a_live_handle_and_releases_its_reservation(
    store: FederationStore, state: HandleState
) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    _live(store, "j1", state)
    _live(store, "other", HandleState.PENDING_HANDOFF)
    assert _reserved(store) == ({"j1", "other"} if state is not HandleState.QUEUED_HANDOFF else {"other"})

    assert store.abandon("j1", ABANDONED)
    ended = store.get("j1")
    assert ended is not None
    assert (ended.state, ended.reason) == (HandleState.KILLED, ABANDONED)
    assert _reserved(store) == {"other"}  # only its own reservation is released
    assert "j1" not in {h.job_id for h in store.queued()}
    # The capacity it held is free again: another job takes all 8 remaining plus its 8.
    store.enqueue(handle("next", gpus=8))
    assert store.promote("next", "inc-1", placement("next", need=8), NOW).promoted

    # Once ended, abandoning again is a no-op that changes nothing.
    assert not store.abandon("j1", "something else")
    again = store.get("j1")
    assert again is not None and (again.state, again.reason) == (HandleState.KILLED, ABANDONED)
    # Ended, the job can come back as a new incarnation.
    assert store.enqueue(handle("j1", "inc-2")).state is HandleState.QUEUED_HANDOFF


@pytest.mark.parametrize(
    "end", [HandleState.SUCCEEDED, HandleState.FAILED, HandleState.KILLED, HandleState.HANDOFF_REJECTED]
)
def test_abandon_is_a_no_op_for_an_ended_handle(store: FederationStore, end: HandleState) -> None:
    store.save_reports([report(PEER, gpu_backend(free=16))])
    _live(store, "j1", HandleState.HANDED_OFF)
    assert store.set_state("j1", "inc-1", end, "ended by its workflow") is not None
    before = store.get("j1")
    assert not store.abandon("j1", ABANDONED)
    assert store.get("j1") == before


def test_abandon_is_a_no_op_for_an_expired_or_unknown_job(store: FederationStore) -> None:
    store.enqueue(handle("late", deadline_ms=NOW))
    assert store.expire_due(NOW) == ["late"]
    before = store.get("late")
    assert before is not None and before.state is HandleState.UNSCHEDULABLE
    assert not store.abandon("late", ABANDONED)
    assert store.get("late") == before
    assert not store.abandon("never-queued", ABANDONED)
    assert store.get("never-queued") is None


def test_an_abandoned_handle_is_never_promoted(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("j1"))
    assert store.abandon("j1", ABANDONED)
    result = store.promote("j1", "inc-1", placement("j1"), NOW)
    assert result.outcome is PromoteOutcome.NOT_QUEUED and not result.promoted
    assert store.reservations() == []


# ---- requeue from HANDED_OFF (the next attempt) ----------------------------------------------


def test_requeue_from_handed_off_clears_the_assignment_and_the_reservation(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    _live(store, "j1", HandleState.HANDED_OFF)
    assert _reserved(store) == {"j1"}

    assert not store.requeue("j1", "inc-0")  # a stale incarnation is refused and changes nothing
    stale = store.get("j1")
    assert stale is not None and stale.state is HandleState.HANDED_OFF and stale.assigned_peer == PEER
    assert _reserved(store) == {"j1"}

    assert store.requeue("j1", "inc-1")
    back = store.get("j1")
    assert back is not None and back.state is HandleState.QUEUED_HANDOFF
    assert (back.assigned_peer, back.assigned_backend, back.observation_epoch_ms) == (None, None, None)
    assert back.reason is None
    assert store.reservations() == []
    assert [h.job_id for h in store.queued()] == ["j1"]
    # The next attempt is promoted afresh and charged once.
    assert store.promote("j1", "inc-1", placement("j1"), NOW).outcome is PromoteOutcome.PROMOTED
    assert _reserved(store) == {"j1"}


def test_requeue_from_handed_off_is_refused_with_a_cancel_intent(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    _live(store, "j1", HandleState.HANDED_OFF)
    assert not store.record_cancel("j1", "stop").won
    assert not store.requeue("j1", "inc-1")
    kept = store.get("j1")
    assert kept is not None and kept.state is HandleState.HANDED_OFF
    assert _reserved(store) == {"j1"}


def test_live_jobs_names_the_handles_that_have_not_ended(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=32))])
    _live(store, "queued", HandleState.QUEUED_HANDOFF)
    _live(store, "pending", HandleState.PENDING_HANDOFF)
    _live(store, "handed", HandleState.HANDED_OFF)
    _live(store, "parked", HandleState.HANDOFF_FAILED)
    _live(store, "done", HandleState.HANDED_OFF)
    assert store.set_state("done", "inc-1", HandleState.SUCCEEDED) is not None
    store.enqueue(handle("gone"))
    assert store.abandon("gone", ABANDONED)
    asked = ["queued", "pending", "handed", "parked", "done", "gone", "unknown", "queued"]
    assert store.live_jobs(asked) == {"queued", "pending", "handed", "parked"}
    assert store.live_jobs([]) == set()
    many = [f"j{i:04d}" for i in range(700)]  # more than one IN list
    for job_id in many[::7]:
        store.enqueue(handle(job_id, gpus=0))
    assert store.live_jobs(many) == set(many[::7])
