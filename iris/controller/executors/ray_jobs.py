"""The Ray backend: a cluster's jobs run on a Ray cluster through its Jobs API
(docs/DESIGN.md, "Components").

Each job is one Ray job whose submission id is the job id (``/`` escaped, see ``submission_id``),
so a launch repeated by anyone — a retried handoff, a restarted controller — can never start a
second run: Ray refuses a duplicate submission id. The device request becomes
``entrypoint_resources`` on the backend's custom resource per device token, plus a little CPU.

Capacity comes from Ray itself, read from its GCS: totals from the nodes' resources, free from
their available resources, minus the demand of this controller's jobs Ray has not started yet;
held-by-band from this controller's running jobs. The observation time changes only when one of
those inputs changes. A Ray cluster that does not answer makes ``report`` raise
``BackendUnreachable``: its capacity is unknown, never free.

Ray's Jobs client is synchronous (``requests`` without timeouts), so every call runs on this
backend's own small thread pool with a timeout; the event loop never blocks on Ray. One monitor
task per backend does all submissions, status polls and stops, one job at a time, so a job is never
submitted and stopped concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import requests
from ray.core.generated import autoscaler_pb2 as _autoscaler_pb2
from ray.core.generated import autoscaler_pb2_grpc as _autoscaler_pb2_grpc
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from iris.bundle import BundleError
from iris.config import BackendConfig
from iris.controller.errors import InvalidArgument
from iris.controller.executors.base import Backend, BackendUnreachable, JobHost
from iris.controller.models import TIMED_OUT, ControllerJobState
from iris.controller.state import JobRecord, now_ms
from iris.policy.models import BackendReport

log = logging.getLogger("iris.controller.executor.ray")

# Generated protobuf modules come without type stubs.
autoscaler_pb2: Any = _autoscaler_pb2
autoscaler_pb2_grpc: Any = _autoscaler_pb2_grpc

T = TypeVar("T")

POLL_INTERVAL_S = 0.5
CALL_TIMEOUT_S = 5.0
# A submission with a working_dir uploads it to Ray first (up to the bundle limit, 25 MiB).
UPLOAD_TIMEOUT_S = 60.0
# No successful read of Ray for this long (a wedged poll) counts as unreachable too.
STALE_AFTER_S = 10.0
LOG_REFRESH_S = 0.5
# A submission Ray refuses this many times in a row (not as a duplicate) fails the job.
MAX_REFUSALS = 10
MIB = 1 << 20
# Ray's Jobs client lets these variables override the address it is given; each backend names its
# own cluster, so the controller must not inherit them.
_ADDRESS_OVERRIDES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
_IGNORE_GITIGNORE = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"
_GRPC_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000), ("grpc.initial_reconnect_backoff_ms", 200)]
_DEAD = autoscaler_pb2.NodeStatus.Value("DEAD")
_DRAINING = autoscaler_pb2.NodeStatus.Value("DRAINING")
# Runs each replica of a gang in the one Ray entrypoint; the exit code is the first failure's.
_REPLICAS_SH = (
    'i=0; pids=""; while [ "$i" -lt "$IRIS_NUM_REPLICAS" ]; do '
    'IRIS_REPLICA_INDEX=$i "$@" & pids="$pids $!"; i=$((i+1)); done; '
    'rc=0; for p in $pids; do wait "$p"; c=$?; [ "$rc" -eq 0 ] && rc=$c; done; exit "$rc"'
)


# Ray writes lines of its own into a job's log: its job manager's timestamped INFO records (e.g.
# "Runtime env is setting up."), written at submission, before the entrypoint starts; and its
# supervisor's "Running entrypoint for job <id>: <entrypoint>", appended once the entrypoint has
# started, so possibly after the job's first output. Warnings and errors (Ray failed to start the
# job) stay: they are all the log can say about why the job never ran.
_RAY_INFO_RECORD = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\tINFO job_manager\.py:\d+ -- [^\n]*\n")


def job_output(ray_log: bytes, sid: str, command: str) -> bytes:
    """A job's own output from the log Ray keeps for it: Ray's lines (above) left out, so a job's
    log is the same whichever backend ran it.

    Applied to any whole-line prefix of Ray's log it gives a prefix of what it gives for the whole
    log, so the controller's copy can keep growing by appending.
    """
    data = ray_log
    while (record := _RAY_INFO_RECORD.match(data)) is not None:
        data = data[record.end() :]
    # The exact line, wherever it landed (after a partial line of the job, it ends that line).
    return data.replace(f"Running entrypoint for job {sid}: {command}\n".encode(), b"", 1)


class RayUnreachable(Exception):
    """Ray did not answer (connection refused, timeout)."""


class RayRefused(Exception):
    """Ray answered with an HTTP error; ``status`` is its code."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


