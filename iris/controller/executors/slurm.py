"""The Slurm backend: a cluster's jobs run on a Slurm cluster through its commands
(docs/DESIGN.md, "The Slurm backend").

Slurm 22.05 (Debian 12's packages) has no Python binding and ``scontrol`` has no ``--json``; the
backend runs ``sbatch``, ``squeue --json``, ``sinfo --json`` and ``scancel`` as subprocesses, on
the event loop (asyncio subprocesses, each with a timeout), from one monitor task per backend.

- **A job** is one Slurm batch job: ``--ntasks`` replicas, each ``--gpus-per-task`` of the token's
  GRES type and ``slurm_cpus`` CPUs, in the band's partition, ``--no-requeue`` (a lost or preempted
  attempt is the federation's to re-queue, never Slurm's to run again). Its batch script runs the
  job's command in its working directory, the unpacked workspace bundle, on a directory every node
  sees (``slurm_work_dir``); one replica is the batch step itself, several are ``srun`` tasks. The
  job's environment goes to sbatch through ``--export-file`` (a memfd): never on a command line,
  never read as sbatch's own options, and none of the controller's environment reaches it.
- **Identity.** Each job carries ``--comment=iris:<run id>`` (and ``--job-name=iris:<job id>``).
  Before sbatch the run's engine handle is saved as ``submit@<ms>``, after it as Slurm's job id, so
  a controller restarted at any moment finds its jobs in ``squeue`` by comment and adopts them, and
  never submits a run twice: an sbatch whose outcome is unknown is resubmitted only once Slurm has
  shown no such job for ``SUBMIT_SETTLE_S`` and it cannot have been purged since (MinJobAge).
- **Status** comes from ``squeue --json`` (every job Slurm still holds, finished ones included for
  MinJobAge; it ignores ``-j`` and ``-u``, so jobs are matched by comment here), **capacity** from
  ``sinfo --json``: per device token, the GPUs of the token's GRES type on the up nodes of the
  backend's partitions, less those allocated to any job, Iris's or not (the cluster is shared).
- **Admission and preemption** as on the Ray backend: a device job goes to Slurm only when it fits,
  in (band, arrival) order per token; the first that does not fit blocks its token and preempts the
  victims ``choose_victims`` picks among this backend's own running jobs: SIGTERM to the whole job
  (``scancel --signal=TERM --full``), then SIGKILL and ``scancel`` after the cluster's
  ``preempt_grace_s``. The preempted attempt ends PREEMPTED; home re-queues it.
- **Output.** Slurm writes a job's output to ``output.log`` beside its working directory; the
  controller copies it into its own log by byte offset when someone reads the log and at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import re
import shlex
import shutil
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iris.bundle import BundleError
from iris.config import BackendConfig, ConfigError
from iris.controller.errors import InvalidArgument
from iris.controller.executors.base import Backend, BackendUnreachable, Demand, JobHost
from iris.controller.executors.process import RUN_ID_ENV
from iris.controller.models import TIMED_OUT, ControllerJobState, preempted_note
from iris.controller.state import JobRecord, now_ms
from iris.policy.models import BackendReport
from iris.policy.preemption import RunningTask, choose_victims

log = logging.getLogger("iris.controller.executor.slurm")

# What a Slurm command may take before it counts as unanswered (sbatch may stage a large script
# environment; slurmctld's own MessageTimeout defaults to 10 s).
CALL_TIMEOUT_S = 20.0
# No successful read of Slurm for this long counts as unreachable (the capacity is unknown).
STALE_AFTER_S = 15.0
# After an sbatch whose outcome is unknown (it timed out, or Slurm could not be reached), how long
# Slurm has to show the job before the backend concludes it was never taken.
SUBMIT_SETTLE_S = 30.0
# Slurm's defaults of MinJobAge (how long a finished job stays in squeue) and KillWait, if `scontrol
# show config` cannot say.
DEFAULT_MIN_JOB_AGE_S = 300
DEFAULT_KILL_WAIT_S = 30
# A submission Slurm refuses this many times in a row fails the job.
MAX_REFUSALS = 3
LOG_REFRESH_S = 0.5
MIB = 1 << 20
# The most one refresh of a running job's log copies; the final copy copies everything.
LOG_CHUNK = 4 * MIB
# Slurm ends a job with SIGTERM, and SIGKILL KillWait later (slurmd waits at least 5 s whatever
# KillWait says), by a timer that ran 0.35 s short here: a stop ends the job in Slurm this much
# later than its grace asks, so the job has all of it.
SIGNAL_LAG_S = 1.0
SLURMD_MIN_KILL_WAIT_S = 5
# After the SIGKILL of a stop, how long before the backend asks Slurm to end the job again.
RESEND_STOP_S = 10.0
COMMENT_PREFIX = "iris:"
SUBMIT_MARK = "submit@"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
GPU = "gpu"

# Slurm's job states (squeue --json ``job_state``: a flag such as COMPLETING replaces the base state).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
    }
)
# Started: its batch script runs (or ran, and its processes are still being cleaned up).
STARTED_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED"})
# Node states whose GPUs count: anything but a node that is down, failed or not there yet.
_DEAD_NODE = frozenset({"DOWN", "FAIL", "FUTURE", "UNKNOWN", "INVALID", "CLOUD", "POWERED_DOWN"})
# Node flags that take a node's GPUs out of the total (not responding) or out of what is free (no
# new work: draining, maintenance, powering down).
_DEAD_FLAGS = frozenset({"NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN"})
_CLOSED_FLAGS = frozenset({"DRAIN", "DRAINING", "DRAINED", "MAINTENANCE", "RESERVED", "POWER_DOWN"})
# sbatch errors after which Slurm may still have taken the job.
_UNKNOWN_OUTCOME = re.compile(r"timed out|unable to contact|temporarily|connection|communication", re.I)
# Runs each replica of a gang as one srun task, IRIS_REPLICA_INDEX its task rank.
_REPLICA_SH = 'IRIS_REPLICA_INDEX=$SLURM_PROCID exec "$@"'


class SlurmUnreachable(Exception):
    """A Slurm command did not answer (slurmctld down, a timeout, no such command)."""


class SlurmRefused(Exception):
    """A Slurm command answered with an error (its stderr, one line)."""


# ---- what Slurm says ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmJob:
    """One job as ``squeue --json`` shows it."""

    job_id: int
    state: str
    comment: str
    # The batch script's wait status (exit code << 8, or the signal number).
    exit_status: int = 0
    start_s: int = 0
    restarts: int = 0
    reason: str = ""
    nodes: str = ""
    partition: str = ""
    user: str = ""
    name: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def started(self) -> bool:
        return self.state in STARTED_STATES

    @property
    def pending(self) -> bool:
        return not self.terminal and not self.started


def _int(value: Any) -> int:
    # 22.05 writes plain numbers; later versions wrap them ({"set": true, "number": N}).
    if isinstance(value, dict):
        value = value.get("number", 0) if value.get("set", True) else 0
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _text(value: Any) -> str:
    if isinstance(value, list):  # later versions give a state as a list of flags
        return str(value[0]) if value else ""
    return "" if value is None else str(value)


def parse_jobs(data: Mapping[str, Any]) -> list[SlurmJob]:
    """The jobs of a ``squeue --json`` document."""
    jobs = []
    for raw in data.get("jobs") or []:
        jobs.append(
            SlurmJob(
                job_id=_int(raw.get("job_id")),
                state=_text(raw.get("job_state")).upper(),
                comment=_text(raw.get("comment")),
                exit_status=_int(raw.get("exit_code")),
                start_s=_int(raw.get("start_time")),
                restarts=_int(raw.get("restart_cnt")),
                reason=_text(raw.get("state_reason")),
                nodes=_text(raw.get("nodes")),
                partition=_text(raw.get("partition")),
                user=_text(raw.get("user_name")),
                name=_text(raw.get("name")),
            )
        )
    return jobs


def exit_code(status: int) -> int:
    """A wait status the way a shell reports it: the exit code, or 128 + the signal."""
    signal = status & 0x7F
    return 128 + signal if signal else (status >> 8) & 0xFF


def _split_top(text: str) -> list[str]:
    """``text`` split at commas outside parentheses (``gpu:h100:2(IDX:0,3),gpu:a100:1``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_gres(text: str) -> list[tuple[str, str, int]]:
    """A node's GRES (``sinfo``'s ``gres`` or ``gres_used``) as (name, type, count) items:
    ``gpu:h100:8(S:0-1)`` → ("gpu", "h100", 8); ``gpu:4`` → ("gpu", "", 4)."""
    items = []
    for part in _split_top(text or ""):
        spec = part.split("(", 1)[0]
        fields = spec.split(":")
        if len(fields) < 2:
            continue
        count_text = fields[-1]
        match = re.fullmatch(r"(\d+)([KMG]?)", count_text)
        if match is None:
            continue
        count = int(match.group(1)) * {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2)]
        kind = ":".join(fields[1:-1])
        items.append((fields[0], kind, count))
    return items


