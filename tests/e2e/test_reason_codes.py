"""Each reason code of issue 18 produced on the real stack, and found by a visibility filter on
``IrisReason`` (docs/DESIGN.md, "Reason codes"; acceptance 3).

The session stack: real Temporal dev server, controllers behind fault proxies, the worker. The
codes of a wait that lasts (NoCapacity, PinnedPeerFull, PeerUnreachable, ArtifactMissing) and of an
end (ShapeMismatch, DeadlinePassed, HandoffRefused) come from the running placement manager and the
job workflows. ``Priority`` and ``PeerStale`` last one tick by nature (the next tick sees the
capacity taken, or a fresh report): for those the manager is paused and the test runs the tick
itself, the production activity against the same store, controllers and job workflows, so that
nothing changes the code before the filter has looked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from stack import WAITS, Stack, wait_until
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment

from activities.placement import PlacementActivities, TickInput, TickOutcome
from iris import contract
from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.jobs import JobSpec, JobState, JobStatus, start_search_attributes
from iris.policy.models import DeviceRequest
from iris.policy.reasons import ReasonCode
from iris.userauth import Action
from worker.main import ensure_manager

RNO = "cw-rno2a"  # 8 × H100
H100 = {"device_type": "h100", "gpu_count": 8}


async def listed(stack: Stack, job_id: str, code: ReasonCode, *, within: float = 15.0) -> list[str]:
    """The job ids a visibility filter on ``IrisReason = code`` finds among this job's workflow."""
    query = f"WorkflowId = '{job_id}' AND IrisReason = '{code.value}'"
    deadline = time.monotonic() + within
    while True:
        ids = [w.id async for w in stack.client.list_workflows(query)]
        if ids or time.monotonic() > deadline:
            return ids
        await asyncio.sleep(0.2)


async def shows(stack: Stack, job_id: str, code: ReasonCode, *, within: float = 60.0) -> JobStatus:
    """Wait until the job's status shows ``code``; then the visibility filter must find it."""
    deadline = time.monotonic() + within
    while True:
        st = await stack.iris.describe(job_id)
        if st.reason_code is code:
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{job_id} shows {st.reason_code} ({st.state.value}: {st.reason}), not {code}"
            )
        await asyncio.sleep(0.2)
    assert await listed(stack, job_id, code) == [job_id], (
        f"IrisReason = '{code.value}' does not find {job_id}"
    )
    return st


async def cancel_all(stack: Stack, *job_ids: str) -> None:
    for job_id in job_ids:
        if not (await stack.iris.describe(job_id)).terminal:
            await stack.iris.cancel(job_id)
    for job_id in job_ids:
        await wait_until(
            lambda j=job_id: _terminal(stack, j), timeout=60, what=f"{job_id} to end after its cancel"
        )


async def _terminal(stack: Stack, job_id: str) -> bool:
    return (await stack.iris.describe(job_id)).terminal


# ---- waits that last: the running placement manager ----------------------------------------------


async def test_no_capacity_anywhere(stack: Stack) -> None:
    # 2 × 8 chips on one backend: only cw-us-east-02a's 16 hold it, and one of them is held. The
    # first such job has them held for it (backfill: the holder's time limit says when its chip
    # comes back), so it is Reserved; the next has nowhere left to hold: NoCapacity.
    async with stack.holding():
        first = await stack.iris.submit(["true"], name="rc-reserved", **WAITS)
        await shows(stack, first, ReasonCode.Reserved)
        job_id = await stack.iris.submit(["true"], name="rc-no-capacity", **WAITS)
        try:
            st = await shows(stack, job_id, ReasonCode.NoCapacity)
            assert st.state is JobState.QUEUED_HANDOFF and "full on" in st.reason
            held = await stack.iris.describe(first)
            assert held.hold is not None and (held.hold.peer_id, held.hold.amount) == ("cw-us-east-02a", 16)
            assert held.reason.endswith("; 16 h100 held for it on cw-us-east-02a"), held.reason
            described = await stack.cli("job", "describe", first)
            assert "Reserved:       16 h100 on cw-us-east-02a/" in described.stdout, described.stdout
        finally:
            await cancel_all(stack, first, job_id)
    st = await stack.iris.describe(job_id)
    assert (st.state, st.reason_code) == (JobState.KILLED, ReasonCode.Cancelled)


