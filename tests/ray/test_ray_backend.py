"""A controller whose backend is Ray, against a real local Ray head (issue 6).

Each test runs ``python -m iris.controller`` as a real process on a backend with ``kind = "ray"``
and checks what it says over its API against what Ray itself says through its Jobs API.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controller_harness import (
    Controller,
    cluster,
    federation,
    poll,
    py,
    read_all_logs,
    request,
    restart,
    start_controller,
    wait_terminal,
    write_config,
)
from faultproxy import FaultProxy
from ray.job_submission import JobStatus as RayStatus
from ray.job_submission import JobSubmissionClient
from ray_harness import TcpProxy, ray_backend
from stack import wait_until

from iris import devstack
from iris.config import load_config
from iris.controller.client import ControllerClient
from iris.controller.errors import Unavailable
from iris.controller.executors.ray_jobs import job_output, submission_id
from iris.controller.models import ControllerJobState as S
from iris.controller.models import JobStatus
from iris.policy.availability import PeerStatus, peer_status
from iris.policy.models import Availability, Band, DeviceRequest, JobShape, PeerReport
from iris.policy.planner import plan
from iris.reports import cluster_report


def ray_jobs(spec: devstack.RayHeadSpec) -> JobSubmissionClient:
    return JobSubmissionClient(spec.address)


# What the controller's Ray monitor asks Ray's job API once a round (iris/controller/executors/ray_jobs.py).
VERSION = "GET /api/version"


def controller_on(root: Path, backend: dict[str, Any], name: str = "peer") -> Controller:
    peer = cluster(name, backends=[backend])
    cfg = write_config(root / "clusters.toml", federation(cluster("home"), peer))
    return start_controller(cfg, name, root / "state", port=peer["port"], kill_grace=1.0, ready_timeout=90)


@pytest.fixture(scope="module")
def jobs_controller(
    ray_head: devstack.RayHeadSpec, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    """One controller for the job tests (each uses its own job ids)."""
    ctl = controller_on(tmp_path_factory.mktemp("jobs"), ray_backend(ray_head, "jobs"))
    try:
        yield ctl
    finally:
        ctl.stop()


async def availability(client: ControllerClient) -> Availability:
    backends = await client.backends()
    block = backends.backends[0].availability
    assert block is not None
    return block


async def first_availability(client: ControllerClient) -> Availability | None:
    """None until a new controller has read Ray once (it answers 503 "not contacted yet" before)."""
    try:
        return await availability(client)
    except Unavailable:
        return None


async def wait_state(client: ControllerClient, job_id: str, *states: S, timeout: float = 30) -> JobStatus:
    return await poll(
        lambda: client.status(job_id), lambda s: s.state in states, timeout=timeout, what=f"{job_id} {states}"
    )


def test_submission_ids_are_the_job_ids_and_one_to_one() -> None:
    assert submission_id("alice/train-llama", 1) == "alice~_train-llama"
    assert submission_id("alice/train-llama", 2) == "alice~_train-llama~2"
    ids = ["a/b", "a~_b", "a~/b", "a/~b", "a~~b", "a~b", "a~2", "a"]
    seen = {submission_id(j, n) for j in ids for n in (1, 2, 3)}
    assert len(seen) == len(ids) * 3


async def test_launch_logs_exit_codes_replicas_and_idempotent_relaunch(
    ray_head: devstack.RayHeadSpec, jobs_controller: Controller
) -> None:
    hello = request(
        py("import os; print('hello from', os.environ['IRIS_CLUSTER'], os.environ['SECRET_FREE'])"),
        job_id="alice/hello",
        gpus=4,
        env={"SECRET_FREE": "value-42"},
        backend_id="ray-h100",
    )
    gang = request(
        ["sh", "-c", 'echo "replica $IRIS_REPLICA_INDEX of $IRIS_NUM_REPLICAS"'],
        gpus=2,
        replicas=3,
        backend_id="ray-h100",
    )
    failing = request(["sh", "-c", "echo about to fail; exit 3"], backend_id="ray-h100")
    async with jobs_controller.client() as c:
        launched = [await c.launch(r) for r in (hello, gang, failing)]
        assert all(s.state in (S.PENDING, S.RUNNING) for s in launched)
        done = await asyncio.gather(*(wait_terminal(c, r.job_id, timeout=60) for r in (hello, gang, failing)))
        assert [s.state for s in done] == [S.SUCCEEDED, S.SUCCEEDED, S.FAILED], done
        assert done[0].exit_code == 0 and done[2].exit_code == 3
        assert "hello from peer value-42" in await read_all_logs(c, hello.job_id)
        gang_log = await read_all_logs(c, gang.job_id)
        for i in range(3):
            assert f"replica {i} of 3" in gang_log
        assert "about to fail" in await read_all_logs(c, failing.job_id)

        # Logs by offset: the same bytes, however they are split.
        whole = await read_all_logs(c, hello.job_id)
        chunk = await c.logs(hello.job_id, offset=5, limit=7)
        assert chunk.data == whole.encode()[5:12].decode() and chunk.next_offset == 12

        # The same launch again (a retried handoff) is the same job: nothing new reaches Ray.
        again = await c.launch(hello)
        assert again.attempts == 1 and again.state is S.SUCCEEDED
    ray = ray_jobs(ray_head)
    sid = submission_id(hello.job_id, 1)
    assert sid == "alice~_hello"
    assert [j.submission_id for j in ray.list_jobs()].count(sid) == 1
    info = ray.get_job_info(sid)
    assert info.status == RayStatus.SUCCEEDED
    assert info.metadata["iris_job_id"] == hello.job_id
    # Ray itself refuses a second run under the same submission id, whoever asks.
    with pytest.raises(RuntimeError, match="already exists"):
        ray.submit_job(entrypoint="echo twice", submission_id=sid)


async def test_a_new_nonce_after_the_end_is_a_second_attempt(jobs_controller: Controller) -> None:
    first = request(["true"], job_id="bob/rerun", nonce="n1", backend_id="ray-h100")
    async with jobs_controller.client() as c:
        await c.launch(first)
        assert (await wait_terminal(c, first.job_id, timeout=60)).state is S.SUCCEEDED
        second = first.model_copy(update={"nonce": "n2", "command": ["sh", "-c", "echo second"]})
        status = await c.launch(second)
        assert status.attempts == 2
        final = await wait_terminal(c, first.job_id, timeout=60)
        assert final.state is S.SUCCEEDED
        assert "second" in await read_all_logs(c, first.job_id)


def test_job_output_leaves_out_rays_own_lines() -> None:
    sid, cmd = "alice~_x", "sh -c 'echo hi'"
    info = b"2026-11-30 16:41:35,104\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
    banner = f"Running entrypoint for job {sid}: {cmd}\n".encode()
    assert job_output(info + b"first\n" + banner + b"second\n", sid, cmd) == b"first\nsecond\n"
    assert job_output(info + banner + b"first\n", sid, cmd) == b"first\n"
    # Ray's line ends a partial line of the job's; the job's bytes join up again.
    assert job_output(info + b"par" + banner + b"tial\n", sid, cmd) == b"partial\n"
    # Growing logs give growing outputs: the controller's copy only ever appends.
    whole = info + b"a\n" + banner + b"b\n"
    outputs = [job_output(whole[: i + 1], sid, cmd) for i, c in enumerate(whole) if c == ord("\n")]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(outputs))
    # What says why Ray could not start the job stays.
    warning = b"2026-11-30 16:41:35,104\tWARNING job_manager.py:618 -- Failed to start supervisor actor\n"
    assert job_output(info + warning, sid, cmd) == warning


async def test_a_ray_jobs_log_is_its_own_output_only(jobs_controller: Controller) -> None:
    """The same log as on the process backend: what the job wrote, none of Ray's lines."""
    req = request(["sh", "-c", "echo first; sleep 1; echo second >&2"], gpus=1, backend_id="ray-h100")
    async with jobs_controller.client() as c:
        await c.launch(req)
        assert (await wait_terminal(c, req.job_id, timeout=60)).state is S.SUCCEEDED
        assert await read_all_logs(c, req.job_id) == "first\nsecond\n"


