"""Cancel versus promotion, 1000 times with randomized timing (docs/DESIGN.md,
"Promotion (the CAS)", "Cancellation", "1. A job is handed off at most once per incarnation",
"2. A cancel recorded before promotion is never delivered").

What races: a cancel — the ``cancel_job`` Update, the ``cancel`` signal, Temporal's own cancel, or an
operator recording the intent straight in the federation store — against the tick's ``place``
signal (sometimes sent twice) and the promotion CAS activity it triggers. Each iteration picks the
stage the cancel aims at (job queued, placement just sent, CAS in flight, handoff in flight, job
running) and lands it there with a random jitter; the CAS itself starts after a random delay.

Each iteration is the real JobWorkflow on the session's Temporal with the real store activities on
a fresh SQLite store; only the peer is a stub that counts deliveries and terminations. Fits in CI:
iterations run 24 at a time.

Violations (all must be 0): a delivery after a cancel that reported it won (Update or store), a
second delivery, a delivery without a won CAS, a job killed at home but left running on the peer,
a job not terminal in time, a store handle that disagrees with the job's final state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from stack import Stack
from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.artifacts import ArtifactInput, ArtifactReport
from activities.auth import AuthActivities
from activities.peers import (
    AttemptFound,
    FindInput,
    FindResult,
    FollowInput,
    FollowResult,
    LaunchInput,
    MirrorInput,
    TerminateInput,
)
from activities.store import EnqueueInput, PromoteInput, StoreActivities
from iris import contract
from iris.client import build_spec, execute_update
from iris.contract import JOB_WORKFLOW
from iris.controller.models import ControllerJobState
from iris.controller.models import JobStatus as PeerJobStatus
from iris.jobs import CancelOutcome, CancelRequest, JobState, JobStatus
from iris.policy.models import Availability, BackendReport, Band, PeerReport, Placement
from iris.reports import FederationView
from iris.store import FederationStore, HandleState, JobHandle, PromoteResult
from iris.userauth import Action
from workflows.job import JobWorkflow

ITERATIONS = int(os.environ.get("IRIS_RACE_ITERATIONS", "1000"))
PARALLEL = 24
SEED = 20261130
# Every job is this user's, its submission and cancels signed with its key.
RACER = "race@example.com"
PEER, BACKEND = "cw-race", "h100-race"
METHODS = ("update", "signal", "temporal", "store")
# Where the cancel aims, and how often.
STAGES = ("queued", "placed", "promoting", "launching", "running")
STAGE_WEIGHTS = (2, 2, 3, 2, 1)


class Milestones:
    """Per-job events the activities set, so a cancel can aim at a stage of the lifecycle."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def event(self, job_id: str, stage: str) -> asyncio.Event:
        return self._events.setdefault((job_id, stage), asyncio.Event())

    def reach(self, job_id: str, stage: str) -> None:
        self.event(job_id, stage).set()


