"""Durable controller state: every job it ever accepted, in SQLite (``state_dir/controller.db``).

The executor owns the in-memory truth and writes each transition through this store before acting
on it (e.g. a job is recorded RUNNING with its run id before its processes are spawned), so a
controller restarted after ``kill -9`` can report every job honestly and find leftover processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iris.controller.models import ControllerJobState, JobStatus, LaunchRequest, TaskStatus
from iris.policy.models import Band, DeviceRequest

DB_NAME = "controller.db"
SCHEMA_VERSION = 3
# Each step takes the schema from version N-1 to N; a store is migrated on open.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("ALTER TABLE jobs ADD COLUMN bundle TEXT",),
    3: (
        "ALTER TABLE jobs ADD COLUMN preempted TEXT",
        "ALTER TABLE jobs ADD COLUMN preemptions INTEGER NOT NULL DEFAULT 0",
    ),
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    requester TEXT NOT NULL,
    nonce TEXT NOT NULL,
    user TEXT NOT NULL,
    band INTEGER NOT NULL,
    backend_id TEXT NOT NULL,
    command TEXT NOT NULL,
    env TEXT NOT NULL,
    device TEXT NOT NULL,
    timeout_s REAL,
    state TEXT NOT NULL,
    exit_code INTEGER,
    error TEXT,
    created_ms INTEGER NOT NULL,
    started_ms INTEGER,
    finished_ms INTEGER,
    attempts INTEGER NOT NULL,
    run_id TEXT NOT NULL,
    tasks TEXT NOT NULL,
    terminate_requested INTEGER NOT NULL DEFAULT 0,
    bundle TEXT,
    preempted TEXT,
    preemptions INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_seq ON jobs (seq);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_ms, job_id) WHERE finished_ms IS NOT NULL;
CREATE TABLE IF NOT EXISTS seen_tokens (jti TEXT PRIMARY KEY, expires_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS seen_tokens_expiry ON seen_tokens (expires_ms);
"""


# The highest seq retention ever removed: a later job never takes a seq a reader has seen (the
# listing ``/v1/jobs`` pages by seq).
_SEQ_FLOOR_KEY = "removed_seq_floor"


class StateDirBusy(RuntimeError):
    """Another live controller holds the state directory."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class TaskRecord:
    index: int
    state: ControllerJobState = ControllerJobState.PENDING
    exit_code: int | None = None
    slots: list[int] = field(default_factory=list)
    pid: int | None = None
    # The sandbox pool uid it runs as (iris/controller/sandbox.py), saved before it starts: a
    # restarted controller reclaims it.
    uid: int | None = None
    # The engine's own handle of the run, saved before the engine is asked to start it: a Slurm
    # job id, or "submit@<ms>" while an sbatch's outcome is unknown (docs/DESIGN.md, "The Slurm
    # backend"). A restarted controller thereby knows whether the run may exist.
    engine_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": self.index,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "slots": self.slots,
            "pid": self.pid,
            "uid": self.uid,
        }
        if self.engine_id is not None:
            data["engine_id"] = self.engine_id
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRecord:
        return cls(
            index=int(data["index"]),
            state=ControllerJobState(data["state"]),
            exit_code=data.get("exit_code"),
            slots=[int(s) for s in data.get("slots", [])],
            pid=data.get("pid"),
            uid=data.get("uid"),
            engine_id=data.get("engine_id"),
        )


@dataclass
class JobRecord:
    """Everything the controller knows about one job id (its latest run)."""

    job_id: str
    seq: int
    requester: str
    nonce: str
    user: str
    band: Band
    backend_id: str
    command: list[str]
    env: dict[str, str]
    device: DeviceRequest
    timeout_s: float | None
    state: ControllerJobState
    created_ms: int
    attempts: int
    run_id: str
    exit_code: int | None = None
    error: str | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    tasks: list[TaskRecord] = field(default_factory=list)
    terminate_requested: bool = False
    # The sha256 of the job's workspace bundle in this controller's bundle store, if it has one.
    bundle: str | None = None
    # Set, and saved, the moment its backend preempts it for a higher band (docs/DESIGN.md,
    # "Preemption"): "preempted by <job id> at <time>". Stored, so a controller that restarts
    # during the victim's grace still settles it PREEMPTED.
    preempted: str | None = None
    # The launch's count of earlier attempts preempted or lost (LaunchRequest.preemptions).
    preemptions: int = 0
    # Its latest change in the change feed (in memory only; set by the executor on every save).
    epoch: str = ""
    version: int = 0

    @classmethod
    def new(cls, req: LaunchRequest, *, seq: int, run_id: str, attempts: int) -> JobRecord:
        return cls(
            job_id=req.job_id,
            seq=seq,
            requester=req.requester,
            nonce=req.nonce,
            user=req.user,
            band=req.band,
            backend_id=req.backend_id,
            command=list(req.command),
            env=dict(req.env),
            device=req.device,
            timeout_s=req.timeout_s,
            state=ControllerJobState.PENDING,
            created_ms=now_ms(),
            attempts=attempts,
            run_id=run_id,
            tasks=[TaskRecord(index=i) for i in range(req.device.replicas)],
            bundle=req.bundle.sha256 if req.bundle else None,
            preemptions=req.preemptions,
        )

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            state=self.state,
            backend_id=self.backend_id,
            exit_code=self.exit_code,
            error=self.error,
            created_ms=self.created_ms,
            started_ms=self.started_ms,
            finished_ms=self.finished_ms,
            band=self.band,
            user=self.user,
            requester=self.requester,
            nonce=self.nonce,
            attempts=self.attempts,
            epoch=self.epoch,
            version=self.version,
            tasks=[
                TaskStatus(index=t.index, state=t.state, exit_code=t.exit_code, slots=list(t.slots))
                for t in self.tasks
            ],
        )


_COLUMNS = (
    "job_id, seq, requester, nonce, user, band, backend_id, command, env, device, timeout_s, state, "
    "exit_code, error, created_ms, started_ms, finished_ms, attempts, run_id, tasks, terminate_requested, "
    "bundle, preempted, preemptions"
)


class _ThreadConnection:
    """A connection of its own for calls made from worker threads (``asyncio.to_thread``),
    serialized by a lock: the event loop's connection is never shared across threads, and their
    transactions never interleave with this one's."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: sqlite3.Connection | None = None
        self._closed = False
        self.lock = threading.Lock()

    def get(self) -> sqlite3.Connection:
        """The connection (call with ``lock`` held)."""
        if self._closed:
            raise RuntimeError("the state store is closed")
        if self._db is None:
            self._db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=5000")
        return self._db

    def close(self) -> None:
        with self.lock:
            self._closed = True
            if self._db is not None:
                self._db.close()
                self._db = None