@dataclass(frozen=True)
class SlurmNode:
    """One node as ``sinfo --json`` shows it."""

    name: str
    state: str
    flags: frozenset[str]
    partitions: frozenset[str]
    gres: tuple[tuple[str, str, int], ...]
    gres_used: tuple[tuple[str, str, int], ...]

    @property
    def alive(self) -> bool:
        return self.state.upper() not in _DEAD_NODE and not (self.flags & _DEAD_FLAGS)

    @property
    def open(self) -> bool:
        return self.alive and not (self.flags & _CLOSED_FLAGS) and self.state.upper() not in _CLOSED_FLAGS


def parse_nodes(data: Mapping[str, Any]) -> list[SlurmNode]:
    nodes = []
    for raw in data.get("nodes") or []:
        state = raw.get("state")
        states = [str(s).upper() for s in state] if isinstance(state, list) else [str(state or "").upper()]
        flags = {str(f).upper() for f in raw.get("state_flags") or []} | set(states[1:])
        nodes.append(
            SlurmNode(
                name=_text(raw.get("name")),
                state=states[0] if states else "",
                flags=frozenset(flags),
                partitions=frozenset(str(p) for p in raw.get("partitions") or []),
                gres=tuple(parse_gres(_text(raw.get("gres")))),
                gres_used=tuple(parse_gres(_text(raw.get("gres_used")))),
            )
        )
    return nodes


def _count(items: Iterable[tuple[str, str, int]], gres_type: str) -> int:
    return sum(n for name, kind, n in items if name == GPU and (not gres_type or kind == gres_type))


def capacity(
    nodes: Iterable[SlurmNode], partitions: Iterable[str], types: Mapping[str, str]
) -> tuple[dict[str, int], dict[str, int]]:
    """(total, free) GPUs per device token (``types``: token → GRES type, "" any) on the nodes of
    ``partitions``: a node that is down or not responding counts for nothing, one that takes no new
    work (draining) only in the total. Allocated GPUs are taken whoever holds them."""
    wanted = set(partitions)
    totals = dict.fromkeys(types, 0)
    free = dict.fromkeys(types, 0)
    for node in nodes:
        if not node.alive or not (node.partitions & wanted):
            continue
        for token, gres_type in types.items():
            have = _count(node.gres, gres_type)
            totals[token] += have
            if node.open:
                free[token] += max(0, have - _count(node.gres_used, gres_type))
    return totals, free


