"""The per-cluster watcher (docs/DESIGN.md, "The change feed") against a real controller process
and a real Temporal dev server: its signals follow the feed, a silent cluster's jobs are found by
visibility and told, and a controller restart (a new epoch) is a resync that still reaches them.

The job workflows are stand-ins registered under the job workflow's type: they upsert the search
attributes a running job has and record every ``observe`` signal, so what the watcher sends is seen
exactly as a job would receive it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from controller_harness import (
    Controller,
    cluster,
    federation,
    gpu_backend,
    poll,
    py,
    request,
    restart,
    start_controller,
    write_config,
)
from temporalio import workflow
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.watch import Observation, WatchActivities
from iris import contract, devstack
from iris.config import load_config
from iris.controller.models import ControllerJobState as S
from iris.controller.models import JobStatus
from iris.temporal import data_converter
from workflows.watch import PeerWatch, WatcherInput


@workflow.defn(name=contract.JOB_WORKFLOW)
class Recorder:
    """A running job as visibility shows it (IrisPeer, IrisState), recording what it is told."""

    def __init__(self) -> None:
        self._seen: list[Observation] = []

    @workflow.signal(name=contract.OBSERVE)
    def observe(self, seen: Observation) -> None:
        self._seen.append(seen)

    @workflow.query(name="seen")
    def seen(self) -> list[Observation]:
        return self._seen

    @workflow.run
    async def run(self, peer: str) -> None:
        workflow.upsert_search_attributes(
            [contract.SA_PEER.value_set(peer), contract.SA_STATE.value_set("RUNNING")]
        )
        await workflow.wait_condition(lambda: False)


@pytest.fixture
async def env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(devstack.venv_bin("temporal")),
        search_attributes=contract.SEARCH_ATTRIBUTE_KEYS,
        data_converter=data_converter(),
        dev_server_startup_timeout=timedelta(seconds=60),
    )
    try:
        yield env
    finally:
        await env.shutdown()


async def seen(handle: WorkflowHandle[Any, Any]) -> list[Observation]:
    result: list[Observation] = await handle.query("seen", result_type=list[Observation])
    return result


async def test_the_watcher_signals_changes_tells_a_silent_clusters_jobs_and_resyncs_after_a_restart(
    env: WorkflowEnvironment, tmp_path: Path
) -> None:
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    path = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    config = load_config(path)
    ctl: Controller = start_controller(path, "peer", tmp_path / "state", port=peer["port"])
    queue = f"watch-{uuid.uuid4().hex}"
    worker = Worker(
        env.client,
        task_queue=queue,
        workflows=[Recorder, PeerWatch],
        activities=[WatchActivities(config).watch_peer],
        # The stand-in lives in this test module, which the sandbox would re-import (with the
        # harness's imports): unsandboxed here; the replay tests check PeerWatch in the sandbox.
        workflow_runner=UnsandboxedWorkflowRunner(),
    )
    jobs: dict[str, WorkflowHandle[Any, Any]] = {}
    try:
        async with worker:
            for name in ("w/first", "w/second"):
                jobs[name] = await env.client.start_workflow(Recorder.run, "peer", id=name, task_queue=queue)
            async with ctl.client() as c:
                await c.launch(request(py("import time; time.sleep(300)"), job_id="w/first", gpus=1))
                await env.client.start_workflow(
                    PeerWatch.run,
                    WatcherInput(cluster="peer", wait_s=5, silent_report_s=1, run_for_s=120),
                    id=contract.peer_watch_workflow_id(queue, "peer"),
                    task_queue=queue,
                )
                # Its start: the listing signals the running job.
                first = await poll(lambda: seen(jobs["w/first"]), bool, what="the listing's signal")
                listed = first[0].status
                assert listed is not None and listed.job_id == "w/first"
                # A change, through the feed: the terminate's KILLED, a later version, same epoch.
                await c.terminate("w/first")
                after = await poll(
                    lambda: seen(jobs["w/first"]),
                    lambda s: killed_in(s) is not None,
                    what="the feed's signal",
                )
                killed = killed_in(after)
                assert killed is not None and killed.epoch == listed.epoch and killed.version > listed.version
                # Another job's workflow got nothing of it.
                assert await seen(jobs["w/second"]) == []
                await c.launch(request(py("import time; time.sleep(300)"), job_id="w/second", gpus=1))
                running = await poll(lambda: seen(jobs["w/second"]), bool, what="w/second's signal")
                assert running[0].status is not None
                epoch = running[0].status.epoch

            # The controller dies: the jobs visibility shows on it are told, and since when.
            ctl.kill9()
            notices = await poll(
                lambda: seen(jobs["w/second"]),
                lambda s: notice_in(s) is not None,
                what="the silence notice",
                timeout=30,
            )
            notice = notice_in(notices)
            assert notice is not None and notice.cluster == "peer" and notice.error
            assert notice.silent_since_ms is not None
            # Back, with a new epoch: the old cursor resyncs, and the job lost in the restart is told.
            ctl = restart(ctl)
            lost = await poll(
                lambda: seen(jobs["w/second"]),
                lambda s: lost_in(s) is not None,
                what="the resync's signal",
                timeout=60,
            )
            worker_failed = lost_in(lost)
            assert worker_failed is not None and worker_failed.epoch != epoch
    finally:
        ctl.stop()
        for handle in [
            *jobs.values(),
            env.client.get_workflow_handle(contract.peer_watch_workflow_id(queue, "peer")),
        ]:
            with contextlib.suppress(Exception):
                await handle.terminate("test over")


def _with_state(observations: list[Observation], state: S) -> JobStatus | None:
    return next((o.status for o in observations if o.status is not None and o.status.state is state), None)


def killed_in(observations: list[Observation]) -> JobStatus | None:
    return _with_state(observations, S.KILLED)


def lost_in(observations: list[Observation]) -> JobStatus | None:
    return _with_state(observations, S.WORKER_FAILED)


def notice_in(observations: list[Observation]) -> Observation | None:
    return next((o for o in observations if o.status is None), None)


async def completed_runs(handle: WorkflowHandle[Any, Any]) -> int:
    """The watcher's completed runs of ``watch_peer`` (its history's completed activities)."""
    events = [e async for e in handle.fetch_history_events()]
    return sum(1 for e in events if e.HasField("activity_task_completed_event_attributes"))


async def test_a_listing_does_not_wake_a_job_already_told_that_record(
    env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Each watcher run starts with a listing; a job this worker process already told the record
    it lists is not signalled again (each signal wakes the job: a replay, once the worker's cache
    is full). A change is told; a new process (a fresh ``WatchActivities``) tells every job once."""
    peer = cluster("peer", backends=[gpu_backend(slots=4)])
    path = write_config(tmp_path / "c.toml", federation(cluster("home"), peer))
    config = load_config(path)
    ctl: Controller = start_controller(path, "peer", tmp_path / "state", port=peer["port"])
    queue = f"watch-{uuid.uuid4().hex}"
    handles: list[WorkflowHandle[Any, Any]] = []

    def worker(watch: WatchActivities) -> Worker:
        return Worker(
            env.client,
            task_queue=queue,
            workflows=[Recorder, PeerWatch],
            activities=[watch.watch_peer],
            workflow_runner=UnsandboxedWorkflowRunner(),
        )

    def states(observations: list[Observation]) -> list[S]:
        return [o.status.state for o in observations if o.status is not None]

    def records(observations: list[Observation]) -> list[tuple[str, int]]:
        """The feed records a job was told (a task's change is a record of its own)."""
        return [(o.status.epoch, o.status.version) for o in observations if o.status is not None]

    def once_each(observations: list[Observation]) -> bool:
        return len(set(records(observations))) == len(records(observations))

    try:
        async with ctl.client() as c, worker(WatchActivities(config)):
            for name in ("w/held", "w/changed"):
                handles.append(
                    await env.client.start_workflow(Recorder.run, "peer", id=name, task_queue=queue)
                )
                await c.launch(request(py("import time; time.sleep(300)"), job_id=name, gpus=1))
            held, changed = handles
            # Runs of 1 s: each begins with a listing.
            watcher = await env.client.start_workflow(
                PeerWatch.run,
                WatcherInput(cluster="peer", wait_s=0.5, run_for_s=1.0),
                id=contract.peer_watch_workflow_id(queue, "peer"),
                task_queue=queue,
            )
            handles.append(watcher)
            await poll(lambda: seen(held), lambda s: S.RUNNING in states(s), what="w/held told RUNNING")
            runs = await completed_runs(watcher)
            await poll(lambda: completed_runs(watcher), lambda n: n >= runs + 3, what="3 more runs")
            told = await seen(held)
            assert once_each(told), f"a record told at every run's listing: {records(told)}"
            # A change is news: told, once.
            await c.terminate("w/changed")
            await poll(lambda: seen(changed), lambda s: S.KILLED in states(s), what="w/changed told KILLED")
            runs = await completed_runs(watcher)
            await poll(lambda: completed_runs(watcher), lambda n: n >= runs + 3, what="3 more runs")
            ended = await seen(changed)
            assert states(ended)[-1] is S.KILLED and states(ended).count(S.KILLED) == 1, states(ended)
            assert once_each(ended), records(ended)
            told = await seen(held)
            assert once_each(told), records(told)
        # A new process knows nothing it told: its first listing tells the running job again.
        async with worker(WatchActivities(config)):
            again = await poll(
                lambda: seen(held), lambda s: len(s) > len(told), what="the new process's listing"
            )
            assert records(again)[-1] == records(told)[-1], "the same record, told again"
    finally:
        ctl.stop()
        for handle in handles:
            with contextlib.suppress(Exception):
                await handle.terminate("test over")
