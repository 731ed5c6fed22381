"""The process backend: runs each job as local processes with exclusive device slots (SPEC §5).

All bookkeeping happens on the event loop thread. A fit check and the slot allocation that follows
it never straddle an ``await``, so concurrent launches cannot over-commit a backend. Every state
transition is written to the store before the executor acts on it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import logging
import os
import signal
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from iris.config import BackendConfig, ClusterConfig
from iris.controller.errors import AlreadyExists, InvalidArgument, NotFound
from iris.controller.models import ControllerJobState, LaunchRequest, LogChunk
from iris.controller.state import JobRecord, StateStore, now_ms
from iris.policy.models import Availability, BackendReport, Band, DeviceRequest, HeldByBand

log = logging.getLogger("iris.controller.executor")

# The job's environment starts from these controller variables only: the controller's own
# credentials (object-store keys, signing keys) must never leak into job processes or their logs.
PASSTHROUGH_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "VIRTUAL_ENV",
    "PYTHONPATH",
)
RUN_ID_ENV = "IRIS_RUN_ID"
CPU_RESOURCE = "cpu"
MAX_LOG_CHUNK = 1 << 20
_AUTO_VARIANTS = frozenset({"", "auto"})


@dataclass(frozen=True)
class Demand:
    """What one job takes from its backend: ``replicas`` units of ``resource`` of ``per_replica`` each."""

    resource: str  # a device token, or CPU_RESOURCE
    per_replica: int
    replicas: int

    @property
    def is_cpu(self) -> bool:
        return self.resource == CPU_RESOURCE

    @property
    def total(self) -> int:
        return self.per_replica * self.replicas


def demand_for(backend: BackendConfig, device: DeviceRequest) -> Demand:
    """Resolve a device request against a backend, or raise InvalidArgument with the reason."""
    if device.count == 0 or device.type.lower() == "cpu":
        if device.replicas > backend.cpu_slots:
            raise InvalidArgument(
                f"backend {backend.id} runs at most {backend.cpu_slots} CPU processes; "
                f"{device.replicas} replicas requested"
            )
        return Demand(CPU_RESOURCE, 1, device.replicas)
    token = device.variant.strip().lower()
    if token in _AUTO_VARIANTS:
        tokens = [t for t, n in backend.devices.items() if n > 0]
        if len(tokens) != 1:
            raise InvalidArgument(
                f"backend {backend.id} cannot resolve device variant 'auto' "
                f"(device tokens: {sorted(tokens) or 'none'}); name the variant"
            )
        token = tokens[0]
    total = backend.devices.get(token, 0)
    if total <= 0:
        raise InvalidArgument(f"backend {backend.id} has no {token!r} devices")
    if device.total > total:
        raise InvalidArgument(
            f"backend {backend.id} has {total} {token} devices; "
            f"{device.replicas}x{device.count}={device.total} requested"
        )
    return Demand(token, device.count, device.replicas)


class SlotPool:
    """Exclusive slot indices of one device token on one backend."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free: set[int] = set(range(total))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError("slot pool over-committed")  # a bug: callers check fits() first
        slots = sorted(self._free)[:n]
        self._free.difference_update(slots)
        return slots

    def give(self, slots: Iterable[int]) -> None:
        for s in slots:
            if s in self._free or not 0 <= s < self.total:
                raise RuntimeError(f"slot {s} released twice or out of range")
            self._free.add(s)


@dataclass
class BackendRuntime:
    config: BackendConfig
    pools: dict[str, SlotPool]
    cpu_free: int
    # Pending jobs per resource, each served strictly in (band, arrival) order.
    queues: dict[str, list[JobRecord]] = field(default_factory=dict)
    # The capacity observation: when this backend's slot state last changed. The federation's
    # reservations stay charged against it until the next change, so a job handed off but not
    # yet started is never offered to a second job (SPEC §5 "same observation").
    observed_ms: int = field(default_factory=lambda: now_ms())

    def changed(self) -> None:
        self.observed_ms = max(now_ms(), self.observed_ms + 1)

    def pending(self, resource: str) -> int:
        """Chips already promised to jobs waiting here: not free for anyone else."""
        return sum(demand_for(self.config, j.device).total for j in self.queues.get(resource, []))

    def fits(self, demand: Demand) -> bool:
        if demand.is_cpu:
            return self.cpu_free >= demand.replicas
        return self.pools[demand.resource].free >= demand.total