# ---- the commands --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmSettings:
    # How long a finished job stays in squeue (without slurmdbd, the only record of its end).
    min_job_age_s: int = 300
    # Between the SIGTERM and the SIGKILL of every job Slurm ends (scancel, a time limit): Slurm
    # sends no SIGKILL sooner, whatever it is asked.
    kill_wait_s: int = 30

    @property
    def kill_wait(self) -> float:
        """The wait slurmd really keeps: KillWait, but at least its own floor of 5 s."""
        return float(max(self.kill_wait_s, SLURMD_MIN_KILL_WAIT_S))


class SlurmCli:
    """Slurm's commands for one cluster (its slurm.conf), each with a timeout, from a minimal
    environment: the controller's own (its credentials) never reaches Slurm, nor a job through
    sbatch's ``--export``."""

    def __init__(self, slurm_conf: str = "") -> None:
        conf = slurm_conf or os.environ.get("SLURM_CONF", "")
        self.env = {"PATH": os.environ.get("PATH") or DEFAULT_PATH, "LANG": "C.UTF-8"}
        if conf:
            self.env["SLURM_CONF"] = conf
        self.where = conf or "Slurm's default configuration"
        self.calls = 0

    async def run(
        self,
        *argv: str,
        stdin: bytes | None = None,
        pass_fds: Sequence[int] = (),
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> str:
        """The command's stdout; SlurmRefused (non-zero exit) or SlurmUnreachable (no answer)."""
        self.calls += 1
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env,
                pass_fds=tuple(pass_fds),
                start_new_session=True,
            )
        except OSError as exc:
            raise SlurmUnreachable(f"cannot run {argv[0]}: {exc.strerror}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            where = f"{argv[0]} did not answer within {timeout_s:.0f}s ({self.where})"
            raise SlurmUnreachable(where) from None
        if proc.returncode != 0:
            message = " ".join(err.decode(errors="replace").split())[:500] or f"exit code {proc.returncode}"
            if _UNKNOWN_OUTCOME.search(message):
                raise SlurmUnreachable(f"{argv[0]}: {message}")
            raise SlurmRefused(f"{argv[0]}: {message}")
        return out.decode(errors="replace")

    async def _json(self, *argv: str) -> dict[str, Any]:
        text = await self.run(*argv)
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise SlurmUnreachable(f"{argv[0]} --json gave no JSON ({self.where})") from None
        if not isinstance(data, dict):
            raise SlurmUnreachable(f"{argv[0]} --json gave no JSON object ({self.where})")
        return data

    async def squeue(self) -> list[SlurmJob]:
        try:
            return parse_jobs(await self._json("squeue", "--json"))
        except SlurmRefused as exc:  # e.g. "Unable to contact slurm controller"
            raise SlurmUnreachable(str(exc)) from None

    async def sinfo(self) -> list[SlurmNode]:
        try:
            return parse_nodes(await self._json("sinfo", "--json"))
        except SlurmRefused as exc:
            raise SlurmUnreachable(str(exc)) from None

    async def sbatch(self, args: Sequence[str], script: str, env: Mapping[str, str]) -> int:
        """Submit ``script`` with ``args``; the job's environment is ``env`` (an export file).
        Returns Slurm's job id."""
        fd = os.memfd_create("iris-slurm-env", 0)
        try:
            os.write(fd, b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
            os.lseek(fd, 0, os.SEEK_SET)
            out = await self.run(
                "sbatch", "--parsable", f"--export-file={fd}", *args, stdin=script.encode(), pass_fds=(fd,)
            )
        finally:
            os.close(fd)
        first = out.strip().split(";", 1)[0]
        if not first.isdigit():
            raise SlurmUnreachable(f"sbatch printed no job id ({out.strip()[:100]!r})")
        return int(first)

    async def scancel(self, job_id: int, *, signal: str | None = None, full: bool = False) -> None:
        argv = ["scancel"]
        if signal is not None:
            argv.append(f"--signal={signal}")
        if full:
            argv.append("--full")
        await self.run(*argv, str(job_id))

    async def settings(self) -> SlurmSettings:
        """What the backend needs of the cluster's configuration (``scontrol show config``)."""
        text = await self.run("scontrol", "show", "config")

        def seconds(name: str, default: int) -> int:
            match = re.search(rf"^{name}\s*=\s*(\d+)", text, re.M)
            return int(match.group(1)) if match else default

        return SlurmSettings(
            min_job_age_s=seconds("MinJobAge", DEFAULT_MIN_JOB_AGE_S),
            kill_wait_s=seconds("KillWait", DEFAULT_KILL_WAIT_S),
        )


# ---- the batch job -------------------------------------------------------------------------------


def comment_of(job: JobRecord) -> str:
    """The Slurm comment that names one run of a job: how the backend finds it again."""
    return f"{COMMENT_PREFIX}{job.run_id}"


def batch_script(job: JobRecord, demand: Demand) -> str:
    """The batch script: the job's command, as the batch step itself (one replica) or as one srun
    task per replica, each with its own GPUs."""
    head = (
        f"#!/bin/sh\n# Iris job {job.job_id}, attempt {job.attempts} (docs/DESIGN.md, 'The Slurm backend').\n"
    )
    if demand.replicas <= 1:
        return head + f"exec {shlex.join(job.command)}\n"
    srun = ["srun", "--kill-on-bad-exit=1"]
    if not demand.is_cpu:
        srun.append(f"--gpu-bind=per_task:{demand.per_replica}")
    return head + f"exec {shlex.join([*srun, '/bin/sh', '-c', _REPLICA_SH, 'iris-replica', *job.command])}\n"


def time_limit(timeout_s: float) -> str:
    """Slurm's own limit, a backstop behind the controller's: whole minutes, one more than the
    job's timeout (the controller ends it first, to the second)."""
    return str(int(timeout_s // 60) + 2)


def unreachable_by(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory on the way to ``path`` that ``uid`` (primary group ``gid``) cannot
    search, or None. By mode bits: root searches everything."""
    if uid == 0:
        return None
    for directory in [*reversed(path.parents), path]:
        try:
            st = directory.stat()
        except OSError:
            return directory
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return directory
    return None


@dataclass(frozen=True)
class RunPaths:
    """Where one run lives on the shared filesystem: ``run/`` (the controller's, search-only),
    ``run/work/`` (the job's working directory, its user's) and ``run/output.log`` (its output,
    written by Slurm as the job's user)."""

    run: Path

    @property
    def workdir(self) -> Path:
        return self.run / "work"

    @property
    def output(self) -> Path:
        return self.run / "output.log"


@dataclass
class _Tracked:
    """One unfinished job of this backend, and what Slurm last said of it."""

    job: JobRecord
    # True only for a job accepted by this process and not yet submitted: it may be dropped
    # without asking Slurm. Jobs recovered from the store may be in Slurm already.
    fresh: bool = False
    slurm: SlurmJob | None = None
    refusals: int = 0
    timed_out: bool = False
    # When the stop's SIGTERM went out (monotonic), and its SIGKILL.
    term_at: float | None = None
    kill_at: float | None = None
    log_read_at: float = 0.0
    log_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def engine_id(job: JobRecord) -> str | None:
    return job.tasks[0].engine_id if job.tasks else None


class SlurmBackend(Backend):
    """Runs a backend's jobs as Slurm batch jobs and reports Slurm's own allocation."""

    def __init__(self, config: BackendConfig, host: JobHost, *, kill_grace_s: float = 5.0) -> None:
        super().__init__(config, host)
        self.cli = SlurmCli(config.slurm_conf)
        self.kill_grace_s = kill_grace_s
        self.preempt_grace_s = host.cluster.preempt_grace_s
        self.tokens = sorted(config.devices)
        self.types = {t: config.slurm_gres_type(t) for t in self.tokens}
        self.partitions = sorted({config.slurm_partition, *config.slurm_partitions.values()})
        # Who the jobs run as (docs/SECURITY.md, "Slurm jobs"): the backend's slurm_user, else the
        # cluster's run_as. Only root may submit as another user; otherwise jobs run as the
        # controller's own user.
        name = config.slurm_user or host.cluster.run_as
        try:
            entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except (KeyError, OverflowError):
            raise ConfigError(f"backend {config.id}: slurm_user names an unknown user {name!r}") from None
        self.switch = os.geteuid() == 0 and entry.pw_uid != os.geteuid()
        self.uid, self.gid = (entry.pw_uid, entry.pw_gid) if self.switch else (os.geteuid(), os.getegid())
        self.user = entry.pw_name if self.switch else pwd.getpwuid(os.geteuid()).pw_name
        root = Path(config.slurm_work_dir) if config.slurm_work_dir else Path(host.state_dir) / "slurm-work"
        self.work_root = Path(os.path.abspath(root))
        self.work_base = self.work_root / f"{host.cluster.name}.{config.id}"
        self.isolation = f"slurm: as {self.user} (uid {self.uid})"
        self.observed_ms = now_ms()
        self._tracked: dict[str, _Tracked] = {}
        self._by_comment: dict[str, SlurmJob] = {}
        self._totals: dict[str, int] = {}
        self._free: dict[str, int] = {}
        self._reachable = False
        self._reason = f"Slurm ({self.cli.where}) not contacted yet"
        self._last_ok = 0.0
        self._settings: SlurmSettings | None = None
        self._admitted: set[str] = set()
        self._busy: str | None = None
        self._signature: object = None
        # Rounds of the monitor that read Slurm and stepped every job: a test waits for a few to
        # see that the backend did not act.
        self.rounds = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # ---- Backend ---------------------------------------------------------------------------

    def recover(self, jobs: list[JobRecord]) -> None:
        self._prepare_work_root()
        live = set()
        for job in jobs:
            # Slurm keeps running what it was given: the monitor finds each run by its comment.
            self._tracked[job.job_id] = _Tracked(job)
            live.add(self._paths(job).run.name)
            log.info("job %s: re-attaching to Slurm job %s", job.job_id, engine_id(job) or "(not submitted)")
        self._sweep(live)
        self._observe()
        self._task = asyncio.get_running_loop().create_task(self._monitor())

    def accept(self, job: JobRecord) -> None:
        self._tracked[job.job_id] = _Tracked(job, fresh=True)
        self._observe()
        self._wake.set()

    def cancel_pending(self, job: JobRecord) -> bool:
        tracked = self._tracked.get(job.job_id)
        if tracked is None or not tracked.fresh or self._busy == job.job_id or engine_id(job) is not None:
            return False
        del self._tracked[job.job_id]
        self.host.settle(job, ControllerJobState.KILLED, error="terminated before it started")
        self._observe()
        return True

    def stop(self, job: JobRecord) -> None:
        self._wake.set()  # the monitor stops it in Slurm and settles it when Slurm says it ended

    def report(self) -> BackendReport:
        # No ``cpu`` token, as on Ray: Slurm's CPUs are shared with every other user of the cluster
        # and queued by Slurm; the federation places CPU jobs here by shape (docs/DESIGN.md,
        # "Vocabulary").
        if self._reachable and time.monotonic() - self._last_ok > STALE_AFTER_S:
            self._reachable = False
            self._reason = f"Slurm ({self.cli.where}) has not answered for {STALE_AFTER_S:.0f}s"
        if not self._reachable:
            raise BackendUnreachable(self._reason)
        waiting: dict[str, int] = {}
        for tracked in self._tracked.values():
            if tracked.job.state is ControllerJobState.RUNNING:
                continue
            demand = self._demand(tracked.job)
            if demand is not None and not demand.is_cpu:
                # Promised to a job Slurm has not started: not free for anyone else. (A job Slurm
                # has just started may be counted twice for a round: under-reported, never
                # over-committed.)
                waiting[demand.resource] = waiting.get(demand.resource, 0) + demand.total
        report = self.capacity_report(
            self.observed_ms,
            free={t: max(0, self._free.get(t, 0) - waiting.get(t, 0)) for t in self.tokens},
            totals={t: self._totals.get(t, 0) for t in self.tokens},
            running=(t.job for t in self._tracked.values() if t.job.state is ControllerJobState.RUNNING),
        )
        report.sandbox = self.isolation
        return report

    async def refresh_log(self, job: JobRecord) -> None:
        tracked = self._tracked.get(job.job_id)
        if tracked is None or tracked.slurm is None or tracked.slurm.pending:
            return
        now = time.monotonic()
        if now - tracked.log_read_at < LOG_REFRESH_S:
            return
        tracked.log_read_at = now
        await self._copy_output(tracked, final=False)

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
                "backend %s: %d job(s) keep running in Slurm; a restarted controller re-attaches",
                self.config.id,
                len(live),
            )

    # ---- the work directories ---------------------------------------------------------------

    def _paths(self, job: JobRecord) -> RunPaths:
        return RunPaths(self.work_base / f"{self.log_path(job).stem}-{job.run_id}")

    def _prepare_work_root(self) -> None:
        """The work root and the backend's directory in it: the controller's, search-only (0711),
        so a job reaches its own directory by path and lists nothing. The default root is in the
        state dir, which then becomes search-only too (its files stay private: docs/DESIGN.md,
        "Job → controller")."""
        self.work_base.mkdir(parents=True, exist_ok=True)
        opened = [self.work_root, self.work_base]
        state_dir = Path(os.path.abspath(self.host.state_dir))
        if self.switch and self.work_root.is_relative_to(state_dir):
            opened.append(state_dir)
        for path in opened:
            mode = 0o711 if self.switch else 0o700
            with contextlib.suppress(OSError):
                os.chmod(path, mode)
        blocked = unreachable_by(self.work_base, self.uid, self.gid)
        if blocked is not None:
            raise ConfigError(
                f"backend {self.config.id}: {self.user} cannot reach slurm_work_dir {self.work_root} "
                f"({blocked} is not searchable by it): set slurm_work_dir to a directory every Slurm "
                "node sees at the same path and the job's user can reach"
            )

    def _sweep(self, live: set[str]) -> None:
        """Remove run directories no unfinished job owns (a controller that died before removing
        one)."""
        try:
            entries = list(self.work_base.iterdir())
        except OSError:
            return
        for entry in entries:
            if entry.name not in live:
                shutil.rmtree(entry, ignore_errors=True)

    def _make_run(self, job: JobRecord, paths: RunPaths) -> None:
        """On a worker thread: the run's directory, its working directory (the unpacked bundle,
        given to the job's user) and its empty output file (the job's user's, in a directory the
        job cannot change: Slurm appends to it, the controller reads it)."""
        if paths.run.exists():
            shutil.rmtree(paths.run)
        paths.run.mkdir()
        # Set, not asked of mkdir: the controller's umask (077) would take the search bits.
        os.chmod(paths.run, 0o711 if self.switch else 0o700)
        paths.workdir.mkdir(mode=0o700)
        if job.bundle is not None:
            self.host.bundles.unpack_into(job.bundle, paths.workdir)
        fd = os.open(paths.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            if self.switch:
                os.fchown(fd, self.uid, self.gid)
        finally:
            os.close(fd)
        if self.switch:
            os.lchown(paths.workdir, self.uid, self.gid)
            for dirpath, dirnames, filenames in os.walk(paths.workdir):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), self.uid, self.gid)

    # ---- the monitor -----------------------------------------------------------------------

    async def _monitor(self) -> None:
        while not self._closing:
            try:
                await self._poll()
            except Exception:  # one bad round must not end the monitoring of every job
                log.exception("backend %s: Slurm poll failed", self.config.id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.slurm_poll_s)
            self._wake.clear()

    async def _poll(self) -> None:
        try:
            if self._settings is None:
                self._settings = await self.cli.settings()
            # Jobs first, then nodes: a job seen ending here has released its GPUs in the nodes'
            # later answer, so an error errs towards more free, never towards an extra victim.
            jobs = await self.cli.squeue()
            nodes = await self.cli.sinfo()
        except (SlurmUnreachable, SlurmRefused) as exc:
            self._unreachable(str(exc))
            return
        if not self._reachable:
            log.info("backend %s: Slurm (%s) answers", self.config.id, self.cli.where)
        self._reachable = True
        self._last_ok = time.monotonic()
        by_comment: dict[str, SlurmJob] = {}
        for sj in jobs:
            if sj.comment.startswith(COMMENT_PREFIX):
                known = by_comment.get(sj.comment)
                if known is None or sj.job_id > known.job_id:
                    by_comment[sj.comment] = sj
        self._by_comment = by_comment
        self._totals, self._free = capacity(nodes, self.partitions, self.types)
        self._observe()
        self._plan()
        for job_id in list(self._tracked):
            tracked = self._tracked.get(job_id)
            if tracked is None or self._closing:
                continue
            self._busy = job_id
            try:
                await self._step(tracked)
            except SlurmUnreachable as exc:
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

    def _demand(self, job: JobRecord) -> Demand | None:
        try:
            return self.demand(job.device)
        except InvalidArgument:  # recovered under a config that no longer has its device
            return None

    def _starting(self, token: str) -> int:
        """What this backend's jobs that are (or may be) in Slurm but not started will take."""
        total = 0
        for tracked in self._tracked.values():
            if tracked.fresh or tracked.job.state is not ControllerJobState.PENDING:
                continue
            demand = self._demand(tracked.job)
            if demand is not None and demand.resource == token:
                total += demand.total
        return total

    def _plan(self) -> None:
        """Which waiting jobs go to Slurm this round, and whom they preempt (docs/DESIGN.md,
        "Preemption"): per device token, in (band, arrival) order, while Slurm's free GPUs less
        what submitted jobs will take cover them; the first that does not fit blocks its token."""
        self._admitted.clear()
        queues: dict[str, list[tuple[JobRecord, Demand]]] = {}
        for tracked in self._tracked.values():
            job = tracked.job
            if not tracked.fresh or job.terminate_requested:
                continue
            demand = self._demand(job)
            if demand is None or demand.is_cpu:
                self._admitted.add(job.job_id)  # CPU: Slurm queues it; no demand: _submit fails it
                continue
            queues.setdefault(demand.resource, []).append((job, demand))
        for token, queue in queues.items():
            queue.sort(key=lambda entry: (int(entry[0].band), entry[0].seq))
            free = self._free.get(token, 0) - self._starting(token)
            for job, demand in queue:
                if demand.total > self._totals.get(token, 0):
                    continue  # more than Slurm has now (nodes down): it waits and blocks no one
                if demand.total > free:
                    self._preempt_for(job, demand, free)
                    break
                self._admitted.add(job.job_id)
                free -= demand.total

    def _preempt_for(self, job: JobRecord, demand: Demand, free: int) -> None:
        """Mark (and store) the jobs ``choose_victims`` picks among this backend's running jobs for
        the waiting ``job``; this round's steps stop them in Slurm. ``free`` is Slurm's free amount
        less what is about to start; jobs already being stopped count as free (a job waiting for
        them stops no one else). Only this backend's own jobs are ever victims: the cluster's other
        users are not the federation's to preempt."""
        token = demand.resource
        candidates: list[RunningTask] = []
        for tracked in self._tracked.values():
            other = tracked.job
            if other.state is not ControllerJobState.RUNNING:
                continue
            theirs = self._demand(other)
            if theirs is None or theirs.resource != token:
                continue
            if other.preempted is not None or other.terminate_requested or tracked.timed_out:
                free += theirs.total  # on its way out
                continue
            candidates.append(self.running_task(other, token, theirs.total))
        victims = choose_victims(
            job.band,
            {token: demand.total},
            {token: max(0, free)},
            candidates,
            now_ms=now_ms(),
            exempt_ms=self.preempt_exempt_ms,
        )
        if not victims:
            return
        at_ms = now_ms()
        for victim in victims:
            # Stored before the stop: a controller that restarts during the grace still settles
            # the victim PREEMPTED.
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
                self.preempt_grace_s,
            )

    async def _step(self, tracked: _Tracked) -> None:
        """Move one job forward: submit it, follow it, stop it, settle it."""
        job = tracked.job
        if job.terminal:
            self._tracked.pop(job.job_id, None)
            return
        found = self._by_comment.get(comment_of(job))
        if found is not None:
            tracked.fresh = False
            if engine_id(job) != str(found.job_id):
                self._set_engine(job, str(found.job_id))  # adopted: the sbatch's answer was lost
            await self._follow(tracked, found)
            return
        handle = engine_id(job)
        if handle is None:
            if job.terminate_requested:
                self._finish(tracked, ControllerJobState.KILLED, None, "terminated before it started")
            elif job.state is ControllerJobState.RUNNING:
                self._finish(
                    tracked,
                    ControllerJobState.WORKER_FAILED,
                    None,
                    "recorded running with no Slurm job; its outcome is unknown",
                )
            elif not tracked.fresh:
                tracked.fresh = True  # recovered, never submitted: waits for _plan like a new job
            elif job.job_id in self._admitted:
                await self._submit(tracked)
            return
        if handle.startswith(SUBMIT_MARK):
            await self._unknown_submission(tracked, handle)
            return
        if job.terminate_requested:
            gone = f"terminated; Slurm no longer knows job {handle}"
            self._finish(tracked, ControllerJobState.KILLED, None, gone)
        else:
            self._finish(
                tracked,
                ControllerJobState.WORKER_FAILED,
                None,
                f"Slurm no longer knows job {handle} (was its state lost, or the job purged after "
                "MinJobAge?); its outcome is unknown",
            )

    async def _unknown_submission(self, tracked: _Tracked, handle: str) -> None:
        """An sbatch whose outcome is unknown, and no job with the run's comment in Slurm."""
        job = tracked.job
        tracked.fresh = False
        age_s = (now_ms() - int(handle[len(SUBMIT_MARK) :] or 0)) / 1000
        if age_s < SUBMIT_SETTLE_S:
            return  # Slurm may yet show it
        min_age = (self._settings or SlurmSettings()).min_job_age_s
        if age_s < min_age:
            # Had Slurm taken it, it would still show it (finished jobs stay for MinJobAge): it
            # never had it. The run waits for its turn again.
            log.info("job %s: Slurm never took its submission; it waits to be submitted again", job.job_id)
            self._set_engine(job, None)
            tracked.fresh = True
            return
        self._finish(
            tracked,
            ControllerJobState.WORKER_FAILED,
            None,
            f"its submission to Slurm {age_s:.0f}s ago had no known outcome and Slurm shows no such job "
            f"(it forgets finished jobs after MinJobAge = {min_age}s); it may have run",
        )

    def _set_engine(self, job: JobRecord, value: str | None) -> None:
        for task in job.tasks:
            task.engine_id = value
        self.host.save(job)

    def _env(self, job: JobRecord, paths: RunPaths) -> dict[str, str]:
        """The job's environment (docs/DESIGN.md, "Job → controller"): PATH and LANG, the backend's
        ``slurm_env``, HOME (its working directory), its spec's env and the IRIS_* variables; Slurm
        adds its own (SLURM_*, CUDA_VISIBLE_DEVICES) on the node. Nothing of the controller's."""
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", **self.config.slurm_env, "HOME": str(paths.workdir)}
        env.update(job.env)
        env.update(
            {
                "IRIS_JOB_ID": job.job_id,
                "IRIS_CLUSTER": self.host.cluster.name,
                "IRIS_BACKEND_ID": job.backend_id,
                "IRIS_REPLICA_INDEX": "0",
                "IRIS_NUM_REPLICAS": str(len(job.tasks)),
                RUN_ID_ENV: job.run_id,
            }
        )
        return env

    def _sbatch_args(self, job: JobRecord, demand: Demand, paths: RunPaths) -> list[str]:
        args = [
            *self.config.slurm_sbatch_args,
            "--no-requeue",
            "--export=ALL",
            f"--job-name=iris:{job.job_id}",
            f"--comment={comment_of(job)}",
            f"--partition={self.config.slurm_partition_for(job.band.label)}",
            f"--ntasks={demand.replicas}",
            f"--cpus-per-task={self.config.slurm_cpus}",
            f"--chdir={paths.workdir}",
            f"--output={paths.output}",
            "--open-mode=append",
        ]
        if not demand.is_cpu:
            gres_type = self.types[demand.resource]
            args.append(f"--gpus-per-task={gres_type + ':' if gres_type else ''}{demand.per_replica}")
        if self.config.slurm_mem_per_cpu_mb:
            args.append(f"--mem-per-cpu={self.config.slurm_mem_per_cpu_mb}")
        if job.timeout_s is not None:
            args.append(f"--time={time_limit(job.timeout_s)}")
        if self.switch:
            args += [f"--uid={self.uid}", f"--gid={self.gid}"]
        return args

    async def _submit(self, tracked: _Tracked) -> None:
        job = tracked.job
        demand = self._demand(job)
        if demand is None:
            try:
                self.demand(job.device)
            except InvalidArgument as exc:
                self._finish(tracked, ControllerJobState.FAILED, None, exc.message)
            return
        paths = self._paths(job)
        try:
            await asyncio.to_thread(self._make_run, job, paths)
        except BundleError as exc:
            why = f"cannot unpack the workspace bundle: {exc}"
            self._finish(tracked, ControllerJobState.FAILED, None, why)
            return
        except OSError as exc:
            log.warning("job %s: cannot prepare %s: %s", job.job_id, paths.run, exc)
            why = f"cannot prepare the job's directory: {exc.strerror}"
            self._finish(tracked, ControllerJobState.FAILED, None, why)
            return
        # Saved before Slurm is asked: whatever happens next, a restarted controller knows the job
        # may be in Slurm and looks for it before it submits anything (never twice).
        self._set_engine(job, f"{SUBMIT_MARK}{now_ms()}")
        tracked.fresh = False
        try:
            slurm_id = await self.cli.sbatch(
                self._sbatch_args(job, demand, paths), batch_script(job, demand), self._env(job, paths)
            )
        except SlurmRefused as exc:
            # Slurm answered no: it does not have the job.
            tracked.refusals += 1
            self._set_engine(job, None)
            tracked.fresh = True
            log.warning("job %s: Slurm refused it (%d): %s", job.job_id, tracked.refusals, exc)
            if tracked.refusals >= MAX_REFUSALS:
                self._finish(tracked, ControllerJobState.FAILED, None, f"Slurm refused the job: {exc}"[:500])
            return
        except SlurmUnreachable as exc:
            # No answer: it may have taken the job. The next rounds look for it by its comment.
            log.warning("job %s: sbatch had no answer (%s); looking for the job in Slurm", job.job_id, exc)
            return
        self._set_engine(job, str(slurm_id))
        log.info(
            "job %s submitted to Slurm as job %d (partition %s, %s)",
            job.job_id,
            slurm_id,
            self.config.slurm_partition_for(job.band.label),
            "CPU" if demand.is_cpu else f"{demand.replicas}x{demand.per_replica} {demand.resource}",
        )

    async def _follow(self, tracked: _Tracked, sj: SlurmJob) -> None:
        job = tracked.job
        previous = tracked.slurm
        tracked.slurm = sj
        if (sj.started or sj.terminal) and job.state is ControllerJobState.PENDING and sj.start_s > 0:
            if sj.started:
                job.state = ControllerJobState.RUNNING
                for task in job.tasks:
                    task.state = ControllerJobState.RUNNING
            job.started_ms = sj.start_s * 1000
            self.host.save(job)
            self.host.notify(job.job_id)
            if sj.started:
                log.info("job %s running in Slurm (job %d on %s)", job.job_id, sj.job_id, sj.nodes)
        if sj.terminal:
            # Every byte of the output is in the controller's copy before the job is terminal there.
            await self._copy_output(tracked, final=True)
            self._finish(tracked, *self._outcome(tracked, sj))
            return
        requeued = sj.restarts > 0 or (sj.pending and previous is not None and previous.started)
        if requeued and job.preempted is None:
            # Slurm put the attempt back in its queue (its own preemption, an operator's requeue):
            # it must not run again here behind the federation's back.
            job.preempted = f"requeued by Slurm (job {sj.job_id}, {sj.reason or 'no reason given'})"
            self.host.save(job)
            log.info("job %s: %s; ending it", job.job_id, job.preempted)
        if (
            job.timeout_s is not None
            and job.started_ms is not None
            and sj.started
            and now_ms() - job.started_ms > job.timeout_s * 1000
            and not tracked.timed_out
        ):
            tracked.timed_out = True
            log.info("job %s timed out after %ss", job.job_id, job.timeout_s)
        if job.terminate_requested or tracked.timed_out or job.preempted is not None:
            await self._stop_in_slurm(tracked, sj)

    async def _stop_in_slurm(self, tracked: _Tracked, sj: SlurmJob) -> None:
        """Stop the job within its grace (docs/DESIGN.md, "The Slurm backend"). Slurm ends a job
        (``scancel``) with SIGTERM and, KillWait later, SIGKILL; it sends no earlier SIGKILL. A
        grace longer than that gets a SIGTERM to every process of the job now (``--signal=TERM
        --full``) and Slurm's end of the job once only KillWait is left of it; a shorter one, the
        end at once (the job then has KillWait, more than its grace). A job Slurm has not started
        is just cancelled."""
        job = tracked.job
        now = time.monotonic()
        if sj.pending or sj.restarts > 0:
            if tracked.kill_at is None or now - tracked.kill_at >= RESEND_STOP_S:
                tracked.kill_at = now
                await self._scancel(sj.job_id)
            return
        preempting = job.preempted is not None and not job.terminate_requested and not tracked.timed_out
        grace = self.preempt_grace_s if preempting else self.kill_grace_s
        kill_wait = (self._settings or SlurmSettings()).kill_wait
        # How long after the SIGTERM Slurm's end of the job may come, for the job to have its grace.
        delay = max(0.0, grace - kill_wait + SIGNAL_LAG_S)
        if tracked.term_at is None:
            tracked.term_at = now
            if delay > 0:
                await self._scancel(sj.job_id, signal="TERM", full=True)
                log.info("job %s: SIGTERM to Slurm job %d (grace %ss)", job.job_id, sj.job_id, grace)
                return
        if now - tracked.term_at >= delay and (
            tracked.kill_at is None or now - tracked.kill_at >= RESEND_STOP_S
        ):
            tracked.kill_at = now
            await self._scancel(sj.job_id)
            log.info(
                "job %s: Slurm job %d ended (SIGKILL after KillWait, %ss)", job.job_id, sj.job_id, kill_wait
            )

    async def _scancel(self, slurm_id: int, *, signal: str | None = None, full: bool = False) -> None:
        try:
            await self.cli.scancel(slurm_id, signal=signal, full=full)
        except SlurmRefused as exc:  # e.g. it ended meanwhile
            log.info("scancel of Slurm job %d: %s", slurm_id, exc)

    def _outcome(self, tracked: _Tracked, sj: SlurmJob) -> tuple[ControllerJobState, int | None, str | None]:
        job = tracked.job
        code = exit_code(sj.exit_status)
        if job.terminate_requested:
            return ControllerJobState.KILLED, None, "terminated on request"
        if tracked.timed_out or sj.state == "TIMEOUT":
            return ControllerJobState.FAILED, code or None, TIMED_OUT
        if sj.state == "COMPLETED" and code == 0:
            # Done before the preemption or on its SIGTERM: done, as on the process backend.
            return ControllerJobState.SUCCEEDED, 0, None
        if job.preempted is not None:
            return ControllerJobState.PREEMPTED, None, job.preempted
        if sj.state in ("NODE_FAIL", "BOOT_FAIL"):
            return (
                ControllerJobState.WORKER_FAILED,
                None,
                f"Slurm reports {sj.state} for job {sj.job_id} on {sj.nodes or 'its node'}: the run is lost",
            )
        if sj.state == "PREEMPTED":
            return ControllerJobState.PREEMPTED, None, f"preempted by Slurm (job {sj.job_id}, {sj.partition})"
        if sj.state == "CANCELLED":
            return ControllerJobState.KILLED, None, f"cancelled in Slurm (job {sj.job_id}), not by Iris"
        if sj.state == "OUT_OF_MEMORY":
            return ControllerJobState.FAILED, code or None, "out of memory (Slurm)"
        if code:
            return ControllerJobState.FAILED, code, None
        why = f"Slurm ended job {sj.job_id} {sj.state} ({sj.reason or 'no reason given'})"
        return ControllerJobState.FAILED, None, why

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
        # Its output is in the controller's log: the run's directory goes (the workspace stays in
        # the bundle store).
        run = self._paths(job).run
        asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, run, True)

    # ---- job output --------------------------------------------------------------------------

    async def _copy_output(self, tracked: _Tracked, *, final: bool) -> None:
        """Bring the controller's copy of the job's log up to Slurm's output file: at most
        LOG_CHUNK bytes, or with ``final`` (the job has ended) everything."""
        async with tracked.log_lock:
            await asyncio.to_thread(self._copy, tracked.job, final)

    def _copy(self, job: JobRecord, final: bool) -> None:
        """On a worker thread. The output file is opened without following links and only if it
        is a regular file: it sits in a directory only the controller can change, but is written
        by the job's user."""
        target = self.log_path(job)
        done = target.stat().st_size if target.exists() else 0
        try:
            fd = os.open(self._paths(job).output, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            with open(target, "ab") as out:
                while True:
                    chunk = os.pread(fd, LOG_CHUNK, done)
                    if not chunk:
                        return
                    out.write(chunk)
                    done += len(chunk)
                    if not final:
                        return
        finally:
            os.close(fd)

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