def submission_id(job_id: str, attempt: int) -> str:
    """The Ray submission id of one attempt of a job: its job id, readable and unique.

    Ray puts the id in URL paths and file names, so ``/`` cannot stay; ``~`` escapes it (``~~`` is a
    literal ``~``, ``~_`` a ``/``) and a later attempt adds ``~<n>``, which keeps the mapping
    one-to-one. ``alice/train`` → ``alice~_train``, its second attempt ``alice~_train~2``.
    """
    escaped = job_id.replace("~", "~~").replace("/", "~_")
    return escaped if attempt <= 1 else f"{escaped}~{attempt}"


def entrypoint(job: JobRecord) -> str:
    if len(job.tasks) <= 1:
        return shlex.join(job.command)
    return shlex.join(["sh", "-c", _REPLICAS_SH, "iris-replicas", *job.command])


class _JobsClient(JobSubmissionClient):
    """Ray's Jobs client with a timeout on every request (it sends none, so a hung head would
    hold a thread forever)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        super().__init__(address)

    def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> requests.Response:
        # A package upload (a job's working_dir) carries up to a whole bundle.
        upload = method == "PUT" and endpoint.startswith("/api/packages/")
        kwargs.setdefault("timeout", UPLOAD_TIMEOUT_S if upload else self._timeout_s)
        response: requests.Response = super()._do_request(method, endpoint, **kwargs)
        return response


def _refusal(exc: RuntimeError) -> RayRefused:
    # The client reports HTTP errors as RuntimeError("Request failed with status code N: text").
    text = str(exc)
    marker = "status code "
    status = 0
    if marker in text:
        digits = text.split(marker, 1)[1][:3]
        status = int(digits) if digits.isdigit() else 0
    return RayRefused(status, text)


@dataclass
class _Tracked:
    """One unfinished job of this backend, and what Ray last said about it."""

    job: JobRecord
    # Ray's last status; None until Ray confirms it has the job.
    ray_status: JobStatus | None = None
    # True only for a job accepted by this process and not yet submitted: it may be dropped
    # without asking Ray. Jobs recovered from the store may already be in Ray.
    fresh: bool = False
    refusals: int = 0
    timed_out: bool = False
    log_read_at: float = 0.0


class RayBackend(Backend):
    """Runs a backend's jobs as Ray jobs and reports Ray's own capacity."""

    def __init__(self, config: BackendConfig, host: JobHost) -> None:
        super().__init__(config, host)
        for var in _ADDRESS_OVERRIDES:
            if os.environ.pop(var, None) is not None:
                log.warning("ignoring %s: Ray backend %s uses %s", var, config.id, config.address)
        # A bundle is already filtered by the submitter's ignore files (iris.bundle): Ray must ship
        # all of it, including what a shipped .gitignore would name (re-included by .irisignore).
        os.environ[_IGNORE_GITIGNORE] = "1"
        self.address = config.address
        self.gcs_address = config.ray_gcs_address
        self.tokens = sorted(config.devices)
        self.observed_ms = now_ms()
        self._tracked: dict[str, _Tracked] = {}
        self._totals: dict[str, int] = {}
        self._free: dict[str, int] = {}
        self._reachable = False
        self._reason = f"Ray at {self.address} not contacted yet"
        self._last_ok = 0.0
        self._signature: object = None
        self._busy: str | None = None  # the job id the monitor is talking to Ray about
        # The monitor's calls and log reads for API callers never queue behind each other.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"ray-{config.id}")
        self._log_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"ray-logs-{config.id}")
        self._jobs_client: _JobsClient | None = None
        self._channel: grpc.Channel | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # ---- Backend ---------------------------------------------------------------------------

    def recover(self, jobs: list[JobRecord]) -> None:
        for job in jobs:
            # Ray keeps running what it was given: the monitor re-attaches by submission id.
            self._tracked[job.job_id] = _Tracked(job)
            log.info("job %s: re-attaching to Ray job %s", job.job_id, self._sid(job))
        self._observe()
        self._task = asyncio.get_running_loop().create_task(self._monitor())

    def accept(self, job: JobRecord) -> None:
        self._tracked[job.job_id] = _Tracked(job, fresh=True)
        self._observe()
        self._wake.set()

    def cancel_pending(self, job: JobRecord) -> bool:
        tracked = self._tracked.get(job.job_id)
        if tracked is None or not tracked.fresh or self._busy == job.job_id:
            return False
        del self._tracked[job.job_id]
        self.host.settle(job, ControllerJobState.KILLED, error="terminated before it started")
        self._observe()
        return True

    def stop(self, job: JobRecord) -> None:
        self._wake.set()  # the monitor stops it in Ray and settles it when Ray says it ended

    def report(self) -> BackendReport:
        # No ``cpu`` token: the policy then takes CPU jobs here by shape (docs/DESIGN.md,
        # "Vocabulary"). Ray's CPU count is known but is not this backend's: clusters sharing one
        # head (``iris dev --ray``) would each report the same CPUs (devices are kept apart by
        # per-backend resource names, CPU has none), the jobs' own tasks and other Ray users take
        # CPUs no job slot accounts for, and a replica's share (``ray_cpus``) may be 0. Ray queues
        # what does not fit.
        if self._reachable and time.monotonic() - self._last_ok > STALE_AFTER_S:
            self._reachable = False
            self._reason = f"Ray at {self.address} has not answered for {STALE_AFTER_S:.0f}s"
        if not self._reachable:
            raise BackendUnreachable(self._reason)
        waiting: dict[str, int] = {}
        for tracked in self._tracked.values():
            if tracked.ray_status == JobStatus.RUNNING:
                continue
            try:
                demand = self.demand(tracked.job.device)
            except InvalidArgument:  # recovered under a config that no longer has its device
                continue
            if not demand.is_cpu:
                # Promised to a job Ray has not started: not free for anyone else. (While Ray
                # starts it, its resources may already be taken: counted twice, briefly, which
                # under-reports and never over-commits.)
                waiting[demand.resource] = waiting.get(demand.resource, 0) + demand.total
        return self.capacity_report(
            self.observed_ms,
            free={t: max(0, self._free.get(t, 0) - waiting.get(t, 0)) for t in self.tokens},
            totals={t: self._totals.get(t, 0) for t in self.tokens},
            running=(t.job for t in self._tracked.values() if t.ray_status == JobStatus.RUNNING),
        )

    async def refresh_log(self, job: JobRecord) -> None:
        tracked = self._tracked.get(job.job_id)
        if tracked is None or tracked.ray_status is None:
            return
        now = time.monotonic()
        if now - tracked.log_read_at < LOG_REFRESH_S:
            return
        tracked.log_read_at = now
        with contextlib.suppress(RayUnreachable, RayRefused):
            text = await self._call(lambda c: c.get_job_logs(self._sid(job)), self._log_pool)
            self._mirror_log(job, text, final=False)

    async def shutdown(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        live = [t.job.job_id for t in self._tracked.values() if not t.job.terminal]
        if live:
            log.info(
                "backend %s: %d job(s) keep running on Ray; a restarted controller re-attaches",
                self.config.id,
                len(live),
            )
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._log_pool.shutdown(wait=False, cancel_futures=True)
        if self._channel is not None:
            self._channel.close()

    # ---- Ray calls (on the pool) -----------------------------------------------------------

    def _sid(self, job: JobRecord) -> str:
        return submission_id(job.job_id, job.attempts)

    def _client(self) -> _JobsClient:
        if self._jobs_client is None:
            self._jobs_client = _JobsClient(self.address, CALL_TIMEOUT_S)
        return self._jobs_client

    async def _call(
        self,
        fn: Callable[[_JobsClient], T],
        pool: ThreadPoolExecutor | None = None,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> T:
        """``fn(client)`` on the pool; RayUnreachable / RayRefused for what Ray does or does not say."""

        def run() -> T:
            try:
                return fn(self._client())
            except (requests.RequestException, ConnectionError) as exc:
                reason = f"Ray Jobs API at {self.address} does not answer ({type(exc).__name__})"
                raise RayUnreachable(reason) from None
            except RuntimeError as exc:
                raise _refusal(exc) from None

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(pool or self._pool, run), timeout_s + 2)
        except TimeoutError:
            raise RayUnreachable(f"Ray Jobs API at {self.address} did not answer in time") from None

    def _read_resources(self) -> tuple[dict[str, int], dict[str, int]]:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.gcs_address, options=_GRPC_OPTIONS)
        stub = autoscaler_pb2_grpc.AutoscalerStateServiceStub(self._channel)
        try:
            reply = stub.GetClusterResourceState(
                autoscaler_pb2.GetClusterResourceStateRequest(), timeout=CALL_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            # A fresh channel next time: a failed one backs off its reconnects for many seconds.
            self._channel.close()
            self._channel = None
            reason = f"Ray GCS at {self.gcs_address} does not answer ({exc.code().name})"
            raise RayUnreachable(reason) from None
        totals = dict.fromkeys(self.tokens, 0.0)
        free = dict.fromkeys(self.tokens, 0.0)
        for node in reply.cluster_resource_state.node_states:
            if node.status == _DEAD:
                continue
            for token in self.tokens:
                name = self.config.ray_resource(token)
                totals[token] += node.total_resources.get(name, 0.0)
                if node.status != _DRAINING:  # a draining node takes no new work
                    free[token] += node.available_resources.get(name, 0.0)
        # Chips are whole; a fractional remainder is not a chip anyone can be given.
        return {t: int(v + 1e-9) for t, v in totals.items()}, {t: int(v + 1e-9) for t, v in free.items()}

    # ---- the monitor -----------------------------------------------------------------------

    async def _monitor(self) -> None:
        while not self._closing:
            try:
                await self._poll()
            except Exception:  # one bad round must not end the monitoring of every job
                log.exception("backend %s: Ray poll failed", self.config.id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_INTERVAL_S)
            self._wake.clear()

    async def _poll(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            totals, free = await asyncio.wait_for(
                loop.run_in_executor(self._pool, self._read_resources), CALL_TIMEOUT_S + 2
            )
            await self._call(lambda c: c.get_version())
        except (RayUnreachable, RayRefused, TimeoutError) as exc:
            self._unreachable(str(exc) or f"Ray at {self.address} did not answer in time")
            return
        if not self._reachable:
            log.info("backend %s: Ray at %s answers", self.config.id, self.address)
        self._reachable = True
        self._last_ok = time.monotonic()
        self._totals, self._free = totals, free
        self._observe()
        for job_id in list(self._tracked):
            tracked = self._tracked.get(job_id)
            if tracked is None or self._closing:
                continue
            self._busy = job_id
            try:
                await self._step(tracked)
            except RayUnreachable as exc:
                self._unreachable(str(exc))
                return
            finally:
                self._busy = None
            self._observe()

    def _unreachable(self, reason: str) -> None:
        if self._reachable:
            log.warning("backend %s: %s", self.config.id, reason)
        self._reachable = False
        self._reason = reason
        self._observe()

    async def _step(self, tracked: _Tracked) -> None:
        """Move one job forward: submit it, follow its status, stop it, settle it."""
        job = tracked.job
        sid = self._sid(job)
        if job.terminal:
            self._tracked.pop(job.job_id, None)
            return
        info: JobDetails | None = None
        if not tracked.fresh:
            try:
                info = await self._call(lambda c: c.get_job_info(sid))
            except RayRefused as exc:
                if exc.status != 404:
                    raise RayUnreachable(f"Ray Jobs API at {self.address} failed: {exc}") from None
        if info is None:
            if job.state is ControllerJobState.RUNNING or tracked.ray_status is not None:
                self._finish(
                    tracked,
                    ControllerJobState.WORKER_FAILED,
                    None,
                    f"Ray no longer knows job {sid} (was the Ray cluster restarted?); its outcome is unknown",
                )
            elif job.terminate_requested:
                self._finish(tracked, ControllerJobState.KILLED, None, "terminated before it started")
            else:
                await self._submit(tracked)
            return
        if (info.metadata or {}).get("iris_run_id") != job.run_id:
            self._finish(
                tracked,
                ControllerJobState.FAILED,
                None,
                f"Ray already has a job {sid} that this controller did not submit",
            )
            return
        await self._follow(tracked, info)

    async def _submit(self, tracked: _Tracked) -> None:
        job = tracked.job
        sid = self._sid(job)
        try:
            demand = self.demand(job.device)
        except InvalidArgument as exc:  # recovered under a config that no longer has its device
            self._finish(tracked, ControllerJobState.FAILED, None, exc.message)
            return
        resources = {} if demand.is_cpu else {self.config.ray_resource(demand.resource): float(demand.total)}
        cpus = self.config.ray_cpus * demand.replicas
        memory = self.config.ray_memory_mb * MIB * demand.replicas
        env = {
            **job.env,
            "IRIS_JOB_ID": job.job_id,
            "IRIS_CLUSTER": self.host.cluster.name,
            "IRIS_BACKEND_ID": job.backend_id,
            "IRIS_REPLICA_INDEX": "0",
            "IRIS_NUM_REPLICAS": str(len(job.tasks)),
        }
        runtime_env: dict[str, Any] = {"env_vars": env}
        if job.bundle is not None:
            try:
                # Ray packs this directory into its own store (once per content) and runs the
                # entrypoint in a copy of it on the node: the job's working directory.
                workdir = await asyncio.to_thread(self.host.bundles.unpacked, job.bundle)
            except (BundleError, OSError) as exc:
                self._finish(
                    tracked, ControllerJobState.FAILED, None, f"cannot unpack the workspace bundle: {exc}"
                )
                return
            runtime_env["working_dir"] = str(workdir)
        try:
            await self._call(
                lambda c: c.submit_job(
                    entrypoint=entrypoint(job),
                    submission_id=sid,
                    entrypoint_resources=resources or None,
                    entrypoint_num_cpus=cpus or None,
                    entrypoint_memory=memory or None,
                    runtime_env=runtime_env,
                    metadata={"iris_job_id": job.job_id, "iris_run_id": job.run_id},
                ),
                timeout_s=UPLOAD_TIMEOUT_S if job.bundle is not None else CALL_TIMEOUT_S,
            )
        except RayRefused as exc:
            tracked.fresh = False
            # A duplicate means it is already there (e.g. submitted just before a crash): the next
            # round re-attaches and checks that it is ours.
            if "already exists" in str(exc):
                log.info("job %s: Ray already has %s; re-attaching", job.job_id, sid)
                return
            tracked.refusals += 1
            log.warning("job %s: Ray refused submission %s (%d): %s", job.job_id, sid, tracked.refusals, exc)
            if tracked.refusals >= MAX_REFUSALS:
                self._finish(tracked, ControllerJobState.FAILED, None, f"Ray refused the job: {exc}"[:500])
            return
        tracked.fresh = False
        tracked.ray_status = JobStatus.PENDING
        log.info("job %s submitted to Ray as %s (%s)", job.job_id, sid, resources or f"{cpus} CPU")

    async def _follow(self, tracked: _Tracked, info: JobDetails) -> None:
        job = tracked.job
        status = info.status
        tracked.ray_status = status
        if status == JobStatus.RUNNING and job.state is ControllerJobState.PENDING:
            job.state = ControllerJobState.RUNNING
            job.started_ms = now_ms()
            for task in job.tasks:
                task.state = ControllerJobState.RUNNING
            self.host.save(job)
            self.host.notify(job.job_id)
            log.info("job %s running on Ray", job.job_id)
        if status.is_terminal():
            text = None
            with contextlib.suppress(RayRefused):
                text = await self._call(lambda c: c.get_job_logs(self._sid(job)))
            if text is not None:
                self._mirror_log(job, text, final=True)
            self._finish(tracked, *self._outcome(tracked, info))
            return
        if (
            job.timeout_s is not None
            and job.started_ms is not None
            and now_ms() - job.started_ms > job.timeout_s * 1000
            and not tracked.timed_out
        ):
            tracked.timed_out = True
            log.info("job %s timed out after %ss", job.job_id, job.timeout_s)
        if job.terminate_requested or tracked.timed_out:
            await self._call(lambda c: c.stop_job(self._sid(job)))

    def _outcome(
        self, tracked: _Tracked, info: JobDetails
    ) -> tuple[ControllerJobState, int | None, str | None]:
        code = info.driver_exit_code
        if tracked.job.terminate_requested:
            return ControllerJobState.KILLED, None, "terminated on request"
        if tracked.timed_out:
            return ControllerJobState.FAILED, code if code else None, TIMED_OUT
        if info.status == JobStatus.SUCCEEDED:
            return ControllerJobState.SUCCEEDED, 0, None
        if info.status == JobStatus.STOPPED:
            return ControllerJobState.KILLED, None, "stopped in Ray"
        # A plain non-zero exit says enough; otherwise Ray's message says what went wrong.
        return ControllerJobState.FAILED, code, None if code else (info.message or "failed in Ray")[:500]

    def _finish(
        self, tracked: _Tracked, state: ControllerJobState, code: int | None, error: str | None
    ) -> None:
        job = tracked.job
        self._tracked.pop(job.job_id, None)
        if len(job.tasks) == 1:
            job.tasks[0].exit_code = code
        self.host.settle(job, state, exit_code=code, error=error)
        self._observe()
        note = f" ({error})" if error else ""
        log.info("job %s finished: %s exit_code=%s%s", job.job_id, state, code, note)

    def _mirror_log(self, job: JobRecord, text: str, *, final: bool) -> None:
        """Append the job's output beyond our copy. Ray's log only grows, so our copy is a prefix of
        the job's output in it; while the job runs, only whole lines, so a character split by Ray's
        decoding is never copied (nor a line of Ray's own not yet complete)."""
        data = job_output(text.encode(), self._sid(job), entrypoint(job))
        if not final:
            data = data[: data.rfind(b"\n") + 1]
        path = self.log_path(job)
        size = path.stat().st_size if path.exists() else 0
        if len(data) > size:
            with path.open("ab") as f:
                f.write(data[size:])

    def _observe(self) -> None:
        """Start a new observation when anything the report depends on changed."""
        signature = (
            self._reachable,
            tuple(sorted(self._totals.items())),
            tuple(sorted(self._free.items())),
            tuple(sorted((jid, t.ray_status == JobStatus.RUNNING) for jid, t in self._tracked.items())),
        )
        if signature != self._signature:
            self._signature = signature
            self.observed_ms = max(now_ms(), self.observed_ms + 1)
