"""The process backend: runs each job as local processes with exclusive device slots
(docs/DESIGN.md, "Components").

All bookkeeping happens on the event loop thread. A fit check and the slot allocation that follows
it never straddle an ``await``, so concurrent launches cannot over-commit a backend. Every state
transition is written to the store before the backend acts on it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import math
import os
import secrets
import signal
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from iris.bundle import BundleError
from iris.config import BackendConfig
from iris.controller.errors import InvalidArgument
from iris.controller.executors.base import CPU_RESOURCE, Backend, Demand, JobHost
from iris.controller.models import TIMED_OUT, ControllerJobState, preempted_note
from iris.controller.privileges import RunAs, chown_tree, harden_state_dir, resolve_run_as
from iris.controller.sandbox import (
    LAUNCH_ENV,
    Sandbox,
    UidLease,
    WorkdirOverlay,
    find_command,
    signal_sandbox,
)
from iris.controller.state import JobRecord, now_ms
from iris.policy.models import BackendReport, Band, HeldByBand
from iris.policy.preemption import RunningTask, choose_victims, is_exempt, may_preempt

log = logging.getLogger("iris.controller.executor")

# A job's environment is its spec's env, the IRIS_* variables, HOME (its working directory) and
# only these of the controller's: its credentials (object-store keys, key paths) and anything else
# in its environment never reach a job (docs/DESIGN.md, "Job → controller").
PASSTHROUGH_ENV = ("PATH", "LANG")
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
RUN_ID_ENV = "IRIS_RUN_ID"
WORK_DIR = "work"


def work_dir_for(state_dir: Path, log_path: Path) -> Path:
    """A fresh directory for one run: ``work/<digest>-<attempt>-<random>``, the log file's stem
    (``log_path_for``) and an unguessable suffix (docs/DESIGN.md, "Job → controller")."""
    return state_dir / WORK_DIR / f"{log_path.stem}-{secrets.token_hex(16)}"


def work_dir_attempt(name: str) -> str:
    """The ``<digest>-<attempt>`` of a work directory's name: the stem of its run's log file."""
    return name.rsplit("-", 1)[0]


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


# How soon a queue head that found no free uid in the sandbox pool asks again (a run here that ends
# frees one and schedules at once; this is for the pool's other controllers on the host).
UID_RETRY_S = 1.0


@dataclass
class _Run:
    """The live processes of one RUNNING job."""

    job: JobRecord
    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)  # task index -> process
    task: asyncio.Task[None] | None = None
    killer: asyncio.Task[None] | None = None
    # The pool uid the job's sandboxes run as, held until its processes are gone.
    lease: UidLease | None = None
    # The working directory's overlay, mounted by the job's sandbox itself (WorkdirOverlay).
    overlay: WorkdirOverlay | None = None


def _with_cpu(entries: list[HeldByBand], slots: dict[Band, int]) -> list[HeldByBand]:
    """``entries`` (chips by band) with the CPU slots of ``slots`` added as the ``cpu`` token."""
    if not slots:
        return entries
    by_band = {h.band: dict(h.amounts) for h in entries}
    for band, n in slots.items():
        by_band.setdefault(band, {})[CPU_RESOURCE] = n
    return [HeldByBand(band=b, amounts=a) for b, a in sorted(by_band.items())]


def _queue_order(job: JobRecord) -> tuple[int, int]:
    return int(job.band), job.seq


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _exit_code(returncode: int) -> int:
    # asyncio reports death by signal N as -N; report it the way a shell would.
    return 128 - returncode if returncode < 0 else returncode


def kill_leftovers(run_ids: set[str], skip: AbstractSet[int] = frozenset()) -> dict[str, int]:
    """SIGKILL every process whose environment carries one of ``run_ids``; count kills per run id.

    Processes of a job outlive a controller killed with -9 (they have their own session). The run id
    in their environment identifies them without trusting recorded pids, which may have been reused.
    One call reads every process's environment: ask for many run ids at once (``LeftoverSweeper``).
    ``skip``: pids known to be of no asked run, whose environment is not read (the live main
    processes of other runs: children not yet reaped, so their pids cannot have been reused).
    """
    killed: dict[str, int] = {}
    if not run_ids:
        return killed
    markers = {f"{RUN_ID_ENV}={rid}".encode(): rid for rid in run_ids}
    prefix = f"{RUN_ID_ENV}=".encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return killed
    for name in names:
        if not name.isdigit() or (skip and int(name) in skip):
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if prefix not in environ:  # not a job's process: most of them
            continue
        for var in environ.split(b"\0"):
            rid = markers.get(var)
            if rid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(name), signal.SIGKILL)
                    killed[rid] = killed.get(rid, 0) + 1
                break
    return killed


class LeftoverSweeper:
    """Kills what ended runs left behind (``kill_leftovers``), one scan for every run that ended
    while the previous scan ran: a scan reads every process's environment, so one scan per ending
    job would cost O(processes) each, O(N²) when N running jobs end together (docs/DESIGN.md,
    "Controller costs"). Scans begin at most every ``min_interval_s``, so jobs ending at any rate
    cost at most a few scans a second; a job ending alone is scanned for at once. A run is only ever
    answered by a scan that began after it asked.

    ``skip`` names, when a scan begins, the pids whose environment it need not read
    (``kill_leftovers``). ``asked`` and ``scans`` count the runs asked for and the scans made."""

    def __init__(
        self, min_interval_s: float = 0.25, skip: Callable[[], AbstractSet[int]] | None = None
    ) -> None:
        self.min_interval_s = min_interval_s
        self._skip = skip
        self._waiting: dict[str, asyncio.Future[int]] = {}
        self._scanning: asyncio.Task[None] | None = None
        self._last_scan = -math.inf
        self.asked = 0
        self.scans = 0

    async def kill(self, run_id: str) -> int:
        """SIGKILL the processes left with ``run_id`` in their environment; how many."""
        loop = asyncio.get_running_loop()
        self.asked += 1
        future = self._waiting.get(run_id)
        if future is None:
            future = self._waiting[run_id] = loop.create_future()
        if self._scanning is None or self._scanning.done():
            self._scanning = loop.create_task(self._scan())
        return await asyncio.shield(future)

    async def _scan(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            await asyncio.sleep(max(0.0, self._last_scan + self.min_interval_s - loop.time()))
            self._last_scan = loop.time()
            batch, self._waiting = self._waiting, {}
            skip = self._skip() if self._skip is not None else frozenset()
            self.scans += 1
            try:
                killed = await asyncio.to_thread(kill_leftovers, set(batch), skip)
            except Exception as exc:  # each waiter's job settles with it
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for run_id, future in batch.items():
                if not future.done():
                    future.set_result(killed.get(run_id, 0))


def settle_lost_run(host: JobHost, job: JobRecord, killed: int) -> None:
    """A job recorded RUNNING by a previous controller whose processes died (or were killed) with it."""
    note = f" ({killed} leftover process(es) killed)" if killed else ""
    if job.terminate_requested:
        host.settle(
            job,
            ControllerJobState.KILLED,
            error="terminated; the controller restarted before the exit was observed" + note,
        )
    elif job.preempted is not None:
        # Preempted, and the controller restarted during the grace: still a preemption (the job
        # goes back to its queue at home), not a lost worker.
        host.settle(
            job,
            ControllerJobState.PREEMPTED,
            error=f"{job.preempted}; the controller restarted during its grace" + note,
        )
    else:
        host.settle(
            job,
            ControllerJobState.WORKER_FAILED,
            error="the controller restarted while the job was running; "
            "its processes and exit status were lost" + note,
        )
    log.info("job %s recovered as %s%s", job.job_id, job.state, note)


class ProcessBackend(Backend):
    """Local processes, one per replica, each holding exclusive slots of its backend."""

    def __init__(self, config: BackendConfig, host: JobHost, *, kill_grace_s: float = 5.0) -> None:
        super().__init__(config, host)
        self.kill_grace_s = kill_grace_s
        # A preempted job's SIGTERM-to-SIGKILL grace (docs/DESIGN.md, "Preemption").
        self.preempt_grace_s = host.cluster.preempt_grace_s
        self.pools = {t: SlotPool(n) for t, n in config.devices.items()}
        self.cpu_free = config.cpu_slots
        # Pending jobs per resource, each served strictly in (band, arrival) order, and the chips
        # promised to them (kept as jobs come and go: the capacity report costs no walk of a queue).
        self.queues: dict[str, list[JobRecord]] = {}
        self._promised: dict[str, int] = {}
        # The capacity observation: when this backend's slot state last changed. The federation's
        # reservations stay charged against it until the next change, so a job handed off but not
        # yet started is never offered to a second job (docs/DESIGN.md, "The ledger").
        self.observed_ms = now_ms()
        self._runs: dict[str, _Run] = {}
        self._leftovers = LeftoverSweeper(skip=self._live_main_pids)
        self._closing = False
        # A queue head that waits only because lower-band runs are exempt from preemption is
        # scheduled again when the first exemption ends (no other event may come).
        self._exemption_ends: asyncio.TimerHandle | None = None
        self._uid_retry: asyncio.TimerHandle | None = None
        # Who the jobs run as; the state dir's modes follow (docs/DESIGN.md, "Job → controller").
        # In the sandbox, each job runs as a uid of the cluster's pool and sees its own working
        # directory by a bind: run_as is the fallback of a host that cannot sandbox
        # (docs/SECURITY.md, "The job sandbox").
        self.sandbox = Sandbox.for_cluster(host.cluster, host.state_dir)
        # Work directories by absolute path: a sandbox binds them there.
        self._state_dir = Path(os.path.abspath(host.state_dir))
        self.run_as = resolve_run_as(host.cluster)
        traverse = self.run_as.switch and not self.sandbox.enabled
        harden_state_dir(host.state_dir, self.run_as, traverse=traverse)

    # ---- bookkeeping -----------------------------------------------------------------------

    def changed(self) -> None:
        self.observed_ms = max(now_ms(), self.observed_ms + 1)

    def _live_main_pids(self) -> set[int]:
        """The pids of the runs' own processes not yet seen to exit: none is another run's
        leftover. A child's pid stays taken until it is reaped; one reaped while a scan runs could
        only be reused once Linux's cyclic pid allocation has come round the whole pid space."""
        return {p.pid for run in self._runs.values() for p in run.procs.values() if p.returncode is None}

    def pending(self, resource: str) -> int:
        """Chips already promised to jobs waiting here: not free for anyone else."""
        return self._promised.get(resource, 0)

    def fits(self, demand: Demand) -> bool:
        if demand.is_cpu:
            return self.cpu_free >= demand.replicas
        return self.pools[demand.resource].free >= demand.total

    # ---- Backend ---------------------------------------------------------------------------

    def recover(self, jobs: list[JobRecord]) -> None:
        lost = {j.run_id for j in jobs if j.state is ControllerJobState.RUNNING}
        killed = kill_leftovers(lost)
        if self.sandbox.pool is not None:
            # A lost run's pool uid: whatever still runs as it is the lost run's (a process that
            # cleared its environment escapes kill_leftovers, not this), unless another controller
            # has leased the uid since.
            for job in jobs:
                uid = job.tasks[0].uid if job.tasks and job.state is ControllerJobState.RUNNING else None
                if uid is not None:
                    killed[job.run_id] = killed.get(job.run_id, 0) + self.sandbox.pool.reclaim(uid)
        for job in jobs:
            if job.state is ControllerJobState.RUNNING:
                settle_lost_run(self.host, job, killed.get(job.run_id, 0))
            elif job.state is ControllerJobState.PENDING:
                try:
                    self.demand(job.device)
                except InvalidArgument as exc:
                    self.host.settle(job, ControllerJobState.FAILED, error=exc.message)
                    continue
                self._enqueue(job)
        self._schedule()

    def accept(self, job: JobRecord) -> None:
        self._enqueue(job)
        self._schedule()

    def cancel_pending(self, job: JobRecord) -> bool:
        self._dequeue(job)
        self.host.settle(job, ControllerJobState.KILLED, error="terminated before it started")
        self._schedule()
        return True

    def stop(self, job: JobRecord) -> None:
        run = self._runs.get(job.job_id)
        if run is not None:
            self._kill_run(job, run, grace_s=self.kill_grace_s)

    def report(self) -> BackendReport:
        """Device chips per token and CPU slots as the ``cpu`` token (docs/DESIGN.md, "Vocabulary":
        one slot per replica), each free minus what PENDING jobs here are promised."""
        free = {t: max(0, p.free - self.pending(t)) for t, p in self.pools.items()}
        totals = {t: p.total for t, p in self.pools.items()}
        free[CPU_RESOURCE] = max(0, self.cpu_free - self.pending(CPU_RESOURCE))
        totals[CPU_RESOURCE] = self.config.cpu_slots
        running = [run.job for run in self._runs.values()]
        at_ms = now_ms()
        report = self.capacity_report(
            self.observed_ms, free=free, totals=totals, running=running, at_ms=at_ms
        )
        report.sandbox = self.sandbox.status
        # capacity_report counts device chips only; running CPU jobs hold their slots by band too
        # (and exempt ones hold them beyond reclaim, like chips).
        cpu_held: dict[Band, int] = {}
        cpu_exempt: dict[Band, int] = {}
        for job in running:
            try:
                demand = self.demand(job.device)
            except InvalidArgument:  # recovered under a config that no longer has its device
                continue
            if demand.is_cpu:
                cpu_held[job.band] = cpu_held.get(job.band, 0) + demand.replicas
                if self.exempt(job, at_ms):
                    cpu_exempt[job.band] = cpu_exempt.get(job.band, 0) + demand.replicas
        block = report.availability
        if block is not None:
            block.held_by_band = _with_cpu(block.held_by_band, cpu_held)
            block.exempt_by_band = _with_cpu(block.exempt_by_band, cpu_exempt)
        return report

    async def shutdown(self) -> None:
        """Stop every running job (they cannot outlive their controller unobserved)."""
        self._closing = True
        if self._exemption_ends is not None:
            self._exemption_ends.cancel()
        if self._uid_retry is not None:
            self._uid_retry.cancel()
        runs = list(self._runs.items())
        for job_id, run in runs:
            log.info("job %s: stopping because the controller shuts down", job_id)
            self._kill_run(run.job, run, grace_s=min(self.kill_grace_s, 3.0))
        tasks = [r.task for _, r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=10.0)

    # ---- scheduling ------------------------------------------------------------------------

    def _enqueue(self, job: JobRecord) -> None:
        demand = self.demand(job.device)
        bisect.insort(self.queues.setdefault(demand.resource, []), job, key=_queue_order)
        self._promised[demand.resource] = self._promised.get(demand.resource, 0) + demand.total
        self.changed()

    def _dequeue(self, job: JobRecord) -> None:
        demand = self.demand(job.device)
        try:
            self.queues.get(demand.resource, []).remove(job)
        except ValueError:
            pass
        else:
            self._promised[demand.resource] -= demand.total
        self.changed()

    def _schedule(self) -> None:
        """Start queue heads while they fit; a head that does not fit blocks its queue (no starving)
        and preempts the lower-band runs it needs, if any (docs/DESIGN.md, "Preemption")."""
        if self._closing:
            return
        for queue in self.queues.values():
            while queue:
                job = queue[0]
                demand = self.demand(job.device)
                if not self.fits(demand):
                    self._preempt_for(job, demand)
                    break
                lease = None
                if self.sandbox.pool is not None:
                    # A root controller's job needs a pool uid too: with none free the head waits,
                    # PENDING, as for devices (a start never fails for want of a uid).
                    lease = self.sandbox.pool.take()
                    if lease is None:
                        self._retry_for_uid()
                        break
                queue.pop(0)
                self._promised[demand.resource] -= demand.total
                self._start(job, demand, lease)

    def _retry_for_uid(self) -> None:
        """Schedule again in UID_RETRY_S: a uid frees when any run here ends (which schedules at
        once) or when another controller sharing the host's pool ends one (which nothing here sees)."""
        if self._uid_retry is not None and not self._uid_retry.cancelled():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (recovery): the next event schedules
            return
        self._uid_retry = loop.call_later(UID_RETRY_S, self._uid_retried)

    def _uid_retried(self) -> None:
        self._uid_retry = None
        self._schedule()

    def _preempt_for(self, job: JobRecord, demand: Demand) -> None:
        """Preempt the runs ``choose_victims`` picks for the waiting ``job``: SIGTERM now, SIGKILL
        after the cluster's grace. Capacity that runs already being stopped will release counts as
        free, so a head that waits for them preempts no one else."""
        resource = demand.resource
        free = self.cpu_free if demand.is_cpu else self.pools[resource].free
        candidates: list[RunningTask] = []
        for run in self._runs.values():
            try:
                held = self.demand(run.job.device)
            except InvalidArgument:  # recovered under a config that no longer has its device
                continue
            if held.resource != resource:
                continue
            if run.job.preempted is not None or run.job.terminate_requested:
                free += held.total  # on its way out
                continue
            candidates.append(self.running_task(run.job, resource, held.total))
        at_ms = now_ms()
        victims = choose_victims(
            job.band,
            {resource: demand.total},
            {resource: free},
            candidates,
            now_ms=at_ms,
            exempt_ms=self.preempt_exempt_ms,
        )
        if victims is None:
            self._schedule_at_exemption_end(job.band, candidates, at_ms)
        if not victims:
            return
        for victim in victims:
            run = self._runs[victim.task_id]
            # Recorded before the first signal: a controller that restarts during the grace still
            # knows the job was preempted, not lost (settle_lost_run).
            run.job.preempted = preempted_note(job.job_id, at_ms)
            self.host.save(run.job)
            log.info(
                "job %s (%s) preempted for job %s (%s): %d %s, grace %ss",
                victim.task_id,
                victim.band.label,
                job.job_id,
                job.band.label,
                victim.amounts[resource],
                resource,
                self.preempt_grace_s,
            )
            self._kill_run(run.job, run, grace_s=self.preempt_grace_s)

    def _schedule_at_exemption_end(self, band: Band, candidates: list[RunningTask], at_ms: int) -> None:
        """Run ``_schedule`` again when the first exemption among ``candidates`` a job of ``band``
        could preempt ends: then they may make room, and no start or end may come before."""
        ends = [
            c.started_ms + self.preempt_exempt_ms
            for c in candidates
            if may_preempt(band, c.band) and is_exempt(c, now_ms=at_ms, exempt_ms=self.preempt_exempt_ms)
        ]
        if not ends:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the event loop (recovery): the next event schedules
            return
        # Wall-clock ms to the loop's clock, with a margin so the exemption has ended by then.
        when = loop.time() + max(0.01, (min(ends) - at_ms) / 1000 + 0.005)
        timer = self._exemption_ends
        if timer is not None and not timer.cancelled() and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._exemption_ends = loop.call_at(when, self._exemption_ended)

    def _exemption_ended(self) -> None:
        self._exemption_ends = None
        self._schedule()

    def _start(self, job: JobRecord, demand: Demand, lease: UidLease | None = None) -> None:
        # Allocation and the RUNNING record happen before any await: no other launch can interleave.
        for task in job.tasks:
            if demand.is_cpu:
                self.cpu_free -= 1
                task.slots = []
            else:
                task.slots = self.pools[demand.resource].take(demand.per_replica)
            task.state = ControllerJobState.RUNNING
        job.state = ControllerJobState.RUNNING
        job.started_ms = now_ms()
        self.changed()
        self.host.save(job)
        run = _Run(job, lease=lease)
        self._runs[job.job_id] = run
        run.task = asyncio.get_running_loop().create_task(self._run(job, run, demand))
        self.host.notify(job.job_id)

    def _release(self, job: JobRecord, demand: Demand) -> None:
        for task in job.tasks:
            if demand.is_cpu:
                self.cpu_free += 1
            else:
                self.pools[demand.resource].give(task.slots)
        self.changed()

    def _job_env(self, job: JobRecord, index: int, slots: list[int], workdir: Path) -> dict[str, str]:
        env = {k: os.environ.get(k) or DEFAULT_ENV[k] for k in PASSTHROUGH_ENV}
        env["HOME"] = str(workdir)
        env.update(job.env)
        slot_list = ",".join(str(s) for s in slots)
        env.update(
            {
                "IRIS_JOB_ID": job.job_id,
                "IRIS_CLUSTER": self.host.cluster.name,
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
        path = self.log_path(job)
        # A fresh private directory per run, named unguessably: the work dir cannot be listed, so a
        # job reaches no other job's directory by its path (docs/DESIGN.md, "Job → controller").
        workdir = work_dir_for(self._state_dir, path)
        outcome: tuple[ControllerJobState, int | None, str | None]
        owner: RunAs | None = None  # who the working directory was given to
        # The directory that holds the job's writes: the working directory itself, or the layer
        # of an overlay mounted on it (BundleStore.workspace).
        writable = workdir
        try:
            workdir.mkdir(mode=0o700)
            writable, unpacked = await self._unpack(job, run, workdir)
            if unpacked is None:
                owner, unpacked = await self._identity(job, run)
            if owner is not None and writable != workdir:
                # The overlay's root is its layer's: the shared files stay the controller's, a
                # job's uid reads them and writes into its layer.
                os.lchown(writable, owner.uid, owner.gid)
            elif owner is not None:
                await asyncio.to_thread(chown_tree, workdir, owner)
            if unpacked is not None:
                outcome = unpacked
            else:
                with path.open("ab") as logf:
                    outcome = await self._spawn_and_wait(job, run, logf.fileno(), workdir)
            # Descendants that left the process group (setsid, daemons) must not outlive the job.
            # A sandboxed job has none left: its sandboxes' PID namespaces ended with their inits,
            # taking every process of the job with them (no process leaves a PID namespace), so
            # only an unsandboxed run costs a look through /proc (docs/DESIGN.md, "Controller
            # costs").
            if not self.sandbox.enabled:
                stray = await self._leftovers.kill(job.run_id)
                if stray:
                    log.info("job %s: killed %d stray process(es) it left behind", job.job_id, stray)
        except Exception as exc:  # a controller-side failure must still settle the job
            log.exception("job %s: executor error", job.job_id)
            for proc in run.procs.values():
                self._signal(proc.pid, signal.SIGKILL)
            outcome = (ControllerJobState.WORKER_FAILED, None, f"controller error: {type(exc).__name__}")
        finally:
            if run.killer is not None:
                run.killer.cancel()
            if writable != workdir:
                try:
                    await asyncio.to_thread(self.host.bundles.release, workdir)
                except OSError as exc:
                    log.warning("job %s: %s", job.job_id, exc)
            if owner is not None:
                # The run is over: its directory goes back to the controller, out of reach of
                # later jobs that run as the same user (docs/DESIGN.md, "Job → controller").
                with contextlib.suppress(OSError):
                    os.chown(writable, os.geteuid(), os.getegid())
            if run.lease is not None:
                # Every process of the job is gone with its sandboxes' PID namespaces: the uid
                # is released clean, and its next run need not look through /proc for it.
                run.lease.release(clean=True)
            self._runs.pop(job.job_id, None)
            self._release(job, demand)
        state, code, error = outcome
        ended = (ControllerJobState.SUCCEEDED, ControllerJobState.PREEMPTED)
        if self._closing and state not in ended and not job.terminate_requested:
            state, code, error = (
                ControllerJobState.WORKER_FAILED,
                None,
                "the controller shut down while the job was running",
            )
        self.host.settle(job, state, exit_code=code, error=error)
        log.info(
            "job %s finished: %s exit_code=%s%s", job.job_id, state, code, f" ({error})" if error else ""
        )
        self._schedule()

    async def _identity(
        self, job: JobRecord, run: _Run
    ) -> tuple[RunAs | None, tuple[ControllerJobState, int | None, str | None] | None]:
        """Who the job runs as, if not the controller's own user, or why it cannot start. A pool
        uid is recorded with the job before any process runs as it: a controller that restarts
        knows what to reclaim (``recover``)."""
        pool = self.sandbox.pool
        if pool is None:
            return (self.run_as if self.run_as.switch and not self.sandbox.enabled else None), None
        taken = run.lease  # the scheduler's (``_schedule``: a run with a pool starts with one)
        if taken is None or await asyncio.to_thread(pool.busy, taken):
            # A process runs as the uid the scheduler took (a lost run's leftover, or the
            # operator's): another one, checked, if the pool has one.
            if taken is not None:
                taken.release()
            run.lease = await asyncio.to_thread(pool.lease, skip=taken.uid if taken else None)
        if run.lease is None:
            return None, (
                ControllerJobState.WORKER_FAILED,
                None,
                f"no free uid in the cluster's sandbox pool ({self.host.cluster.sandbox_uids})",
            )
        uid = run.lease.uid
        for task in job.tasks:
            task.uid = uid
        self.host.save(job)
        return RunAs(user=f"uid {uid}", uid=uid, gid=uid, switch=True), None

    async def _unpack(
        self, job: JobRecord, run: _Run, workdir: Path
    ) -> tuple[Path, tuple[ControllerJobState, int | None, str | None] | None]:
        """Give the job's working directory its workspace bundle (the bundle's one copy through an
        overlay, or a copy of its own: BundleStore.workspace); the directory that takes the job's
        writes, and the job's failure if that failed. A one-replica job in a sandbox that can
        mount it gets its overlay from its sandbox (``run.overlay``): no mount is made in this
        controller's namespace, which every new sandbox copies (a job's start would otherwise grow
        with the jobs running). Replicas share one layer, so theirs is mounted here."""
        bundle = job.bundle
        if bundle is None:
            return workdir, None
        bundles = self.host.bundles
        inside = self.sandbox.enabled and self.sandbox.overlays and bundles.overlays and len(job.tasks) == 1
        try:
            writable = await asyncio.to_thread(bundles.workspace, bundle, workdir, mount=not inside)
            if inside:
                run.overlay = bundles.overlay_of(bundle, workdir)
            return writable, None
        except (BundleError, OSError) as exc:
            log.warning("job %s: cannot unpack bundle %s: %s", job.job_id, bundle[:12], exc)
            return workdir, (ControllerJobState.FAILED, None, f"cannot unpack the workspace bundle: {exc}")

    async def _spawn_and_wait(
        self, job: JobRecord, run: _Run, log_fd: int, workdir: Path
    ) -> tuple[ControllerJobState, int | None, str | None]:
        for task in job.tasks:
            if job.terminate_requested or job.preempted is not None:
                break
            env = self._job_env(job, task.index, task.slots, workdir)
            try:
                if self.sandbox.enabled:
                    proc = await self._spawn_sandboxed(job, run, env, log_fd, workdir)
                else:
                    # As root: the run_as uid, its primary group, no supplementary group (root's
                    # would stay otherwise). The log file was opened by the controller: the job
                    # inherits the fd.
                    switch = self.run_as.switch
                    proc = await asyncio.create_subprocess_exec(
                        *job.command,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=log_fd,
                        stderr=log_fd,
                        env=env,
                        cwd=workdir,
                        start_new_session=True,
                        user=self.run_as.uid if switch else None,
                        group=self.run_as.gid if switch else None,
                        extra_groups=[] if switch else None,
                    )
            except OSError as exc:
                for p in run.procs.values():
                    self._signal(p.pid, signal.SIGKILL)
                    await p.wait()
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                return ControllerJobState.FAILED, code, f"cannot start {job.command[0]!r}: {exc.strerror}"
            run.procs[task.index] = proc
            task.pid = proc.pid
        self.host.save(job)
        if job.terminate_requested:
            self._kill_run(job, run, grace_s=self.kill_grace_s)
        elif job.preempted is not None:
            self._kill_run(job, run, grace_s=self.preempt_grace_s)
        log.info("job %s started: pids=%s", job.job_id, [p.pid for p in run.procs.values()])

        waits = {asyncio.ensure_future(p.wait()): idx for idx, p in run.procs.items()}
        loop = asyncio.get_running_loop()
        deadline = None if job.timeout_s is None else loop.time() + job.timeout_s
        first_failure: int | None = None
        timed_out = False
        killing = False  # True once we stopped the job ourselves: later exits are not its verdict
        pending = set(waits)
        while pending:
            killing = killing or job.terminate_requested or timed_out or job.preempted is not None
            timeout = None if deadline is None or timed_out else max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                # A preemption decided while we waited: the exits it causes are not failures.
                killing = killing or job.preempted is not None
                idx = waits[fut]
                code = _exit_code(fut.result())
                task = job.tasks[idx]
                task.exit_code = code
                preempted = job.preempted is not None and not job.terminate_requested and not timed_out
                if code == 0:
                    task.state = ControllerJobState.SUCCEEDED
                elif preempted and first_failure is None:
                    task.state = ControllerJobState.PREEMPTED
                elif killing:
                    task.state = ControllerJobState.KILLED
                else:
                    task.state = ControllerJobState.FAILED
                # Sweep what the replica left behind in its process group (a sandbox's ended
                # with its PID namespace).
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
                self.host.save(job)
                self.host.notify(job.job_id)

        if job.terminate_requested:
            return ControllerJobState.KILLED, None, "terminated on request"
        if timed_out:
            return ControllerJobState.FAILED, first_failure, TIMED_OUT
        if first_failure is not None:
            return ControllerJobState.FAILED, first_failure, None
        if job.preempted is not None and any(t.state is not ControllerJobState.SUCCEEDED for t in job.tasks):
            return ControllerJobState.PREEMPTED, None, job.preempted
        return ControllerJobState.SUCCEEDED, 0, None

    async def _spawn_sandboxed(
        self, job: JobRecord, run: _Run, env: dict[str, str], log_fd: int, workdir: Path
    ) -> asyncio.subprocess.Process:
        """One replica in its sandbox (iris/controller/sandbox.py). bwrap gets a fixed environment;
        the job's own reaches the launcher inside, as the job's uid, through its stdin."""
        uid = run.lease.uid if run.lease is not None else None
        overlay = run.overlay
        why = find_command(
            self.sandbox.view,
            job.command[0],
            path_env=env.get("PATH", ""),
            workdir=workdir,
            uid=uid,
            workdir_files=overlay.lower if overlay is not None else None,
        )
        if why is not None:
            raise (PermissionError if why == "Permission denied" else FileNotFoundError)(0, why)
        env_fd = os.memfd_create("iris-job-env", os.MFD_CLOEXEC)
        try:
            os.write(env_fd, json.dumps(env).encode())
            os.lseek(env_fd, 0, os.SEEK_SET)
            return await asyncio.create_subprocess_exec(
                *self.sandbox.argv(job.command, workdir=workdir, uid=uid, overlay=overlay),
                stdin=env_fd,
                stdout=log_fd,
                stderr=log_fd,
                env=LAUNCH_ENV,
                cwd=workdir,
                start_new_session=True,
            )
        finally:
            os.close(env_fd)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        """``sig`` to every process of one replica: its sandbox's, or its process group."""
        if self.sandbox.enabled:
            signal_sandbox(pid, sig)
        else:
            _signal_group(pid, sig)

    def _kill_run(self, job: JobRecord, run: _Run, *, grace_s: float) -> None:
        """SIGTERM every live process of the job now, SIGKILL what remains after ``grace_s``."""
        live = [p for p in run.procs.values() if p.returncode is None]
        for proc in live:
            self._signal(proc.pid, signal.SIGTERM)
        if run.killer is None or run.killer.done():
            run.killer = asyncio.get_running_loop().create_task(self._escalate(job.job_id, run, grace_s))

    async def _escalate(self, job_id: str, run: _Run, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        for proc in run.procs.values():
            if proc.returncode is None:
                log.info("job %s: pid %d ignored SIGTERM for %ss, sending SIGKILL", job_id, proc.pid, grace_s)
                self._signal(proc.pid, signal.SIGKILL)
