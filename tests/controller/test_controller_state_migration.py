"""The controller's store migrates a state dir written by an older controller (schema 2: no
``preempted`` and ``preemptions`` columns) on open, keeps its jobs, and then stores the preemption
note and a launch's count of earlier preemptions (docs/DESIGN.md, "Preemption")."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from iris.controller import state
from iris.controller.models import ControllerJobState, LaunchRequest
from iris.controller.state import JobRecord, StateStore
from iris.policy.models import Band, DeviceRequest


def _v2_store(state_dir: Path) -> None:
    """A store as schema 2 left it, with one job in it."""
    schema = state._SCHEMA.replace(
        "    bundle TEXT,\n    preempted TEXT,\n    preemptions INTEGER NOT NULL DEFAULT 0\n",
        "    bundle TEXT\n",
    )
    assert schema != state._SCHEMA
    state_dir.mkdir()
    db = sqlite3.connect(state_dir / state.DB_NAME)
    db.executescript(schema)
    db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '2')")
    db.execute(
        "INSERT INTO jobs (job_id, seq, requester, nonce, user, band, backend_id, command, env, device, "
        "timeout_s, state, created_ms, attempts, run_id, tasks, terminate_requested, bundle) VALUES "
        "('b/old', 1, 'home', 'n1', 'alice', 3, 'gpu', '[\"true\"]', '{}', ?, NULL, 'RUNNING', 1, 1, "
        "'r1', '[]', 0, NULL)",
        (DeviceRequest(type="gpu", variant="h100", count=8).model_dump_json(),),
    )
    db.commit()
    db.close()


def test_a_schema_2_store_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    _v2_store(state_dir)

    store = StateStore(state_dir)
    try:
        (old,) = store.load_all()
        assert (old.job_id, old.state, old.preempted, old.preemptions) == (
            "b/old",
            ControllerJobState.RUNNING,
            None,
            0,
        )
        version = store._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        assert int(version) == state.SCHEMA_VERSION == 3

        old.preempted = "preempted by p/new at 2026-12-03 12:00:00 UTC"
        store.save(old)
        new = JobRecord.new(
            LaunchRequest(
                job_id="p/new",
                command=["true"],
                device=DeviceRequest(type="gpu", variant="h100", count=8),
                band=Band.PRODUCTION,
                user="alice",
                requester="home",
                nonce="n2",
                backend_id="gpu",
                preemptions=2,
            ),
            seq=store.next_seq(),
            run_id="r2",
            attempts=1,
        )
        store.save(new)
    finally:
        store.close()

    again = StateStore(state_dir)
    try:
        jobs = {j.job_id: j for j in again.load_all()}
        assert jobs["b/old"].preempted == "preempted by p/new at 2026-12-03 12:00:00 UTC"
        assert (jobs["p/new"].preempted, jobs["p/new"].preemptions) == (None, 2)
    finally:
        again.close()