async def test_terminate_stops_the_ray_job(
    ray_head: devstack.RayHeadSpec, jobs_controller: Controller
) -> None:
    req = request(["sleep", "60"], gpus=1, backend_id="ray-h100")
    async with jobs_controller.client() as c:
        await c.launch(req)
        await wait_state(c, req.job_id, S.RUNNING, timeout=60)
        await c.terminate(req.job_id)
        final = await wait_terminal(c, req.job_id, timeout=30)
        assert final.state is S.KILLED and final.error == "terminated on request"
        # A pending job that never reached Ray is dropped at once.
        never = request(["sleep", "60"], backend_id="ray-h100")
        await c.launch(never)
        await c.terminate(never.job_id)
        assert (await wait_terminal(c, never.job_id, timeout=30)).state is S.KILLED
    info = await asyncio.to_thread(ray_jobs(ray_head).get_job_info, submission_id(req.job_id, 1))
    assert info.status == RayStatus.STOPPED


async def test_capacity_comes_from_ray_while_a_job_holds_devices_and_after(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    # The controller's Ray monitor asks Ray's job API for its version once a round: counted through
    # a proxy, they tell the test when a round has begun (and the one before it ended) after a step.
    jobs_api = FaultProxy(ray_head.address)
    await jobs_api.start(devstack.free_port())
    backend = ray_backend(ray_head, "cap", address=f"http://127.0.0.1:{jobs_api.port}")
    ctl = await asyncio.to_thread(controller_on, tmp_path, backend)

    async def a_whole_round(what: str) -> None:
        floor = jobs_api.requests[VERSION] + 2

        async def past() -> bool:
            return jobs_api.requests[VERSION] >= floor

        await wait_until(past, timeout=60, what=f"a whole round of the Ray monitor after {what}")

    try:
        async with ctl.client() as c:
            first = await poll(
                lambda: first_availability(c),
                lambda a: a is not None and a.total_amounts == {"h100": 8},
                timeout=60,
            )
            assert first is not None
            idle = first
            assert idle.amounts == {"h100": 8} and idle.held_by_band == []
            # Nothing changed, so the observation is the same one (reservations stay charged to it).
            await a_whole_round("the idle report")
            assert (await availability(c)).observation_epoch_ms == idle.observation_epoch_ms

            batch = request(["sleep", "30"], gpus=6, band=Band.BATCH, backend_id="ray-h100")
            await c.launch(batch)
            # Promised at once, before Ray even starts it: never offered to anyone else.
            promised = await availability(c)
            assert promised.amounts == {"h100": 2}
            assert promised.observation_epoch_ms > idle.observation_epoch_ms
            await wait_state(c, batch.job_id, S.RUNNING, timeout=60)
            held = await poll(lambda: availability(c), lambda a: a.held_by_band != [], timeout=20)
            assert held.amounts == {"h100": 2} and held.total_amounts == {"h100": 8}
            assert [(h.band, h.amounts) for h in held.held_by_band] == [(Band.BATCH, {"h100": 6})]

            # A job that does not fit yet (4 > 2 free) waits; its demand is not free either. Batch
            # like the running job, so it preempts nothing (docs/DESIGN.md, "Preemption").
            waiting = request(["true"], gpus=4, band=Band.BATCH, backend_id="ray-h100")
            await c.launch(waiting)
            assert (await availability(c)).amounts == {"h100": 0}
            await a_whole_round("the launch of the job that does not fit")
            assert (await c.status(waiting.job_id)).state is S.PENDING
            assert (await c.status(batch.job_id)).state is S.RUNNING

            await c.terminate(batch.job_id)
            await wait_terminal(c, waiting.job_id, timeout=60)
            after = await poll(
                lambda: availability(c),
                lambda a: a.amounts == {"h100": 8} and a.held_by_band == [],
                timeout=20,
                what="capacity back after the jobs ended",
            )
            assert after.observation_epoch_ms > held.observation_epoch_ms
    finally:
        await asyncio.to_thread(ctl.stop)
        await jobs_api.stop()


async def test_ray_going_away_is_unreachable_and_nothing_is_placed_there(
    ray_head: devstack.RayHeadSpec, ray_proxies: tuple[TcpProxy, TcpProxy], tmp_path: Path
) -> None:
    jobs, gcs = ray_proxies
    backend = ray_backend(
        ray_head,
        "down",
        address=f"http://127.0.0.1:{jobs.port}",
        gcs_address=f"127.0.0.1:{gcs.port}",
    )
    ctl = await asyncio.to_thread(controller_on, tmp_path, backend, "raypeer")
    config = load_config(ctl.config_path)
    shapes = [
        JobShape(job_id="free", device=_h100(4)),
        JobShape(job_id="pinned", device=_h100(4), target_cluster="raypeer"),
        JobShape(job_id="cpu", target_cluster="raypeer"),
    ]

    async def report() -> PeerReport:
        return await cluster_report(config, "raypeer", timeout_s=3)

    def placed(r: PeerReport) -> list[str]:
        now = int(time.time() * 1000)
        home = PeerReport(peer_id="home", reachable=True, last_contact_ms=now)
        result = plan(shapes, home="home", reports=[home, r], now_ms=now, stale_after_ms=30_000)
        return sorted(p.job_id for p in result.placements)

    try:
        up = await poll(report, lambda r: r.reachable, timeout=60, what="raypeer reachable")
        assert placed(up) == ["cpu", "free", "pinned"]

        await jobs.cut()
        await gcs.cut()
        down = await poll(report, lambda r: not r.reachable, timeout=20, what="raypeer unreachable")
        assert down.error is not None and "Ray" in down.error and "ray-h100" in down.error
        assert peer_status(down, int(time.time() * 1000), 30_000) is PeerStatus.UNREACHABLE
        assert placed(down) == []
        # The controller itself still answers; only its capacity is unknown.
        async with ctl.client() as c:
            assert (await c.health()).status == "ok"

        await jobs.restore()
        await gcs.restore()
        back = await poll(report, lambda r: r.reachable, timeout=20, what="raypeer back")
        assert placed(back) == ["cpu", "free", "pinned"]
    finally:
        await asyncio.to_thread(ctl.stop)


def _h100(count: int) -> DeviceRequest:
    return DeviceRequest(type="gpu", variant="h100", count=count)


async def test_a_restarted_controller_reattaches_to_its_ray_jobs(
    ray_head: devstack.RayHeadSpec, tmp_path: Path
) -> None:
    ctl = await asyncio.to_thread(controller_on, tmp_path, ray_backend(ray_head, "restart"))
    flag = tmp_path / "finish"  # Ray runs on this machine: the job ends when the test says so
    script = f"echo started; while [ ! -e {flag} ]; do sleep 0.1; done; echo finished"
    req = request(["sh", "-c", script], gpus=8, backend_id="ray-h100")
    try:
        async with ctl.client() as c:
            await c.launch(req)
            await wait_state(c, req.job_id, S.RUNNING, timeout=60)
        await asyncio.to_thread(ctl.kill9)
        ctl = await asyncio.to_thread(restart, ctl, 90)
        async with ctl.client() as c:
            after = await c.status(req.job_id)
            assert after.state is S.RUNNING, after  # Ray still runs it: not WORKER_FAILED
            # Its devices are still held: nothing to offer while it runs.
            # A new controller answers 503 "not contacted yet" until its first read of Ray.
            block = await poll(
                lambda: first_availability(c),
                lambda a: a is not None and a.total_amounts == {"h100": 8},
                timeout=60,
                what="the restarted controller's first read of Ray",
            )
            assert block is not None and block.amounts == {"h100": 0}
            flag.touch()
            final = await wait_terminal(c, req.job_id, timeout=60)
            assert final.state is S.SUCCEEDED and final.exit_code == 0
            log = await read_all_logs(c, req.job_id)
            assert "started" in log and "finished" in log
    finally:
        await asyncio.to_thread(ctl.stop)
    sid = submission_id(req.job_id, 1)
    runs = [j for j in ray_jobs(ray_head).list_jobs() if j.submission_id == sid]
    assert len(runs) == 1
