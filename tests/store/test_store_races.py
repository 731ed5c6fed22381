"""Concurrency (docs/DESIGN.md, "Promotion (the CAS)",
"2. A cancel recorded before promotion is never delivered", "3. No backend is over-committed"):
racing promotions never over-commit, and cancel versus promote always has exactly one winner.
Threads stand in for workers; half of them go through a second store instance so the database, not
one process's pool, does the serializing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from budget import scaled
from sqlalchemy import Engine, create_engine, event, select
from store_factories import EPOCH, NOW, PEER, Stores, gpu_backend, handle, placement, report

from iris.store import CancelResult, HandleState, PromoteOutcome, PromoteResult
from iris.store.schema import peer_reports, reservations

T = TypeVar("T")


def _race(calls: list[Callable[[], T]]) -> list[T]:
    """Run every call at once (released together by a barrier) and return their results."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.mark.parametrize(("threads", "free"), [(2, 8), (12, 16), (16, 8)])
def test_racing_promotions_never_overcommit(stores: Stores, threads: int, free: int) -> None:
    workers = [stores.open(), stores.open()]
    workers[0].save_reports([report(PEER, gpu_backend(free=free))])
    job_ids = [f"job-{i:02d}" for i in range(threads)]
    for job_id in job_ids:
        workers[0].enqueue(handle(job_id))

    def promote(i: int) -> Callable[[], PromoteResult]:
        job_id = job_ids[i]
        return lambda: workers[i % 2].promote(job_id, "inc-1", placement(job_id), NOW)

    results = _race([promote(i) for i in range(threads)])

    winners = [r for r in results if r.promoted]
    assert len(winners) == free // 8
    assert all(r.outcome is PromoteOutcome.NO_CAPACITY for r in results if not r.promoted)
    ledger = workers[1].reservations()
    assert sum(r.amounts["h100"] for r in ledger) == free
    assert sorted(r.job_id for r in ledger) == sorted(r.handle.job_id for r in winners if r.handle)
    assert len(workers[1].queued()) == threads - len(winners)


def test_cancel_racing_promotion_has_exactly_one_winner(stores: Stores) -> None:
    promoter, canceller = stores.open(), stores.open()
    # One GPU per job and every promotion released afterwards, so capacity never decides the race.
    promoter.save_reports([report(PEER, gpu_backend(free=1))])
    iterations = scaled(300)
    outcomes = {"cancel": 0, "promote": 0}
    barrier = threading.Barrier(2)

    def promote(job_id: str) -> PromoteResult:
        barrier.wait()
        return promoter.promote(job_id, "inc-1", placement(job_id, need=1), NOW)

    def cancel(job_id: str) -> CancelResult:
        barrier.wait()
        return canceller.record_cancel(job_id, "user")

    with ThreadPoolExecutor(max_workers=2) as pool:
        for i in range(iterations):
            job_id = f"race-{i:04d}"
            promoter.enqueue(handle(job_id, gpus=1))
            # Alternate submission order so both sides get to start first.
            if i % 2:
                f_cancel, f_promote = pool.submit(cancel, job_id), pool.submit(promote, job_id)
            else:
                f_promote, f_cancel = pool.submit(promote, job_id), pool.submit(cancel, job_id)
            promoted, cancelled = f_promote.result(), f_cancel.result()

            assert promoted.promoted != cancelled.won, (job_id, promoted, cancelled)
            final = promoter.get(job_id)
            assert final is not None and final.cancel_requested
            if cancelled.won:
                outcomes["cancel"] += 1
                assert promoted.outcome is PromoteOutcome.CANCELLED
                assert final.state is HandleState.KILLED and final.assigned_peer is None
                assert promoter.reservations() == []
            else:
                outcomes["promote"] += 1
                assert promoted.outcome is PromoteOutcome.PROMOTED
                assert cancelled.state is HandleState.PENDING_HANDOFF
                assert final.state is HandleState.PENDING_HANDOFF
                assert [r.job_id for r in promoter.reservations()] == [job_id]
                # The workflow then stops it through the peer and ends it.
                assert promoter.set_state(job_id, "inc-1", HandleState.KILLED) is not None
    # Not a correctness condition, but a race that one side always wins tests nothing.
    print(f"{stores.backend}: {outcomes}")
    assert sum(outcomes.values()) == iterations


def test_enqueue_and_report_upserts_race_safely(stores: Stores) -> None:
    a, b = stores.open(), stores.open()
    results = _race([lambda: a.enqueue(handle("same")), lambda: b.enqueue(handle("same"))])
    assert results[0] == results[1]
    _race(
        [
            lambda: a.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH))]),
            lambda: b.save_reports([report(PEER, gpu_backend(free=8, epoch=EPOCH + 1))]),
        ]
    )
    assert [r.peer_id for r in a.load_reports()] == [PEER]


def _until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


def _lock_waiters(engine: Engine) -> int:
    """PostgreSQL sessions of this database waiting for a lock (each query its own snapshot)."""
    with engine.connect() as watcher:
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return int(watcher.exec_driver_sql(query).scalar_one())


@contextlib.contextmanager
def _taking_the_write_lock() -> Iterator[threading.Event]:
    """Set once a thread other than this one sends SQLite's ``BEGIN IMMEDIATE`` (the store's writers
    take the write lock up front, iris/store/store.py): from then on it waits for the lock."""
    asked = threading.Event()
    me = threading.get_ident()

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement == "BEGIN IMMEDIATE" and threading.get_ident() != me:
            asked.set()

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield asked
    finally:
        event.remove(Engine, "before_cursor_execute", before)


def test_promotion_waits_for_a_concurrent_charge_and_sees_it(stores: Stores) -> None:
    """Deterministic form of the race: another writer holds the peer and charges the backend.

    The promotion must wait for that transaction and then count its reservation; one that read
    the ledger without waiting would promote into capacity that is already spent.
    """
    store = stores.open()
    store.save_reports([report(PEER, gpu_backend(free=8))])
    store.enqueue(handle("a"))
    postgres = stores.backend == "postgresql"
    args = {"options": f"-csearch_path={stores.schema}"} if postgres else {}
    engine = create_engine(stores.url, connect_args=args, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as other, ThreadPoolExecutor(max_workers=1) as pool:
            other.exec_driver_sql("BEGIN" if postgres else "BEGIN IMMEDIATE")
            if postgres:
                other.execute(select(peer_reports).where(peer_reports.c.peer_id == PEER).with_for_update())
            other.execute(
                reservations.insert().values(
                    job_id="someone-else",
                    peer_id=PEER,
                    backend_id="h100-a",
                    observation_epoch_ms=EPOCH,
                    amounts='{"h100": 8}',
                    band=2,
                    created_ms=NOW,
                )
            )
            with _taking_the_write_lock() as sqlite_waits:
                pending = pool.submit(store.promote, "a", "inc-1", placement("a"), NOW)
                # The promotion is at the lock `other` holds (not merely submitted) before it commits.
                if postgres:
                    _until(
                        lambda: _lock_waiters(engine) > 0 or pending.done(),
                        "the promotion to wait for the lock",
                    )
                else:
                    assert sqlite_waits.wait(60), "the promotion never asked for the write lock"
                assert not pending.done(), pending.result()
            other.exec_driver_sql("COMMIT")
            result = pending.result(timeout=10)
    finally:
        engine.dispose()
    assert result.outcome is PromoteOutcome.NO_CAPACITY, result
    assert [r.job_id for r in store.reservations()] == ["someone-else"]