class StubPeer:
    """The peer side: counts deliveries and terminations; a job 'runs' for 0.05–0.25 s."""

    def __init__(self, rng: random.Random, milestones: Milestones) -> None:
        self.rng = rng
        self.milestones = milestones
        self.report_delay_s = 0.0
        self.reports_started = asyncio.Event()
        self.launches: Counter[str] = Counter()
        self.terminated: set[str] = set()
        self.stopped: dict[str, asyncio.Event] = {}
        self.ends_at: dict[str, float] = {}

    def _status(self, job_id: str, state: ControllerJobState) -> PeerJobStatus:
        return PeerJobStatus(
            job_id=job_id,
            state=state,
            backend_id=BACKEND,
            created_ms=int(time.time() * 1000),
            band=Band.INTERACTIVE,
            user="race@example.com",
            requester="marin",
            nonce=job_id,
        )

    @activity.defn(name=contract.FETCH_REPORTS)
    async def fetch_reports(self) -> FederationView:
        self.reports_started.set()
        if self.report_delay_s:
            await asyncio.sleep(self.report_delay_s)
        now = int(time.time() * 1000)
        gpu = BackendReport(
            backend_id=BACKEND,
            advertised_attributes={"device-type": ["gpu"], "device-variant": ["h100"]},
            availability=Availability(
                observation_epoch_ms=now, amounts={"h100": 0}, total_amounts={"h100": 8}
            ),
        )
        cpu = BackendReport(backend_id="cpu", advertised_attributes={"device-type": ["cpu"]})
        return FederationView(
            home="marin",
            stale_after_ms=60_000,
            reports=[
                PeerReport(peer_id="marin", reachable=True, last_contact_ms=now, backends=[cpu]),
                PeerReport(peer_id=PEER, reachable=True, last_contact_ms=now, backends=[gpu]),
            ],
        )

    @activity.defn(name=contract.LAUNCH_JOB)
    async def launch_job(self, inp: LaunchInput) -> PeerJobStatus:
        job_id = inp.request.job_id
        self.milestones.reach(job_id, "launching")
        await asyncio.sleep(self.rng.uniform(0, 0.01))
        self.launches[job_id] += 1
        self.ends_at.setdefault(job_id, time.monotonic() + self.rng.uniform(0.05, 0.25))
        self.milestones.reach(job_id, "running")
        return self._status(job_id, ControllerJobState.RUNNING)

    @activity.defn(name=contract.MIRROR_JOB)
    async def mirror_job(self, inp: MirrorInput) -> PeerJobStatus:
        """Like the real one: returns once the state differs from ``known_state``; the job runs until
        its end time, or until it is terminated."""
        job_id = inp.job_id
        stopped = self.stopped.setdefault(job_id, asyncio.Event())
        remaining = self.ends_at.get(job_id, 0) - time.monotonic()
        if remaining > 0 and not stopped.is_set() and inp.known_state != ControllerJobState.RUNNING.value:
            return self._status(job_id, ControllerJobState.RUNNING)
        if remaining > 0:
            try:
                async with asyncio.timeout(remaining):
                    await stopped.wait()
            except TimeoutError:
                pass
        done = ControllerJobState.KILLED if job_id in self.terminated else ControllerJobState.SUCCEEDED
        return self._status(job_id, done)

    @activity.defn(name=contract.FOLLOW_JOB)
    async def follow_job(self, inp: FollowInput) -> FollowResult:
        """The attempt followed as ``mirror_job`` mirrors it (the peer never goes silent here)."""
        mirrored = await self.mirror_job(
            MirrorInput(cluster=inp.cluster, job_id=inp.job_id, known_state=inp.known_state)
        )
        return FollowResult(status=mirrored)

    @activity.defn(name=contract.FIND_ATTEMPT)
    async def find_attempt(self, inp: FindInput) -> FindResult:
        if self.launches[inp.job_id] == 0:
            return FindResult(found=AttemptFound.ABSENT)
        return FindResult(
            found=AttemptFound.HERE,
            status=await self.mirror_job(
                MirrorInput(cluster=inp.cluster, job_id=inp.job_id, known_state=None)
            ),
        )

    @activity.defn(name=contract.TERMINATE_JOB)
    async def terminate_job(self, inp: TerminateInput) -> PeerJobStatus | None:
        self.terminated.add(inp.job_id)
        self.stopped.setdefault(inp.job_id, asyncio.Event()).set()
        return self._status(inp.job_id, ControllerJobState.KILLED)

    @activity.defn(name=contract.CHECK_ARTIFACTS)
    async def check_artifacts(self, inp: ArtifactInput) -> ArtifactReport:
        return ArtifactReport(missing=[], reasons=[])


class JitteredStore(StoreActivities):
    """The real store activities; the CAS starts after a random delay, so cancels land mid-flight."""

    def __init__(
        self, store: FederationStore, task_queue: str, rng: random.Random, milestones: Milestones
    ) -> None:
        # No placement manager here (the test is the tick): wake it at most once.
        super().__init__(store, task_queue, wake_debounce_s=3600)
        self.rng = rng
        self.milestones = milestones
        self.enqueue_delay_s = 0.0

    @activity.defn(name=contract.ENQUEUE_JOB)
    async def enqueue_and_tell(self, inp: EnqueueInput) -> JobHandle:
        self.milestones.reach(inp.shape.job_id, "enqueueing")
        if self.enqueue_delay_s:
            await asyncio.sleep(self.enqueue_delay_s)
        handle = await super().enqueue_job(inp)
        self.milestones.reach(inp.shape.job_id, "queued")
        return handle

    @activity.defn(name=contract.PROMOTE_JOB)
    async def jittered_promote(self, inp: PromoteInput) -> PromoteResult:
        self.milestones.reach(inp.job_id, "promoting")
        await asyncio.sleep(self.rng.uniform(0, 0.015))
        return await super().promote_job(inp)


