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

A device job goes to Ray only when it fits (docs/DESIGN.md, "Preemption"): each round the monitor
admits the waiting jobs of a device token in (band, arrival) order while Ray's free amount, less what
jobs already submitted but not yet running will take, covers them; the first that does not fit
blocks its token's queue and preempts the lower-band jobs ``choose_victims`` picks, which Ray stops
(SIGTERM, then SIGKILL after the job's stop wait: the cluster's ``preempt_grace_s``). CPU jobs go to
Ray at once: Ray's CPUs are not this backend's to count (see ``report``).

Ray's Jobs client is synchronous (``requests`` without timeouts), so every call runs on this
backend's own small thread pool with a timeout; the event loop never blocks on Ray. One monitor
task per backend does all submissions, status polls and stops, one job at a time, so a job is never
submitted and stopped concurrently.

A job's log is copied by byte range, never whole (docs/DESIGN.md, "Logs"): Ray's Jobs API only hands
out a job's whole log (``GET /api/jobs/<id>/logs`` reads the file from its start every time), but the
dashboard agent of the job's driver node serves the same file from its log directory (``/logs/``,
at the job's ``driver_agent_http_address``) with HTTP ``Range`` support. Each read asks for the bytes
past what the controller has already read, at most ``LOG_CHUNK`` of them; ``JobOutput`` applies
``job_output`` to them incrementally. Reads happen only when someone reads a running job's log (at
most every ``LOG_REFRESH_S``) and once at its end. A controller that re-attaches to a running job
reads its log once from the start (how far its predecessor read is not kept). A job whose agent
cannot serve a range falls back to the Jobs API's whole log (as before), so no log is lost for want
of an agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shlex
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import requests
from ray.core.generated import autoscaler_pb2 as _autoscaler_pb2
from ray.core.generated import autoscaler_pb2_grpc as _autoscaler_pb2_grpc
from ray.dashboard.modules.job.common import JOB_LOGS_PATH_TEMPLATE
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from iris.bundle import BundleError
from iris.config import BackendConfig
from iris.controller.errors import InvalidArgument
from iris.controller.executors.base import Backend, BackendUnreachable, Demand, JobHost
from iris.controller.models import TIMED_OUT, ControllerJobState, preempted_note
from iris.controller.state import JobRecord, now_ms
from iris.policy.models import BackendReport
from iris.policy.preemption import RunningTask, choose_victims

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
# The most one read of a job's log asks Ray for. A refresh (a reader asking, at most every
# LOG_REFRESH_S) makes one such read; the final read at the job's end makes as many as it takes.
LOG_CHUNK = 4 * MIB
# After an agent fails to serve a range of a job's log, its reads go to the Jobs API for this long.
AGENT_RETRY_S = 60.0
# Ray's Jobs client lets these variables override the address it is given; each backend names its
# own cluster, so the controller must not inherit them.
_ADDRESS_OVERRIDES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
_IGNORE_GITIGNORE = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE"
# How long Ray's job supervisor waits between the SIGTERM of a stop and its SIGKILL (whole seconds,
# Ray's default 3). Read from the supervisor's environment, which a job's runtime_env env_vars
# become: set per job at submission, it applies to every stop of that job.
_STOP_WAIT = "RAY_JOB_STOP_WAIT_TIME_S"
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


def _line_end(data: bytes) -> int:
    """Where the last whole line of ``data`` ends (0: none). Line ends are those of Python's text
    mode, in which Ray's Jobs API reads a job's log: ``\n``, ``\r\n``, and a ``\r`` that is not
    the last byte (a last one may be the first half of a ``\r\n``)."""
    end = len(data) - 1 if data.endswith(b"\r") else len(data)
    return max(data.rfind(b"\n", 0, end), data.rfind(b"\r", 0, end)) + 1