class StateStore:
    """A small synchronous SQLite store; each call is one short transaction.

    The event loop's calls (``save``, ``job_ids_after``, ``load_all``) use one connection; calls
    made from worker threads (``remember_token``, and retention's ``expired``/``remove``) each use
    one of their own.
    """

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        # Two controllers on one state dir would each take the other's jobs for lost and kill them.
        self._lock = (state_dir / "controller.lock").open("a")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StateDirBusy(f"state dir {state_dir} is in use by another controller") from None
        self.path = state_dir / DB_NAME
        # Every job's env is in here: the controller's user only (docs/DESIGN.md, "Job →
        # controller"). SQLite gives the -wal and -shm files the database file's mode.
        os.chmod(state_dir, 0o700)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self.path, 0o600)
        # The executor runs on one event loop thread; autocommit off, explicit transactions.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        for suffix in ("-wal", "-shm"):  # made by an older version, or before its mode was set
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f"{self.path}{suffix}", 0o600)
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._tokens = _ThreadConnection(self.path)
        self._retention = _ThreadConnection(self.path)
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row[0]) > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path}: unsupported schema version {row[0]} (newer than this code)")
        else:
            self._migrate(int(row[0]))
        # The last seq handed out; kept here so a launch costs no query.
        self._seq = max(
            int(self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM jobs").fetchone()[0]),
            self._seq_floor(self._db),
        )

    @staticmethod
    def _seq_floor(db: sqlite3.Connection) -> int:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (_SEQ_FLOOR_KEY,)).fetchone()
        return 0 if row is None else int(row[0])

    def _migrate(self, version: int) -> None:
        """Bring a store written by an older controller up to SCHEMA_VERSION, one step per version,
        each in its own transaction."""
        for target in range(version + 1, SCHEMA_VERSION + 1):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _MIGRATIONS[target]:
                    self._db.execute(statement)
                self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(target),))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self._tokens.close()
        self._retention.close()
        self._db.close()
        self._lock.close()

    def next_seq(self) -> int:
        """A seq for a new job: above every seq this store ever held, removed ones included."""
        self._seq += 1
        return self._seq

    def save(self, job: JobRecord) -> None:
        placeholders = ", ".join("?" for _ in _COLUMNS.split(","))
        self._db.execute(
            f"INSERT OR REPLACE INTO jobs ({_COLUMNS}) VALUES ({placeholders})",
            (
                job.job_id,
                job.seq,
                job.requester,
                job.nonce,
                job.user,
                int(job.band),
                job.backend_id,
                json.dumps(job.command),
                json.dumps(job.env),
                job.device.model_dump_json(),
                job.timeout_s,
                job.state.value,
                job.exit_code,
                job.error,
                job.created_ms,
                job.started_ms,
                job.finished_ms,
                job.attempts,
                job.run_id,
                json.dumps([t.to_json() for t in job.tasks]),
                int(job.terminate_requested),
                job.bundle,
                job.preempted,
                job.preemptions,
            ),
        )

    def job_ids_after(self, seq: int, limit: int) -> list[tuple[int, str]]:
        """(seq, job id) of the first ``limit`` jobs launched after ``seq`` (by the ``jobs_seq`` index)."""
        rows = self._db.execute(
            "SELECT seq, job_id FROM jobs WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        ).fetchall()
        return [(int(r[0]), str(r[1])) for r in rows]

    def load_all(self) -> list[JobRecord]:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM jobs ORDER BY seq").fetchall()
        return [self._row_to_job(r) for r in rows]

    @staticmethod
    def _row_to_job(r: tuple[Any, ...]) -> JobRecord:
        return JobRecord(
            job_id=r[0],
            seq=r[1],
            requester=r[2],
            nonce=r[3],
            user=r[4],
            band=Band(r[5]),
            backend_id=r[6],
            command=json.loads(r[7]),
            env=json.loads(r[8]),
            device=DeviceRequest.model_validate_json(r[9]),
            timeout_s=r[10],
            state=ControllerJobState(r[11]),
            exit_code=r[12],
            error=r[13],
            created_ms=r[14],
            started_ms=r[15],
            finished_ms=r[16],
            attempts=r[17],
            run_id=r[18],
            tasks=[TaskRecord.from_json(t) for t in json.loads(r[19])],
            terminate_requested=bool(r[20]),
            bundle=r[21],
            preempted=r[22],
            preemptions=r[23],
        )

    def remember_token(self, jti: str, expires_ms: int) -> bool:
        """Record a token id; False if it was already seen (a replay). Expired ids are pruned (by
        the ``seen_tokens_expiry`` index).

        Called from a worker thread (``asyncio.to_thread``, docs/DESIGN.md "Identity tokens"), on
        a connection of its own.
        """
        now = now_ms()
        with self._tokens.lock:
            db = self._tokens.get()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM seen_tokens WHERE expires_ms < ?", (now,))
                try:
                    db.execute("INSERT INTO seen_tokens (jti, expires_ms) VALUES (?, ?)", (jti, expires_ms))
                except sqlite3.IntegrityError:
                    db.execute("ROLLBACK")
                    return False
                db.execute("COMMIT")
                return True
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    # ---- retention (docs/DESIGN.md, "Retention"): from a worker thread, on a connection of its own

    def expired(
        self, cutoff_ms: int, after: tuple[int, str] | None, limit: int
    ) -> list[tuple[int, str, str]]:
        """(finished_ms, job id, run id) of up to ``limit`` jobs that finished at or before
        ``cutoff_ms``, oldest first, after the key ``after`` (by the ``jobs_finished`` index: a
        batch costs what it holds). Unfinished jobs have no ``finished_ms`` and are never listed."""
        floor_ms, floor_id = after if after is not None else (-1, "")
        with self._retention.lock:
            rows = (
                self._retention.get()
                .execute(
                    "SELECT finished_ms, job_id, run_id FROM jobs WHERE finished_ms IS NOT NULL "
                    "AND finished_ms <= ? AND (finished_ms, job_id) > (?, ?) "
                    "ORDER BY finished_ms, job_id LIMIT ?",
                    (cutoff_ms, floor_ms, floor_id, limit),
                )
                .fetchall()
            )
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]

    def remove(self, runs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Delete the records of these (job id, run id) in one transaction; a job relaunched since
        (another run id) keeps its record. The highest seq removed is remembered, so a later job
        never reuses it (``next_seq``). Returns the (job id, run id) whose record was deleted."""
        if not runs:
            return []
        with self._retention.lock:
            db = self._retention.get()
            db.execute("BEGIN IMMEDIATE")
            try:
                top = 0
                deleted: list[tuple[str, str]] = []
                for job_id, run_id in runs:
                    row = db.execute(
                        "DELETE FROM jobs WHERE job_id = ? AND run_id = ? RETURNING seq", (job_id, run_id)
                    ).fetchone()
                    if row is not None:
                        deleted.append((job_id, run_id))
                        top = max(top, int(row[0]))
                if top > self._seq_floor(db):
                    db.execute(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_SEQ_FLOOR_KEY, str(top))
                    )
                db.execute("COMMIT")
                return deleted
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