@dataclass
class Outcome:
    job_id: str
    method: str
    stage: str
    update: CancelOutcome | None = None
    store_won: bool | None = None
    final: JobStatus | None = None
    cancelled_run: bool = False
    deliveries: int = 0
    terminated: bool = False
    handle_state: HandleState | None = None
    assigned_peer: str | None = None
    problems: list[str] = field(default_factory=list)

    def who_won(self) -> str:
        if self.cancelled_run:
            return "run CANCELED (a violation)"
        if self.deliveries == 0:
            return "cancel won" if self.assigned_peer is None else "CAS won, cancelled before handoff"
        if self.final is not None and self.final.state is JobState.KILLED:
            return "delivered, terminated"
        return "delivered, cancel too late"


@dataclass
class Race:
    stack: Stack
    store: FederationStore
    peer: StubPeer
    queue: JitteredStore
    milestones: Milestones
    task_queue: str
    rng: random.Random
    started: list[str] = field(default_factory=list)

    async def start(self, job_id: str) -> WorkflowHandle[JobWorkflow, JobStatus]:
        self.started.append(job_id)
        spec = build_spec(["true"], name=job_id.split("/")[1], user=RACER, device_type="h100", gpu_count=8)
        # Signed by its user, as the SDK signs a submission (docs/DESIGN.md, "User → home").
        signature = self.stack.iris.sign(Action.SUBMIT, RACER, spec.job_id, spec)
        spec = spec.model_copy(update={"signature": signature})
        return await self.stack.client.start_workflow(
            JOB_WORKFLOW,
            spec,
            id=job_id,
            task_queue=self.task_queue,
            result_type=JobStatus,
            execution_timeout=timedelta(minutes=5),
        )

    async def place(self, handle: WorkflowHandle[JobWorkflow, JobStatus], job_id: str) -> None:
        placement = Placement(job_id=job_id, peer_id=PEER, backend_id=BACKEND, reason="race")
        for _ in range(2 if self.rng.random() < 0.3 else 1):  # duplicate signals happen too
            try:
                await handle.signal(JobWorkflow.place, placement)
            except RPCError:
                return  # the workflow already ended
        self.milestones.reach(job_id, "placed")

    def cancel_request(self, o: Outcome) -> CancelRequest:
        """The owner's signed cancel, as the CLI sends it."""
        request = CancelRequest(reason="race")
        signature = self.stack.iris.sign(Action.CANCEL, RACER, o.job_id, request)
        return request.model_copy(update={"signature": signature})

    async def cancel(self, handle: WorkflowHandle[JobWorkflow, JobStatus], o: Outcome) -> None:
        try:
            async with asyncio.timeout(30):
                await self.milestones.event(o.job_id, o.stage).wait()
        except TimeoutError:
            o.problems.append(f"never reached stage {o.stage}")
            return
        await asyncio.sleep(self.rng.uniform(0, 0.012))
        try:
            if o.method == "update":
                # As the CLI sends it: again if the server dropped it with a failed workflow task.
                o.update = await execute_update(
                    handle, JobWorkflow.cancel_job, self.cancel_request(o), CancelOutcome
                )
            elif o.method == "signal":
                await handle.signal(JobWorkflow.cancel, self.cancel_request(o))
            elif o.method == "temporal":
                await handle.cancel()
            else:
                o.store_won = (await asyncio.to_thread(self.store.record_cancel, o.job_id, "operator")).won
        except RPCError:
            pass  # the workflow ended first: nothing was cancelled
        except WorkflowUpdateRPCTimeoutOrCancelledError:
            o.problems.append("the cancel Update got no answer within the RPC timeout")

    async def iteration(self, i: int) -> Outcome:
        method = METHODS[i % len(METHODS)]
        stage = self.rng.choices(STAGES, STAGE_WEIGHTS)[0]
        if method == "store" and stage in ("launching", "running"):
            stage = "promoting"  # the store intent only competes with the CAS
        job_id = f"race/{self.task_queue[-8:]}-{i:04d}"
        o = Outcome(job_id=job_id, method=method, stage=stage)
        handle = await self.start(job_id)
        canceller = asyncio.create_task(self.cancel(handle, o))
        try:
            async with asyncio.timeout(30):
                await self.milestones.event(job_id, "queued").wait()
            await asyncio.sleep(self.rng.uniform(0, 0.01))
            await self.place(handle, job_id)
        except TimeoutError:
            pass  # cancelled before it was ever queued
        await canceller
        try:
            async with asyncio.timeout(60):
                o.final = await handle.result()
        except TimeoutError:
            o.problems.append("not terminal within 60 s")
        except WorkflowFailureError:
            o.cancelled_run = True
        stored = await asyncio.to_thread(self.store.get, job_id)
        o.deliveries = self.peer.launches[job_id]
        o.terminated = job_id in self.peer.terminated
        if stored is not None:
            o.handle_state, o.assigned_peer = stored.state, stored.assigned_peer
        judge(o)
        return o


