"""The cancel-versus-promotion race, shared by its two runs (docs/DESIGN.md, "Promotion (the CAS)",
"Cancellation", "1. A job is handed off at most once per incarnation", "2. A cancel recorded before
promotion is never delivered"):

- ``tests/chaos/test_chaos_cancel_race.py``: the real JobWorkflow and store activities in this
  process, on a fresh SQLite store, against a stub peer that counts deliveries;
- ``tests/e2e/test_two_workers.py``: two ``iris worker`` processes on one PostgreSQL store, against
  the real controllers.

What races: a cancel (the ``cancel_job`` Update, the ``cancel`` signal, Temporal's own cancel, or an
operator recording the intent straight in the federation store) against a ``place`` signal
(sometimes sent twice) and the promotion CAS activity it triggers. Each iteration picks the stage
the cancel aims at (job queued, placement just sent, CAS in flight, handoff in flight, job running)
and lands it there with a random jitter. Whoever runs the race says when a job reaches each stage
(``Milestones``), where the race's own placements go (``Race.place_on``) and how often the peers
received a job (``Peers.delivery``).

Violations (``judge``, all must be 0): a delivery after a cancel that reported it won (Update or
store), a second delivery, a delivery without a won CAS, a job killed at home but left running on
its peer, a job not terminal in time, a store handle that disagrees with the job's final state,
and more than ``MAX_MISSED_STAGES`` of the iterations missing the stage their cancel aimed at.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Generic, Protocol, TypeVar

from stack import Stack
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError

from iris.client import build_spec, execute_update
from iris.contract import JOB_WORKFLOW
from iris.jobs import CancelOutcome, CancelRequest, JobState, JobStatus
from iris.policy.models import Placement
from iris.store import FederationStore, HandleState
from iris.userauth import Action
from workflows.job import JobWorkflow

# Every job is this user's, its submission and cancels signed with its key.
RACER = "race@example.com"
METHODS = ("update", "signal", "temporal", "store")
# Where the cancel aims, and how often.
STAGES = ("queued", "placed", "promoting", "launching", "running")
STAGE_WEIGHTS = (2, 2, 3, 2, 1)
# The share of iterations whose cancel may land elsewhere because its stage never came in time.
MAX_MISSED_STAGES = 0.02


class Milestones:
    """Per-job events, set as each job reaches a stage, so a cancel can aim at that stage."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def event(self, job_id: str, stage: str) -> asyncio.Event:
        return self._events.setdefault((job_id, stage), asyncio.Event())

    def reach(self, job_id: str, stage: str) -> None:
        self.event(job_id, stage).set()


class Peers(Protocol):
    async def delivery(self, job_id: str) -> tuple[int, bool]:
        """How many times the job was delivered to a peer, and whether a peer terminated it."""
        ...


P = TypeVar("P", bound=Peers)


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
    # The stage never came in time (the job's promotion was refused and it waited in the queue
    # behind newer race placements, say): the cancel landed wherever the job was instead.
    missed_stage: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def cancel_won(self) -> bool:
        """The canceller was told it won: the Update's answer, or the store's."""
        return bool((self.update is not None and self.update.won) or self.store_won)

    def who_won(self) -> str:
        if self.cancelled_run:
            return "run CANCELED (a violation)"
        if self.deliveries == 0:
            return "cancel won" if self.assigned_peer is None else "CAS won, cancelled before handoff"
        if self.final is not None and self.final.state is JobState.KILLED:
            return "delivered, terminated"
        return "delivered, cancel too late"


