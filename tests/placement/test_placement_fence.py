"""The tick terminates fenced attempts, by nonce, on clusters that answer (docs/DESIGN.md,
"Attempts"): against a real controller app (uvicorn in this process, jobs as real processes)."""

from __future__ import annotations

import sys

from placement_harness import (
    DOWN,
    PEER,
    Controller,
    eventually,
    new_job_id,
    reachable,
    tick_activities,
    unreachable,
    view,
)
from temporalio.testing import ActivityEnvironment

from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.controller.models import ControllerJobState, JobStatus, LaunchRequest
from iris.reports import FederationView
from iris.store import FederationStore

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
DONE = [sys.executable, "-c", "pass"]


def _reachable(*peers: str) -> FederationView:
    return view(*(reachable(p) for p in peers))


async def _fence(config: FederationConfig, store: FederationStore, federation: FederationView) -> int:
    acts = tick_activities(config, store)
    fenced: int = await ActivityEnvironment().run(acts._fence, federation)
    return fenced


async def _launch(client: ControllerClient, job_id: str, nonce: str, command: list[str]) -> JobStatus:
    req = LaunchRequest(
        job_id=job_id,
        command=command,
        user="alice@example.com",
        requester="marin",
        nonce=nonce,
        backend_id="cpu",
    )
    await client.launch(req)
    want = (lambda s: s.terminal) if command is DONE else (lambda s: s.state is ControllerJobState.RUNNING)
    return await eventually(lambda: client.status(job_id), want, what=f"{job_id} ({nonce})")


def _fences(store: FederationStore) -> list[tuple[str, str, str]]:
    return [(f.job_id, f.nonce, f.cluster) for f in store.fences()]


async def test_a_fence_terminates_its_running_attempt_and_is_forgotten(
    controller: Controller, config: FederationConfig, store: FederationStore
) -> None:
    job_id = new_job_id("fenced")
    async with controller.client() as client:
        running = await _launch(client, job_id, "n1", SLEEP)
        assert running.nonce == "n1"
        store.add_fence(job_id, "n1", PEER)

        assert await _fence(config, store, _reachable(PEER)) == 1
        ended = await client.status(job_id)
        assert ended.terminal and ended.nonce == "n1"
        assert ended.state is ControllerJobState.KILLED
    assert _fences(store) == []


async def test_a_fence_of_an_earlier_attempt_leaves_the_current_run_alone(
    controller: Controller, config: FederationConfig, store: FederationStore
) -> None:
    job_id = new_job_id("relaunched")
    async with controller.client() as client:
        first = await _launch(client, job_id, "n1", DONE)
        assert first.nonce == "n1"
        current = await _launch(client, job_id, "n2", SLEEP)
        assert (current.nonce, current.attempts) == ("n2", 2)
        store.add_fence(job_id, "n1", PEER)

        # The cluster answers with its current run (n2): the fenced attempt has ended there.
        assert await _fence(config, store, _reachable(PEER)) == 1
        assert _fences(store) == []
        after = await client.status(job_id)
        assert (after.nonce, after.state) == ("n2", ControllerJobState.RUNNING)
        await client.terminate(job_id, nonce="n2")


async def test_a_fence_for_a_job_the_cluster_never_had_is_forgotten(
    controller: Controller, config: FederationConfig, store: FederationStore
) -> None:
    store.add_fence(new_job_id("never-launched"), "n1", PEER)
    assert await _fence(config, store, _reachable(PEER)) == 1
    assert _fences(store) == []


async def test_a_fence_stays_while_its_cluster_cannot_be_reached(
    controller: Controller, config: FederationConfig, store: FederationStore
) -> None:
    job_id = new_job_id("silent")
    async with controller.client() as client:
        await _launch(client, job_id, "n1", SLEEP)
        store.add_fence(job_id, "n1", PEER)
        store.add_fence(job_id, "n0", DOWN)

        # cw-a reported unreachable this tick: not even asked. cw-down "answered" but nothing
        # listens at its address: the terminate fails, its fence stays.
        federation = view(unreachable(PEER), reachable(DOWN))
        assert await _fence(config, store, federation) == 0
        assert sorted(_fences(store)) == sorted([(job_id, "n1", PEER), (job_id, "n0", DOWN)])
        still = await client.status(job_id)
        assert (still.nonce, still.state) == ("n1", ControllerJobState.RUNNING)

        # Once cw-a answers again its attempt is terminated; cw-down's fence still waits.
        assert await _fence(config, store, _reachable(PEER, DOWN)) == 1
        assert _fences(store) == [(job_id, "n0", DOWN)]
        assert (await client.status(job_id)).state is ControllerJobState.KILLED