def judge(o: Outcome) -> None:
    if o.deliveries > 1:
        o.problems.append(f"delivered {o.deliveries} times")
    if o.update is not None and o.update.won and o.deliveries:
        o.problems.append("the Update reported the cancel won, yet the job was delivered")
    if o.store_won and o.deliveries:
        o.problems.append("the store recorded the cancel first, yet the job was delivered")
    if o.deliveries and o.assigned_peer is None:
        o.problems.append("delivered without a won promotion CAS")
    if o.cancelled_run:
        # A Temporal cancel must converge on the job's own cancel path (ends KILLED, bookkeeping
        # done), not end the run as CANCELED — what an ActivityError(CancelledError) once did.
        o.problems.append("the run itself ended CANCELED instead of the job ending KILLED")
    if o.final is None:
        return
    state = o.final.state
    if state not in (JobState.KILLED, JobState.SUCCEEDED):
        o.problems.append(f"unexpected final state {state}: {o.final.reason}")
    if state is JobState.KILLED and o.deliveries and not o.terminated:
        o.problems.append("killed at home but never terminated on the peer")
    if o.update is not None and o.update.won and state is not JobState.KILLED:
        o.problems.append(f"the cancel won but the job ended {state}")
    expected = {JobState.KILLED: HandleState.KILLED, JobState.SUCCEEDED: HandleState.SUCCEEDED}.get(state)
    never_queued = o.handle_state is None and state is JobState.KILLED and not o.deliveries
    if expected is not None and o.handle_state is not expected and not never_queued:
        o.problems.append(f"job {state} but its store handle is {o.handle_state}")


@pytest.fixture
async def race(stack: Stack, tmp_path: Path) -> AsyncIterator[Race]:
    rng = random.Random(SEED)
    milestones = Milestones()
    task_queue = f"iris-race-{uuid.uuid4().hex[:8]}"
    store = FederationStore(f"sqlite:///{tmp_path / 'federation.db'}")
    peer = StubPeer(rng, milestones)
    queue = JitteredStore(store, task_queue, rng, milestones)
    stack.add_user(RACER, ["user"])
    auth = AuthActivities(stack.config)
    worker = Worker(
        stack.client,
        task_queue=task_queue,
        workflows=[JobWorkflow],
        activities=[
            auth.verify_request,
            peer.fetch_reports,
            peer.launch_job,
            peer.mirror_job,
            peer.follow_job,
            peer.find_attempt,
            peer.terminate_job,
            peer.check_artifacts,
            queue.enqueue_and_tell,
            queue.jittered_promote,
            queue.record_cancel,
            queue.expire_job,
            queue.set_handle_state,
            queue.requeue_job,
            queue.record_fence,
        ],
        max_concurrent_activities=100,
    )
    try:
        async with worker:
            race = Race(stack, store, peer, queue, milestones, task_queue, rng)
            yield race
            await forget(stack, race)
    finally:
        store.close()