@dataclass
class _Run:
    """The live processes of one RUNNING job."""

    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)  # task index -> process
    task: asyncio.Task[None] | None = None
    killer: asyncio.Task[None] | None = None


def log_path_for(state_dir: Path, job_id: str, attempt: int) -> Path:
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:32]
    return state_dir / "logs" / f"{digest}-{attempt}.log"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _exit_code(returncode: int) -> int:
    # asyncio reports death by signal N as -N; report it the way a shell would.
    return 128 - returncode if returncode < 0 else returncode


def kill_leftovers(run_ids: set[str]) -> dict[str, int]:
    """SIGKILL every process whose environment carries one of ``run_ids``; count kills per run id.

    Processes of a job outlive a controller killed with -9 (they have their own session). The run id
    in their environment identifies them without trusting recorded pids, which may have been reused.
    """
    killed: dict[str, int] = {}
    if not run_ids:
        return killed
    markers = {f"{RUN_ID_ENV}={rid}".encode(): rid for rid in run_ids}
    proc = Path("/proc")
    if not proc.is_dir():
        return killed
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in environ.split(b"\0"):
            rid = markers.get(var)
            if rid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed[rid] = killed.get(rid, 0) + 1
                break
    return killed


class Executor:
    """Accepts, queues, runs and reports the jobs of one cluster."""

    def __init__(
        self,
        cluster: ClusterConfig,
        state_dir: Path,
        store: StateStore,
        *,
        kill_grace_s: float = 5.0,
    ) -> None:
        self.cluster = cluster
        self.state_dir = state_dir
        self.store = store
        self.kill_grace_s = kill_grace_s
        self.jobs: dict[str, JobRecord] = {}
        self.backends: dict[str, BackendRuntime] = {
            b.id: BackendRuntime(
                config=b,
                pools={t: SlotPool(n) for t, n in b.devices.items()},
                cpu_free=b.cpu_slots,
            )
            for b in cluster.backends
        }
        self._runs: dict[str, _Run] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._closing = False
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        (state_dir / "work").mkdir(parents=True, exist_ok=True)

    # ---- lifecycle -------------------------------------------------------------------------

    def recover(self) -> None:
        """Load every known job; settle the ones whose processes died with a previous controller."""
        jobs = self.store.load_all()
        lost = {j.run_id for j in jobs if j.state is ControllerJobState.RUNNING}
        killed = kill_leftovers(lost)
        for job in jobs:
            self.jobs[job.job_id] = job
            if job.state is ControllerJobState.RUNNING:
                n = killed.get(job.run_id, 0)
                note = f" ({n} leftover process(es) killed)" if n else ""
                if job.terminate_requested:
                    self._settle(
                        job,
                        ControllerJobState.KILLED,
                        error="terminated; the controller restarted before the exit was observed" + note,
                    )
                else:
                    self._settle(
                        job,
                        ControllerJobState.WORKER_FAILED,
                        error="the controller restarted while the job was running; "
                        "its processes and exit status were lost" + note,
                    )
                log.info("job %s recovered as %s%s", job.job_id, job.state, note)
            elif job.state is ControllerJobState.PENDING:
                backend = self.backends.get(job.backend_id)
                try:
                    if backend is None:
                        raise InvalidArgument(f"backend {job.backend_id} is no longer configured")
                    demand_for(backend.config, job.device)
                except InvalidArgument as exc:
                    self._settle(job, ControllerJobState.FAILED, error=exc.message)
                    continue
                self._enqueue(job)
        self._schedule()

    async def shutdown(self) -> None:
        """Stop every running job (they cannot outlive their controller unobserved)."""
        self._closing = True
        runs = list(self._runs.items())
        for job_id, run in runs:
            log.info("job %s: stopping because the controller shuts down", job_id)
            self._kill_run(self.jobs[job_id], run, grace_s=min(self.kill_grace_s, 3.0))
        tasks = [r.task for _, r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)

    # ---- API operations --------------------------------------------------------------------

    def launch(self, req: LaunchRequest) -> tuple[JobRecord, bool]:
        """Admit ``req``; return (job, created). Same requester + same nonce replays the job."""
        existing = self.jobs.get(req.job_id)
        attempts = 1
        if existing is not None:
            if existing.requester != req.requester:
                raise AlreadyExists(f"job {req.job_id} already exists from another requester")
            if existing.nonce == req.nonce:
                return existing, False
            if not existing.terminal:
                raise AlreadyExists(
                    f"job {req.job_id} is still {existing.state.value} under another nonce; "
                    "terminate it before launching a new run"
                )
            attempts = existing.attempts + 1
        backend = self.backends.get(req.backend_id)
        if backend is None:
            raise InvalidArgument(
                f"unknown backend {req.backend_id!r} on cluster {self.cluster.name} "
                f"(backends: {', '.join(sorted(self.backends))})"
            )
        demand_for(backend.config, req.device)
        job = JobRecord.new(req, seq=self.store.next_seq(), run_id=uuid.uuid4().hex, attempts=attempts)
        self.store.save(job)
        self.jobs[job.job_id] = job
        log.info(
            "job %s accepted: backend=%s band=%s requester=%s user=%s attempt=%d",
            job.job_id,
            job.backend_id,
            job.band.label,
            job.requester,
            job.user,
            job.attempts,
        )
        self._enqueue(job)
        self._schedule()
        self._notify(job.job_id)
        return job, True

    def get(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found on cluster {self.cluster.name}")
        return job

    def all_jobs(self) -> list[JobRecord]:
        return sorted(self.jobs.values(), key=lambda j: j.seq)

    async def terminate(self, job_id: str, *, wait_s: float | None = None) -> JobRecord:
        """Kill a job (pending: dropped; running: SIGTERM, then SIGKILL after the grace)."""
        job = self.get(job_id)
        if job.terminal:
            return job
        if job.state is ControllerJobState.PENDING:
            self._dequeue(job)
            self._settle(job, ControllerJobState.KILLED, error="terminated before it started")
            log.info("job %s terminated while pending", job_id)
            self._schedule()
            return job
        run = self._runs.get(job_id)
        if not job.terminate_requested:
            job.terminate_requested = True
            self.store.save(job)
            log.info("job %s: terminate requested", job_id)
            if run is not None:
                self._kill_run(job, run, grace_s=self.kill_grace_s)
        await self.wait_terminal(job_id, self.kill_grace_s + 2.0 if wait_s is None else wait_s)
        return job

    async def wait_terminal(self, job_id: str, timeout_s: float) -> JobRecord:
        """Wait up to ``timeout_s`` for the job to become terminal; return it either way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        job = self.get(job_id)
        while not job.terminal:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            event = self._changed.setdefault(job_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
            job = self.get(job_id)
        return job

    def read_log(self, job_id: str, offset: int, limit: int = MAX_LOG_CHUNK) -> LogChunk:
        job = self.get(job_id)
        terminal = job.terminal  # read before the file so eof never skips a final write
        path = log_path_for(self.state_dir, job_id, job.attempts)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                raw = f.read(max(0, min(limit, size - offset)))
        except FileNotFoundError:
            size, raw = 0, b""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        at_end = offset + len(raw) >= size
        # Hold back a split multi-byte character unless nothing more can ever follow it.
        text = decoder.decode(raw, final=terminal and at_end)
        consumed = len(raw) - len(decoder.getstate()[0])
        next_offset = offset + consumed
        return LogChunk(
            data=text,
            offset=offset,
            next_offset=next_offset,
            eof=terminal and next_offset >= size,
        )

    async def follow_log(
        self, job_id: str, offset: int, wait_s: float, limit: int = MAX_LOG_CHUNK
    ) -> LogChunk:
        """Like read_log, but wait up to ``wait_s`` for data beyond ``offset`` or the job's end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            chunk = self.read_log(job_id, offset, limit)
            if chunk.data or chunk.eof or loop.time() >= deadline:
                return chunk
            # The log is a plain file written by the job: poll it briefly.
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))

    def availability(self) -> list[BackendReport]:
        """The capacity report, computed from the live slot state (SPEC §5)."""
        held: dict[str, dict[Band, dict[str, int]]] = {b: {} for b in self.backends}
        for job in self.jobs.values():
            if job.state is not ControllerJobState.RUNNING:
                continue
            backend = self.backends.get(job.backend_id)
            if backend is None:
                continue
            demand = demand_for(backend.config, job.device)
            if demand.is_cpu:
                continue
            by_token = held[job.backend_id].setdefault(job.band, {})
            by_token[demand.resource] = by_token.get(demand.resource, 0) + demand.total
        reports = []
        for bid, backend in self.backends.items():
            reports.append(
                BackendReport(
                    backend_id=bid,
                    advertised_attributes=backend.config.attributes,
                    availability=Availability(
                        observation_epoch_ms=backend.observed_ms,
                        amounts={t: max(0, p.free - backend.pending(t)) for t, p in backend.pools.items()},
                        total_amounts={t: p.total for t, p in backend.pools.items()},
                        held_by_band=[
                            HeldByBand(band=band, amounts=amounts)
                            for band, amounts in sorted(held[bid].items())
                        ],
                    ),
                )
            )
        return reports

    # ---- scheduling ------------------------------------------------------------------------

    def _demand(self, job: JobRecord) -> Demand:
        return demand_for(self.backends[job.backend_id].config, job.device)

    def _enqueue(self, job: JobRecord) -> None:
        backend = self.backends[job.backend_id]
        queue = backend.queues.setdefault(self._demand(job).resource, [])
        queue.append(job)
        queue.sort(key=lambda j: (int(j.band), j.seq))
        backend.changed()

    def _dequeue(self, job: JobRecord) -> None:
        backend = self.backends[job.backend_id]
        queue = backend.queues.get(self._demand(job).resource, [])
        with contextlib.suppress(ValueError):
            queue.remove(job)
        backend.changed()

    def _schedule(self) -> None:
        """Start queue heads while they fit; a head that does not fit blocks its queue (no starving)."""
        if self._closing:
            return
        for backend in self.backends.values():
            for queue in backend.queues.values():
                while queue:
                    job = queue[0]
                    demand = self._demand(job)
                    if not backend.fits(demand):
                        break
                    queue.pop(0)
                    self._start(job, backend, demand)

    def _start(self, job: JobRecord, backend: BackendRuntime, demand: Demand) -> None:
        # Allocation and the RUNNING record happen before any await: no other launch can interleave.
        for task in job.tasks:
            if demand.is_cpu:
                backend.cpu_free -= 1
                task.slots = []
            else:
                task.slots = backend.pools[demand.resource].take(demand.per_replica)
            task.state = ControllerJobState.RUNNING
        job.state = ControllerJobState.RUNNING
        job.started_ms = now_ms()
        backend.changed()
        self.store.save(job)
        run = _Run()
        self._runs[job.job_id] = run
        run.task = asyncio.get_running_loop().create_task(self._run(job, run, demand))
        self._notify(job.job_id)

    def _release(self, job: JobRecord, demand: Demand) -> None:
        backend = self.backends[job.backend_id]
        for task in job.tasks:
            if demand.is_cpu:
                backend.cpu_free += 1
            else:
                backend.pools[demand.resource].give(task.slots)
        backend.changed()

    def _job_env(self, job: JobRecord, index: int, slots: list[int]) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
        env.update(job.env)
        slot_list = ",".join(str(s) for s in slots)
        env.update(
            {
                "IRIS_JOB_ID": job.job_id,
                "IRIS_CLUSTER": self.cluster.name,
                "IRIS_BACKEND_ID": job.backend_id,
                "IRIS_REPLICA_INDEX": str(index),
                "IRIS_NUM_REPLICAS": str(len(job.tasks)),
                "IRIS_DEVICE_SLOTS": slot_list,
                "CUDA_VISIBLE_DEVICES": slot_list,
                RUN_ID_ENV: job.run_id,
            }
        )
        return env

    async def _run(self, job: JobRecord, run: _Run, demand: Demand) -> None:
        path = log_path_for(self.state_dir, job.job_id, job.attempts)
        workdir = self.state_dir / "work" / path.stem
        workdir.mkdir(parents=True, exist_ok=True)
        outcome: tuple[ControllerJobState, int | None, str | None]
        try:
            with path.open("ab") as logf:
                outcome = await self._spawn_and_wait(job, run, logf.fileno(), workdir)
            # Descendants that left the process group (setsid, daemons) must not outlive the job.
            stray = await asyncio.to_thread(kill_leftovers, {job.run_id})
            if stray:
                log.info("job %s: killed %d stray process(es) it left behind", job.job_id, stray[job.run_id])
        except Exception as exc:  # a controller-side failure must still settle the job
            log.exception("job %s: executor error", job.job_id)
            for proc in run.procs.values():
                _signal_group(proc.pid, signal.SIGKILL)
            outcome = (ControllerJobState.WORKER_FAILED, None, f"controller error: {type(exc).__name__}")
        finally:
            if run.killer is not None:
                run.killer.cancel()
            self._runs.pop(job.job_id, None)
            self._release(job, demand)
        state, code, error = outcome
        if self._closing and state is not ControllerJobState.SUCCEEDED and not job.terminate_requested:
            state, code, error = (
                ControllerJobState.WORKER_FAILED,
                None,
                "the controller shut down while the job was running",
            )
        self._settle(job, state, exit_code=code, error=error)
        log.info(
            "job %s finished: %s exit_code=%s%s", job.job_id, state, code, f" ({error})" if error else ""
        )
        self._schedule()

    async def _spawn_and_wait(
        self, job: JobRecord, run: _Run, log_fd: int, workdir: Path
    ) -> tuple[ControllerJobState, int | None, str | None]:
        for task in job.tasks:
            if job.terminate_requested:
                break
            try:
                proc = await asyncio.create_subprocess_exec(
                    *job.command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=log_fd,
                    env=self._job_env(job, task.index, task.slots),
                    cwd=workdir,
                    start_new_session=True,
                )
            except OSError as exc:
                for p in run.procs.values():
                    _signal_group(p.pid, signal.SIGKILL)
                    await p.wait()
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                return ControllerJobState.FAILED, code, f"cannot start {job.command[0]!r}: {exc.strerror}"
            run.procs[task.index] = proc
            task.pid = proc.pid
        self.store.save(job)
        if job.terminate_requested:
            self._kill_run(job, run, grace_s=self.kill_grace_s)
        log.info("job %s started: pids=%s", job.job_id, [p.pid for p in run.procs.values()])

        waits = {asyncio.ensure_future(p.wait()): idx for idx, p in run.procs.items()}
        loop = asyncio.get_running_loop()
        deadline = None if job.timeout_s is None else loop.time() + job.timeout_s
        first_failure: int | None = None
        timed_out = False
        killing = False  # True once we stopped the job ourselves: later exits are not its verdict
        pending = set(waits)
        while pending:
            killing = killing or job.terminate_requested or timed_out
            timeout = None if deadline is None or timed_out else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                idx = waits[fut]
                code = _exit_code(fut.result())
                task = job.tasks[idx]
                task.exit_code = code
                if code == 0:
                    task.state = ControllerJobState.SUCCEEDED
                elif killing:
                    task.state = ControllerJobState.KILLED
                else:
                    task.state = ControllerJobState.FAILED
                # Sweep what the replica left behind in its process group.
                _signal_group(run.procs[idx].pid, signal.SIGKILL)
                # Exit codes of replicas we killed (timeout, terminate) are not the job's failure.
                if code != 0 and not killing:
                    first_failure = code
                    killing = True
                    if pending:
                        # A gang with a dead replica cannot finish: stop the others.
                        self._kill_run(job, run, grace_s=self.kill_grace_s)
            if not done and not timed_out:
                timed_out = True
                log.info("job %s timed out after %ss", job.job_id, job.timeout_s)
                self._kill_run(job, run, grace_s=self.kill_grace_s)
            if done:
                self.store.save(job)
                self._notify(job.job_id)

        if job.terminate_requested:
            return ControllerJobState.KILLED, None, "terminated on request"
        if timed_out:
            return ControllerJobState.FAILED, first_failure, "timed out"
        if first_failure is not None:
            return ControllerJobState.FAILED, first_failure, None
        return ControllerJobState.SUCCEEDED, 0, None

    def _kill_run(self, job: JobRecord, run: _Run, *, grace_s: float) -> None:
        """SIGTERM every live process group of the job now, SIGKILL what remains after ``grace_s``."""
        live = [p for p in run.procs.values() if p.returncode is None]
        for proc in live:
            _signal_group(proc.pid, signal.SIGTERM)
        if run.killer is None or run.killer.done():
            run.killer = asyncio.get_running_loop().create_task(self._escalate(job.job_id, run, grace_s))

    async def _escalate(self, job_id: str, run: _Run, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        for proc in run.procs.values():
            if proc.returncode is None:
                log.info("job %s: pid %d ignored SIGTERM for %ss, sending SIGKILL", job_id, proc.pid, grace_s)
                _signal_group(proc.pid, signal.SIGKILL)

    def _settle(
        self,
        job: JobRecord,
        state: ControllerJobState,
        *,
        exit_code: int | None = None,
        error: str | None = None,
    ) -> None:
        job.state = state
        job.exit_code = exit_code
        job.error = error
        job.finished_ms = now_ms()
        for task in job.tasks:
            if not task.state.terminal:
                task.state = state
        self.store.save(job)
        self._notify(job.job_id)

    def _notify(self, job_id: str) -> None:
        event = self._changed.pop(job_id, None)
        if event is not None:
            event.set()
