"""Activities over the federation store: enqueue, the promotion CAS, cancel intent, expiry, state.

Each is one store transaction run in a thread (the store is synchronous SQLAlchemy); the rules
live in the store (the CAS) and the policy (capacity), not here.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel
from temporalio import activity
from temporalio.exceptions import ApplicationError

from iris import contract
from iris.policy.models import JobShape, Placement
from iris.store.errors import StoreConflict
from iris.store.models import CancelResult, HandleState, JobHandle, PromoteResult

if TYPE_CHECKING:
    from iris.store import FederationStore


class EnqueueInput(BaseModel):
    shape: JobShape
    incarnation: str


class PromoteInput(BaseModel):
    job_id: str
    incarnation: str
    placement: Placement
    # A parked job's replay in place taking its released capacity again (FederationStore.promote).
    retake: bool = False


class CancelIntentInput(BaseModel):
    job_id: str
    reason: str


class ExpireInput(BaseModel):
    job_id: str
    incarnation: str


class HandleStateInput(BaseModel):
    job_id: str
    incarnation: str
    state: HandleState
    reason: str | None = None
    # HANDED_OFF: the cluster's clock when it accepted the job (its JobStatus.created_ms).
    counted_from_ms: int | None = None
    # HANDOFF_FAILED: the job is known not to run on its cluster; its reservation is deleted.
    release: bool = False


class FenceInput(BaseModel):
    job_id: str
    nonce: str
    cluster: str


class StoreActivities:
    def __init__(self, store: FederationStore, task_queue: str, *, wake_debounce_s: float = 0.05) -> None:
        self._store = store
        self._manager_id = contract.manager_workflow_id(task_queue)
        self._debounce = wake_debounce_s
        self._last_wake = 0.0

    async def _wake_manager(self) -> None:
        # Many submissions in a burst need one wake-up, not one signal each.
        now = time.monotonic()
        if now - self._last_wake < self._debounce:
            return
        self._last_wake = now
        try:
            await activity.client().get_workflow_handle(self._manager_id).signal(contract.WAKE)
        except Exception as exc:  # the periodic tick still finds the job; waking is an optimisation
            activity.logger.warning("could not wake the placement manager: %s", exc)

    @activity.defn(name=contract.ENQUEUE_JOB)
    async def enqueue_job(self, inp: EnqueueInput) -> JobHandle:
        """Put the job's handle in the federation queue (idempotent) and wake the placement tick."""
        handle = JobHandle(
            job_id=inp.shape.job_id,
            incarnation=inp.incarnation,
            state=HandleState.QUEUED_HANDOFF,
            shape=inp.shape,
            band=inp.shape.band,
            submit_ms=inp.shape.submit_ms,
            deadline_ms=inp.shape.deadline_ms,
            updated_ms=int(time.time() * 1000),
        )
        stored = await asyncio.to_thread(self._store.enqueue, handle)
        await self._wake_manager()
        return stored

    @activity.defn(name=contract.PROMOTE_JOB)
    async def promote_job(self, inp: PromoteInput) -> PromoteResult:
        """The compare-and-swap (docs/DESIGN.md, "Promotion (the CAS)"), in one store transaction."""
        return await asyncio.to_thread(
            functools.partial(
                self._store.promote,
                inp.job_id,
                inp.incarnation,
                inp.placement,
                int(time.time() * 1000),
                retake=inp.retake,
            )
        )

    @activity.defn(name=contract.RECORD_CANCEL)
    async def record_cancel(self, inp: CancelIntentInput) -> CancelResult:
        """Record the cancel intent; whichever of cancel and promotion commits first wins."""
        return await asyncio.to_thread(self._store.record_cancel, inp.job_id, inp.reason)

    @activity.defn(name=contract.EXPIRE_JOB)
    async def expire_job(self, inp: ExpireInput) -> bool:
        return await asyncio.to_thread(
            self._store.expire, inp.job_id, inp.incarnation, int(time.time() * 1000)
        )

    @activity.defn(name=contract.REQUEUE_JOB)
    async def requeue_job(self, inp: ExpireInput) -> bool:
        """Operator replay: a parked handle goes back to the queue, its reservation released."""
        requeued = await asyncio.to_thread(self._store.requeue, inp.job_id, inp.incarnation)
        await self._wake_manager()
        return requeued

    @activity.defn(name=contract.SET_HANDLE_STATE)
    async def set_handle_state(self, inp: HandleStateInput) -> None:
        try:
            await asyncio.to_thread(
                functools.partial(
                    self._store.set_state,
                    inp.job_id,
                    inp.incarnation,
                    inp.state,
                    inp.reason,
                    counted_from_ms=inp.counted_from_ms,
                    release=inp.release,
                )
            )
        except StoreConflict as exc:  # a refused transition is an answer, not an outage: never retried
            raise ApplicationError(str(exc), type=contract.STORE_CONFLICT, non_retryable=True) from None

    @activity.defn(name=contract.RECORD_FENCE)
    async def record_fence(self, inp: FenceInput) -> None:
        """Remember an attempt a silent cluster may still run: the tick terminates it there later."""
        await asyncio.to_thread(self._store.add_fence, inp.job_id, inp.nonce, inp.cluster)