def _newlines(data: bytes) -> bytes:
    """Text mode's universal newlines, as the Jobs API's whole log has them."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class JobOutput:
    """``job_output`` of Ray's log, computed from its bytes fed in pieces of any size.

    ``feed`` gives out what is certain: whole lines only (a character split between two pieces is
    never given out), never Ray's leading records, and nothing that may be the start of Ray's
    "Running entrypoint" line (it may be still arriving; its command can span lines). With
    ``final``, the log is complete and the rest is given out. However the log is split, what is
    given out adds up to ``job_output`` of the whole log as the Jobs API reads it (its newlines
    translated by ``_newlines``), piece after piece, so the controller's copy only ever appends.
    """

    def __init__(self, sid: str, command: str) -> None:
        self._banner = f"Running entrypoint for job {sid}: {command}\n".encode()
        self._raw = b""  # Ray's bytes past the last line end seen
        self._text = b""  # output held back
        self._leading = True  # still among Ray's leading records
        self._banner_seen = False

    def feed(self, raw: bytes, *, final: bool = False) -> bytes:
        data = self._raw + raw
        cut = len(data) if final else _line_end(data)
        self._raw = data[cut:]
        text = self._text + _newlines(data[:cut])
        if self._leading:
            # Only whole lines arrive here while leading, so a record is either all here or not.
            while (record := _RAY_INFO_RECORD.match(text)) is not None:
                text = text[record.end() :]
            if not text and not final:
                return b""
            self._leading = False
        if not self._banner_seen and (at := text.find(self._banner)) >= 0:
            text = text[:at] + text[at + len(self._banner) :]
            self._banner_seen = True
        if final:
            self._text = b""
            return text
        limit = len(text) if self._banner_seen else self._banner_start(text)
        end = text.rfind(b"\n", 0, limit) + 1
        self._text = text[end:]
        return text[:end]

    def _banner_start(self, text: bytes) -> int:
        """Where the longest end of ``text`` that is a proper beginning of the banner starts."""
        first = self._banner[:1]
        at = text.find(first, max(0, len(text) - len(self._banner) + 1))
        while at >= 0:
            if self._banner.startswith(text[at:]):
                return at
            at = text.find(first, at + 1)
        return len(text)


class RayUnreachable(Exception):
    """Ray did not answer (connection refused, timeout)."""


class _AgentFailed(Exception):
    """The dashboard agent did not serve a ranged read of a job's log."""


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
    # Where Ray's agent serves the job's log; None until its driver has started.
    log_url: str | None = None
    # How far the controller has read that log; None until the first read (or after a fallback).
    log_tail: _LogTail | None = None
    # When the agent last failed to serve a range of it (the Jobs API's whole log is read meanwhile).
    agent_failed_at: float = float("-inf")
    # One read of the job's log at a time (reads run on pool threads and append to its copy).
    log_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _LogTail:
    """The controller's read position in Ray's log of one job."""

    url: str
    output: JobOutput
    offset: int = 0  # bytes of Ray's log read
    # Bytes of output already in the controller's copy (a job re-attached after a restart: its log
    # is read once from the start, and what the copy has is not written again).
    skip: int = 0


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
        # Rounds of the monitor that read Ray and stepped every tracked job: a test waits for a few
        # of them to see that the backend did not act, where it would otherwise sleep.
        self.rounds = 0
        self._signature: object = None
        self._busy: str | None = None  # the job id the monitor is talking to Ray about
        # Waiting jobs that may go to Ray this round (``_plan``).
        self._admitted: set[str] = set()
        # A stop's SIGTERM-to-SIGKILL wait in Ray: the cluster's preemption grace, in whole seconds.
        self.stop_wait_s = math.ceil(host.cluster.preempt_grace_s)
        # The monitor's calls and log reads for API callers never queue behind each other.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"ray-{config.id}")
        self._log_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"ray-logs-{config.id}")
        self._jobs_client: _JobsClient | None = None
        self._channel: grpc.Channel | None = None
        # What reading job logs cost: requests to Ray, bytes received, and how many of those
        # requests had to fetch a whole log (the Jobs API, when an agent could not serve a range).
        self.log_requests = 0
        self.log_bytes_fetched = 0
        self.log_whole_reads = 0
        self._agent_warned = False
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
        # By the job table's state, so ``held_by_band`` is what the RUNNING jobs hold at every
        # moment: a job becomes RUNNING, and leaves this table settled, in one step of the monitor;
        # a victim in its grace is RUNNING and still holds its devices.
        waiting: dict[str, int] = {}
        held: dict[str, int] = {}
        for tracked in self._tracked.values():
            try:
                demand = self.demand(tracked.job.device)
            except InvalidArgument:  # recovered under a config that no longer has its device
                continue
            if demand.is_cpu:
                continue
            if tracked.job.state is ControllerJobState.RUNNING:
                held[demand.resource] = held.get(demand.resource, 0) + demand.total
            else:
                # Promised to a job Ray has not started: not free for anyone else. (While Ray
                # starts it, its resources may already be taken: counted twice, briefly, which
                # under-reports and never over-commits.)
                waiting[demand.resource] = waiting.get(demand.resource, 0) + demand.total
        # Ray's available resources trail its jobs (each raylet reports them to the GCS on its own
        # period): a job Ray already runs can still show as free there, more so on a busy host. What
        # this backend's RUNNING jobs hold is never free, whatever Ray's last view says.
        free = {
            t: max(0, min(self._free.get(t, 0), self._totals.get(t, 0) - held.get(t, 0)) - waiting.get(t, 0))
            for t in self.tokens
        }
        return self.capacity_report(
            self.observed_ms,
            free=free,
            totals={t: self._totals.get(t, 0) for t in self.tokens},
            running=(t.job for t in self._tracked.values() if t.job.state is ControllerJobState.RUNNING),
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
            await self._copy_log(tracked, final=False, pool=self._log_pool)

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
        self._plan()
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
        self.rounds += 1

    def _unreachable(self, reason: str) -> None:
        if self._reachable:
            log.warning("backend %s: %s", self.config.id, reason)
        self._reachable = False
        self._reason = reason
        self._observe()

    def _plan(self) -> None:
        """Which waiting jobs go to Ray this round, and whom they preempt (docs/DESIGN.md,
        "Preemption"). Per device token, waiting jobs are admitted in (band, arrival) order while
        Ray's free amount, less what jobs submitted but not yet running will take, covers them
        (conservative: a job Ray has just started may be counted twice for a round). The first that
        does not fit blocks the token's queue, as on the process backend, and preempts for itself."""
        self._admitted.clear()
        queues: dict[str, list[tuple[JobRecord, Demand]]] = {}
        for tracked in self._tracked.values():
            job = tracked.job
            if not tracked.fresh or job.terminate_requested:
                continue
            try:
                demand = self.demand(job.device)
            except InvalidArgument:  # _submit fails it with the reason
                self._admitted.add(job.job_id)
                continue
            if demand.is_cpu:
                self._admitted.add(job.job_id)
                continue
            queues.setdefault(demand.resource, []).append((job, demand))
        for token, queue in queues.items():
            queue.sort(key=lambda entry: (int(entry[0].band), entry[0].seq))
            free = self._free.get(token, 0) - self._starting(token)
            for job, demand in queue:
                if demand.total > self._totals.get(token, 0):
                    # More than Ray has now (nodes gone): it waits for them and blocks no one.
                    continue
                if demand.total > free:
                    self._preempt_for(job, demand)
                    break
                self._admitted.add(job.job_id)
                free -= demand.total

    def _starting(self, token: str) -> int:
        """What this backend's jobs in Ray (or perhaps in Ray: recovered) that have not started will
        take of ``token``."""
        total = 0
        for tracked in self._tracked.values():
            if tracked.fresh or tracked.job.state is not ControllerJobState.PENDING:
                continue
            with contextlib.suppress(InvalidArgument):
                demand = self.demand(tracked.job.device)
                if demand.resource == token:
                    total += demand.total
        return total

    def _preempt_for(self, job: JobRecord, demand: Demand) -> None:
        """Mark (and store) the jobs ``choose_victims`` picks for the waiting ``job`` as preempted;
        the monitor stops them in Ray in this round.

        What is free is counted from this backend's own jobs, not from Ray's available resources:
        Ray returns a stopped job's resources a moment after it reports the job ended, so its free
        amount lags, and counting from it would stop victims that are not needed. Free is the
        token's total less what this backend's jobs hold or are about to take (running, submitted,
        admitted this round); jobs already being stopped (preempted, terminated, timed out) count
        as free, so a job waiting for them stops no one else. Only RUNNING jobs are candidates."""
        token = demand.resource
        held = 0
        candidates: list[RunningTask] = []
        for tracked in self._tracked.values():
            other = tracked.job
            if tracked.fresh and other.job_id not in self._admitted:
                continue
            if other.preempted is not None or other.terminate_requested or tracked.timed_out:
                continue  # on its way out
            try:
                theirs = self.demand(other.device)
            except InvalidArgument:
                continue
            if theirs.resource != token:
                continue
            held += theirs.total
            if other.state is ControllerJobState.RUNNING:
                candidates.append(self.running_task(other, token, theirs.total))
        free = max(0, self._totals.get(token, 0) - held)
        victims = choose_victims(
            job.band,
            {token: demand.total},
            {token: free},
            candidates,
            now_ms=now_ms(),
            exempt_ms=self.preempt_exempt_ms,
        )
        if not victims:
            return
        at_ms = now_ms()
        for victim in victims:
            # Stored before the stop: a controller that restarts during the grace re-attaches to
            # the victim and still settles it PREEMPTED when Ray reports it stopped.
            victim_job = self._tracked[victim.task_id].job
            victim_job.preempted = preempted_note(job.job_id, at_ms)
            self.host.save(victim_job)
            log.info(
                "job %s (%s) preempted for job %s (%s): %d %s, grace %ss",
                victim.task_id,
                victim.band.label,
                job.job_id,
                job.band.label,
                victim.amounts[token],
                token,
                self.stop_wait_s,
            )

    async def _step(self, tracked: _Tracked) -> None:
        """Move one job forward: submit it, follow its status, stop it, settle it."""
        job = tracked.job
        sid = self._sid(job)
        if job.terminal:
            self._tracked.pop(job.job_id, None)
            return
        if tracked.fresh and not job.terminate_requested and job.job_id not in self._admitted:
            return  # waits for its turn and its devices (``_plan``)
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
            elif tracked.fresh:
                await self._submit(tracked)
            else:
                # Not in Ray (recovered, or refused): only this monitor submits, so it stays out of
                # Ray until ``_plan`` admits it, like a new job.
                tracked.fresh = True
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
            # Ray's supervisor reads it from this environment (see _STOP_WAIT).
            _STOP_WAIT: str(self.stop_wait_s),
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
        if info.driver_agent_http_address:
            name = JOB_LOGS_PATH_TEMPLATE.format(submission_id=self._sid(job))
            tracked.log_url = f"{info.driver_agent_http_address}/logs/{urllib.parse.quote(name)}"
        if status == JobStatus.RUNNING and job.state is ControllerJobState.PENDING:
            job.state = ControllerJobState.RUNNING
            job.started_ms = now_ms()
            for task in job.tasks:
                task.state = ControllerJobState.RUNNING
            self.host.save(job)
            self.host.notify(job.job_id)
            log.info("job %s running on Ray", job.job_id)
        if status.is_terminal():
            # Every byte of the log is in the controller's copy before the job is terminal there.
            with contextlib.suppress(RayRefused):
                await self._copy_log(tracked, final=True)
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
        if job.terminate_requested or tracked.timed_out or job.preempted is not None:
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
            if tracked.job.preempted is not None:
                return ControllerJobState.PREEMPTED, None, tracked.job.preempted
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

    # ---- job logs ---------------------------------------------------------------------------

    async def _copy_log(
        self, tracked: _Tracked, *, final: bool, pool: ThreadPoolExecutor | None = None
    ) -> None:
        """Bring the job's copy of its log up to Ray's: one read of at most LOG_CHUNK bytes, or with
        ``final`` (Ray's job has ended, its log is complete) as many as it takes to reach the end."""
        more = True
        while more:
            made, fetched, more, whole = await self._call(
                lambda c: self._read_log(c, tracked, final=final),
                pool,
                # A failed ranged read and the whole read after it, each with its own timeout.
                timeout_s=2 * CALL_TIMEOUT_S,
            )
            self.log_requests += made
            self.log_bytes_fetched += fetched
            self.log_whole_reads += whole
            more = more and final

    def _read_log(
        self, client: _JobsClient, tracked: _Tracked, *, final: bool
    ) -> tuple[int, int, bool, bool]:
        """On a pool thread: read the job's log past what the controller has and append its output
        to the copy. Returns (requests made to Ray, bytes received, whether more may follow,
        whether the whole log was read)."""
        job = tracked.job
        with tracked.log_lock:
            if tracked.log_url is None:
                # No driver has started: Ray has no log for the job (the Jobs API answers "").
                return 0, 0, False, False
            made = 0
            if time.monotonic() - tracked.agent_failed_at >= AGENT_RETRY_S:
                made += 1
                try:
                    fetched, more = self._read_range(client, tracked, final=final)
                    return made, fetched, more, False
                except _AgentFailed as exc:
                    tracked.agent_failed_at = time.monotonic()
                    if not self._agent_warned:
                        self._agent_warned = True
                        log.warning(
                            "backend %s: %s; reading whole job logs through the Jobs API instead",
                            self.config.id,
                            exc,
                        )
            # The fallback. Offsets in the agent's file and in the Jobs API's text need not line
            # up: the next ranged read starts from the beginning, writing only what the copy lacks.
            tracked.log_tail = None
            text = client.get_job_logs(self._sid(job)).encode()
            out = JobOutput(self._sid(job), entrypoint(job)).feed(text, final=final)
            self._append(job, out, skip=self._copied(job))
            return made + 1, len(text), False, True

    def _read_range(self, client: _JobsClient, tracked: _Tracked, *, final: bool) -> tuple[int, bool]:
        """One ranged read past the tail of the job's log, its output appended to the copy.
        Returns (bytes received, whether more may follow)."""
        assert tracked.log_url is not None
        tail = tracked.log_tail
        if tail is None or tail.url != tracked.log_url:
            output = JobOutput(self._sid(tracked.job), entrypoint(tracked.job))
            tail = _LogTail(tracked.log_url, output, skip=self._copied(tracked.job))
            tracked.log_tail = tail
        data = self._get_range(client, tail.url, tail.offset, missing_ok=not final)
        more = len(data) == LOG_CHUNK
        tail.offset += len(data)
        out = tail.output.feed(data, final=final and not more)
        dropped = min(tail.skip, len(out))
        tail.skip -= dropped
        self._append(tracked.job, out, skip=dropped)
        return len(data), more

    def _get_range(self, client: _JobsClient, url: str, offset: int, *, missing_ok: bool) -> bytes:
        """Bytes ``offset`` to ``offset + LOG_CHUNK`` of Ray's log of a job at ``url`` (fewer at its
        end, none past it). ``missing_ok``: no file yet (a driver just starting) is no bytes yet."""
        headers = {**client._headers, "Range": f"bytes={offset}-{offset + LOG_CHUNK - 1}"}
        try:
            r = requests.get(
                url, headers=headers, cookies=client._cookies, verify=client._verify, timeout=CALL_TIMEOUT_S
            )
        except requests.RequestException as exc:
            reason = f"Ray's dashboard agent at {url} does not answer ({type(exc).__name__})"
            raise _AgentFailed(reason) from None
        if r.status_code == 206 and r.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
            return r.content
        if r.status_code == 416:  # nothing past offset yet
            return b""
        if r.status_code == 404 and missing_ok:
            return b""
        if r.status_code == 200:  # the range was ignored: the whole file came
            return r.content[offset : offset + LOG_CHUNK]
        raise _AgentFailed(f"Ray's dashboard agent answered {r.status_code} for {url}")

    def _copied(self, job: JobRecord) -> int:
        path = self.log_path(job)
        return path.stat().st_size if path.exists() else 0

    def _append(self, job: JobRecord, out: bytes, *, skip: int) -> None:
        """Append ``out`` to the job's copy of its log, less its first ``skip`` bytes (the copy
        has them already)."""
        if len(out) > skip:
            with self.log_path(job).open("ab") as f:
                f.write(out[skip:])

    def _observe(self) -> None:
        """Start a new observation when anything the report depends on changed."""
        signature = (
            self._reachable,
            tuple(sorted(self._totals.items())),
            tuple(sorted(self._free.items())),
            tuple(
                sorted((jid, t.job.state is ControllerJobState.RUNNING) for jid, t in self._tracked.items())
            ),
        )
        if signature != self._signature:
            self._signature = signature
            self.observed_ms = max(now_ms(), self.observed_ms + 1)
