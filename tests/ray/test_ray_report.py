"""The Ray backend's capacity report when Ray's own view trails its jobs (no Ray needed): Ray's
available resources come from each raylet on its own period, so a job Ray already runs can still
show as free there, longer on a busy host (CI run BB: 8 of 8 H100 "free" while a RUNNING job held
6). What this backend's RUNNING jobs hold is never reported free."""

from __future__ import annotations

import time
from pathlib import Path

from controller_harness import cluster, federation, request, write_config

from iris.config import load_config
from iris.controller.executors.core import Executor
from iris.controller.executors.ray_jobs import RayBackend, _Tracked
from iris.controller.models import ControllerJobState as S
from iris.controller.state import JobRecord, StateStore
from iris.policy.models import Availability, Band

BACKEND = {
    "id": "ray-h100",
    "kind": "ray",
    "address": "http://127.0.0.1:9",  # never called: the test sets what Ray last said
    "gcs_address": "127.0.0.1:9",
    "attributes": {"device-type": ["gpu"], "device-variant": ["h100"]},
    "devices": {"h100": 8},
    "ray_resources": {"h100": "report_h100"},
    "cpu_slots": 4,
}


def _backend(tmp_path: Path) -> tuple[Executor, RayBackend]:
    cfg = write_config(tmp_path / "c.toml", federation(cluster("home"), cluster("peer", backends=[BACKEND])))
    store = StateStore(tmp_path / "state" / "controller.db")
    executor = Executor(load_config(cfg).cluster("peer"), tmp_path / "state", store)
    backend = executor.backends["ray-h100"]
    assert isinstance(backend, RayBackend)
    return executor, backend


def _track(backend: RayBackend, gpus: int, state: S, job_id: str) -> None:
    req = request(["sleep", "30"], job_id=job_id, gpus=gpus, band=Band.BATCH, backend_id="ray-h100")
    job = JobRecord.new(req, seq=1, run_id=f"run-{job_id}", attempts=1)
    job.state = state
    backend._tracked[job.job_id] = _Tracked(job=job)


def _ray_says(backend: RayBackend, free: int) -> None:
    backend._reachable, backend._last_ok = True, time.monotonic()
    backend._totals, backend._free = {"h100": 8}, {"h100": free}


def _free(backend: RayBackend) -> Availability:
    block = backend.report().availability
    assert block is not None
    return block


def test_a_running_jobs_devices_are_not_free_while_rays_view_trails(tmp_path: Path) -> None:
    executor, backend = _backend(tmp_path)
    try:
        _track(backend, 6, S.RUNNING, "t/running")
        _ray_says(backend, free=8)  # Ray has not yet counted the job's 6
        report = _free(backend)
        assert report.amounts == {"h100": 2} and report.total_amounts == {"h100": 8}
        # Once Ray counts them, the same; a promised (PENDING) job comes off the rest.
        _ray_says(backend, free=2)
        assert _free(backend).amounts == {"h100": 2}
        _track(backend, 1, S.PENDING, "t/pending")
        assert _free(backend).amounts == {"h100": 1}
        # Another Ray user's work shows in Ray's view only: the lower of the two stands.
        _ray_says(backend, free=0)
        assert _free(backend).amounts == {"h100": 0}
    finally:
        executor.store.close()