@dataclass
class Race(Generic[P]):
    stack: Stack
    store: FederationStore
    peer: P
    milestones: Milestones
    task_queue: str
    rng: random.Random
    # Where the race's own `place` signals send a job.
    place_on: Callable[[str], Placement]
    command: list[str] = field(default_factory=lambda: ["true"])
    gpu_count: int = 8
    # A cancel lands up to this long after its stage is reached.
    jitter_s: float = 0.012
    # How long a cancel waits for its stage, and the race for the job's end.
    stage_timeout_s: float = 30.0
    end_timeout_s: float = 60.0
    started: list[str] = field(default_factory=list)

    async def start(self, job_id: str) -> WorkflowHandle[JobWorkflow, JobStatus]:
        self.started.append(job_id)
        spec = build_spec(
            self.command, name=job_id.split("/")[1], user=RACER, device_type="h100", gpu_count=self.gpu_count
        )
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
        placement = self.place_on(job_id)
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
            async with asyncio.timeout(self.stage_timeout_s):
                await self.milestones.event(o.job_id, o.stage).wait()
        except TimeoutError:
            # Not a violation by itself: the cancel still races whatever the job is doing now,
            # and every invariant is judged as for any other iteration. RaceRun bounds how many
            # iterations may miss their stage, so a race that never hits its stages still fails.
            o.missed_stage = True
        await asyncio.sleep(self.rng.uniform(0, self.jitter_s))  # not a wait: the race's random jitter
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
                if o.store_won:
                    # Nothing but an offer takes the intent to a workflow whose job waits in the
                    # queue (its last CAS found no capacity, say), and the tick offers only queued
                    # handles: as a tick that read the queue just before, offer it again. That
                    # `place` must be answered CANCELLED (docs/DESIGN.md, "Cancellation").
                    await self.place(handle, o.job_id)
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
            async with asyncio.timeout(self.stage_timeout_s):
                await self.milestones.event(job_id, "queued").wait()
            await asyncio.sleep(self.rng.uniform(0, 0.01))  # not a wait: the race's random jitter
            await self.place(handle, job_id)
        except TimeoutError:
            pass  # cancelled before it was ever queued
        await canceller
        try:
            async with asyncio.timeout(self.end_timeout_s):
                o.final = await handle.result()
        except TimeoutError:
            o.problems.append(f"not terminal within {self.end_timeout_s:.0f} s")
        except WorkflowFailureError:
            o.cancelled_run = True
        stored = await asyncio.to_thread(self.store.get, job_id)
        o.deliveries, o.terminated = await self.peer.delivery(job_id)
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


@dataclass
class RaceRun:
    outcomes: list[Outcome]
    elapsed_s: float
    parallel: int

    @property
    def wins(self) -> Counter[tuple[str, str]]:
        return Counter((o.method, o.who_won()) for o in self.outcomes)

    @property
    def missed_stages(self) -> list[str]:
        return [f"{o.job_id} ({o.method} at {o.stage})" for o in self.outcomes if o.missed_stage]

    @property
    def violations(self) -> list[str]:
        found = [f"{o.job_id} ({o.method} at {o.stage}): {p}" for o in self.outcomes for p in o.problems]
        if len(self.missed_stages) > MAX_MISSED_STAGES * len(self.outcomes):
            found.append(
                f"{len(self.missed_stages)} of {len(self.outcomes)} iterations never reached the stage"
                f" their cancel aimed at (at most {MAX_MISSED_STAGES:.0%}): {self.missed_stages[:5]}"
            )
        return found

    def summary(self) -> str:
        lines = [
            f"cancel vs promotion: {len(self.outcomes)} iterations in {self.elapsed_s:.0f}s,"
            f" {self.parallel} at a time"
        ]
        wins = self.wins
        for method in METHODS:
            row = {who: n for (m, who), n in sorted(wins.items()) if m == method}
            lines.append(f"  {method:<9} " + "  ".join(f"{who}: {n}" for who, n in row.items()))
        deliveries = sum(o.deliveries for o in self.outcomes)
        terminations = sum(o.terminated for o in self.outcomes)
        lines.append(
            f"  deliveries {deliveries}, terminations {terminations}, violations {len(self.violations)},"
            f" stages missed {len(self.missed_stages)}"
        )
        return "\n".join(lines)

    def was_a_race(self) -> bool:
        """Cancels won some of it and lost some of it."""
        whos = {who for _, who in self.wins}
        return "cancel won" in whos and bool({"delivered, terminated", "delivered, cancel too late"} & whos)


async def run_race(race: Race[P], iterations: int, parallel: int) -> RaceRun:
    """``iterations`` iterations, ``parallel`` at a time."""
    started = time.monotonic()
    gate = asyncio.Semaphore(parallel)

    async def bounded(i: int) -> Outcome:
        async with gate:
            return await race.iteration(i)

    # A task group: an iteration that raises stops the others (none is left running unseen).
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(bounded(i)) for i in range(iterations)]
    return RaceRun([t.result() for t in tasks], time.monotonic() - started, parallel)


async def forget(stack: Stack, workflow_ids: Sequence[str]) -> None:
    """Delete these executions: a thousand race runs would only slow the session's later list,
    replay and scan tests down."""
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

    await asyncio.gather(*(delete(job_id) for job_id in workflow_ids))
