"""The federation store (docs/DESIGN.md, "Components", "Promotion (the CAS)"): queue handles, the
reservation ledger, reports and reasons.

Every public method is one transaction. Writes that must not interleave are serialized by the
database, not by this process, so any number of workers can share one store:

* PostgreSQL: the handle row is locked (``SELECT ... FOR UPDATE``) by promote, cancel and every
  state change, so cancel and promote of one job commit in some order; a promotion that reserves
  capacity also locks the peer's ``peer_reports`` row, so two promotions to one peer never both
  read the ledger before either wrote it. Deadlocks and racing inserts are retried.
* SQLite: every write transaction is ``BEGIN IMMEDIATE`` (one writer at a time, WAL so readers
  never block), which is stronger than per-peer locking.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Row, bindparam, create_engine, delete, event, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from iris.policy.availability import live_reservations, usable_block, working_capacity
from iris.policy.explain import CANCELLED_BEFORE_HANDOFF, DEADLINE_PASSED
from iris.policy.models import Band, JobShape, PeerReport, Placement, Reservation, RunningOn
from iris.policy.reasons import ReasonCode
from iris.store.errors import StoreConflict, StoreError
from iris.store.models import (
    CancelResult,
    Fence,
    HandleState,
    JobHandle,
    PromoteOutcome,
    PromoteResult,
)
from iris.store.schema import LATEST_VERSION, job_handles, migrate, peer_reports, recorded_versions
from iris.store.schema import fences as fences_table
from iris.store.schema import reservations as reservations_table

T = TypeVar("T")


_WRITE_OPTION = "iris_store_write"
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# PostgreSQL errors worth running the whole transaction again for: deadlock, serialization
# failure, and a unique violation from two writers inserting the same new row.
_RETRY_SQLSTATES = frozenset({"40P01", "40001", "23505"})
_MAX_ATTEMPTS = 6
# Keeps IN lists under SQLite's bound-parameter limit.
_CHUNK = 500
_LIVE_ASSIGNED = (HandleState.PENDING_HANDOFF, HandleState.HANDED_OFF, HandleState.HANDOFF_FAILED)
# A holding job's row as ``in_use`` reads it: (shape JSON, assigned peer, assigned backend, updated_ms).
_InUseRow = tuple[str, str | None, str | None, int]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _chunks(items: Sequence[str], size: int = _CHUNK) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _expired(handle: JobHandle, now_ms: int) -> bool:
    # Same boundary as the planner: a deadline that has been reached is past.
    return handle.deadline_ms is not None and now_ms >= handle.deadline_ms


def _target(peer: str | None, backend: str | None) -> str:
    return f"{peer}/{backend or '-'}"


def _promoted_message(
    verb: str, placement: Placement, reservation: Reservation | None, observation: int | None
) -> str:
    """``promoted to cw-a/h100-a; reserved 8 h100 of observation 123`` (``verb``: "promoted to" or
    "retaken on"), or what a shape-only placement took: nothing."""
    target = _target(placement.peer_id, placement.backend_id)
    if reservation is None:
        return f"{verb} {target} (shape-only; nothing reserved)"
    amounts = ", ".join(f"{n} {t}" for t, n in sorted(reservation.amounts.items()))
    return f"{verb} {target}; reserved {amounts} of observation {observation}"


class FederationStore:
    """Durable state shared by every worker; synchronous (run methods in a thread from asyncio).

    ``url`` is a SQLAlchemy URL: ``sqlite:///path/federation.db`` (the parent directory is
    created) or ``postgresql+psycopg://user@host:5432/db``. ``schema`` (PostgreSQL only) puts the
    tables in that schema, created if missing, e.g. to isolate tests or deployments in one database.
    Opening creates or migrates the schema.
    """

    def __init__(
        self,
        url: str,
        *,
        schema: str | None = None,
        busy_timeout_s: float = 30.0,
        pool_size: int = 5,
        max_overflow: int = 20,
    ) -> None:
        parsed = make_url(url)
        backend = parsed.get_backend_name()
        self._schema = schema
        if schema is not None and not _SCHEMA_NAME.match(schema):
            raise StoreError(f"invalid schema name {schema!r}")
        if backend == "sqlite":
            if schema is not None:
                raise StoreError("schema= is only supported on PostgreSQL")
            database = parsed.database
            if not database or database == ":memory:" or parsed.query.get("mode") == "memory":
                raise StoreError("the SQLite federation store needs a file (sqlite:///path/federation.db)")
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            self._engine = self._sqlite_engine(url, busy_timeout_s, pool_size, max_overflow)
            self._postgres = False
        elif backend == "postgresql":
            connect_args: dict[str, Any] = {}
            if schema is not None:
                connect_args["options"] = f"-csearch_path={schema}"
            self._engine = create_engine(
                url,
                pool_size=pool_size,
                max_overflow=max_overflow,
                pool_pre_ping=True,
                connect_args=connect_args,
            )
            self._postgres = True
        else:
            raise StoreError(f"unsupported federation store URL {parsed.render_as_string()!r}")
        self._url = parsed.render_as_string(hide_password=True)
        # The shapes ``in_use`` returned last, by what they were parsed from: its rows' columns.
        self._in_use_shapes: dict[_InUseRow, JobShape] = {}
        try:
            self._open()
        except BaseException:
            self._engine.dispose()
            raise

    @staticmethod
    def _sqlite_engine(url: str, busy_timeout_s: float, pool_size: int, max_overflow: int) -> Engine:
        engine = create_engine(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            connect_args={"check_same_thread": False, "timeout": busy_timeout_s},
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            # Take transaction control away from sqlite3 so BEGIN is ours (see _on_begin).
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # Writers take the write lock up front: a deferred transaction that upgrades later can
            # fail with SQLITE_BUSY without waiting, and two of them could both read the old ledger.
            write = conn.get_execution_options().get(_WRITE_OPTION, True)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        return engine

    def _open(self) -> None:
        def body(conn: Connection) -> None:
            if self._postgres:
                key = f"iris.store.migrate:{self._schema or ''}"
                conn.execute(select(_advisory_xact_lock(key)))
                if self._schema is not None:
                    conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{self._schema}"')
            migrate(conn)

        self._run(body)

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The store's URL with any password hidden."""
        return self._url

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return "postgresql" if self._postgres else "sqlite"

    def close(self) -> None:
        """Close every pooled connection; the store must not be used afterwards."""
        self._engine.dispose()

    @contextmanager
    def _begin(self, *, write: bool) -> Iterator[Connection]:
        with self._engine.connect() as conn:
            conn.execution_options(**{_WRITE_OPTION: write})
            with conn.begin():
                yield conn

    def _run(self, body: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run ``body`` in one transaction, again from scratch after a retryable conflict."""
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._begin(write=write) as conn:
                    return body(conn)
            except DBAPIError as exc:
                sqlstate = getattr(exc.orig, "sqlstate", None)
                if attempt >= _MAX_ATTEMPTS or sqlstate not in _RETRY_SQLSTATES:
                    raise
                time.sleep(random.uniform(0.0, 0.01 * attempt))

    def schema_versions(self) -> list[int]:
        """The migration versions recorded in this database, oldest first."""
        return self._run(recorded_versions, write=False)

    @staticmethod
    def latest_schema_version() -> int:
        return LATEST_VERSION

    # ---- handles -------------------------------------------------------------------------------

    def enqueue(self, handle: JobHandle) -> JobHandle:
        """Put a job in the queue as QUEUED_HANDOFF; idempotent for the same (job_id, incarnation).

        The same incarnation again returns the stored handle unchanged, whatever its state. A new
        incarnation replaces a terminal handle (its reservations are released) and raises
        ``StoreConflict`` while the old one is still live.
        """

        def body(conn: Connection) -> JobHandle:
            row = _lock_handle(conn, handle.job_id)
            fresh = handle.model_copy(
                update={
                    "state": HandleState.QUEUED_HANDOFF,
                    "assigned_peer": None,
                    "assigned_backend": None,
                    "observation_epoch_ms": None,
                    "cancel_requested": False,
                    "cancel_reason": None,
                    "updated_ms": _now_ms(),
                }
            )
            if row is None:
                conn.execute(job_handles.insert().values(_handle_values(fresh)))
                return fresh
            existing = _row_handle(row)
            if existing.incarnation == handle.incarnation:
                return existing
            if not existing.state.terminal:
                raise StoreConflict(
                    f"job {handle.job_id} incarnation {existing.incarnation} is still {existing.state}; "
                    f"cannot enqueue incarnation {handle.incarnation}"
                )
            _delete_reservations(conn, [handle.job_id])
            _write_handle(conn, fresh)
            return fresh

        return self._run(body)

    def get(self, job_id: str) -> JobHandle | None:
        """The job's handle, or None if it was never queued."""

        def body(conn: Connection) -> JobHandle | None:
            row = conn.execute(select(job_handles).where(job_handles.c.job_id == job_id)).first()
            return None if row is None else _row_handle(row)

        return self._run(body, write=False)

    def queued(self) -> list[JobHandle]:
        """Every QUEUED_HANDOFF handle in placement order: (band, submit_ms, job_id)."""

        def body(conn: Connection) -> list[JobHandle]:
            rows = conn.execute(
                select(job_handles)
                .where(job_handles.c.state == HandleState.QUEUED_HANDOFF.value)
                .order_by(job_handles.c.band, job_handles.c.submit_ms, job_handles.c.job_id)
            )
            return [_row_handle(r) for r in rows]

        return self._run(body, write=False)

    def in_use(self) -> list[JobShape]:
        """The shapes of the jobs holding devices: promoted (PENDING_HANDOFF) or handed off, by job
        id; what the fair share counts (docs/DESIGN.md, "Fair share and aging"). A parked job
        (HANDOFF_FAILED) holds none. The shape names the user (shapes stored before it did leave it
        empty, and the policy reads the job id's prefix) and its time limit; ``running_on`` is the
        handle's peer and backend, since its last change (the promotion, then the handoff), which
        backfill reads as its start (docs/DESIGN.md, "Backfill"). A force-routed job (no backend)
        has none.

        Every tick reads every running job here (docs/DESIGN.md, "The tick"), and nearly all are
        unchanged since the last read: a row whose shape JSON, peer, backend and ``updated_ms`` are
        all as the last call read them gets the shape that call parsed, the same object. So the
        shapes returned are shared between calls: read them, never change them. Only the rows of
        this call are kept for the next (a job that stopped holding devices is forgotten)."""
        holding = [HandleState.PENDING_HANDOFF.value, HandleState.HANDED_OFF.value]
        t = job_handles.c

        def body(conn: Connection) -> list[JobShape]:
            # Fetched at once (``all``): a row at a time costs a call per row.
            rows = conn.execute(
                select(t.shape, t.assigned_peer, t.assigned_backend, t.updated_ms)
                .where(t.state.in_(holding))
                .order_by(t.job_id)
            ).all()
            known = self._in_use_shapes
            seen: dict[_InUseRow, JobShape] = {}
            shapes: list[JobShape] = []
            for shape, peer_id, backend_id, since_ms in rows:
                key = (shape, peer_id, backend_id, since_ms)
                parsed = known.get(key)
                if parsed is None:
                    parsed = JobShape.model_validate_json(shape)
                    if peer_id and backend_id:
                        # Parsed here and not yet shared: set in place rather than copied.
                        where = RunningOn(peer_id=peer_id, backend_id=backend_id, since_ms=since_ms)
                        parsed.running_on = where
                seen[key] = parsed
                shapes.append(parsed)
            # Replaced whole, never changed in place: a concurrent call (the tick, a queue-position
            # inquiry) reads one map or the other, and either gives it right shapes.
            self._in_use_shapes = seen
            return shapes

        return self._run(body, write=False)

    def handles(self, states: Iterable[HandleState] | None = None) -> list[JobHandle]:
        """Handles in the given states (all when None), by job id; for operators and diagnostics."""
        wanted = None if states is None else [s.value for s in states]

        def body(conn: Connection) -> list[JobHandle]:
            stmt = select(job_handles).order_by(job_handles.c.job_id)
            if wanted is not None:
                stmt = stmt.where(job_handles.c.state.in_(wanted))
            return [_row_handle(r) for r in conn.execute(stmt)]

        return self._run(body, write=False)

    def live_jobs(self, job_ids: Iterable[str]) -> set[str]:
        """Those of ``job_ids`` whose handle has not ended (queued, promoted, handed off, parked)."""
        ids = sorted(set(job_ids))
        live = [s.value for s in HandleState if not s.terminal]

        def body(conn: Connection) -> set[str]:
            found: set[str] = set()
            for chunk in _chunks(ids):
                found.update(
                    conn.execute(
                        select(job_handles.c.job_id).where(
                            job_handles.c.job_id.in_(chunk), job_handles.c.state.in_(live)
                        )
                    ).scalars()
                )
            return found

        return self._run(body, write=False) if ids else set()

    # ---- the compare-and-swap (docs/DESIGN.md, "Promotion (the CAS)") --------------------------

    def promote(
        self, job_id: str, incarnation: str, placement: Placement, now_ms: int, *, retake: bool = False
    ) -> PromoteResult:
        """Move the handle QUEUED_HANDOFF → PENDING_HANDOFF(peer, backend) and charge the ledger.

        Only if the handle of this incarnation is still queued, has no cancel intent, has not
        reached its deadline (then it becomes UNSCHEDULABLE here) and, when the placement reserves
        capacity, the confirmed reservations of that backend's latest stored observation plus this
        job's need still fit its effective capacity for the job's band. The reservation is
        recorded against that latest observation. A retry while that promotion is live (pending,
        handed off or parked) answers ALREADY_PROMOTED without charging twice; an ended handle is
        never reported promoted again, but for one: a HANDOFF_REJECTED handle, asked for its own
        target with no cancel on it, is what an operator's reset of the refused run asks, and is
        answered ALREADY_PROMOTED, neither revived nor charged (``_not_queued``). Any refusal but
        CANCELLED and EXPIRED leaves the job queued.

        ``retake``: an operator's replay in place of a parked job whose reservation was released
        when it parked (``set_state(..., release=True)``): the same CAS from HANDOFF_FAILED, to the
        cluster the handle is assigned to, with no deadline (it applies only while queued). A
        refusal leaves the handle parked; a handle that still holds its reservation keeps it and
        is not charged twice (docs/DESIGN.md, "Errors, retries and parking").
        """
        if placement.job_id and placement.job_id != job_id:
            raise ValueError(f"placement is for job {placement.job_id!r}, not {job_id!r}")

        def body(conn: Connection) -> PromoteResult:
            row = _lock_handle(conn, job_id)
            if row is None:
                return PromoteResult(
                    outcome=PromoteOutcome.NOT_FOUND, message=f"job {job_id} is not in the federation queue"
                )
            handle = _row_handle(row)
            if handle.incarnation != incarnation:
                return PromoteResult(
                    outcome=PromoteOutcome.NOT_FOUND,
                    message=f"job {job_id} is queued as incarnation {handle.incarnation}, not {incarnation}",
                    handle=handle,
                )
            pin = handle.shape.target_cluster
            if pin is not None and placement.peer_id != pin:
                raise StoreConflict(
                    f"job {job_id} is pinned to {pin}; refusing to promote it to {placement.peer_id}"
                )
            if retake and handle.state is HandleState.HANDOFF_FAILED:
                return self._retake(conn, handle, placement, now_ms)
            if handle.state is not HandleState.QUEUED_HANDOFF:
                return self._not_queued(conn, handle, placement)
            if handle.cancel_requested:
                return PromoteResult(
                    outcome=PromoteOutcome.CANCELLED,
                    message=f"job {job_id} has a cancel request: {handle.cancel_reason or 'cancelled'}",
                    handle=handle,
                )
            if _expired(handle, now_ms):
                expired = handle.model_copy(
                    update={
                        "state": HandleState.UNSCHEDULABLE,
                        "reason": DEADLINE_PASSED,
                        "updated_ms": now_ms,
                    }
                )
                _write_handle(conn, expired)
                return PromoteResult(
                    outcome=PromoteOutcome.EXPIRED,
                    message=f"job {job_id} reached its deadline ({handle.deadline_ms}) at {now_ms}",
                    handle=expired,
                )
            reservation: Reservation | None = None
            observation = placement.observation_epoch_ms
            if placement.reserved:
                charged = _charge(conn, handle, placement, now_ms)
                if isinstance(charged, PromoteResult):
                    return charged
                reservation = charged
                observation = charged.observation_epoch_ms
            promoted = handle.model_copy(
                update={
                    "state": HandleState.PENDING_HANDOFF,
                    "assigned_peer": placement.peer_id,
                    "assigned_backend": placement.backend_id or None,
                    "observation_epoch_ms": observation,
                    "reason": None,
                    "updated_ms": now_ms,
                }
            )
            _write_handle(conn, promoted)
            message = _promoted_message("promoted to", placement, reservation, observation)
            return PromoteResult(
                outcome=PromoteOutcome.PROMOTED, message=message, handle=promoted, reservation=reservation
            )

        return self._run(body)

    @staticmethod
    def _retake(conn: Connection, handle: JobHandle, placement: Placement, now_ms: int) -> PromoteResult:
        """A parked handle takes its capacity again through the CAS (``promote(retake=True)``)."""
        job_id = handle.job_id
        if handle.cancel_requested:
            return PromoteResult(
                outcome=PromoteOutcome.CANCELLED,
                message=f"job {job_id} has a cancel request: {handle.cancel_reason or 'cancelled'}",
                handle=handle,
            )
        if handle.assigned_peer != placement.peer_id:
            return PromoteResult(
                outcome=PromoteOutcome.NOT_QUEUED,
                message=f"job {job_id} is parked on {handle.assigned_peer}, not {placement.peer_id}",
                handle=handle,
            )
        reservation = _job_reservation(conn, job_id)
        observation = handle.observation_epoch_ms
        if reservation is not None:
            observation = reservation.observation_epoch_ms  # never released: kept, not charged twice
        elif placement.reserved:
            charged = _charge(conn, handle, placement, now_ms)
            if isinstance(charged, PromoteResult):
                return charged
            reservation = charged
            observation = charged.observation_epoch_ms
        promoted = handle.model_copy(
            update={
                "state": HandleState.PENDING_HANDOFF,
                "assigned_backend": placement.backend_id or None,
                "observation_epoch_ms": observation,
                "updated_ms": now_ms,
            }
        )
        _write_handle(conn, promoted)
        message = _promoted_message("retaken on", placement, reservation, observation)
        return PromoteResult(
            outcome=PromoteOutcome.PROMOTED, message=message, handle=promoted, reservation=reservation
        )

    @staticmethod
    def _not_queued(conn: Connection, handle: JobHandle, placement: Placement) -> PromoteResult:
        same_target = (
            handle.assigned_peer is not None
            and handle.assigned_peer == placement.peer_id
            and (handle.assigned_backend or "") == placement.backend_id
        )
        where = (
            f" on {_target(handle.assigned_peer, handle.assigned_backend)}" if handle.assigned_peer else ""
        )
        # Only a live promotion is "already promoted": a retry must never revive an ended job.
        if same_target and handle.state in _LIVE_ASSIGNED:
            existing = _job_reservation(conn, handle.job_id)
            return PromoteResult(
                outcome=PromoteOutcome.ALREADY_PROMOTED,
                message=f"job {handle.job_id} is already {handle.state}{where}",
                handle=handle,
                reservation=existing,
            )
        if same_target and handle.state is HandleState.HANDOFF_REJECTED and not handle.cancel_requested:
            # Only the run an operator reset to before its refused launch asks this (docs/DESIGN.md,
            # "Replaying a failed handoff"): a run whose CAS was a local activity runs it again in
            # the task that sends the launch again. The handle is not revived (no reservation, its
            # state kept): the answer only lets the launch be sent, as the recorded answer of a
            # regular activity did before.
            return PromoteResult(
                outcome=PromoteOutcome.ALREADY_PROMOTED,
                message=f"job {handle.job_id} was refused{where}; sent again after a reset",
                handle=handle,
            )
        if handle.state is HandleState.UNSCHEDULABLE:
            return PromoteResult(
                outcome=PromoteOutcome.EXPIRED,
                message=f"job {handle.job_id} is UNSCHEDULABLE: {handle.reason or DEADLINE_PASSED}",
                handle=handle,
            )
        if handle.cancel_requested:
            return PromoteResult(
                outcome=PromoteOutcome.CANCELLED,
                message=f"job {handle.job_id} was cancelled ({handle.cancel_reason or 'cancelled'}); "
                f"it is {handle.state}{where}",
                handle=handle,
            )
        return PromoteResult(
            outcome=PromoteOutcome.NOT_QUEUED,
            message=f"job {handle.job_id} is {handle.state}{where}, not queued",
            handle=handle,
        )

    # ---- cancellation, expiry, state -----------------------------------------------------------

    def record_cancel(self, job_id: str, reason: str) -> CancelResult:
        """Record the cancel intent; ``won`` when it committed before any promotion.

        A queued handle becomes KILLED (never deliverable). A promoted or handed-off one keeps its
        state with the intent set: the job has to be stopped through its peer. An unknown job was
        never queued, so nothing can deliver it: won. Repeating a cancel that already won answers
        won again, so the activity is idempotent under retries.
        """

        def body(conn: Connection) -> CancelResult:
            row = _lock_handle(conn, job_id)
            if row is None:
                return CancelResult(
                    won=True, state=HandleState.KILLED, message=f"job {job_id} was never queued for handoff"
                )
            handle = _row_handle(row)
            state = handle.state
            where = _target(handle.assigned_peer, handle.assigned_backend)
            if state is HandleState.QUEUED_HANDOFF:
                killed = handle.model_copy(
                    update={
                        "state": HandleState.KILLED,
                        "cancel_requested": True,
                        "cancel_reason": reason,
                        "reason": CANCELLED_BEFORE_HANDOFF,
                        "updated_ms": _now_ms(),
                    }
                )
                _write_handle(conn, killed)
                _delete_reservations(conn, [job_id])
                return CancelResult(won=True, state=HandleState.KILLED, message=CANCELLED_BEFORE_HANDOFF)
            if state in _LIVE_ASSIGNED:
                if not handle.cancel_requested:
                    _write_handle(
                        conn,
                        handle.model_copy(
                            update={
                                "cancel_requested": True,
                                "cancel_reason": reason,
                                "updated_ms": _now_ms(),
                            }
                        ),
                    )
                return CancelResult(
                    won=False,
                    state=state,
                    message=f"job {job_id} is already {state} on {where}; it must be stopped through "
                    f"{handle.assigned_peer}",
                )
            if state is HandleState.KILLED and handle.cancel_requested and handle.assigned_peer is None:
                return CancelResult(won=True, state=state, message=CANCELLED_BEFORE_HANDOFF)
            return CancelResult(won=False, state=state, message=f"job {job_id} already ended {state}")

        return self._run(body)

    def expire_due(self, now_ms: int) -> list[str]:
        """Every queued handle whose deadline has been reached becomes UNSCHEDULABLE; their ids."""

        def body(conn: Connection) -> list[str]:
            # Lock in job-id order so concurrent multi-row writers cannot deadlock.
            ids = list(
                conn.execute(
                    select(job_handles.c.job_id)
                    .where(
                        job_handles.c.state == HandleState.QUEUED_HANDOFF.value,
                        job_handles.c.deadline_ms.is_not(None),
                        job_handles.c.deadline_ms <= now_ms,
                    )
                    .order_by(job_handles.c.job_id)
                    .with_for_update()
                ).scalars()
            )
            for chunk in _chunks(ids):
                conn.execute(
                    update(job_handles)
                    .where(job_handles.c.job_id.in_(chunk))
                    .values(
                        state=HandleState.UNSCHEDULABLE.value,
                        reason=DEADLINE_PASSED,
                        reason_code=None,
                        updated_ms=now_ms,
                    )
                )
            _delete_reservations(conn, ids)
            return ids

        return self._run(body)

    def expire(self, job_id: str, incarnation: str, now_ms: int) -> bool:
        """Make one queued handle UNSCHEDULABLE if its deadline has been reached; True if it did."""

        def body(conn: Connection) -> bool:
            handle = _locked(conn, job_id, incarnation)
            if (
                handle is None
                or handle.state is not HandleState.QUEUED_HANDOFF
                or not _expired(handle, now_ms)
            ):
                return False
            _write_handle(
                conn,
                handle.model_copy(
                    update={
                        "state": HandleState.UNSCHEDULABLE,
                        "reason": DEADLINE_PASSED,
                        "updated_ms": now_ms,
                    }
                ),
            )
            _delete_reservations(conn, [job_id])
            return True

        return self._run(body)

    def set_state(
        self,
        job_id: str,
        incarnation: str,
        state: HandleState,
        reason: str | None = None,
        *,
        counted_from_ms: int | None = None,
        release: bool = False,
    ) -> JobHandle | None:
        """Record HANDED_OFF, HANDOFF_FAILED or a terminal state; None for an unknown or stale handle.

        A terminal handle is final: it is returned unchanged. A terminal state releases the job's
        reservations. A queued handle cannot be handed off (promote it first): ``StoreConflict``.
        ``counted_from_ms`` (HANDED_OFF) is the cluster's clock when it accepted the job: the
        reservation stays charged until an observation at least that new counts the job
        (``prune_reservations``). ``release`` (HANDOFF_FAILED only): the parked job is known not to
        run on its cluster, so its reservation is deleted at once; a replay in place takes it
        again through ``promote(retake=True)`` (docs/DESIGN.md, "Errors, retries and parking").
        """
        if release and state is not HandleState.HANDOFF_FAILED:
            raise ValueError(f"only a parked job releases its reservation, not one set {state}")
        if state in (HandleState.QUEUED_HANDOFF, HandleState.PENDING_HANDOFF):
            raise ValueError(f"{state} is set by enqueue/requeue and promote, not set_state")

        def body(conn: Connection) -> JobHandle | None:
            handle = _locked(conn, job_id, incarnation)
            if handle is None:
                return None
            if handle.state.terminal:
                return handle
            if counted_from_ms is not None and state is HandleState.HANDED_OFF:
                t = reservations_table
                conn.execute(update(t).where(t.c.job_id == job_id).values(counted_from_ms=counted_from_ms))
            if release and handle.state in (HandleState.PENDING_HANDOFF, HandleState.HANDOFF_FAILED):
                _delete_reservations(conn, [job_id])
            if handle.state is state and reason in (None, handle.reason):
                return handle
            if handle.state is HandleState.QUEUED_HANDOFF and not state.terminal:
                raise StoreConflict(f"job {job_id} is still queued; it cannot be {state} before promotion")
            changed = handle.model_copy(
                update={
                    "state": state,
                    "reason": reason if reason is not None else handle.reason,
                    "updated_ms": _now_ms(),
                }
            )
            _write_handle(conn, changed)
            if state.terminal:
                _delete_reservations(conn, [job_id])
            return changed

        return self._run(body)

    def requeue(self, job_id: str, incarnation: str) -> bool:
        """Put a handle back in the queue: an operator's replay of a PENDING_HANDOFF or
        HANDOFF_FAILED handoff, or the next attempt after one that ended (HANDED_OFF).

        Clears the assignment and releases the reservation. Refused (False) for a stale
        incarnation, any other state, or a handle with a cancel intent.
        """
        requeueable = (HandleState.PENDING_HANDOFF, HandleState.HANDOFF_FAILED, HandleState.HANDED_OFF)

        def body(conn: Connection) -> bool:
            handle = _locked(conn, job_id, incarnation)
            if handle is None or handle.state not in requeueable or handle.cancel_requested:
                return False
            _write_handle(
                conn,
                handle.model_copy(
                    update={
                        "state": HandleState.QUEUED_HANDOFF,
                        "assigned_peer": None,
                        "assigned_backend": None,
                        "observation_epoch_ms": None,
                        "reason": None,
                        "updated_ms": _now_ms(),
                    }
                ),
            )
            _delete_reservations(conn, [job_id])
            return True

        return self._run(body)

    def abandon(self, job_id: str, reason: str) -> bool:
        """End a live handle whose workflow has closed without ending it (e.g. terminated from the
        Web UI): KILLED with ``reason``, its reservation released. True if it did."""

        def body(conn: Connection) -> bool:
            row = _lock_handle(conn, job_id)
            if row is None:
                return False
            handle = _row_handle(row)
            if handle.state.terminal:
                return False
            _write_handle(
                conn,
                handle.model_copy(
                    update={"state": HandleState.KILLED, "reason": reason, "updated_ms": _now_ms()}
                ),
            )
            _delete_reservations(conn, [job_id])
            return True

        return self._run(body)

    # ---- fences ----------------------------------------------------------------------------------

    def add_fence(self, job_id: str, nonce: str, cluster: str) -> None:
        """Remember an attempt ``cluster`` may still run (idempotent)."""
        t = fences_table

        def body(conn: Connection) -> None:
            exists = conn.execute(select(t.c.job_id).where(t.c.job_id == job_id, t.c.nonce == nonce)).first()
            if exists is None:
                conn.execute(
                    t.insert().values(job_id=job_id, nonce=nonce, cluster=cluster, created_ms=_now_ms())
                )

        self._run(body)

    def fences(self, limit: int = 1000) -> list[Fence]:
        """The attempts still to terminate, oldest first."""
        t = fences_table

        def body(conn: Connection) -> list[Fence]:
            rows = conn.execute(select(t).order_by(t.c.created_ms, t.c.job_id).limit(limit))
            return [
                Fence(job_id=r.job_id, nonce=r.nonce, cluster=r.cluster, created_ms=r.created_ms)
                for r in rows
            ]

        return self._run(body, write=False)

    def remove_fence(self, job_id: str, nonce: str) -> None:
        t = fences_table
        self._run(lambda conn: conn.execute(delete(t).where(t.c.job_id == job_id, t.c.nonce == nonce)))

    # ---- the reservation ledger ----------------------------------------------------------------

    def reservations(self, peer_id: str | None = None) -> list[Reservation]:
        """Every confirmed reservation (on ``peer_id`` only, if given), by (peer, backend,
        observation, job)."""

        def body(conn: Connection) -> list[Reservation]:
            t = reservations_table
            query = select(t)
            if peer_id is not None:
                query = query.where(t.c.peer_id == peer_id)
            rows = conn.execute(
                query.order_by(t.c.peer_id, t.c.backend_id, t.c.observation_epoch_ms, t.c.job_id)
            )
            return [_row_reservation(r) for r in rows]

        return self._run(body, write=False)

    def prune_reservations(self, reports: list[PeerReport]) -> int:
        """Delete reservations no longer charged against a current observation; how many.

        "Current" is judged by ``reports`` (the policy's ``live_reservations``), except that a
        reservation charged to an observation newer than the one ``reports`` show for its backend
        is kept: a caller holding an older view must not free capacity spent since. A reservation
        of a job still promoted but not yet handed off (PENDING_HANDOFF) is carried forward to
        its backend's newer observation instead: the cluster cannot count the job before it has
        received it, and dropping the reservation then would offer its capacity twice (a burst of
        jobs classified to run at home, say, while each start changes home's observation). So is
        the reservation of a handed-off job while the newer observation is older than the moment
        its cluster accepted it (``counted_from_ms``): a report taken before the launch but stored
        after the handoff does not count the job either. A handed-off job's charge on the newest
        observation goes as soon as that observation counts it (its ``counted_from_ms`` is no later).
        """
        seen: dict[tuple[str, str], int] = {}
        for report in reports:
            for backend in report.backends:
                block = usable_block(backend)
                if block is not None:
                    seen[(report.peer_id, backend.backend_id)] = block.observation_epoch_ms

        def body(conn: Connection) -> int:
            rows = list(conn.execute(select(reservations_table)))
            current = [_row_reservation(r) for r in rows]
            counted_from = {row.job_id: row.counted_from_ms for row in rows}
            live = {_reservation_key(r) for r in live_reservations(current, reports)}
            promoted = set(
                conn.execute(
                    select(job_handles.c.job_id).where(
                        job_handles.c.state == HandleState.PENDING_HANDOFF.value
                    )
                ).scalars()
            )
            outdated = [
                r
                for r in current
                if _reservation_key(r) not in live
                and r.observation_epoch_ms <= seen.get((r.peer_id, r.backend_id), r.observation_epoch_ms)
            ]

            def uncounted(r: Reservation) -> bool:
                """Its cluster's newest observation cannot count the job yet."""
                if r.job_id in promoted:
                    return True
                since = counted_from.get(r.job_id)
                newer = seen.get((r.peer_id, r.backend_id))
                return since is not None and newer is not None and newer < since

            def counted(r: Reservation) -> bool:
                """Charged to the newest observation, which counts the job already: its charge was
                carried there while home still showed the job promoted, and the cluster had
                accepted it by then. Kept, it would count the job twice until the cluster changed
                again (a peer that looks full changes no more)."""
                since = counted_from.get(r.job_id)
                newer = seen.get((r.peer_id, r.backend_id))
                return (
                    r.job_id not in promoted
                    and since is not None
                    and newer is not None
                    and r.observation_epoch_ms == newer
                    and since <= newer
                )

            gone = [r for r in outdated if not uncounted(r)]
            gone += [r for r in current if _reservation_key(r) in live and counted(r)]
            t = reservations_table
            for r in outdated:
                newer = seen.get((r.peer_id, r.backend_id))
                if uncounted(r) and newer is not None and newer > r.observation_epoch_ms:
                    conn.execute(
                        update(t)
                        .where(
                            t.c.job_id == r.job_id,
                            t.c.peer_id == r.peer_id,
                            t.c.backend_id == r.backend_id,
                            t.c.observation_epoch_ms == r.observation_epoch_ms,
                        )
                        .values(observation_epoch_ms=newer)
                    )
            for r in gone:
                # Matched on the full key, so only the row this decision was about is deleted.
                conn.execute(
                    delete(t).where(
                        t.c.job_id == r.job_id,
                        t.c.peer_id == r.peer_id,
                        t.c.backend_id == r.backend_id,
                        t.c.observation_epoch_ms == r.observation_epoch_ms,
                    )
                )
            return len(gone)

        return self._run(body)

    def release(self, job_id: str) -> int:
        """Delete the job's reservations; how many."""
        return self._run(lambda conn: _delete_reservations(conn, [job_id]))

    # ---- peer reports --------------------------------------------------------------------------

    def save_reports(self, reports: list[PeerReport]) -> None:
        """Upsert each peer's latest report.

        An unreachable peer keeps the ``last_contact_ms`` of its last good report, so staleness
        is measured from when it was last really heard from.
        """
        by_peer = {r.peer_id: r for r in reports}

        def body(conn: Connection) -> None:
            now = _now_ms()
            # Sorted so two concurrent savers lock peer rows in the same order.
            for peer_id in sorted(by_peer):
                report = by_peer[peer_id]
                row = conn.execute(
                    select(peer_reports.c.last_contact_ms)
                    .where(peer_reports.c.peer_id == peer_id)
                    .with_for_update()
                ).first()
                last_contact = report.last_contact_ms
                if not report.reachable and row is not None and row.last_contact_ms is not None:
                    last_contact = row.last_contact_ms
                stored = report.model_copy(update={"last_contact_ms": last_contact})
                values = {
                    "reachable": stored.reachable,
                    "last_contact_ms": last_contact,
                    "report": stored.model_dump_json(),
                    "updated_ms": now,
                }
                if row is None:
                    conn.execute(peer_reports.insert().values(peer_id=peer_id, **values))
                else:
                    conn.execute(
                        update(peer_reports).where(peer_reports.c.peer_id == peer_id).values(**values)
                    )

        self._run(body)

    def load_reports(self) -> list[PeerReport]:
        """The latest stored report of every peer, by peer id."""

        def body(conn: Connection) -> list[PeerReport]:
            rows = conn.execute(select(peer_reports).order_by(peer_reports.c.peer_id))
            return [_row_report(r) for r in rows]

        return self._run(body, write=False)

    # ---- waiting reasons -----------------------------------------------------------------------

    def update_reasons(
        self, reasons: Mapping[str, str], codes: Mapping[str, ReasonCode] | None = None
    ) -> list[str]:
        """Store each queued job's latest waiting summary (and its code, when ``codes`` names one);
        the ids whose summary or code changed.

        Jobs that are not queued (promoted or ended meanwhile) are ignored.
        """
        ids = sorted(reasons)
        given = codes or {}

        def body(conn: Connection) -> list[str]:
            changed: list[str] = []
            now = _now_ms()
            for chunk in _chunks(ids):
                rows = conn.execute(
                    select(job_handles.c.job_id, job_handles.c.reason, job_handles.c.reason_code)
                    .where(
                        job_handles.c.job_id.in_(chunk),
                        job_handles.c.state == HandleState.QUEUED_HANDOFF.value,
                    )
                    .order_by(job_handles.c.job_id)
                    .with_for_update()
                )
                batch = []
                for r in rows:
                    code = given.get(r.job_id)
                    new_code = r.reason_code if code is None else code.value
                    if r.reason != reasons[r.job_id] or r.reason_code != new_code:
                        batch.append(
                            {"b_job_id": r.job_id, "b_reason": reasons[r.job_id], "b_code": new_code}
                        )
                if batch:
                    conn.execute(
                        update(job_handles)
                        .where(job_handles.c.job_id == bindparam("b_job_id"))
                        .values(
                            reason=bindparam("b_reason"), reason_code=bindparam("b_code"), updated_ms=now
                        ),
                        batch,
                    )
                    changed.extend(b["b_job_id"] for b in batch)
            return changed

        return self._run(body)


# ---- row helpers --------------------------------------------------------------------------------


def _advisory_xact_lock(key: str) -> Any:
    return func.pg_advisory_xact_lock(func.hashtext(key))


def _lock_handle(conn: Connection, job_id: str) -> Row[Any] | None:
    # FOR UPDATE on PostgreSQL; SQLite renders nothing and relies on BEGIN IMMEDIATE.
    return conn.execute(select(job_handles).where(job_handles.c.job_id == job_id).with_for_update()).first()


def _locked(conn: Connection, job_id: str, incarnation: str) -> JobHandle | None:
    """The job's handle, locked, if it is this incarnation's."""
    row = _lock_handle(conn, job_id)
    if row is None:
        return None
    handle = _row_handle(row)
    return handle if handle.incarnation == incarnation else None


# A code a newer worker wrote that this one does not know reads as none.
_CODES = frozenset(code.value for code in ReasonCode)


def _row_handle(row: Row[Any]) -> JobHandle:
    shape = JobShape.model_validate_json(row.shape)
    return JobHandle(
        job_id=row.job_id,
        incarnation=row.incarnation,
        state=HandleState(row.state),
        shape=shape,
        band=Band(row.band),
        submit_ms=row.submit_ms,
        deadline_ms=row.deadline_ms,
        assigned_peer=row.assigned_peer,
        assigned_backend=row.assigned_backend,
        observation_epoch_ms=row.observation_epoch_ms,
        cancel_requested=bool(row.cancel_requested),
        cancel_reason=row.cancel_reason,
        reason=row.reason,
        reason_code=ReasonCode(row.reason_code) if row.reason_code in _CODES else None,
        updated_ms=row.updated_ms,
    )


def _handle_values(handle: JobHandle) -> dict[str, Any]:
    return {
        "job_id": handle.job_id,
        "incarnation": handle.incarnation,
        "state": handle.state.value,
        "shape": handle.shape.model_dump_json(),
        "band": int(handle.shape.band),
        "submit_ms": handle.shape.submit_ms,
        "deadline_ms": handle.shape.deadline_ms,
        "target_cluster": handle.shape.target_cluster,
        "assigned_peer": handle.assigned_peer,
        "assigned_backend": handle.assigned_backend,
        "observation_epoch_ms": handle.observation_epoch_ms,
        "cancel_requested": handle.cancel_requested,
        "cancel_reason": handle.cancel_reason,
        "reason": handle.reason,
        # Only a queued job's reason has a code from the tick; a later state's reason has none here.
        "reason_code": handle.reason_code.value
        if handle.reason_code is not None and handle.state is HandleState.QUEUED_HANDOFF
        else None,
        "updated_ms": handle.updated_ms,
    }


def _write_handle(conn: Connection, handle: JobHandle) -> None:
    conn.execute(
        update(job_handles).where(job_handles.c.job_id == handle.job_id).values(_handle_values(handle))
    )


def _row_reservation(row: Row[Any]) -> Reservation:
    return Reservation(
        peer_id=row.peer_id,
        backend_id=row.backend_id,
        observation_epoch_ms=row.observation_epoch_ms,
        amounts=json.loads(row.amounts),
        band=None if row.band is None else Band(row.band),
        job_id=row.job_id,
    )


def _reservation_key(r: Reservation) -> tuple[str, str, str, int]:
    return (r.job_id, r.peer_id, r.backend_id, r.observation_epoch_ms)


def _job_reservation(conn: Connection, job_id: str) -> Reservation | None:
    row = conn.execute(select(reservations_table).where(reservations_table.c.job_id == job_id)).first()
    return None if row is None else _row_reservation(row)


def _delete_reservations(conn: Connection, job_ids: Sequence[str]) -> int:
    removed = 0
    for chunk in _chunks(job_ids):
        removed += conn.execute(
            delete(reservations_table).where(reservations_table.c.job_id.in_(chunk))
        ).rowcount
    return removed


def _row_report(row: Row[Any]) -> PeerReport:
    report = PeerReport.model_validate_json(row.report)
    # The columns are authoritative (the JSON is written from them, but never trust a copy).
    return report.model_copy(
        update={"reachable": bool(row.reachable), "last_contact_ms": row.last_contact_ms}
    )


def _charge(
    conn: Connection, handle: JobHandle, placement: Placement, now_ms: int
) -> Reservation | PromoteResult:
    """Check the placement's need against the peer's latest report and ledger; record it if it fits.

    Locks the peer's report row first, so concurrent promotions to one peer take turns and each
    sees the reservations the previous one committed.
    """
    peer_id, backend_id = placement.peer_id, placement.backend_id
    target = _target(peer_id, backend_id)

    def refused(outcome: PromoteOutcome, message: str) -> PromoteResult:
        return PromoteResult(outcome=outcome, message=message, handle=handle)

    row = conn.execute(
        select(peer_reports).where(peer_reports.c.peer_id == peer_id).with_for_update()
    ).first()
    if row is None:
        return refused(PromoteOutcome.UNKNOWN_BACKEND, f"no report is stored for peer {peer_id}")
    report = _row_report(row)
    if not report.reachable:
        return refused(PromoteOutcome.NO_CAPACITY, f"peer {peer_id} is unreachable; its capacity is unknown")
    backend = next((b for b in report.backends if b.backend_id == backend_id), None)
    if backend is None:
        return refused(
            PromoteOutcome.UNKNOWN_BACKEND, f"peer {peer_id}'s latest report has no backend {backend_id!r}"
        )
    block = usable_block(backend)
    if block is None:
        # The placement was verified against a capacity block the peer no longer sends; replan.
        return refused(
            PromoteOutcome.NO_CAPACITY, f"{target} no longer reports its capacity; waiting for the next tick"
        )
    observation = block.observation_epoch_ms
    t = reservations_table
    rows = conn.execute(
        select(t, job_handles.c.state)
        .join(job_handles, job_handles.c.job_id == t.c.job_id, isouter=True)
        .where(
            t.c.peer_id == peer_id,
            t.c.backend_id == backend_id,
            t.c.observation_epoch_ms <= observation,
            t.c.job_id != handle.job_id,
        )
    )
    # The charges against this observation, and those against an older one that this observation
    # cannot count yet (prune_reservations carries them forward, but a report stored by the tick
    # is read here before the tick prunes): the job not yet handed off, or accepted after it.
    ledger = [
        _row_reservation(r).model_copy(update={"observation_epoch_ms": observation})
        for r in rows
        if r.observation_epoch_ms == observation
        or r.state == HandleState.PENDING_HANDOFF.value
        or (r.counted_from_ms is not None and r.counted_from_ms > observation)
    ]
    capacity = working_capacity(peer_id, backend, ledger)
    assert capacity is not None  # usable_block above
    need: dict[str, int] = {}
    for token, amount in placement.reserved.items():
        key = token.strip().lower()
        need[key] = need.get(key, 0) + max(0, amount)
    band = handle.band
    for token, amount in sorted(need.items()):
        available = capacity.effective(token, band)
        if available < amount:
            return refused(
                PromoteOutcome.NO_CAPACITY,
                f"{target} has {available} {token} left for band {band.label} after confirmed "
                f"reservations; needs {amount}",
            )
        capacity.spend(token, amount, band)
    reservation = Reservation(
        peer_id=peer_id,
        backend_id=backend_id,
        observation_epoch_ms=observation,
        amounts={k: v for k, v in need.items() if v > 0},
        band=band,
        job_id=handle.job_id,
    )
    conn.execute(
        t.insert().values(
            job_id=handle.job_id,
            peer_id=peer_id,
            backend_id=backend_id,
            observation_epoch_ms=observation,
            amounts=json.dumps(reservation.amounts, sort_keys=True),
            band=int(band),
            created_ms=now_ms,
        )
    )
    return reservation
