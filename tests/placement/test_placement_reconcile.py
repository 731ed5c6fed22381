"""The tick ends the handles of jobs whose workflow closed without ending them (docs/DESIGN.md,
"The tick"): promoted or handed-off handles found by listing closed job workflows (``_reconcile``),
queued ones by the NOT_FOUND answer to their signal. Against a real Temporal dev server."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from placement_harness import (
    GPU_BACKEND,
    PEER,
    Jobs,
    eventually,
    gpu_backend,
    gpu_job,
    in_activity,
    new_job_id,
    reachable,
    tick_activities,
    view,
)
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

import activities.placement as placement_module
from activities.placement import ABANDONED, ABANDONING_STATUSES, TickInput
from iris import contract
from iris.config import FederationConfig
from iris.policy.models import Placement
from iris.reports import FederationView
from iris.store import FederationStore, HandleState

EPOCH = 1_000


def _promoted(store: FederationStore, job_id: str, state: HandleState = HandleState.PENDING_HANDOFF) -> None:
    """``job_id`` promoted to cw-a with 8 h100 reserved (then moved on to ``state``)."""
    store.enqueue(gpu_job(job_id))
    placement = Placement(
        job_id=job_id,
        peer_id=PEER,
        backend_id=GPU_BACKEND,
        observation_epoch_ms=EPOCH,
        reserved={"h100": 8},
        verified=True,
    )
    assert store.promote(job_id, "inc-1", placement, int(time.time() * 1000)).promoted
    if state is not HandleState.PENDING_HANDOFF:
        assert store.set_state(job_id, "inc-1", state) is not None


def _reserved(store: FederationStore) -> set[str]:
    return {r.job_id for r in store.reservations()}


def _state(store: FederationStore, job_id: str) -> HandleState:
    handle = store.get(job_id)
    assert handle is not None
    return handle.state


async def _listed_closed(client: Client, job_ids: list[str], timeout: float = 60.0) -> None:
    """Wait until visibility lists each job's workflow as closed by one of the abandoning statuses
    (the query ``_reconcile`` makes, narrowed to these ids)."""
    statuses = ", ".join(f"'{s}'" for s in ABANDONING_STATUSES)
    ids = ", ".join(f"'{contract.job_workflow_id(j)}'" for j in job_ids)
    query = (
        f"WorkflowType = '{contract.JOB_WORKFLOW}' AND ExecutionStatus IN ({statuses})"
        f" AND WorkflowId IN ({ids})"
    )
    expected = {contract.job_workflow_id(j) for j in job_ids}

    async def listed() -> set[str]:
        return {wf.id async for wf in client.list_workflows(query)}

    await eventually(
        listed, lambda found: found == expected, timeout=timeout, what=f"visibility to list {ids}"
    )


async def _reset_to_first_task(client: Client, job_id: str) -> str:
    """Reset the job's (closed) workflow to its first workflow task: a new run, RUNNING."""
    handle = client.get_workflow_handle(contract.job_workflow_id(job_id))
    history = await handle.fetch_history()
    first_task = next(
        e.event_id for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )
    desc = await handle.describe()
    resp = await client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=desc.run_id),
            reason="operator reset (test)",
            workflow_task_finish_event_id=first_task,
            request_id=str(uuid.uuid4()),
        )
    )
    return resp.run_id


async def test_reconcile_abandons_promoted_and_handed_off_jobs_whose_workflow_was_terminated(
    temporal: WorkflowEnvironment, jobs: Jobs, store: FederationStore, config: FederationConfig
) -> None:
    client = temporal.client
    store.save_reports([reachable(PEER, gpu_backend(32, epoch=EPOCH))])
    pending, handed, alive = new_job_id("pending"), new_job_id("handed"), new_job_id("alive")
    _promoted(store, pending)
    _promoted(store, handed, HandleState.HANDED_OFF)
    _promoted(store, alive)
    for job_id in (pending, handed, alive):
        await jobs.start(job_id)
    assert _reserved(store) == {pending, handed, alive}

    await jobs.handle(pending).terminate("from the Web UI")
    await jobs.handle(handed).terminate("from the Web UI")
    acts = tick_activities(config, store)
    abandoned = 0

    async def reconciled() -> bool:
        nonlocal abandoned
        abandoned += await in_activity(client, acts._reconcile)
        return _state(store, pending) is HandleState.KILLED and _state(store, handed) is HandleState.KILLED

    await eventually(reconciled, bool, timeout=60, what="the terminated jobs' handles to be abandoned")

    assert abandoned == 2
    for job_id in (pending, handed):
        ended = store.get(job_id)
        assert ended is not None and (ended.state, ended.reason) == (HandleState.KILLED, ABANDONED)
    # Their reservations are released; the running job keeps its handle and its reservation.
    assert _reserved(store) == {alive}
    assert _state(store, alive) is HandleState.PENDING_HANDOFF
    # Looking again changes nothing: the overlap lists them again, their handles are already ended.
    assert await in_activity(client, acts._reconcile) == 0
    await jobs.handle(alive).signal("finish")


