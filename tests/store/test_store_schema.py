"""Reports, waiting reasons, migrations and opening the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Connection, create_engine
from store_factories import EPOCH, NOW, PEER, Stores, gpu_backend, handle, placement, report

from iris.policy.models import PeerReport
from iris.store import LATEST_VERSION, MIGRATIONS, FederationStore, HandleState, Migration, StoreError
from iris.store.schema import migrate, recorded_versions


def test_reports_round_trip_and_unreachable_keeps_last_contact(store: FederationStore) -> None:
    cw = report(PEER, gpu_backend(free=8), last_contact_ms=NOW)
    gcp = report("gcp-b", gpu_backend("tpu", free=4, token="v5e"), last_contact_ms=NOW - 5)
    store.save_reports([gcp, cw])
    assert store.load_reports() == [cw, gcp]

    # cw goes dark: staleness must keep counting from the last time it really answered.
    store.save_reports([report(PEER, reachable=False)])
    dark = store.load_reports()[0]
    assert not dark.reachable and dark.last_contact_ms == NOW and dark.error
    assert dark.backends == []
    store.save_reports([report(PEER, reachable=False)])
    assert store.load_reports()[0].last_contact_ms == NOW

    back = report(PEER, gpu_backend(free=8, epoch=EPOCH + 9), last_contact_ms=NOW + 60_000)
    store.save_reports([back])
    assert store.load_reports()[0] == back

    # A peer never heard from stays "never contacted" (the policy treats it as stale).
    store.save_reports([PeerReport(peer_id="new-peer", reachable=False)])
    new = next(r for r in store.load_reports() if r.peer_id == "new-peer")
    assert new.last_contact_ms is None


def test_reasons_report_only_changes_of_queued_jobs(store: FederationStore) -> None:
    store.save_reports([report(PEER, gpu_backend(free=8))])
    for job_id in ("a", "b", "c"):
        store.enqueue(handle(job_id))
    assert store.promote("c", "inc-1", placement("c"), NOW).promoted

    reasons = {"a": "all peers full", "b": "cw full", "c": "placed", "ghost": "?"}
    assert store.update_reasons(reasons) == ["a", "b"]
    assert store.update_reasons(reasons) == []
    assert store.update_reasons({**reasons, "b": "cw unreachable"}) == ["b"]
    assert store.update_reasons({}) == []
    assert store.get("b").reason == "cw unreachable"  # type: ignore[union-attr]
    assert store.get("c").reason is None  # type: ignore[union-attr]


def test_reasons_handle_large_queues(store: FederationStore) -> None:
    for i in range(600):
        store.enqueue(handle(f"j{i:04d}", gpus=0))
    reasons = {f"j{i:04d}": "no peer has a cpu backend" for i in range(600)}
    assert len(store.update_reasons(reasons)) == 600
    assert store.update_reasons(reasons) == []
    assert len(store.expire_due(NOW)) == 0


def test_open_twice_is_idempotent_and_records_the_version(stores: Stores) -> None:
    first = stores.open()
    first.enqueue(handle("kept"))
    second = stores.open()
    assert first.schema_versions() == second.schema_versions() == [m.version for m in MIGRATIONS]
    assert second.schema_versions()[-1] == LATEST_VERSION == FederationStore.latest_schema_version()
    assert second.get("kept") is not None


def _raw_engine(stores: Stores) -> Connection:
    args = {"options": f"-csearch_path={stores.schema}"} if stores.schema else {}
    return create_engine(stores.url, connect_args=args).connect()


def test_a_later_migration_is_applied_once_in_order(stores: Stores) -> None:
    store = stores.open()
    store.enqueue(handle("j1"))
    applied: list[str] = []

    def add_note_column(conn: Connection) -> None:
        applied.append("2")
        conn.exec_driver_sql("ALTER TABLE job_handles ADD COLUMN note TEXT")

    later = (*MIGRATIONS, Migration(LATEST_VERSION + 1, "add note", add_note_column))
    with _raw_engine(stores) as conn:
        with conn.begin():
            assert migrate(conn, later) == [LATEST_VERSION + 1]
        with conn.begin():
            assert migrate(conn, later) == []
            assert recorded_versions(conn) == [*range(1, LATEST_VERSION + 2)]
    assert applied == ["2"]
    # The store still works on the migrated table (it only names the columns it knows).
    assert store.get("j1") is not None

    # This code does not know version LATEST + 1: refuse rather than misread the database.
    with pytest.raises(StoreError, match="newer than this code"):
        stores.open()


def test_migrations_must_be_ordered(stores: Stores) -> None:
    stores.open()
    with _raw_engine(stores) as conn, conn.begin(), pytest.raises(StoreError, match="increasing"):
        migrate(conn, (*MIGRATIONS, MIGRATIONS[0]))


def test_bad_urls_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="needs a file"):
        FederationStore("sqlite://")
    with pytest.raises(StoreError, match="needs a file"):
        FederationStore("sqlite:///:memory:")
    with pytest.raises(StoreError, match="only supported on PostgreSQL"):
        FederationStore(f"sqlite:///{tmp_path / 'x.db'}", schema="s")
    with pytest.raises(StoreError, match="unsupported"):
        FederationStore("mysql://root@localhost/db")
    with pytest.raises(StoreError, match="invalid schema"):
        FederationStore("postgresql+psycopg://postgres@127.0.0.1/test", schema='x"; DROP')


def test_sqlite_store_creates_its_directory(tmp_path: Path) -> None:
    store = FederationStore(f"sqlite:///{tmp_path / 'deep' / 'dir' / 'federation.db'}")
    try:
        store.enqueue(handle("j1"))
        assert store.get("j1").state is HandleState.QUEUED_HANDOFF  # type: ignore[union-attr]
        assert store.dialect == "sqlite"
    finally:
        store.close()
    assert (tmp_path / "deep" / "dir" / "federation.db").exists()