async def test_pinned_peer_full(stack: Stack) -> None:
    async with stack.holding(RNO):  # one of its 8 H100s
        # The first has cw-rno2a's chips held for it (Reserved); the next, pinned there too, finds
        # them held already: PinnedPeerFull.
        first = await stack.iris.submit(["true"], name="rc-pinned-held", target_cluster=RNO, **H100)
        await shows(stack, first, ReasonCode.Reserved)
        job_id = await stack.iris.submit(["true"], name="rc-pinned-full", target_cluster=RNO, **H100)
        short = ""
        try:
            st = await shows(stack, job_id, ReasonCode.PinnedPeerFull)
            assert st.state is JobState.QUEUED_HANDOFF and f"full on {RNO}" in st.reason
            # A one-chip job whose --timeout ends long before the holder's time limit (its band's
            # default, hours): backfilled onto the held chips, ahead of the first.
            short = await stack.iris.submit(
                ["true"],
                name="rc-backfilled",
                target_cluster=RNO,
                device_type="h100",
                gpu_count=1,
                timeout_s=60,
            )
            assert (await stack.iris.wait(short, timeout_s=90)).state is JobState.SUCCEEDED
            described = await stack.cli("job", "describe", short)
            promoted = [line for line in described.stdout.splitlines() if "promoted to" in line]
            assert len(promoted) == 1 and promoted[0].endswith("[Backfilled]"), described.stdout
            assert f"ahead of {first} (backfill:" in promoted[0], promoted
        finally:
            await cancel_all(stack, *(j for j in (first, job_id, short) if j))


async def test_too_large_for_every_backend(stack: Stack) -> None:
    # 3 × 8 chips on one backend: no H100 backend of the federation is that large (issue 27).
    job_id = await stack.iris.submit(["true"], name="rc-too-large", replicas=3, **H100)
    st = await shows(stack, job_id, ReasonCode.TooLarge)
    assert st.state is JobState.REJECTED and "no backend can ever hold it" in st.reason


async def test_peer_unreachable(stack: Stack) -> None:
    proxy = stack.proxies[RNO]
    proxy.refuse()  # the peer's host goes away
    job_id = ""
    try:
        job_id = await stack.iris.submit(["true"], name="rc-unreachable", target_cluster=RNO, **H100)
        st = await shows(stack, job_id, ReasonCode.PeerUnreachable)
        assert st.state is JobState.QUEUED_HANDOFF and f"{RNO} unreachable" in st.reason
        await cancel_all(stack, job_id)
    finally:
        await proxy.heal()
        if job_id:
            await cancel_all(stack, job_id)


async def test_artifact_missing(stack: Stack) -> None:
    job_id = await stack.iris.submit(
        ["true"],
        name="rc-artifact",
        target_cluster=RNO,
        artifacts=[f"s3://{RNO}-artifacts/rc/never-uploaded.bin"],
    )
    try:
        st = await shows(stack, job_id, ReasonCode.ArtifactMissing)
        assert st.state is JobState.HANDOFF_FAILED and "missing" in st.reason
    finally:
        await cancel_all(stack, job_id)


# ---- ends ------------------------------------------------------------------------------------------


async def test_shape_mismatch(stack: Stack) -> None:
    # The SDK's precheck refuses a shape no backend has before anything starts, so the workflow is
    # started as a federation whose reports no longer match the configured shapes would see it.
    spec = JobSpec(
        job_id=f"tester/rc-shape-{int(time.time() * 1000)}",
        name="rc-shape",
        user="tester@example.com",
        command=["true"],
        device=DeviceRequest(type="tpu", variant="tpu-v9", count=4),
        submit_ms=int(time.time() * 1000),
    )
    spec = spec.model_copy(update={"signature": stack.iris.sign(Action.SUBMIT, spec.user, spec.job_id, spec)})
    await stack.client.start_workflow(
        contract.JOB_WORKFLOW,
        spec,
        id=spec.job_id,
        task_queue=stack.config.temporal.task_queue,
        search_attributes=start_search_attributes(spec),
    )
    st = await shows(stack, spec.job_id, ReasonCode.ShapeMismatch)
    assert st.state is JobState.REJECTED


async def test_deadline_passed(stack: Stack) -> None:
    async with stack.holding():
        job_id = await stack.iris.submit(["true"], name="rc-deadline", scheduling_timeout_s=2, **WAITS)
        st = await shows(stack, job_id, ReasonCode.DeadlinePassed)
    assert st.state is JobState.UNSCHEDULABLE


async def test_handoff_refused(stack: Stack) -> None:
    # Pinned to a peer without the shape: force-routed there, and the peer refuses it for good.
    job_id = await stack.iris.submit(
        ["true"], name="rc-refused", target_cluster=RNO, device_type="tpu-v9", gpu_count=4
    )
    st = await shows(stack, job_id, ReasonCode.HandoffRefused)
    assert st.state is JobState.HANDOFF_REJECTED


# ---- one-tick codes: the tick run by the test --------------------------------------------------------