async def forget(stack: Stack, race: Race) -> None:
    """Delete this fixture's executions: a thousand stub-peer runs would only slow the session's
    later list, replay and scan tests down."""
    gate = asyncio.Semaphore(16)

    async def delete(workflow_id: str) -> None:
        async with gate:
            with contextlib.suppress(RPCError):
                await stack.client.workflow_service.delete_workflow_execution(
                    DeleteWorkflowExecutionRequest(
                        namespace=stack.client.namespace,
                        workflow_execution=WorkflowExecution(workflow_id=workflow_id),
                    )
                )

    await asyncio.gather(*(delete(job_id) for job_id in race.started))


@pytest.mark.timeout(900)
async def test_cancel_racing_promotion_1000_times_never_violates(race: Race) -> None:
    started = time.monotonic()
    gate = asyncio.Semaphore(PARALLEL)

    async def bounded(i: int) -> Outcome:
        async with gate:
            return await race.iteration(i)

    outcomes = await asyncio.gather(*(bounded(i) for i in range(ITERATIONS)))
    elapsed = time.monotonic() - started
    listed = await race.stack.client.count_workflows(f"TaskQueue = '{race.task_queue}'")
    assert listed.count == ITERATIONS  # (deleted by the fixture afterwards)

    wins: Counter[tuple[str, str]] = Counter((o.method, o.who_won()) for o in outcomes)
    violations = [f"{o.job_id} ({o.method} at {o.stage}): {p}" for o in outcomes for p in o.problems]
    print(f"\ncancel vs promotion: {ITERATIONS} iterations in {elapsed:.0f}s, {PARALLEL} at a time")
    for method in METHODS:
        row = {who: n for (m, who), n in sorted(wins.items()) if m == method}
        print(f"  {method:<9} " + "  ".join(f"{who}: {n}" for who, n in row.items()))
    deliveries, terminations = sum(o.deliveries for o in outcomes), sum(o.terminated for o in outcomes)
    print(f"  deliveries {deliveries}, terminations {terminations}, violations {len(violations)}")
    assert violations == [], "\n".join(violations[:30])
    # The race was real: cancels won some of it and lost some of it.
    whos = {who for _, who in wins}
    assert "cancel won" in whos and (
        "delivered, terminated" in whos or "delivered, cancel too late" in whos
    ), wins


# ---- deterministic reproductions of what the race found ----------------------------------------
# Both failed before 35bd997: a Temporal cancel that interrupts an awaited activity surfaced as
# ActivityError(CancelledError), which JobWorkflow.run did not catch (the run ended CANCELED with
# none of the cancel bookkeeping), and one landing as the enqueue completed lost that completion
# (the job ended KILLED with its store handle left QUEUED_HANDOFF for every later tick to plan).


async def test_a_temporal_cancel_while_classifying_kills_the_job(race: Race) -> None:
    race.peer.report_delay_s = 1.0  # the cancel lands while fetch_reports runs
    handle = await race.start(f"race/classifying-{uuid.uuid4().hex[:6]}")
    async with asyncio.timeout(30):
        await race.peer.reports_started.wait()
    await handle.cancel()
    final = await handle.result()
    assert final.state is JobState.KILLED


async def test_a_temporal_cancel_during_enqueue_leaves_no_queued_handle(race: Race) -> None:
    race.queue.enqueue_delay_s = 1.0  # the cancel lands while the handle is being written
    job_id = f"race/enqueueing-{uuid.uuid4().hex[:6]}"
    handle = await race.start(job_id)
    async with asyncio.timeout(30):
        await race.milestones.event(job_id, "enqueueing").wait()
    await handle.cancel()
    try:
        final: JobStatus | None = await handle.result()
    except WorkflowFailureError:
        final = None
    async with asyncio.timeout(30):
        await race.milestones.event(job_id, "queued").wait()  # the activity did finish
    stored = await asyncio.to_thread(race.store.get, job_id)
    assert stored is not None and stored.state is not HandleState.QUEUED_HANDOFF, stored
    assert final is not None and final.state is JobState.KILLED