async def test_reconcile_leaves_a_job_whose_reset_run_is_running(
    temporal: WorkflowEnvironment, jobs: Jobs, store: FederationStore, config: FederationConfig
) -> None:
    client = temporal.client
    store.save_reports([reachable(PEER, gpu_backend(32, epoch=EPOCH))])
    reset, control = new_job_id("reset"), new_job_id("control")
    for job_id in (reset, control):
        _promoted(store, job_id)
        await jobs.start(job_id)
        await jobs.handle(job_id).terminate("from the Web UI")
    run_id = await _reset_to_first_task(client, reset)
    desc = await jobs.handle(reset).describe()
    assert (desc.run_id, desc.status) == (run_id, WorkflowExecutionStatus.RUNNING)
    # Both terminated runs are listed as closed: the look below sees them both.
    await _listed_closed(client, [reset, control])

    assert await in_activity(client, tick_activities(config, store)._reconcile) == 1
    assert _state(store, control) is HandleState.KILLED
    # The reset run owns the handle now: still promoted, its reservation kept.
    kept = store.get(reset)
    assert kept is not None and kept.state is HandleState.PENDING_HANDOFF and kept.assigned_peer == PEER
    assert _reserved(store) == {reset}
    await jobs.handle(reset).signal("finish")


async def test_a_completed_job_workflow_is_never_abandoned(
    temporal: WorkflowEnvironment, jobs: Jobs, store: FederationStore, config: FederationConfig
) -> None:
    """A workflow that completed ended its job itself (or left it as it meant to): not listed."""
    client = temporal.client
    store.save_reports([reachable(PEER, gpu_backend(32, epoch=EPOCH))])
    done, control = new_job_id("done"), new_job_id("control")
    for job_id in (done, control):
        _promoted(store, job_id)
        await jobs.start(job_id)
    await jobs.handle(done).signal("finish")
    await jobs.handle(done).result()
    await jobs.handle(control).terminate("from the Web UI")
    await _listed_closed(client, [control])

    assert await in_activity(client, tick_activities(config, store)._reconcile) == 1
    assert _state(store, control) is HandleState.KILLED
    assert _state(store, done) is HandleState.PENDING_HANDOFF


async def test_the_ticks_signal_abandons_a_queued_job_whose_workflow_is_gone(
    temporal: WorkflowEnvironment,
    jobs: Jobs,
    store: FederationStore,
    config: FederationConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = temporal.client
    # cw-a has 8 free h100: the 8-GPU job is offered a place, the 16-GPU ones wait (explain).
    terminated, never_started, fits, alive = (
        new_job_id("terminated"),
        new_job_id("never-started"),
        new_job_id("fits"),
        new_job_id("alive"),
    )
    store.enqueue(gpu_job(terminated, gpus=16))
    store.enqueue(gpu_job(never_started, gpus=16))
    store.enqueue(gpu_job(fits, gpus=8))
    store.enqueue(gpu_job(alive, gpus=16))
    await jobs.start(terminated)
    await jobs.start(alive)
    await jobs.handle(terminated).terminate("from the Web UI")

    async def federation(_config: Any, **_: Any) -> FederationView:
        return view(reachable(PEER, gpu_backend(8, epoch=EPOCH)))

    monkeypatch.setattr(placement_module, "gather_reports", federation)
    acts = tick_activities(config, store)

    async def no_reconcile() -> int:
        return 0

    # Only the signals' answers may end handles in this tick.
    monkeypatch.setattr(acts, "_reconcile", no_reconcile)
    outcome = await in_activity(client, acts._tick, TickInput())

    assert outcome.placed == [fits]
    assert outcome.explained == 3
    for job_id in (terminated, never_started, fits):
        ended = store.get(job_id)
        assert ended is not None and (ended.state, ended.reason) == (HandleState.KILLED, ABANDONED), job_id
    assert outcome.abandoned == 3
    assert [h.job_id for h in store.queued()] == [alive]
    explained = await jobs.handle(alive).query("explained")
    assert len(explained) == 1 and "full on cw-a" in explained[0]
    # The next tick has nothing left to signal to the gone jobs.
    again = await in_activity(client, acts._tick, TickInput())
    assert again.queued == 1 and again.explained == 0 and again.abandoned == 0
    await jobs.handle(alive).signal("finish")


async def test_reconcile_checks_each_closed_run_once_and_a_bounded_number_per_look(
    temporal: WorkflowEnvironment,
    jobs: Jobs,
    store: FederationStore,
    config: FederationConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thousands of jobs terminated at once must not hold up the tick: a look checks at most
    RECONCILE_PER_LOOK live jobs' runs, the next looks go on with the rest, and a run already
    checked (listed again by the overlap) or whose handle has ended costs no describe."""
    client = temporal.client
    monkeypatch.setattr(placement_module, "RECONCILE_PER_LOOK", 2)
    store.save_reports([reachable(PEER, gpu_backend(64, epoch=EPOCH))])
    live = [new_job_id(f"mass-{i}") for i in range(5)]
    ended = new_job_id("ended")
    for job_id in live:
        _promoted(store, job_id)
    store.enqueue(gpu_job(ended))
    assert store.set_state(ended, "inc-1", HandleState.FAILED, "ended by its workflow") is not None
    for job_id in [*live, ended]:
        await jobs.start(job_id)
        await jobs.handle(job_id).terminate("mass termination")
    await _listed_closed(client, [*live, ended])

    acts = tick_activities(config, store)
    described: list[str] = []
    runs = acts._runs

    async def counting_runs(job_id: str) -> bool:
        described.append(job_id)
        return await runs(job_id)

    monkeypatch.setattr(acts, "_runs", counting_runs)
    per_look = [await in_activity(client, acts._reconcile) for _ in range(4)]
    assert per_look == [2, 2, 1, 0]
    assert sorted(described) == sorted(live)  # each live job's run once; the ended job's never
    assert all(_state(store, j) is HandleState.KILLED for j in live)
    assert _reserved(store) == set()
    ended_handle = store.get(ended)
    assert ended_handle is not None and ended_handle.state is HandleState.FAILED