@pytest.fixture
async def paused_manager(stack: Stack) -> AsyncIterator[None]:
    """The placement manager stopped for the test (its ticks are the test's), started again after.

    Stopped between two ticks: a tick the manager had begun would go on on the worker after the
    termination, concurrently with the test's. Its history says whether one was in flight (every
    activity it scheduled has closed, or not); if one was, the manager is started and stopped again.
    """
    handle = stack.client.get_workflow_handle(contract.manager_workflow_id(stack.config.temporal.task_queue))
    for _ in range(20):
        await handle.terminate(reason="tests/e2e/test_reason_codes.py runs the ticks itself")
        await wait_until(lambda: _closed(handle), timeout=30, what="the placement manager to stop")
        if not await _activities_in_flight(handle):
            break
        await ensure_manager(stack.client, stack.config)
    else:
        raise AssertionError("the placement manager was stopped during a tick 20 times in a row")
    try:
        yield
    finally:
        await ensure_manager(stack.client, stack.config)


async def _closed(handle: Any) -> bool:
    return (await handle.describe()).status is not WorkflowExecutionStatus.RUNNING


# How an activity's scheduling closes in a history, once its worker is done with it (a timeout
# closes it on the server while the worker may still run it: counted as in flight).
_ACTIVITY_DONE = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED: "activity_task_completed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED: "activity_task_failed_event_attributes",
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED: "activity_task_canceled_event_attributes",
}


async def _activities_in_flight(handle: Any) -> set[int]:
    """The scheduled-event ids of the activities the (closed) workflow left unfinished."""
    scheduled: set[int] = set()
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled.add(event.event_id)
        elif event.event_type in _ACTIVITY_DONE:
            scheduled.discard(getattr(event, _ACTIVITY_DONE[event.event_type]).scheduled_event_id)
    return scheduled


async def tick(stack: Stack, config: FederationConfig | None = None) -> TickOutcome:
    """One placement tick, the worker's own activity, with the stack's client and store."""
    acts = PlacementActivities(config or stack.config, stack.store)
    outcome: TickOutcome = await ActivityEnvironment(client=stack.client).run(
        acts.placement_tick, TickInput()
    )
    return outcome


async def rno_free(stack: Stack) -> int:
    async with ControllerClient.for_cluster(stack.config, RNO) as ctl:
        resp = await ctl.backends()
    return sum((b.availability.amounts.get("h100", 0) if b.availability else 0) for b in resp.backends)


async def queued(stack: Stack, job_id: str) -> None:
    await wait_until(
        lambda: _state_is(stack, job_id, JobState.QUEUED_HANDOFF), timeout=60, what=f"{job_id} to queue"
    )


async def _state_is(stack: Stack, job_id: str, state: JobState) -> bool:
    return (await stack.iris.describe(job_id)).state is state


async def test_priority_and_peer_stale(stack: Stack, paused_manager: None) -> None:
    await wait_until(lambda: _rno_idle(stack), timeout=120, what=f"{RNO}'s 8 chips to be free")

    # Priority: three jobs each fit cw-rno2a's 8 free chips alone; the oldest takes them this
    # tick, the next has them held for it (Reserved: the oldest's time limit says when they come
    # back), the third finds them taken and held: Priority.
    ahead = await stack.iris.submit(["sleep", "60"], name="rc-ahead", target_cluster=RNO, **H100)
    held = await stack.iris.submit(["true"], name="rc-held", target_cluster=RNO, **H100)
    behind = await stack.iris.submit(["true"], name="rc-behind", target_cluster=RNO, **H100)
    stale_one = ""
    try:
        for job in (ahead, held, behind):
            await queued(stack, job)
        assert (await stack.iris.describe(behind)).reason_code is ReasonCode.Pending
        outcome = await tick(stack)
        assert ahead in outcome.placed and behind not in outcome.placed, outcome
        await shows(stack, held, ReasonCode.Reserved, within=30)
        st = await shows(stack, behind, ReasonCode.Priority, within=30)
        assert st.state is JobState.QUEUED_HANDOFF and f"full on {RNO}" in st.reason
        await cancel_all(stack, ahead, held, behind)

        # PeerStale: home answers the tick's poll 2.5 s late, so cw-rno2a's answer, in hand since
        # the poll began, is older than a staleness bound of 1 s when the tick decides.
        stale_one = await stack.iris.submit(["true"], name="rc-stale", target_cluster=RNO, **H100)
        await queued(stack, stale_one)
        home = stack.proxies[stack.config.home]
        home.delays["GET /v1/backends"] = 2.5
        try:
            strict = stack.config.model_copy(update={"stale_after_ms": 1_000})
            outcome = await tick(stack, strict)
        finally:
            home.delays.clear()
        assert stale_one not in outcome.placed, outcome
        st = await shows(stack, stale_one, ReasonCode.PeerStale, within=30)
        assert st.state is JobState.QUEUED_HANDOFF and f"stale report from {RNO}" in st.reason
    finally:
        await cancel_all(stack, *(j for j in (ahead, held, behind, stale_one) if j))


async def _rno_idle(stack: Stack) -> bool:
    return await rno_free(stack) >= 8
