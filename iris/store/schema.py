"""Tables of the federation store and the ordered migrations that create and evolve them.

The ``Table`` objects describe the *current* schema for queries. Each migration carries its own
frozen DDL, so changing a table later never rewrites what an old migration did: to evolve the
schema, append one function to ``MIGRATIONS`` and update the matching ``Table`` here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    select,
    text,
)

from iris.store.errors import StoreError

metadata = MetaData()

schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("name", Text, nullable=False),
    Column("applied_ms", BigInteger, nullable=False),
)

job_handles = Table(
    "job_handles",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("incarnation", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("shape", Text, nullable=False),
    Column("band", Integer, nullable=False),
    Column("submit_ms", BigInteger, nullable=False),
    Column("deadline_ms", BigInteger),
    Column("target_cluster", Text),
    Column("assigned_peer", Text),
    Column("assigned_backend", Text),
    Column("observation_epoch_ms", BigInteger),
    Column("cancel_requested", Boolean, nullable=False),
    Column("cancel_reason", Text),
    Column("reason", Text),
    Column("updated_ms", BigInteger, nullable=False),
    # The tick's stable code for ``reason`` while queued (iris/policy/reasons.py); None otherwise.
    Column("reason_code", Text),
)

# One reservation per job: a handle is promoted at most once per incarnation, and requeue or a
# terminal state deletes it. Indexed by (peer, backend, observation) for the capacity check.
reservations = Table(
    "reservations",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("peer_id", Text, nullable=False),
    Column("backend_id", Text, nullable=False),
    Column("observation_epoch_ms", BigInteger, nullable=False),
    Column("amounts", Text, nullable=False),
    Column("band", Integer),
    Column("created_ms", BigInteger, nullable=False),
    # Set at handoff: the cluster's clock when it accepted the job. An observation of the backend
    # older than this cannot count the job yet, so the reservation stays charged until one does.
    Column("counted_from_ms", BigInteger),
)

# Also the per-peer lock row that serializes promotions on PostgreSQL.
peer_reports = Table(
    "peer_reports",
    metadata,
    Column("peer_id", Text, primary_key=True),
    Column("reachable", Boolean, nullable=False),
    Column("last_contact_ms", BigInteger),
    Column("report", Text, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
)

# Attempts of a job that a cluster may still run although the job has moved on (the cluster went
# silent, or a launch's answer was lost): the placement manager terminates each one, by its nonce,
# once that cluster answers again, then forgets it (docs/DESIGN.md, "Attempts").
fences = Table(
    "fences",
    metadata,
    Column("job_id", Text, primary_key=True),
    Column("nonce", Text, primary_key=True),
    Column("cluster", Text, nullable=False),
    Column("created_ms", BigInteger, nullable=False),
)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Connection], None]


def _m001_initial(conn: Connection) -> None:
    # Plain DDL that both SQLite and PostgreSQL accept; frozen once released.
    statements = [
        """CREATE TABLE job_handles (
            job_id TEXT NOT NULL PRIMARY KEY,
            incarnation TEXT NOT NULL,
            state TEXT NOT NULL,
            shape TEXT NOT NULL,
            band INTEGER NOT NULL,
            submit_ms BIGINT NOT NULL,
            deadline_ms BIGINT,
            target_cluster TEXT,
            assigned_peer TEXT,
            assigned_backend TEXT,
            observation_epoch_ms BIGINT,
            cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
            cancel_reason TEXT,
            reason TEXT,
            updated_ms BIGINT NOT NULL
        )""",
        "CREATE INDEX ix_job_handles_queue ON job_handles (state, band, submit_ms, job_id)",
        "CREATE INDEX ix_job_handles_deadline ON job_handles (state, deadline_ms)",
        """CREATE TABLE reservations (
            job_id TEXT NOT NULL PRIMARY KEY,
            peer_id TEXT NOT NULL,
            backend_id TEXT NOT NULL,
            observation_epoch_ms BIGINT NOT NULL,
            amounts TEXT NOT NULL,
            band INTEGER,
            created_ms BIGINT NOT NULL
        )""",
        "CREATE INDEX ix_reservations_backend ON reservations (peer_id, backend_id, observation_epoch_ms)",
        """CREATE TABLE peer_reports (
            peer_id TEXT NOT NULL PRIMARY KEY,
            reachable BOOLEAN NOT NULL,
            last_contact_ms BIGINT,
            report TEXT NOT NULL,
            updated_ms BIGINT NOT NULL
        )""",
    ]
    for statement in statements:
        conn.exec_driver_sql(statement)


def _m002_fences(conn: Connection) -> None:
    conn.exec_driver_sql(
        """CREATE TABLE fences (
            job_id TEXT NOT NULL,
            nonce TEXT NOT NULL,
            cluster TEXT NOT NULL,
            created_ms BIGINT NOT NULL,
            PRIMARY KEY (job_id, nonce)
        )"""
    )


def _m003_counted_from(conn: Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE reservations ADD COLUMN counted_from_ms BIGINT")


def _m004_reason_code(conn: Connection) -> None:
    conn.exec_driver_sql("ALTER TABLE job_handles ADD COLUMN reason_code TEXT")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial federation store", _m001_initial),
    Migration(2, "fences of attempts left on silent clusters", _m002_fences),
    Migration(3, "when a handed-off job's cluster counts it", _m003_counted_from),
    Migration(4, "the reason code of a queued job's waiting reason", _m004_reason_code),
)

LATEST_VERSION = MIGRATIONS[-1].version


def migrate(conn: Connection, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[int]:
    """Apply the pending migrations in order inside the caller's transaction; returns their versions.

    The caller holds a lock that serializes concurrent openers (an advisory lock on PostgreSQL,
    ``BEGIN IMMEDIATE`` on SQLite), so two workers starting together never race on DDL.
    """
    versions = [m.version for m in migrations]
    if versions != sorted(set(versions)):
        raise StoreError(f"migrations must have strictly increasing versions, got {versions}")
    conn.exec_driver_sql(
        "CREATE TABLE IF NOT EXISTS schema_version ("
        " version INTEGER NOT NULL PRIMARY KEY, name TEXT NOT NULL, applied_ms BIGINT NOT NULL)"
    )
    current = conn.execute(select(func.max(schema_version.c.version))).scalar_one_or_none() or 0
    known = versions[-1] if versions else 0
    if current > known:
        raise StoreError(
            f"the federation store is at schema version {current}, newer than this code knows "
            f"({known}); upgrade iris before opening it"
        )
    applied: list[int] = []
    for migration in migrations:
        if migration.version <= current:
            continue
        migration.apply(conn)
        conn.execute(
            schema_version.insert().values(
                version=migration.version, name=migration.name, applied_ms=int(time.time() * 1000)
            )
        )
        applied.append(migration.version)
    return applied


def recorded_versions(conn: Connection) -> list[int]:
    """Versions recorded in ``schema_version``, in order (for tests and ``iris`` diagnostics)."""
    return list(conn.execute(text("SELECT version FROM schema_version ORDER BY version")).scalars())
