"""Activities that talk to cluster controllers: capacity reports, handoff, mirroring, terminate.

Thin adapters: each does one kind of I/O through the typed controller client and returns plain
models; decisions stay in the policy package and the workflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from enum import StrEnum

from pydantic import BaseModel
from temporalio import activity
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError

from iris import contract, metrics
from iris.bundle import BundleError, BundleRef, fetch_from_home
from iris.config import ConfigError, FederationConfig
from iris.controller.client import ClientPool, ControllerClient
from iris.controller.errors import ControllerError, NotFound
from iris.controller.models import ErrorCode, LaunchRequest
from iris.controller.models import JobStatus as ControllerJobStatus
from iris.logrelay import LogRelay
from iris.objectstore import StoreError, StoreUnavailable, open_store
from iris.policy.fairshare import held_devices
from iris.policy.models import PeerReport
from iris.reports import FederationView, gather_reports
from iris.store import FederationStore


class LaunchInput(BaseModel):
    cluster: str
    request: LaunchRequest
    # A cluster that answers that it lacks the request's bundle: True, the activity stages it and
    # launches again (a run before LAUNCH_FIRST_PATCH, which staged first, or the launch after
    # staging); False, it fails BUNDLE_MISSING, and the workflow stages it (BUILDING).
    stage_missing: bool = True


class MirrorInput(BaseModel):
    cluster: str
    job_id: str
    known_state: str | None = None
    # Where the output goes in the home relay (default: the job id, the first attempt's).
    log_key: str | None = None
    poll_interval_s: float = 0.2
    log_interval_s: float = 1.0
    # Return even without a change after this long, so the workflow's loop stays responsive.
    max_wait_s: float = 600.0


class TerminateInput(BaseModel):
    cluster: str
    job_id: str
    # Only this attempt's run (a later attempt's is never touched); None: whatever run is current.
    nonce: str | None = None
    # Re-send the terminate until the cluster confirms the run has ended (or does not know it).
    confirm: bool = False
    resend_interval_s: float = 5.0


class FollowInput(BaseModel):
    cluster: str
    job_id: str
    # The attempt followed: a record of another attempt is not this one's (it is gone).
    nonce: str | None = None
    known_state: str | None = None
    # Where this attempt's output goes in the home relay (docs/DESIGN.md, "Logs").
    log_key: str
    poll_interval_s: float = 0.2
    log_interval_s: float = 1.0
    # Return even without a change after this long, so the workflow's loop stays responsive.
    max_wait_s: float = 600.0
    # Return after the cluster has not answered for this long: the workflow judges a lost peer.
    report_unreachable_s: float = 30.0


class FollowResult(BaseModel):
    """What following the attempt found: its new status, or that its cluster does not answer
    (``unreachable_s`` so far), or that the cluster no longer has this attempt (``gone``)."""

    status: ControllerJobStatus | None = None
    unreachable_s: float = 0.0
    error: str | None = None
    gone: bool = False


class FindInput(BaseModel):
    cluster: str
    job_id: str
    nonce: str


class AttemptFound(StrEnum):
    """Whether a cluster has an attempt, as it answers it (the source of truth for "did it start?")."""

    # The cluster runs (or ran) this attempt.
    HERE = "here"
    # The cluster answered, and has no run of this attempt.
    ABSENT = "absent"
    # The cluster did not answer.
    UNKNOWN = "unknown"


class FindResult(BaseModel):
    found: AttemptFound
    status: ControllerJobStatus | None = None
    error: str | None = None


class StageInput(BaseModel):
    cluster: str
    bundle: BundleRef


class StageResult(BaseModel):
    # False: the cluster already held the bundle, nothing was sent.
    uploaded: bool


def controller_client(config: FederationConfig, cluster: str, timeout_s: float) -> ControllerClient:
    """A client of ``cluster``'s controller, signed as the home cluster when it requires it
    (docs/DESIGN.md, "Identity tokens"); a non-retryable error for an unknown cluster or an unusable
    key."""
    try:
        return ControllerClient.for_cluster(config, cluster, timeout=timeout_s)
    except KeyError:
        raise ApplicationError(f"unknown cluster {cluster!r}", non_retryable=True) from None
    except ConfigError as exc:
        raise ApplicationError(f"cannot sign requests to {cluster}: {exc}", non_retryable=True) from None


def _last_contacts(view: FederationView, stored: list[PeerReport]) -> list[PeerReport]:
    """The view's reports, an unreachable cluster's with its last real contact (the store keeps it
    across ticks and workers), not "never": `iris peers` shows when a silent cluster was last heard."""
    last = {r.peer_id: r.last_contact_ms for r in stored if r.last_contact_ms is not None}
    return [
        r.model_copy(update={"last_contact_ms": last[r.peer_id]})
        if not r.reachable and r.last_contact_ms is None and r.peer_id in last
        else r
        for r in view.reports
    ]


def _beat(*details: object) -> None:
    """A heartbeat, unless this runs as a local activity (a reported end's confirmation, in the
    workflow's own task: it has no heartbeat to send)."""
    if not activity.info().is_local:
        activity.heartbeat(*details)


class PeerActivities:
    def __init__(
        self,
        config: FederationConfig,
        relay: LogRelay | None = None,
        *,
        store: FederationStore | None = None,
        request_timeout_s: float = 5.0,
        reports_reuse_s: float = 0.5,
    ) -> None:
        self._config = config
        self._relay = relay
        # The reservation ledger, read fresh for every view (the reports may be shared).
        self._store = store
        self._timeout = request_timeout_s
        self._reuse_s = reports_reuse_s
        self._view: tuple[float, FederationView] | None = None
        self._reading: asyncio.Task[FederationView] | None = None
        self._staging: dict[tuple[str, str], asyncio.Task[bool]] = {}
        # One client per cluster, its connections reused by every activity of this worker.
        self._clients = ClientPool(lambda cluster: controller_client(config, cluster, request_timeout_s))

    def _client(self, cluster: str) -> contextlib.AbstractAsyncContextManager[ControllerClient]:
        return self._clients.borrow(cluster)

    async def aclose(self) -> None:
        await self._clients.aclose()

    @activity.defn(name=contract.FETCH_REPORTS)
    async def fetch_reports(self) -> FederationView:
        """Poll every cluster's controller concurrently; an unreachable one is reported as such.

        A burst of submissions shares one read: callers arriving while a read is in flight wait
        for it, and a view read less than ``reports_reuse_s`` ago is answered as is (it carries
        its own ``fetched_ms``, which classification judges staleness by).
        """
        cached = self._view
        if cached is not None and time.monotonic() - cached[0] <= self._reuse_s:
            view = cached[1]
        else:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.create_task(self._read_reports())
            # Shielded: one caller's cancellation must not cancel the read the others wait on.
            view = await asyncio.shield(self._reading)
        if self._store is None:
            return view
        store = self._store
        # Home's reservations only: classification counts home's capacity net of the ledger and
        # nothing else's (iris/policy/classify.py), and each job's history keeps this view, so a
        # burst's charges on the peers would otherwise ride in every history (O(jobs) each).
        reservations, stored = await asyncio.to_thread(
            lambda: (store.reservations(peer_id=view.home), store.load_reports())
        )
        update: dict[str, object] = {"reservations": reservations, "reports": _last_contacts(view, stored)}
        quotas = self._config.quotas.policy()
        if quotas.any:
            # Only with a cap set: the devices each user holds, for classification's check.
            update["quotas"] = quotas
            update["held"] = held_devices(await asyncio.to_thread(store.in_use))
        return view.model_copy(update=update)

    async def _read_reports(self) -> FederationView:
        view = await gather_reports(self._config, timeout_s=self._timeout)
        self._view = (time.monotonic(), view)
        return view

    @activity.defn(name=contract.LAUNCH_JOB)
    async def launch_job(self, inp: LaunchInput) -> ControllerJobStatus:
        """Hand the job to a cluster's controller. Refusals are final; outages are retried.

        A cluster that answers that it does not hold the job's bundle did not take the job. With
        ``stage_missing`` (e.g. its store was lost since ``stage_bundle``) it gets the bundle, and
        the launch is repeated once; without, the answer is final (BUNDLE_MISSING): the workflow
        stages the bundle in its own step, so that the job shows BUILDING while it is sent.
        """
        bundle = inp.request.bundle
        outcome: str | None = None  # None: cancelled, no answer to count
        try:
            async with self._client(inp.cluster) as client:
                try:
                    status = await client.launch(inp.request)
                except NotFound:
                    if bundle is None:
                        raise
                    if not inp.stage_missing:
                        outcome = "bundle_missing"
                        raise ApplicationError(
                            f"{inp.cluster} does not hold workspace bundle {bundle.short}",
                            type=contract.BUNDLE_MISSING,
                            non_retryable=True,
                        ) from None
                    await self._stage(inp.cluster, bundle)
                    status = await client.launch(inp.request)
            outcome = "accepted"
            return status
        except ControllerError as exc:
            outcome = handoff_outcome(exc)
            raise _handoff_error(inp.cluster, "the job", exc) from None
        except Exception:
            outcome = outcome or "error"
            raise
        finally:
            if outcome is not None:
                count_handoff(activity.metric_meter(), inp.cluster, outcome)

    @activity.defn(name=contract.STAGE_BUNDLE)
    async def stage_bundle(self, inp: StageInput) -> StageResult:
        """Send the job's workspace bundle to the cluster that will run it, from the home store.

        Idempotent: a cluster that already holds the bundle (a retried or replayed handoff, or
        another job with the same workspace) is sent nothing. The cluster verifies the bytes
        against the id; the home store is read with the home cluster's credentials only.
        """
        try:
            uploaded = await self._stage(inp.cluster, inp.bundle)
        except ControllerError as exc:
            raise _handoff_error(inp.cluster, f"workspace bundle {inp.bundle.short}", exc) from None
        return StageResult(uploaded=uploaded)

    async def _stage(self, cluster: str, ref: BundleRef) -> bool:
        """Upload unless ``cluster`` holds the bundle; True if this call sent it. Jobs sharing one
        workspace share one upload: a caller arriving while it is in flight waits for it."""
        key = (cluster, ref.sha256)
        running = self._staging.get(key)
        if running is not None:
            await asyncio.shield(running)
            return False
        task = asyncio.create_task(self._upload(cluster, ref))
        self._staging[key] = task
        task.add_done_callback(lambda _: self._staging.pop(key, None))
        # Shielded: one caller's cancellation must not cancel the upload the others wait on.
        return await asyncio.shield(task)

    async def _upload(self, cluster: str, ref: BundleRef) -> bool:
        async with self._client(cluster) as client:
            try:
                await client.bundle_info(ref.sha256)
                return False
            except NotFound:
                pass
            return await self._send(client, ref)

    async def _send(self, client: ControllerClient, ref: BundleRef) -> bool:
        home = self._config.home_cluster.object_store
        if home is None:
            raise ApplicationError(
                f"the home cluster {self._config.home} has no object store holding bundles",
                type=contract.BUNDLE_UNAVAILABLE,
                non_retryable=True,
            )
        try:
            data = await asyncio.to_thread(fetch_from_home, open_store(home), ref)
        except StoreUnavailable as exc:
            raise ApplicationError(f"the home object store is unavailable: {exc}") from None
        except (KeyError, BundleError, StoreError) as exc:
            what = {KeyError: "missing from", BundleError: "damaged in"}.get(type(exc), "unreadable in")
            raise ApplicationError(
                f"workspace bundle {ref.short} is {what} the home object store",
                type=contract.BUNDLE_UNAVAILABLE,
                non_retryable=True,
            ) from None
        await client.put_bundle(ref.sha256, data)
        return True

    async def _relay_logs(
        self, client: ControllerClient, job_id: str, offset: int, log_key: str | None = None
    ) -> int:
        """Copy whatever the job wrote since ``offset`` into the home-side relay (under ``log_key``,
        default the job id); returns the new offset."""
        relay = self._relay
        if relay is None:
            return offset
        while True:
            chunk = await client.logs(job_id, offset=offset)
            if not chunk.data or chunk.next_offset <= offset:
                return offset
            await asyncio.to_thread(relay.append, log_key or job_id, offset, chunk.next_offset, chunk.data)
            offset = chunk.next_offset

    @activity.defn(name=contract.MIRROR_JOB)
    async def mirror_job(self, inp: MirrorInput) -> ControllerJobStatus:
        """Follow the job on its cluster until its state differs from ``known_state``, relaying logs.

        Polls sub-second inside one heartbeating activity (server-side retries are never faster
        than ~1 s); transient errors are ridden out here, heartbeating all along. Before it reports
        a terminal state every byte of output has been copied home.
        """
        deadline = time.monotonic() + inp.max_wait_s
        relayed = 0
        key = inp.log_key or inp.job_id
        if self._relay is not None:
            relayed = await asyncio.to_thread(self._relay.relayed_offset, key)
        next_relay = 0.0
        async with self._client(inp.cluster) as client:
            while True:
                try:
                    last = await client.status(inp.job_id)
                    if last.terminal or time.monotonic() >= next_relay:
                        relayed = await self._relay_logs(client, inp.job_id, relayed, key)
                        next_relay = time.monotonic() + inp.log_interval_s
                except NotFound:
                    raise ApplicationError(
                        f"{inp.cluster} no longer knows job {inp.job_id}",
                        type=contract.JOB_LOST,
                        non_retryable=True,
                    ) from None
                except ControllerError as exc:
                    if not exc.retryable:
                        raise
                    _beat(f"{inp.cluster} unavailable: {exc.message}")
                else:
                    _beat(last.state.value)
                    if last.state.value != inp.known_state or last.terminal:
                        return last
                    if time.monotonic() > deadline:
                        return last
                await asyncio.sleep(inp.poll_interval_s)

    @activity.defn(name=contract.FOLLOW_JOB)
    async def follow_job(self, inp: FollowInput) -> FollowResult:
        """Follow one attempt on its cluster until its state differs from ``known_state``, relaying
        its output home; or until the cluster has not answered for ``report_unreachable_s``.

        Polls sub-second inside one heartbeating activity; before it reports a terminal state every
        byte of output has been copied home.
        """
        deadline = time.monotonic() + inp.max_wait_s
        relayed = 0
        if self._relay is not None:
            relayed = await asyncio.to_thread(self._relay.relayed_offset, inp.log_key)
        next_relay = 0.0
        silent_since: float | None = None
        async with self._client(inp.cluster) as client:
            while True:
                try:
                    last = await client.status(inp.job_id)
                    if inp.nonce is not None and last.nonce != inp.nonce:
                        return FollowResult(gone=True, error=f"{inp.cluster} runs another attempt of the job")
                    if last.terminal or time.monotonic() >= next_relay:
                        relayed = await self._relay_logs(client, inp.job_id, relayed, inp.log_key)
                        next_relay = time.monotonic() + inp.log_interval_s
                except NotFound:
                    return FollowResult(gone=True, error=f"{inp.cluster} no longer knows job {inp.job_id}")
                except ControllerError as exc:
                    if not exc.retryable:
                        raise
                    now = time.monotonic()
                    silent_since = now if silent_since is None else silent_since
                    activity.heartbeat(f"{inp.cluster} unavailable: {exc.message}")
                    if now - silent_since >= inp.report_unreachable_s:
                        return FollowResult(unreachable_s=now - silent_since, error=exc.message)
                else:
                    silent_since = None
                    activity.heartbeat(last.state.value)
                    if last.state.value != inp.known_state or last.terminal or time.monotonic() > deadline:
                        return FollowResult(status=last)
                await asyncio.sleep(inp.poll_interval_s)

    @activity.defn(name=contract.FIND_ATTEMPT)
    async def find_attempt(self, inp: FindInput) -> FindResult:
        """Ask a cluster whether it has this attempt of the job: after a launch whose answer was
        lost, the cluster, not the caller's guess, says whether the job started (docs/DESIGN.md,
        "Errors, retries and parking")."""
        try:
            async with self._client(inp.cluster) as client:
                status = await client.status(inp.job_id)
        except NotFound:
            return FindResult(found=AttemptFound.ABSENT)
        except ControllerError as exc:
            if not exc.retryable:
                raise
            return FindResult(found=AttemptFound.UNKNOWN, error=exc.message)
        if status.nonce != inp.nonce:
            return FindResult(found=AttemptFound.ABSENT, status=status)
        return FindResult(found=AttemptFound.HERE, status=status)

    @activity.defn(name=contract.TERMINATE_JOB)
    async def terminate_job(self, inp: TerminateInput) -> ControllerJobStatus | None:
        """Ask the cluster to terminate the job (with ``nonce``: only that attempt's run); a cluster
        that no longer knows it satisfies the cancel. With ``confirm``, the terminate is sent again
        until the cluster reports the run ended (heartbeating; outages are ridden out here)."""
        async with self._client(inp.cluster) as client:
            while True:
                try:
                    status = await client.terminate(inp.job_id, nonce=inp.nonce)
                except NotFound:
                    return None
                except ControllerError as exc:
                    if not (exc.retryable and inp.confirm):
                        raise
                    activity.heartbeat(f"{inp.cluster} unavailable: {exc.message}")
                else:
                    done = status.terminal or (inp.nonce is not None and status.nonce != inp.nonce)
                    if done or not inp.confirm:
                        return status
                    activity.heartbeat(f"{status.state.value}: terminating")
                await asyncio.sleep(inp.resend_interval_s)


def handoff_outcome(exc: ControllerError) -> str:
    """The ``outcome`` label of a launch that raised ``exc`` (iris/metrics.py, HANDOFF_OUTCOMES):
    an outage is ``unreachable``, a final refusal ``refused``, a token the cluster did not accept
    (retried, but no outage) ``error``."""
    if exc.code is ErrorCode.UNAVAILABLE:
        return "unreachable"
    return "error" if exc.retryable else "refused"


def count_handoff(meter: MetricMeter, peer: str, outcome: str) -> None:
    """One launch request's final answer, in ``iris_handoffs`` (docs/DESIGN.md, "Metrics")."""
    meter.create_counter(metrics.HANDOFFS, "Launch requests sent to a cluster, by outcome").add(
        1, {"peer": peer, "outcome": outcome}
    )


def _handoff_error(cluster: str, what: str, exc: ControllerError) -> Exception:
    """Outages are retried (the error itself); a refusal is final: HANDOFF_REJECTED."""
    if exc.retryable:
        return exc
    return ApplicationError(
        f"{cluster} refused {what}: {exc.message}",
        exc.code,
        type=contract.HANDOFF_REJECTED,
        non_retryable=True,
    )
