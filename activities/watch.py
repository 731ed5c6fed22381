"""The per-cluster watcher (docs/DESIGN.md, "Mirroring"): one long poll of a cluster's change feed
tells every job running there what changed, instead of one poller per running job.

``watch_peer`` starts with a listing of every job there, page by page, and signals each one that is
running or ended recently (so a change the feed did not bring, or a run that never came, costs at
most one run's length), except a job this worker process has already told that very record (its
feed epoch and version): a signal the server accepted is in the job's history, and sending it again
only wakes the job (10,000 running jobs: 10,000 wakes every run, each a replay once the worker's
cache is full). It then long-polls ``GET /v1/changes`` and signals each changed job's workflow
(``observe``) with the job's new status. A cursor the cluster cannot answer (it restarted,
or the cursor is too old) is a resync: the listing again. A cluster that stops answering for
``silent_report_s`` has each job running there told so once: an observation without a status,
sent to the jobs a visibility query on ``IrisPeer`` and ``IrisState`` finds, so a watcher that
restarts during the outage still finds them. Those jobs then follow their attempt themselves and
judge a lost cluster as before, counting the silence from when the watcher first saw it.

The workflow that runs this activity is ``workflows/watch.py``; the activity's heartbeat carries
the cursor, so a retried run goes on where the last one stopped.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.common import MetricMeter
from temporalio.service import RPCError, RPCStatusCode

from activities.peers import controller_client
from iris import contract, metrics
from iris.config import FederationConfig
from iris.controller.client import ControllerClient
from iris.controller.errors import ControllerError
from iris.controller.models import ChangeList, ControllerJobState
from iris.controller.models import JobStatus as ControllerJobStatus
from iris.jobs import JobState

# Signals in flight at once (each is one RPC to the Temporal frontend).
_SIGNAL_CONCURRENCY = 32
# The job states in which an attempt is on its cluster (a silence notice goes to these).
_ON_CLUSTER = (JobState.HANDED_OFF, JobState.PENDING, JobState.RUNNING)


class Observation(BaseModel):
    """What the watcher of ``cluster`` saw of a job there: its status now, or (``status`` None)
    that the cluster has not answered since ``silent_since_ms``."""

    cluster: str
    status: ControllerJobStatus | None = None
    silent_since_ms: int | None = None
    error: str | None = None


class WatchInput(BaseModel):
    cluster: str
    # Where the last run stopped (None: start with a listing).
    cursor: str | None = None
    # Return after this long, so the watcher's workflow records its progress.
    run_for_s: float = 1800.0
    # How long one long poll waits for a change.
    wait_s: float = 20.0
    # A cluster silent this long has its running jobs told so (they judge whether it is lost).
    silent_report_s: float = 3.0
    # On a resync, jobs that ended within this long are signalled too, unless already told (older
    # ones have long been mirrored, or their safety poll finds them); at the listing that starts a
    # run, within twice ``run_for_s`` (the run before this one saw the rest).
    recent_s: float = 3600.0
    # After a reply with changes, wait this long before the next poll: changes arriving together
    # share one request (a few requests per second at most, whatever the number of jobs).
    coalesce_s: float = 0.25


class WatchOutcome(BaseModel):
    cursor: str | None
    signalled: int = 0
    resyncs: int = 0
    # Jobs a listing left alone: this process had told them that record already.
    skipped: int = 0


def change_time_ms(status: ControllerJobStatus) -> int | None:
    """When the job's current state began on its cluster, by the cluster's clock: finished, started
    or created (None when the record does not say)."""
    if status.terminal:
        return status.finished_ms
    if status.state is ControllerJobState.RUNNING:
        return status.started_ms
    if status.state is ControllerJobState.PENDING:
        return status.created_ms
    return None


class MirrorLag:
    """``iris_mirror_propagation_lag_seconds`` of one cluster (docs/DESIGN.md, "Metrics"): for each
    change the feed brings, from when the job's new state began on the cluster to the signal that
    tells its workflow. A record the feed brings again without a new state (a task's change) is not
    a new change; listings only say what each job's state already was."""

    def __init__(self, meter: MetricMeter, cluster: str) -> None:
        self._histogram = meter.create_histogram_float(
            metrics.MIRROR_LAG, "From a job's change on its cluster to its workflow's signal", "s"
        )
        self._labels = {"peer": cluster}
        # Job id -> (state, when it began) last seen, from the listings and the feed.
        self._seen: dict[str, tuple[str, int | None]] = {}

    def known(self, statuses: list[ControllerJobStatus]) -> None:
        for status in statuses:
            self._seen[status.job_id] = (status.state.value, change_time_ms(status))

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            self._seen.pop(job_id, None)

    def changed_at(self, status: ControllerJobStatus) -> int | None:
        """When this change happened, if it is a new one; notes it as seen either way."""
        now = (status.state.value, change_time_ms(status))
        before = self._seen.get(status.job_id)
        self._seen[status.job_id] = now
        return now[1] if now != before else None

    def record(self, changed_at_ms: int) -> None:
        self._histogram.record(max(0.0, time.time() - changed_at_ms / 1000), self._labels)


# A record as a job was told it: its feed epoch and version (with its attempt and state, in case a
# controller numbers badly). None for a controller without a feed: always told again.
Told = tuple[str, int, str, str]


def told_key(status: ControllerJobStatus) -> Told | None:
    if not status.epoch:
        return None
    return status.epoch, status.version, status.nonce, status.state.value


class _Watch:
    """One run of the watcher: the cursor, the counts, and what this worker process has told each
    job of the cluster (``told``, kept across runs by ``WatchActivities``)."""

    def __init__(
        self, inp: WatchInput, cursor: str | None, lag: MirrorLag, told: dict[str, Told] | None = None
    ) -> None:
        self.inp = inp
        self.cursor = cursor
        self.signalled = 0
        self.skipped = 0
        self.resyncs = 0
        self.lag = lag
        self.told: dict[str, Told] = {} if told is None else told
        self._gate = asyncio.Semaphore(_SIGNAL_CONCURRENCY)

    async def tell(self, job_id: str, seen: Observation, changed_at_ms: int | None = None) -> None:
        """Signal the job's workflow; a job without one (closed, or never ours) is skipped. With
        ``changed_at_ms`` (a change from the feed), its propagation lag is recorded once told."""
        handle: WorkflowHandle[object, object] = activity.client().get_workflow_handle(
            contract.job_workflow_id(job_id)
        )
        key = told_key(seen.status) if seen.status is not None else None
        async with self._gate:
            try:
                await handle.signal(contract.OBSERVE, seen)
            except RPCError as exc:
                if exc.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
                    raise
                return
        # Accepted: the record is in the job's history. (A silence notice tells nothing of it.)
        if key is not None:
            self.told[job_id] = key
        self.signalled += 1
        if changed_at_ms is not None:
            self.lag.record(changed_at_ms)

    async def tell_all(self, statuses: list[ControllerJobStatus]) -> None:
        cluster = self.inp.cluster
        await asyncio.gather(*(self.tell(s.job_id, Observation(cluster=cluster, status=s)) for s in statuses))

    async def tell_changes(self, seen: ChangeList) -> None:
        """Tell each job the feed says changed; the new changes' lag is recorded."""
        self.lag.forget(seen.removed)
        for job_id in seen.removed:
            self.told.pop(job_id, None)
        cluster = self.inp.cluster
        told = [(s, self.lag.changed_at(s)) for s in seen.jobs]
        await asyncio.gather(
            *(self.tell(s.job_id, Observation(cluster=cluster, status=s), at) for s, at in told)
        )

    def untold(self, status: ControllerJobStatus) -> bool:
        """Whether ``status`` is news to its job: not the very record this process last told it."""
        key = told_key(status)
        return key is None or self.told.get(status.job_id) != key

    async def resync(self, client: ControllerClient, recent_s: float) -> None:
        """List every job (page by page) and tell each running one, or one that ended within
        ``recent_s``, unless it was told that record already; the feed goes on from the cursor read
        before the listing. What the cluster no longer lists is forgotten."""
        self.resyncs += 1
        page = await client.jobs_page(0)
        cursor = page.cursor
        recent_ms = int((time.time() - recent_s) * 1000)
        listed: set[str] = set()
        while True:
            self.lag.known(page.jobs)
            listed.update(s.job_id for s in page.jobs)
            wanted = [s for s in page.jobs if not s.terminal or (s.finished_ms or 0) >= recent_ms]
            news = [s for s in wanted if self.untold(s)]
            self.skipped += len(wanted) - len(news)
            await self.tell_all(news)
            activity.heartbeat(self.cursor)
            if page.next_after is None:
                break
            page = await client.jobs_page(page.next_after)
        for job_id in self.told.keys() - listed:
            del self.told[job_id]
        self.cursor = cursor

    async def tell_silent(self, since_ms: int, error: str) -> int:
        """Tell every job running on the cluster, as visibility has them, that it is silent."""
        states = ", ".join(f"'{s.value}'" for s in _ON_CLUSTER)
        query = (
            f"WorkflowType = '{contract.JOB_WORKFLOW}' AND ExecutionStatus = 'Running'"
            f" AND {contract.SA_PEER.name} = '{self.inp.cluster}' AND {contract.SA_STATE.name} IN ({states})"
        )
        notice = Observation(cluster=self.inp.cluster, silent_since_ms=since_ms, error=error)
        told: list[asyncio.Task[None]] = []
        async for wf in activity.client().list_workflows(query):
            told.append(asyncio.create_task(self.tell(wf.id, notice)))
        await asyncio.gather(*told)
        return len(told)


class WatchActivities:
    def __init__(self, config: FederationConfig, *, request_timeout_s: float = 10.0) -> None:
        self._config = config
        self._timeout = request_timeout_s
        # Per watcher (its workflow id): the record each job of its cluster was last told, kept
        # across the watcher's runs in this process. A new process starts empty, so its first
        # listing tells every job again.
        self._told: dict[str, dict[str, Told]] = {}

    @activity.defn(name=contract.WATCH_PEER)
    async def watch_peer(self, inp: WatchInput) -> WatchOutcome:
        """Follow ``inp.cluster``'s change feed for ``run_for_s``, signalling each changed job;
        returns the cursor to continue from. Outages are ridden out here, heartbeating."""
        details = activity.info().heartbeat_details
        cursor = inp.cursor
        if details:
            cursor = str(details[0]) if details[0] is not None else None
        memory = self._told.setdefault(activity.info().workflow_id or inp.cluster, {})
        watch = _Watch(inp, cursor, MirrorLag(activity.metric_meter(), inp.cluster), memory)
        deadline = time.monotonic() + inp.run_for_s
        # When the cluster was first seen silent (wall clock, ms), and whether its jobs were told.
        silent_since: int | None = None
        told_silent = False
        listed = False
        async with controller_client(self._config, inp.cluster, self._timeout) as client:
            while time.monotonic() < deadline:
                try:
                    if not listed:
                        # The feed goes on from a carried cursor (nothing after it is skipped;
                        # what the listing sent again is dropped by the jobs as already seen).
                        carried = watch.cursor
                        await watch.resync(client, inp.recent_s if carried is None else 2 * inp.run_for_s)
                        watch.cursor = carried or watch.cursor
                        listed = True
                    seen = await client.changes(watch.cursor, wait_s=inp.wait_s)
                    if seen.resync:
                        await watch.resync(client, inp.recent_s)
                        continue
                    await watch.tell_changes(seen)
                    watch.cursor = seen.cursor
                    if seen.jobs and not seen.more:
                        await asyncio.sleep(inp.coalesce_s)
                except ControllerError as exc:
                    if not exc.retryable:
                        raise
                    now_ms = int(time.time() * 1000)
                    silent_since = now_ms if silent_since is None else silent_since
                    activity.heartbeat(watch.cursor)
                    if not told_silent and now_ms - silent_since >= inp.silent_report_s * 1000:
                        told_silent = True
                        told = await watch.tell_silent(silent_since, exc.message)
                        activity.logger.info(
                            "%s silent since %d: %d job(s) told", inp.cluster, silent_since, told
                        )
                    await asyncio.sleep(1.0)
                    continue
                silent_since = None
                told_silent = False
                activity.heartbeat(watch.cursor)
        return WatchOutcome(
            cursor=watch.cursor, signalled=watch.signalled, resyncs=watch.resyncs, skipped=watch.skipped
        )
