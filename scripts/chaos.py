"""The chaos suite (issue 8 item 3, issue 15 acceptance 7): about 200 jobs across the home cluster
and both peers, each peer's controller behind a fault proxy (tests/faultproxy.py), while (seconds
after the first submission)

- the worker (a separate ``iris worker`` process) is SIGKILLed and restarted every 3-6 s until 60 s,
- the Temporal dev server is restarted once on the same SQLite database file (22 s),
- cw-us-east-02a's controller is stopped and started again (12 s; its running jobs end
  WORKER_FAILED and move to a next attempt),
- cw-us-east-02a's proxy loses every launch reply, after the controller has accepted the launch,
  from 2 s until its partition: a launch whose 6 tries all lose their reply is reconciled,
- cw-rno2a is lost for good once a few long jobs run there (70-110 s; the worker is SIGKILLed 8 s
  before, so that what ends there meanwhile goes unseen): its proxy refuses, its controller and its
  jobs' processes are SIGKILLed, and it stays away past ``peer_lost_after_s`` (50 s in this run's
  config) until every attempt it ran has moved; then it comes back, and its stale attempts must be
  confirmed ended (fences),
- cw-us-east-02a is partitioned 25 s after that, for longer than the launch retry budget but
  shorter than ``peer_lost_after_s``: its proxy cuts a launch in flight (it reached the controller,
  no reply comes back), then refuses every connection for 34 s,
- then four jobs' processes on cw-us-east-02a are SIGKILLed while running
  (``--max-retries-failure 1``).

Then every job must settle. Every job writes its start and end into an execution ledger (one file,
whatever cluster runs it), and every controller is sampled every 2 s past its proxy. Asserted and
printed as a table: 0 jobs lost; 0 runs the workflows did not launch; 0 jobs with two live attempts
at once (samples and ledger); 0 jobs RUNNING/SUCCEEDED on two clusters and 0 run to completion twice,
but for the at-least-once re-run the design allows (a run that ended on the lost peer before it was
lost, unseen, run again elsewhere: listed apart); 0 deliveries after a won cancel; 0 stale attempts
unfenced or still running; 0 jobs stuck on the lost peer; 0 SIGKILLed attempts not retried; 0 leaked
reservations or live handles of ended jobs; every job terminal or parked with a reason; every history
replays. The run's directory keeps the evidence: ``jobs.jsonl`` (every job's final status, events and
attempts), ``held.jsonl`` (the controllers' records), ``store.jsonl`` (handles, reservations,
fences), ``lost-peer.jsonl`` (the jobs that ran on the lost peer, as it came back),
``shared/executions.log`` (the ledger) and every process's log under ``logs/``.

Everything is its own: Temporal (``--db-filename``), S3 and GCS emulators, three controllers, two
proxies (in this process) and the worker, on free loopback ports under one directory. Bounded in
time and count. One command::

    uv run python -m scripts.chaos                # 200 jobs, prints the table, exit 1 on a violation
    uv run python -m scripts.chaos --jobs 60 --seed 7 --keep /tmp/chaos   # smaller, keep the data

The same run is ``IRIS_CHAOS=1 uv run pytest tests/chaos -m chaos`` (skipped by default: it takes a
few minutes, see docs/RELIABILITY.md).

With ``--slurm``, cw-us-east-02a's H100 backend runs its jobs on a single-node Slurm of the run's own
(iris/slurmdev.py; docs/DESIGN.md, "The Slurm backend"), its jobs as this run's user like the
process peers' fallback: its restart then adopts its running jobs instead of losing them, and the
SIGKILLed processes are those of Slurm batch jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pwd
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from temporalio.api.enums.v1 import WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHistory
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.service import RPCError

from cli.ops import DeterminismReport, replay_histories
from iris import devstack, slurmdev
from iris.client import AsyncIrisClient, IrisError, JobAlreadyExists
from iris.config import BackendConfig, FederationConfig, load_config
from iris.controller.client import ControllerClient
from iris.controller.identity import KEY_DIR_ENV, TokenSigner
from iris.controller.models import ControllerJobState
from iris.controller.models import JobStatus as PeerJobStatus
from iris.jobs import AttemptEnd, JobState, JobStatus
from iris.keydirs import provision_key_dirs
from iris.payloadcodec import load_keyring
from iris.policy.models import Reservation
from iris.store import FederationStore, Fence, JobHandle
from iris.temporal import data_converter
from iris.userauth import USER_KEY_DIR_ENV, register_user

T = TypeVar("T")
USER = "chaos@example.com"
# Restarted, lost launch replies, then a long partition; a few of its jobs' processes SIGKILLed.
FLAKY = "cw-us-east-02a"
# Lost for good (past peer_lost_after), brought back once its attempts have moved.
LOST = "cw-rno2a"
PEERS = (FLAKY, LOST)
# Stopped and started again early (so that LOST runs undisturbed until it is lost).
PEER_TO_RESTART = FLAKY
LAUNCH = "POST /v1/jobs"
LIVE = (ControllerJobState.PENDING, ControllerJobState.RUNNING)
# A job in one of these states is on (or being handed to) its cluster.
ON_CLUSTER = (
    JobState.PENDING_HANDOFF,
    JobState.BUILDING,
    JobState.HANDED_OFF,
    JobState.PENDING,
    JobState.RUNNING,
)
ACTIVE = (ControllerJobState.RUNNING, ControllerJobState.SUCCEEDED)
# What the workflow says when a launch whose answers were all lost is found on its cluster, when it
# parks with an unknown outcome, and when a parked job's cluster answers that it has the job.
RECONCILED = "has the job although its answer was lost"
UNKNOWN_OUTCOME = "the outcome is unknown"
ADOPTED = "answers: it has the job"


def _fault_proxy() -> Any:
    """tests/faultproxy.py's FaultProxy (the tests' own HTTP fault injector, not a product module)."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from faultproxy import FaultProxy

    return FaultProxy


@dataclass
class Options:
    jobs: int = 200
    seed: int = 20261130
    # Times are seconds after the first submission. Two phases: for the first minute the worker is
    # SIGKILLed every few seconds (and Temporal and FLAKY restart); the network faults mostly
    # follow, once jobs flow again, so that they meet running and launching jobs.
    submit_window_s: float = 60.0  # the ordinary jobs are submitted over this long
    kill_from_s: float = 2.0  # the worker is first killed 3-6 s after this
    chaos_s: float = 60.0  # until when the worker keeps being killed
    kill_every_s: tuple[float, float] = (3.0, 6.0)
    temporal_restart_at_s: float = 22.0
    peer_restart_at_s: float = 12.0
    peer_down_s: float = 5.0
    # Every launch reply from FLAKY is lost from then until its partition (a launch's 6 tries take
    # ~25 s and more).
    lost_replies_from_s: float = 2.0
    # Jobs pinned to FLAKY submitted late in the first phase: their launches fall in that window.
    lost_reply_jobs_at_s: tuple[float, float] = (0.0, 1.0)
    # LOST is lost once enough long jobs run there (from the first time, at the latest by the
    # second), until every attempt it ran has moved (at least peer_lost_after_s). The worker is
    # SIGKILLed shortly before: what ends on LOST meanwhile goes unseen (a follow lost with its
    # worker resumes after its 30 s heartbeat timeout).
    peer_lost_between_s: tuple[float, float] = (70.0, 110.0)
    long_jobs_on_lost: int = 3
    worker_killed_before_loss_s: float = 8.0
    peer_lost_after_s: float = 50.0
    peer_back_margin_s: float = 10.0
    # Jobs long enough to be running on LOST when it goes (and on FLAKY through its partition).
    # They are submitted first (placed before the worker is first killed) and run until a fixed
    # time, whichever attempt: a later attempt ends at once.
    long_jobs_at_s: tuple[float, float] = (0.0, 1.0)
    long_jobs_until_s: float = 120.0
    # FLAKY unreachable this long, from this long after LOST is lost: more than the launch retry
    # budget (6 tries over ~25 s, then 3 questions), less than peer_lost_after_s.
    partition_after_loss_s: float = 25.0
    partition_s: float = 34.0
    # Jobs on FLAKY whose process is SIGKILLed once running, submitted once the partition is over.
    sigkill_after_partition_s: tuple[float, float] = (0.0, 4.0)
    sample_every_s: float = 2.0
    settle_s: float = 180.0  # after the faults, how long every job has to settle
    # FLAKY's H100 backend on a single-node Slurm of the run's own (``--slurm``).
    slurm: bool = False


# ---- the stack ---------------------------------------------------------------------------------


def chaos_config(root: Path, options: Options) -> FederationConfig:
    """The demo topology on free loopback ports, its own task queue and store, and a short
    ``peer_lost_after_s`` (a silent cluster loses its attempts in under a minute)."""
    cfg = load_config().model_copy(deep=True)
    cfg.temporal.address = f"127.0.0.1:{devstack.free_port()}"
    cfg.temporal.ui_port = devstack.free_port()
    cfg.temporal.task_queue = "iris-chaos"
    cfg.s3_port = devstack.free_port()
    cfg.gcs_port = devstack.free_port()
    cfg.store_url = f"sqlite:///{root / 'worker' / 'federation.db'}"
    cfg.peer_lost_after_s = options.peer_lost_after_s
    if options.slurm:
        # FLAKY's GPU backend as a Slurm one, on the run's Slurm (start_stack points it there).
        flaky = cfg.cluster(FLAKY)
        flaky.backends = [
            BackendConfig.model_validate(
                {**b.model_dump(), "kind": "slurm", "slurm_partition": slurmdev.DEFAULT_PARTITION}
            )
            if b.devices
            else b
            for b in flaky.backends
        ]
    for c in cfg.clusters:
        c.port = devstack.free_port()
        # Jobs run in the job sandbox (the config's default): the ledger's directory is the one
        # host path they all write (docs/SECURITY.md, "The job sandbox").
        c.sandbox_rw_paths = [str(shared_dir(root))]
        # Where the host cannot sandbox: jobs as this run's user (its interpreter may sit where
        # `nobody` cannot run it).
        c.run_as = pwd.getpwuid(os.geteuid()).pw_name
        if c.object_store is not None:
            port = cfg.s3_port if c.object_store.kind == "s3" else cfg.gcs_port
            c.object_store.endpoint = f"http://127.0.0.1:{port}"
    return cfg


@dataclass
class ChaosStack:
    root: Path
    config: FederationConfig
    config_file: Path
    child_env: dict[str, str]
    temporal: devstack.ManagedProcess
    controllers: dict[str, devstack.ManagedProcess]
    emulators: list[devstack.ManagedProcess]
    # Each peer's controller listens here; the federation reaches it through its proxy, on the
    # configured port. The judge reads every controller directly.
    internal_ports: dict[str, int] = field(default_factory=dict)
    proxies: dict[str, Any] = field(default_factory=dict)
    worker: devstack.ManagedProcess | None = None
    worker_starts: int = 0
    client: Client | None = None
    # FLAKY's Slurm (``Options.slurm``).
    slurm: slurmdev.SlurmCluster | None = None

    @property
    def key_dir(self) -> Path:
        """The home cluster's key directory (iris/keydirs.py): the worker's and this judge's."""
        return self.root / "keys" / self.config.home

    def start_worker(self) -> None:
        self.worker_starts += 1
        self.worker = devstack.ManagedProcess(
            name="worker",
            argv=[
                str(devstack.venv_bin("iris")),
                "--config",
                str(self.config_file),
                "worker",
                "--data-dir",
                str(self.root / "worker"),
            ],
            log_path=self.root / "logs" / f"worker-{self.worker_starts:03d}.log",
            ready=lambda: True,
            address="",
            env=self.child_env,
        )
        self.worker.start()

    def kill_worker(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker.stop()  # reaps it and closes its log

    def iris(self) -> AsyncIrisClient:
        assert self.client is not None
        return AsyncIrisClient(self.client, self.config, principal=USER)

    def direct_client(self, cluster: str, timeout: float = 10.0) -> ControllerClient:
        """The controller itself (past its proxy), signed as the home cluster."""
        port = self.internal_ports.get(cluster, self.config.cluster(cluster).port)
        signer = TokenSigner.from_config(self.config, self.config.home, self.key_dir)
        return ControllerClient(f"http://127.0.0.1:{port}", timeout=timeout, signer=signer, audience=cluster)


def shared_dir(root: Path) -> Path:
    """Where the execution ledger lives: every job's sandbox sees it (``sandbox_rw_paths``)."""
    return root / "shared"


def make_ledger(root: Path) -> Path:
    """The empty ledger, appendable by every job's pool uid: a root-owned 0666 file in a 1777
    directory (a job's own file would be 0600 at the controller's umask, closed to the next uid)."""
    shared_dir(root).mkdir(exist_ok=True)
    shared_dir(root).chmod(0o1777)
    ledger = shared_dir(root) / "executions.log"
    ledger.touch()
    ledger.chmod(0o666)
    return ledger


async def start_stack(root: Path, options: Options) -> ChaosStack:
    make_ledger(root)
    cfg = chaos_config(root, options)
    slurm = None
    if options.slurm:
        spec = slurmdev.spec_for(cfg)
        assert spec is not None
        slurm = slurmdev.SlurmCluster(spec, root / "slurm")
        await asyncio.to_thread(slurm.start)  # stops what it started if it fails
        slurmdev.point_at(cfg, slurm)
    config_file = root / "clusters.json"
    # The run's user signs its submissions and cancels (docs/DESIGN.md, "User → home").
    os.environ[USER_KEY_DIR_ENV] = str(root / "users")
    register_user(cfg, USER, ["admin"])  # its long jobs run in the production band: admins only
    config_file.write_text(cfg.model_dump_json(indent=2))
    # One key directory per cluster: each process holds its own private key only.
    key_dirs = provision_key_dirs(cfg, root / "keys")
    child_env = {
        KEY_DIR_ENV: str(key_dirs.of(cfg.home)),
        "IRIS_STORE_URL": cfg.store_url,
        "IRIS_CONFIG": str(config_file),
    }
    internal = {peer: devstack.free_port() for peer in PEERS}
    temporal = devstack.temporal_server(cfg, root, db_file=root / "temporal.db")
    emulators = [devstack.s3_server(cfg, root), devstack.gcs_server(cfg, root)]
    controllers = {
        c.name: devstack.controller(
            config_file, cfg, c.name, root, port=internal.get(c.name), key_dir=key_dirs.of(c.name)
        )
        for c in cfg.clusters
    }
    # The worker holds the home cluster's credentials only.
    worker_env = {**child_env, **devstack.store_credentials(cfg, cfg.home)}
    stack = ChaosStack(
        root, cfg, config_file, worker_env, temporal, controllers, emulators, internal, slurm=slurm
    )
    try:
        for svc in [temporal, *emulators, *controllers.values()]:
            # A controller keeps its own store's credentials (devstack.controller); no process gets
            # another's.
            svc.env = {**child_env, **svc.env}
            svc.start()
        for svc in [temporal, *emulators, *controllers.values()]:
            await asyncio.to_thread(svc.wait_ready, 120)
        fault_proxy = _fault_proxy()
        for peer, port in internal.items():
            proxy = fault_proxy(f"http://127.0.0.1:{port}")
            await proxy.start(cfg.cluster(peer).port)
            stack.proxies[peer] = proxy
        await asyncio.to_thread(devstack.ensure_buckets, cfg)
        # A runtime that logs nothing: the SDK would print every reconnect attempt during the restart.
        quiet = Runtime(telemetry=TelemetryConfig(logging=None))
        stack.client = await Client.connect(
            cfg.temporal.address, data_converter=data_converter(load_keyring()), runtime=quiet
        )
        stack.start_worker()
    except BaseException:
        await stop_stack(stack)  # nothing it started outlives a failed start
        raise
    return stack


async def stop_stack(stack: ChaosStack) -> None:
    procs = [stack.worker, *stack.controllers.values(), *stack.emulators, stack.temporal]
    for proc in procs:
        if proc is not None:
            await asyncio.to_thread(proc.stop)
    for proxy in stack.proxies.values():
        with contextlib.suppress(Exception):
            await proxy.stop()
    if stack.slurm is not None:
        await asyncio.to_thread(stack.slurm.stop)


# ---- job processes (read from /proc) -----------------------------------------------------------


@dataclass(frozen=True)
class JobProcess:
    pid: int
    pgid: int
    job_id: str
    cluster: str
    run_id: str
    ppid: int = 0


def job_processes(prefix: str) -> list[JobProcess]:
    """The processes of this run's jobs (their environment names the job, cluster and run), on
    every controller of this machine; other users' processes are unreadable and skipped."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        env = dict(
            item.decode(errors="replace").split("=", 1) for item in environ.split(b"\0") if b"=" in item
        )
        job_id = env.get("IRIS_JOB_ID", "")
        if not job_id.startswith(prefix):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        ppid, pgid = int(fields[1]), int(fields[2])
        found.append(
            JobProcess(
                int(entry.name), pgid, job_id, env.get("IRIS_CLUSTER", ""), env.get("IRIS_RUN_ID", ""), ppid
            )
        )
    return found


def run_tops(procs: list[JobProcess]) -> list[JobProcess]:
    """The first process of each run: its parent is not the run's. Unsandboxed it leads its own
    process group; in the job sandbox it is not (the group is bwrap's, and killing it ends the
    sandbox, the job's every process with it; docs/SECURITY.md, "The job sandbox")."""
    by_run: dict[str, set[int]] = {}
    for p in procs:
        by_run.setdefault(p.run_id, set()).add(p.pid)
    return [p for p in procs if p.ppid not in by_run[p.run_id]]


def dump(path: Path, models: list[Any]) -> None:
    """Evidence for a reader of the run's directory: one JSON model per line."""
    path.write_text("".join(m.model_dump_json() + "\n" for m in models))


def kill_groups(pgids: set[int]) -> int:
    killed = 0
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            killed += 1
    return killed


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class JobPlan:
    index: int
    kind: str
    kwargs: dict[str, Any]
    command: list[str]
    at_s: float
    cancel_after_s: float | None = None


@dataclass
class Record:
    plan: JobPlan
    job_id: str | None = None
    submit_error: str | None = None
    cancel_won: bool | None = None
    cancel_error: str | None = None
    final: JobStatus | None = None


@dataclass
class Faults:
    worker_kills: int = 0
    worker_restarts: int = 0
    temporal_restarts: int = 0
    temporal_down_s: float = 0.0
    peer_restarts: int = 0
    peer_down_s: float = 0.0
    lost_replies: int = 0
    lost_replies_s: float = 0.0
    partitions: int = 0
    partition_s: float = 0.0
    partition_cut: list[str] = field(default_factory=list)
    peers_lost: int = 0
    peer_lost_s: float = 0.0
    peer_lost_processes: int = 0
    # Attempts of jobs running on LOST when it went that had moved (ended PREEMPTED) when it came back.
    moved: int = 0
    still_on_lost: list[str] = field(default_factory=list)
    # Fences on LOST just before it came back: (job id, nonce).
    fenced_on_lost: set[tuple[str, str]] = field(default_factory=set)
    # Jobs whose process was SIGKILLed: job id -> run id.
    sigkilled: dict[str, str] = field(default_factory=dict)
    # When LOST was lost (ms).
    lost_ms: int = 0
    # Runs whose processes this suite SIGKILLed (no end in the ledger): run id -> when (ms).
    killed_runs: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    log: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    states: Counter[str]
    by_kind: dict[str, Counter[str]]
    invariants: dict[str, int]
    examples: dict[str, list[str]]
    notes: list[str]


@dataclass
class Report:
    options: Options
    records: list[Record]
    faults: Faults
    verdict: Verdict
    timings: dict[str, float]
    replay: DeterminismReport
    task_failures: Counter[str]

    @property
    def invariants(self) -> dict[str, int]:
        return {**self.verdict.invariants, "histories that do not replay": len(self.replay.failures)}

    @property
    def cancels(self) -> tuple[int, int]:
        sent = [r for r in self.records if r.plan.cancel_after_s is not None]
        return len(sent), sum(r.cancel_won is True for r in sent)

    @property
    def ok(self) -> bool:
        return all(v == 0 for v in self.invariants.values())

    def table(self) -> str:
        t = self.timings
        f = self.faults
        o = self.options
        cut = "; it cut a launch in flight" if f.partition_cut else "; no launch in flight: refused"
        lines = [
            f"chaos: {len(self.records)} jobs, seed {o.seed}: {t['total']:.0f}s in all "
            f"(stack up {t['startup']:.0f}s, faults {t['chaos']:.0f}s, settled {t['settle']:.0f}s later, "
            f"checks {t['checks']:.0f}s)",
            "faults:",
            f"  {f.worker_kills} worker SIGKILLs ({f.worker_restarts} restarts); "
            f"{f.temporal_restarts} Temporal restart on the same db file (down {f.temporal_down_s:.1f}s); "
            f"{f.peer_restarts} restart of {PEER_TO_RESTART}'s controller (down {f.peer_down_s:.1f}s)",
            f"  lost replies: {f.lost_replies} launch replies lost by {FLAKY}'s proxy over "
            f"{f.lost_replies_s:.0f}s, after the controller accepted each launch",
            f"  partition: {FLAKY} unreachable {f.partition_s:.1f}s (launch retry budget ~30s, "
            f"peer_lost_after {o.peer_lost_after_s:.0f}s){cut}",
            f"  peer lost: {LOST} gone {f.peer_lost_s:.0f}s (proxy refusing, controller and "
            f"{f.peer_lost_processes} job process group(s) SIGKILLed; the worker SIGKILLed "
            f"{o.worker_killed_before_loss_s:.0f}s before), back once its attempts had moved "
            f"(or {30 + 2 * o.peer_lost_after_s:.0f}s)",
            f"  preempted tasks: {len(f.sigkilled)} running job process group(s) SIGKILLed on {FLAKY}",
            f"  live-attempt samples: {f.samples} (every controller, every {o.sample_every_s:.0f}s)",
            "",
        ]
        columns = sorted(self.verdict.states)
        header = f"{'kind of job':<18}{'jobs':>5}" + "".join(f"{c[:14]:>15}" for c in columns)
        lines += [header, "-" * len(header)]
        for kind, states in sorted(self.verdict.by_kind.items()):
            cells = "".join(f"{states.get(c, 0) or '':>15}" for c in columns)
            lines.append(f"{kind:<18}{sum(states.values()):>5}" + cells)
        total = "".join(f"{self.verdict.states[c]:>15}" for c in columns)
        lines.append(f"{'all':<18}{sum(self.verdict.states.values()):>5}" + total)
        for state in ("REJECTED", "HANDOFF_FAILED", "HANDOFF_REJECTED", "FAILED", "UNSCHEDULABLE"):
            reasons = Counter(
                r.final.reason[:110]
                for r in self.records
                if r.final is not None and r.final.state.value == state
            )
            for reason, n in reasons.most_common(3):
                lines.append(f"  {state} ×{n}: {reason}")
        sent, won = self.cancels
        lines += [
            "",
            f"cancels: {sent} sent at random moments, {won} won (never delivered), {sent - won} lost",
        ]
        lines += self.verdict.notes
        lines += ["", f"{'invariant':<40}{'count':>6}"]
        lines += [f"{name:<40}{n:>6}" for name, n in self.invariants.items()]
        for name, examples in self.verdict.examples.items():
            if examples:
                lines.append(f"  {name}: {', '.join(examples[:5])}")
        lines += [line.line() for line in self.replay.failures[:5]]
        lines += ["", self.replay.summary()]
        failed = ", ".join(f"{cause} {n}" for cause, n in sorted(self.task_failures.items())) or "none"
        lines.append(f"workflow task failures by cause: {failed}")
        return "\n".join(lines)


def job_command(index: int, sleep_s: float, ledger: Path, *, until: float | None = None) -> list[str]:
    """The job sleeps (``until``: to that wall-clock time, whichever attempt it is) and prints its
    name; it writes to the run's execution ledger when it starts and when it ends (ms, job id,
    cluster and the controller's run id): what ran, whatever any controller or workflow says."""
    who = f'$(date +%s%3N) $IRIS_JOB_ID $IRIS_CLUSTER $IRIS_RUN_ID" >> {shlex.quote(str(ledger))}'
    wait = f"sleep {sleep_s:.2f}"
    if until is not None:
        wait = f"left=$(({until:.0f} - $(date +%s))); if [ $left -gt 0 ]; then sleep $left; fi"
    return ["sh", "-c", f'echo "S {who}; {wait}; echo chaos-{index}; echo "E {who}']


def plan_jobs(options: Options, rng: random.Random, ledger: Path, started: float) -> list[JobPlan]:
    """The jobs, in submission order (``started``: wall-clock time of the first submission)."""
    kinds = [
        ("home-cpu", 30),
        ("pinned-east", 14),
        ("pinned-rno", 14),
        ("gpu-unpinned", 24),
        ("cancelled", 8),
        ("missing-artifact", 5),
        ("deadline", 5),
    ]
    names = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    # Jobs for the faults: long ones running on LOST when it goes (and on FLAKY through its
    # partition), and ones whose process is SIGKILLed on FLAKY.
    scale = min(1.0, options.jobs / 200)
    special = ["long-gpu"] * max(1, round(6 * scale)) + ["long-rno"] * max(1, round(4 * scale))
    special += ["sigkilled"] * max(1, round(4 * scale)) + ["lost-reply"] * max(1, round(6 * scale))
    special = special[: options.jobs]
    plans = []
    for i in range(options.jobs):
        kind = special[i] if i < len(special) else rng.choices(names, weights)[0]
        sleep = rng.uniform(0.1, 2.0)
        until: float | None = None
        kwargs: dict[str, Any] = {}
        cancel_after = None
        at = rng.uniform(0.0, options.submit_window_s)
        if kind == "long-gpu":
            at = rng.uniform(*options.long_jobs_at_s)
            until = started + options.long_jobs_until_s
            kwargs = {"device_type": "h100", "gpu_count": 1, "priority": "production"}
        elif kind == "long-rno":
            at = rng.uniform(*options.long_jobs_at_s)
            until = started + options.long_jobs_until_s
            kwargs = {"target_cluster": LOST, "device_type": "h100", "gpu_count": 1, "priority": "production"}
        elif kind == "lost-reply":
            at = rng.uniform(*options.lost_reply_jobs_at_s)
            kwargs = {"target_cluster": FLAKY}
        elif kind == "sigkilled":
            at = rng.uniform(*options.sigkill_after_partition_s)  # after the partition
            sleep = 12.0
            kwargs = {"target_cluster": FLAKY, "max_retries_failure": 1}
        elif kind == "pinned-east":
            kwargs = {"target_cluster": FLAKY}
            if rng.random() < 0.6:
                kwargs.update(device_type="h100", gpu_count=rng.choice([1, 2, 4]))
        elif kind == "pinned-rno":
            kwargs = {"target_cluster": LOST}
            if rng.random() < 0.6:
                kwargs.update(device_type="h100", gpu_count=rng.choice([1, 2, 4]))
        elif kind == "gpu-unpinned":
            kwargs = {"device_type": "h100", "gpu_count": rng.choice([1, 2, 4, 8])}
        elif kind == "cancelled":
            sleep = 30.0
            kwargs = rng.choice([{}, {"target_cluster": FLAKY}, {"device_type": "h100", "gpu_count": 8}])
            cancel_after = rng.uniform(0.0, 6.0)
        elif kind == "missing-artifact":
            peer = rng.choice(PEERS)
            kwargs = {"target_cluster": peer, "artifacts": [f"s3://{peer}-artifacts/chaos/missing-{i}"]}
        elif kind == "deadline":
            # 2 x 8 H100: only cw-us-east-02a's 16 hold it (a shape no backend holds is REJECTED
            # TooLarge at submit, never reaching its deadline), and the jobs running there while
            # it waits keep it queued until it ends UNSCHEDULABLE.
            kwargs = {"device_type": "h100", "gpu_count": 8, "replicas": 2, "scheduling_timeout_s": 10}
        command = job_command(i, sleep, ledger, until=until)
        plans.append(JobPlan(i, kind, kwargs, command, at, cancel_after))
    return plans


async def retrying(call: Callable[[], Awaitable[T]], *, within: float = 120.0) -> T:
    """Retry through restarts (Temporal or the worker down): bounded, with a short backoff.

    RuntimeError is what the client raises while the server it was connected to restarts.
    """
    deadline = time.monotonic() + within
    delay = 0.2
    while True:
        try:
            return await call()
        except (RPCError, IrisError, RuntimeError) as exc:
            if isinstance(exc, JobAlreadyExists) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 2.0)


class Chaos:
    def __init__(self, stack: ChaosStack, options: Options) -> None:
        self.stack = stack
        self.options = options
        self.rng = random.Random(options.seed)
        self.faults = Faults()
        self.started = time.monotonic()
        self.run_id = f"{options.seed % 100000:05d}{random.randrange(1000):03d}"
        # Controllers not running at the moment (the sampler skips them).
        self.down: set[str] = set()
        self.sampling = True
        self.faults_over = asyncio.Event()
        self.peer_lost = asyncio.Event()
        self.partition_started = asyncio.Event()
        self.partition_over = asyncio.Event()
        # What the samples saw of one job on two controllers at once, job id -> the first sighting:
        # two live runs (PENDING/RUNNING), and two RUNNING/SUCCEEDED ones.
        self.live_twice: dict[str, str] = {}
        self.active_twice: dict[str, str] = {}

    @property
    def prefix(self) -> str:
        return f"chaos/c{self.run_id}-"

    def note(self, message: str) -> None:
        line = f"  t+{time.monotonic() - self.started:5.1f}s {message}"
        self.faults.log.append(line)
        print(line, flush=True)

    async def at(self, offset_s: float) -> None:
        await asyncio.sleep(max(0.0, self.started + offset_s - time.monotonic()))

    async def submit(self, record: Record) -> None:
        plan = record.plan
        if plan.kind == "sigkilled":
            await self.partition_over.wait()
            await asyncio.sleep(plan.at_s)
        else:
            await self.at(plan.at_s)
        iris = self.stack.iris()
        name = f"c{self.run_id}-{plan.index:03d}"
        job_id = f"chaos/{name}"

        async def go() -> str:
            try:
                return await iris.submit(plan.command, name=name, user=USER, workdir=None, **plan.kwargs)
            except JobAlreadyExists:
                return job_id  # an earlier attempt started it; its answer was lost

        try:
            record.job_id = await retrying(go)
        except Exception as exc:
            record.submit_error = f"{type(exc).__name__}: {exc}"
            return
        if plan.cancel_after_s is not None:
            await asyncio.sleep(plan.cancel_after_s)

            async def cancel() -> bool:
                return (await iris.cancel_and_report(job_id, "chaos")).won

            try:
                record.cancel_won = await retrying(cancel)
            except Exception as exc:
                record.cancel_error = f"{type(exc).__name__}: {exc}"

    async def submit_all(self, records: list[Record]) -> None:
        await asyncio.gather(*(self.submit(r) for r in records))

    async def kill_workers(self) -> None:
        lo, hi = self.options.kill_every_s
        until = self.started + self.options.chaos_s
        await self.at(self.options.kill_from_s)
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(lo, hi))
            await asyncio.to_thread(self.stack.kill_worker)
            self.faults.worker_kills += 1
            await asyncio.sleep(self.rng.uniform(0.3, 1.5))
            self.stack.start_worker()
            self.faults.worker_restarts += 1
            self.note(f"worker SIGKILLed and restarted (#{self.faults.worker_kills})")

    async def restart_temporal(self) -> None:
        await self.at(self.options.temporal_restart_at_s)
        down = time.monotonic()
        await asyncio.to_thread(self.stack.temporal.stop)
        self.stack.temporal.start()
        await asyncio.to_thread(self.stack.temporal.wait_ready, 120)
        self.faults.temporal_restarts += 1
        self.faults.temporal_down_s = time.monotonic() - down
        self.note(
            f"Temporal restarted on {self.stack.root / 'temporal.db'} ({self.faults.temporal_down_s:.1f}s)"
        )

    async def restart_peer(self) -> None:
        await self.at(self.options.peer_restart_at_s)
        peer = self.stack.controllers[PEER_TO_RESTART]
        down = time.monotonic()
        self.down.add(PEER_TO_RESTART)
        await asyncio.to_thread(peer.stop)
        self.note(f"controller {PEER_TO_RESTART} stopped")
        await asyncio.sleep(self.options.peer_down_s)
        peer.start()
        await asyncio.to_thread(peer.wait_ready, 120)
        self.down.discard(PEER_TO_RESTART)
        self.faults.peer_restarts += 1
        self.faults.peer_down_s = time.monotonic() - down
        self.note(f"controller {PEER_TO_RESTART} back ({self.faults.peer_down_s:.1f}s)")

    async def lose_replies(self) -> None:
        """Every launch reply from FLAKY is lost for a while: the controller has the job, the
        worker gets a 502. A launch whose 6 tries all fall in the window is reconciled."""
        proxy = self.stack.proxies[FLAKY]
        await self.at(self.options.lost_replies_from_s)
        began = time.monotonic()
        proxy.lose_replies[LAUNCH] = 1_000_000
        self.note(f"{FLAKY}'s proxy loses every launch reply")
        await self.partition_started.wait()
        proxy.lose_replies[LAUNCH] = 0
        self.faults.lost_replies_s = time.monotonic() - began
        self.faults.lost_replies = proxy.lost_replies
        self.note(f"{FLAKY}'s proxy answers again ({proxy.lost_replies} launch replies lost)")

    async def partition(self) -> None:
        """FLAKY unreachable for longer than a launch's retries, shorter than peer_lost_after: its
        proxy cuts the next launch after it reached the controller, then refuses every connection."""
        proxy = self.stack.proxies[FLAKY]
        await self.peer_lost.wait()
        await asyncio.sleep(self.options.partition_after_loss_s)
        self.partition_started.set()
        proxy.cut(LAUNCH, forward=True)
        for _ in range(300):  # up to 15 s for a launch to cut, else the partition starts anyway
            if proxy.refusing:
                break
            await asyncio.sleep(0.05)
        else:
            proxy.refuse()
        self.faults.partition_cut = list(proxy.cut_requests)
        began = time.monotonic()
        how = "cut a launch in flight" if proxy.cut_requests else "refusing"
        self.note(f"{FLAKY} partitioned ({how})")
        await asyncio.sleep(self.options.partition_s)
        await proxy.heal()
        self.partition_over.set()
        self.faults.partitions += 1
        self.faults.partition_s = time.monotonic() - began
        self.note(f"{FLAKY} reachable again ({self.faults.partition_s:.1f}s)")

    async def preempt_tasks(self, records: list[Record]) -> None:
        """SIGKILL the process group of each 'sigkilled' job's first run on FLAKY, once it has run
        a second or so (found by the job id in its environment)."""
        targets = {f"{self.prefix}{r.plan.index:03d}" for r in records if r.plan.kind == "sigkilled"}
        seen: dict[str, float] = {}
        give_up: float | None = None
        while targets - set(self.faults.sigkilled):
            if self.faults_over.is_set():
                give_up = give_up or time.monotonic() + 30
                if time.monotonic() > give_up:
                    break
            procs = await asyncio.to_thread(job_processes, self.prefix)
            for proc in run_tops(procs):
                if proc.job_id not in targets or proc.job_id in self.faults.sigkilled:
                    continue
                if proc.cluster != FLAKY:
                    continue
                first = seen.setdefault(proc.run_id, time.monotonic())
                if time.monotonic() - first >= 1.5:
                    kill_groups({proc.pgid})
                    self.faults.sigkilled[proc.job_id] = proc.run_id
                    self.faults.killed_runs[proc.run_id] = int(time.time() * 1000)
                    self.note(f"SIGKILLed {proc.job_id}'s process group {proc.pgid} on {FLAKY}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.faults_over.wait(), 0.5)

    async def lose_peer(self, records: list[Record]) -> None:
        """LOST goes away for good (its host dies): proxy refusing, controller and job processes
        SIGKILLed. It comes back once every attempt it was running has moved (ended PREEMPTED after
        peer_lost_after), with the fences on it recorded first."""
        o = self.options
        first, last = o.peer_lost_between_s
        await self.at(first - o.worker_killed_before_loss_s)
        longs = {f"{self.prefix}{r.plan.index:03d}" for r in records if r.plan.kind.startswith("long")}
        want = min(o.long_jobs_on_lost, len(longs))
        while time.monotonic() < self.started + last - o.worker_killed_before_loss_s:
            held = await self.held([LOST], wait_s=3.0)
            there = [j for j in held.get(LOST, {}).values() if j.job_id in longs and j.state in LIVE]
            if len(there) >= want:
                break
            await asyncio.sleep(1.0)
        await asyncio.to_thread(self.stack.kill_worker)
        self.faults.worker_kills += 1
        self.stack.start_worker()
        self.faults.worker_restarts += 1
        self.note(
            f"worker SIGKILLed and restarted ({o.worker_killed_before_loss_s:.0f}s before {LOST} is lost)"
        )
        await asyncio.sleep(o.worker_killed_before_loss_s)
        proxy = self.stack.proxies[LOST]
        controller = self.stack.controllers[LOST]
        proxy.refuse()
        self.down.add(LOST)
        lost_ms = self.faults.lost_ms = int(time.time() * 1000)
        began = time.monotonic()
        # Its jobs' processes, found before the controller goes: in the job sandbox they end with
        # it (bwrap --die-with-parent), as they would with their host.
        procs = await asyncio.to_thread(job_processes, self.prefix)
        await asyncio.to_thread(controller.kill)
        await asyncio.to_thread(controller.stop)
        groups = {p.pgid for p in procs if p.cluster == LOST}
        self.faults.peer_lost_processes = kill_groups(groups)
        killed_ms = int(time.time() * 1000)
        self.faults.killed_runs.update({p.run_id: killed_ms for p in procs if p.cluster == LOST})
        self.faults.peers_lost += 1
        self.peer_lost.set()
        self.note(
            f"{LOST} lost: controller SIGKILLed, and {self.faults.peer_lost_processes} of its "
            f"{len(groups)} job process group(s) still alive (a sandboxed one ends with its controller)"
        )
        await asyncio.sleep(o.peer_lost_after_s + o.peer_back_margin_s)
        # The judge's part while it is away: every attempt it was running has moved. A follow lost
        # with the worker resumes after its heartbeat timeout (30 s), then counts the silence
        # (peer_lost_after); a job still on LOST after twice that is stuck there.
        deadline = began + 30 + 2 * o.peer_lost_after_s
        while True:
            statuses = await self.describe_all(records)
            stuck = [
                st.job_id
                for st in statuses.values()
                if st.cluster == LOST
                and st.state in ON_CLUSTER
                and st.attempts
                and st.attempts[-1].started_ms < lost_ms
            ]
            if not stuck or time.monotonic() > deadline:
                break
            self.note(f"still followed on {LOST}: {', '.join(stuck)}")
            await asyncio.sleep(5)
        on_lost = [st for st in statuses.values() if any(a.cluster == LOST for a in st.attempts)]
        await asyncio.to_thread(dump, self.stack.root / "lost-peer.jsonl", on_lost)
        self.faults.still_on_lost = stuck
        self.faults.moved = sum(
            1
            for st in statuses.values()
            for a in st.attempts
            if a.cluster == LOST
            and a.end == AttemptEnd.PREEMPTED.value
            and a.started_ms < lost_ms
            and "did not answer" in (a.reason or "")
        )
        fences = await self.store_read(lambda s: s.fences())
        self.faults.fenced_on_lost = {
            (f.job_id, f.nonce) for f in fences if f.cluster == LOST and f.job_id.startswith(self.prefix)
        }
        controller.start()
        await asyncio.to_thread(controller.wait_ready, 120)
        await proxy.heal()
        self.down.discard(LOST)
        self.faults.peer_lost_s = time.monotonic() - began
        self.note(
            f"{LOST} back after {self.faults.peer_lost_s:.0f}s: {self.faults.moved} attempt(s) had moved, "
            f"{len(self.faults.fenced_on_lost)} fenced there, {len(stuck)} still following it"
        )

    async def store_read(self, read: Callable[[FederationStore], T]) -> T:
        def go() -> T:
            store = FederationStore(self.stack.config.store_url)
            try:
                return read(store)
            finally:
                store.close()

        return await asyncio.to_thread(go)

    async def describe_all(self, records: list[Record]) -> dict[str, JobStatus]:
        iris = self.stack.iris()
        gate = asyncio.Semaphore(8)
        found: dict[str, JobStatus] = {}

        async def one(job_id: str) -> None:
            async with gate:
                with contextlib.suppress(Exception):
                    found[job_id] = await retrying(lambda: iris.describe(job_id), within=30)

        await asyncio.gather(*(one(r.job_id) for r in records if r.job_id is not None))
        return found

    async def held(self, clusters: list[str], wait_s: float = 10.0) -> dict[str, dict[str, PeerJobStatus]]:
        """This run's jobs as each controller holds them (read directly, past the proxies)."""

        async def one(cluster: str) -> tuple[str, dict[str, PeerJobStatus]]:
            async with self.stack.direct_client(cluster, wait_s) as ctl:
                jobs = await ctl.list_jobs()
            return cluster, {j.job_id: j for j in jobs if j.job_id.startswith(self.prefix)}

        answers = await asyncio.gather(*(one(c) for c in clusters), return_exceptions=True)
        return dict(a for a in answers if not isinstance(a, BaseException))

    async def sample_live(self) -> None:
        """Every few seconds, every running controller at once: a job with live runs on two
        clusters, or running/succeeded on two, has two live attempts."""
        while self.sampling:
            up = [c for c in self.stack.config.cluster_names if c not in self.down]
            held = await self.held(up, wait_s=3.0)
            if len(held) == len(up):
                self.faults.samples += 1
            live, active = doubles(held)
            for job_id, seen in live.items():
                self.live_twice.setdefault(job_id, seen)
            for job_id, seen in active.items():
                self.active_twice.setdefault(job_id, seen)
            await asyncio.sleep(self.options.sample_every_s)

    async def unsettled(self) -> int:
        """Jobs whose workflow still runs and is not parked (HANDOFF_FAILED)."""
        assert self.stack.client is not None
        # This Temporal server is the suite's own: every JobWorkflow on it is one of ours.
        query = (
            "WorkflowType = 'JobWorkflow' AND ExecutionStatus = 'Running' AND IrisState != 'HANDOFF_FAILED'"
        )
        return (await self.stack.client.count_workflows(query)).count

    async def unknown_outcomes(self) -> int:
        """Parked jobs whose last launch's outcome is still unknown: they go on asking their
        cluster (15 s, doubling), and move again once it answers."""
        assert self.stack.client is not None
        query = (
            "WorkflowType = 'JobWorkflow' AND ExecutionStatus = 'Running' AND IrisState = 'HANDOFF_FAILED'"
        )
        iris = self.stack.iris()
        unknown = 0
        async for wf in self.stack.client.list_workflows(query):
            with contextlib.suppress(IrisError):
                unknown += int(UNKNOWN_OUTCOME in (await iris.describe(wf.id)).reason)
        return unknown

    async def settle(self) -> None:
        """Until every job is terminal or parked for good (not waiting for a cluster's answer), and
        every fence of the run is gone (bounded)."""
        deadline = time.monotonic() + self.options.settle_s
        last_report = 0.0
        while time.monotonic() < deadline:
            with contextlib.suppress(RPCError, RuntimeError):
                left = await self.unsettled()
                fences = [
                    f for f in await self.store_read(lambda s: s.fences()) if f.job_id.startswith(self.prefix)
                ]
                asking = await self.unknown_outcomes() if left == 0 and not fences else 0
                if left == 0 and not fences and not asking:
                    return
                if time.monotonic() - last_report > 15:
                    last_report = time.monotonic()
                    self.note(
                        f"{left} job(s) still moving, {len(fences)} fence(s) left"
                        + (f", {asking} parked job(s) asking their cluster" if asking else "")
                    )
            await asyncio.sleep(1.0)

    async def check_histories(self) -> tuple[DeterminismReport, Counter[str]]:
        """Replay every history of the run against this code; count failed workflow tasks by cause."""
        assert self.stack.client is not None
        client = self.stack.client
        task_failures: Counter[str] = Counter()
        histories: list[WorkflowHistory] = []
        async for wf in client.list_workflows(""):
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            histories.append(history)
            for event in history.events:
                if event.HasField("workflow_task_failed_event_attributes"):
                    cause = event.workflow_task_failed_event_attributes.cause
                    task_failures[WorkflowTaskFailedCause.Name(cause)] += 1

        async def each() -> AsyncIterator[WorkflowHistory]:
            for history in histories:
                yield history

        return await replay_histories(each(), "every execution of the chaos run"), task_failures


def doubles(held: dict[str, dict[str, PeerJobStatus]]) -> tuple[dict[str, str], dict[str, str]]:
    """Jobs that two controllers hold live (PENDING/RUNNING) at once; jobs two controllers report
    RUNNING or SUCCEEDED."""
    runs: dict[str, list[tuple[str, PeerJobStatus]]] = {}
    for cluster, jobs in held.items():
        for job_id, job in jobs.items():
            runs.setdefault(job_id, []).append((cluster, job))
    live: dict[str, str] = {}
    active: dict[str, str] = {}
    for job_id, where in runs.items():
        seen = ", ".join(f"{c} {j.state.value} {j.nonce.rsplit('@', 1)[-1]}" for c, j in where)
        if sum(j.state in LIVE for _, j in where) > 1:
            live[job_id] = f"{job_id} ({seen})"
        if sum(j.state in ACTIVE for _, j in where) > 1:
            active[job_id] = f"{job_id} ({seen})"
    return live, active


@dataclass
class Run:
    """One run of a job's command, as it wrote itself into the execution ledger."""

    job_id: str
    cluster: str
    run_id: str
    started_ms: int
    ended_ms: int | None = None


def read_ledger(path: Path) -> dict[str, list[Run]]:
    """Every run of every job, by job id (replicas of one run share its run id)."""
    runs: dict[str, Run] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        parts = line.split()
        if len(parts) != 5 or parts[0] not in ("S", "E") or not parts[1].isdigit():
            continue
        mark, ms, job_id, cluster, run_id = parts
        run = runs.setdefault(run_id, Run(job_id, cluster, run_id, int(ms)))
        if mark == "S":
            run.started_ms = min(run.started_ms, int(ms))
        else:
            run.ended_ms = max(run.ended_ms or 0, int(ms))
    by_job: dict[str, list[Run]] = {}
    for run in sorted(runs.values(), key=lambda r: r.started_ms):
        by_job.setdefault(run.job_id, []).append(run)
    return by_job


def overlapping(runs: list[Run], killed: dict[str, int]) -> list[tuple[Run, Run]]:
    """Pairs of runs of one job that were alive at the same time (both ends known: the ledger's,
    or when this suite killed it)."""
    ends = {r.run_id: r.ended_ms or killed.get(r.run_id) for r in runs}
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            end_a, end_b = ends[a.run_id], ends[b.run_id]
            if end_a is not None and end_b is not None and a.started_ms < end_b and b.started_ms < end_a:
                pairs.append((a, b))
    return pairs


@dataclass
class StoreState:
    handles: list[JobHandle]
    reservations: list[Reservation]
    fences: list[Fence]


def judge(
    records: list[Record],
    held: dict[str, dict[str, PeerJobStatus]],
    store: StoreState,
    faults: Faults,
    sampled: tuple[dict[str, str], dict[str, str]],
    ledger: dict[str, list[Run]],
) -> Verdict:
    names = (
        "lost",
        "unlaunched run",
        "two live",
        "two clusters",
        "ran twice",
        "after-cancel",
        "stale attempt",
        "stuck",
        "sigkill",
        "reservation",
        "handle",
        "unsettled",
        "unrecorded",
    )
    examples: dict[str, list[str]] = {k: [] for k in names}
    states: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    handles = {h.job_id: h for h in store.handles}
    finals = {r.job_id: r.final for r in records if r.job_id is not None and r.final is not None}
    lost = unlaunched = after_cancel = unsettled = stale = sigkill = leaked = live_handles = unrecorded = 0
    reconciled = unknown = adopted = retried = preempted = twice = 0
    two: dict[str, str] = {}
    # At least once, by design: a run that ended on LOST before it was lost, unseen (the home had
    # not followed it to its end), then run again elsewhere as the next attempt.
    rerun_after_loss: dict[str, str] = {}
    for r in records:
        if r.job_id is None or r.final is None:
            lost += 1
            examples["lost"].append(f"#{r.plan.index} {r.submit_error or 'no status'}")
            states["(no status)"] += 1
            continue
        job_id, final = r.job_id, r.final
        states[final.state.value] += 1
        by_kind.setdefault(r.plan.kind, Counter())[final.state.value] += 1
        messages = [e.message for e in final.events]
        reconciled += any(RECONCILED in m for m in messages)
        unknown += any(UNKNOWN_OUTCOME in m for m in messages)
        adopted += any(ADOPTED in m for m in messages)
        retried += len(final.attempts) > 1
        preempted += any(a.end == AttemptEnd.PREEMPTED.value for a in final.attempts)
        # Every run a controller holds is an attempt the workflow launched there, each nonce once.
        for cluster, jobs in held.items():
            run = jobs.get(job_id)
            if run is None:
                continue
            nonces = {a.nonce for a in final.attempts if a.cluster == cluster}
            if run.nonce not in nonces or run.attempts > len(nonces):
                unlaunched += 1
                examples["unlaunched run"].append(
                    f"{job_id} on {cluster}: nonce {run.nonce}, {run.attempts} run(s); "
                    f"workflow: {sorted(nonces)}"
                )
        # What actually ran (the ledger): no more runs on a cluster than attempts launched there,
        # never two at once, and to completion once, except after a peer lost for good: a run that
        # ended there unseen is run again elsewhere (at least once, by design).
        runs = ledger.get(job_id, [])
        for cluster in {run.cluster for run in runs}:
            ran = sum(run.cluster == cluster for run in runs)
            launched = len({a.nonce for a in final.attempts if a.cluster == cluster})
            if ran > launched:
                unlaunched += 1
                examples["unlaunched run"].append(
                    f"{job_id}: {ran} run(s) on {cluster}, {launched} attempt(s)"
                )
        for a, b in overlapping(runs, faults.killed_runs):
            two[job_id] = f"{job_id} (ran at once on {a.cluster} and {b.cluster})"
        done = [run for run in runs if run.ended_ms is not None]
        # A job that succeeded ran its command to the end, which writes the ledger's last line: a
        # ledger its jobs cannot write (a sandbox that does not see it) would prove nothing.
        if final.state is JobState.SUCCEEDED and not done:
            unrecorded += 1
            examples["unrecorded"].append(f"{job_id}: SUCCEEDED, no completed run in the ledger")
        if len(done) > 1:
            first, later = done[0], done[1:]
            lost_there = any(
                a.cluster == LOST
                and a.end == AttemptEnd.PREEMPTED.value
                and "did not answer" in (a.reason or "")
                for a in final.attempts
            )
            ended_before = first.ended_ms is not None and first.ended_ms < faults.lost_ms
            seen = ", ".join(f"{run.cluster} {run.run_id[:8]}" for run in done)
            if (
                first.cluster == LOST
                and lost_there
                and ended_before
                and all(r.cluster != LOST for r in later)
            ):
                gap = (faults.lost_ms - (first.ended_ms or 0)) / 1000
                rerun_after_loss[job_id] = f"{job_id} (ended {gap:.1f}s before; {seen})"
            else:
                twice += 1
                examples["ran twice"].append(f"{job_id} completed {len(done)}× ({seen})")
        # No delivery after a won cancel: never delivered at all; or, for a cancel the store
        # committed before promotion, no attempt started after it.
        clusters = [c for c, jobs in held.items() if job_id in jobs]
        handle = handles.get(job_id)
        cancel_ms = next((e.at_ms for e in final.events if e.message.startswith("cancel requested")), None)
        if r.cancel_won is True and (clusters or final.attempts):
            after_cancel += 1
            examples["after-cancel"].append(f"{job_id} (won) on {clusters}")
        elif handle is not None and handle.cancel_requested and handle.assigned_peer is None:
            late = [a for a in final.attempts if cancel_ms is not None and a.started_ms > cancel_ms]
            if late or (clusters and not final.attempts):
                after_cancel += 1
                examples["after-cancel"].append(f"{job_id} (store) on {clusters}")
        # A SIGKILLed first run is a failure (exit 137) and is retried (--max-retries-failure 1).
        if r.plan.kind == "sigkilled" and job_id in faults.sigkilled:
            victim = final.attempts[0] if final.attempts else None
            if victim is None or victim.end != AttemptEnd.FAILED.value or len(final.attempts) < 2:
                sigkill += 1
                ends = [(a.end, a.exit_code) for a in final.attempts]
                examples["sigkill"].append(f"{job_id} attempts {ends}")
        parked = final.state is JobState.HANDOFF_FAILED and bool(final.reason.strip())
        if not (final.terminal or parked):
            unsettled += 1
            examples["unsettled"].append(f"{job_id} {final.state.value}: {final.reason[:60]}")
        if final.terminal and handle is not None and not handle.state.terminal:
            live_handles += 1
            examples["handle"].append(f"{job_id} {final.state.value}, handle {handle.state.value}")
    # Two live attempts: in any sample, at the end, and in the ledger. Two clusters reporting a
    # job RUNNING/SUCCEEDED: in any sample and at the end, but for the at-least-once re-runs.
    live_now, active_now = doubles(held)
    two = {**two, **live_now, **sampled[0]}
    examples["two live"] += sorted(two.values())
    on_two = {j: seen for j, seen in {**active_now, **sampled[1]}.items() if j not in rerun_after_loss}
    examples["two clusters"] += sorted(on_two.values())
    examples["stuck"] += [
        f"{job_id} ({finals[job_id].state.value} at the end)"
        for job_id in faults.still_on_lost
        if job_id in finals
    ]
    # Stale attempts on the lost peer: each fenced before it came back, and ended there after.
    lost_nonces = {
        (job_id, a.nonce)
        for job_id, final in finals.items()
        for a in final.attempts
        if a.cluster == LOST and a.end == AttemptEnd.PREEMPTED.value and "did not answer" in (a.reason or "")
    }
    for job_id, nonce in sorted(lost_nonces - faults.fenced_on_lost):
        stale += 1
        examples["stale attempt"].append(f"{job_id} {nonce}: lost, never fenced")
    ended_there: Counter[str] = Counter()
    for job_id, nonce in sorted(faults.fenced_on_lost):
        run = held.get(LOST, {}).get(job_id)
        if run is None:
            ended_there["never received"] += 1
        elif run.nonce != nonce:
            ended_there["superseded by a later attempt"] += 1
        elif run.state in LIVE:
            stale += 1
            examples["stale attempt"].append(f"{job_id} {nonce}: {run.state.value} on {LOST}")
        else:
            ended_there[run.state.value] += 1
    for fence in store.fences:
        stale += 1
        examples["stale attempt"].append(f"{fence.job_id} {fence.nonce}: still fenced on {fence.cluster}")
    for res in store.reservations:
        final_status = finals.get(res.job_id)
        handle = handles.get(res.job_id)
        ended = (final_status is not None and final_status.terminal) or (
            handle is not None and handle.state.terminal
        )
        if ended:
            leaked += 1
            examples["reservation"].append(f"{res.job_id} on {res.peer_id}/{res.backend_id}")
    invariants = {
        "jobs lost": lost,
        "runs the workflows did not launch": unlaunched,
        "jobs with two live attempts at once": len(two),
        "jobs RUNNING/SUCCEEDED on two clusters": len(on_two),
        "jobs run to completion twice": twice,
        "deliveries after a won cancel": after_cancel,
        "stale attempts unfenced or running": stale,
        "jobs stuck on the lost peer": len(faults.still_on_lost),
        "SIGKILLed attempts not retried": sigkill,
        "leaked reservations (ended jobs)": leaked,
        "live handles of ended jobs": live_handles,
        "not terminal nor parked w/ reason": unsettled,
        "SUCCEEDED jobs missing from the ledger": unrecorded,
    }
    killed = [finals[j] for j in faults.sigkilled if j in finals]
    first_ends = Counter(
        f"{st.attempts[0].end} exit {st.attempts[0].exit_code}" for st in killed if st.attempts
    )
    outcome = Counter(f"{st.state.value} after {len(st.attempts)} attempts" for st in killed)
    there = ", ".join(f"{k} ×{n}" for k, n in sorted(ended_there.items())) or "none"
    parked_reservations = sum(
        1 for res in store.reservations if res.job_id not in finals or not finals[res.job_id].terminal
    )
    waits = sorted((st.attempts[0].started_ms - st.submit_ms) / 1000 for st in finals.values() if st.attempts)
    wait = f"median {waits[len(waits) // 2]:.0f}s, max {waits[-1]:.0f}s" if waits else "-"
    all_runs = [run for runs in ledger.values() for run in runs]
    completed = sum(run.ended_ms is not None for run in all_runs)
    killed_runs = sum(run.run_id in faults.killed_runs for run in all_runs)
    notes = [
        f"submit to first launch: {wait}",
        f"execution ledger: {len(all_runs)} runs started, {completed} completed, {killed_runs} SIGKILLed by "
        f"the suite, {len(all_runs) - completed - killed_runs} stopped otherwise (terminated, or died "
        f"with a controller)",
        f"at least once (by design, not counted above): {len(rerun_after_loss)} job(s) whose first run "
        f"ended on {LOST} unseen before it was lost were run again elsewhere"
        + (f": {', '.join(list(rerun_after_loss.values())[:4])}" if rerun_after_loss else ""),
        f"lost replies: {reconciled} job(s) reconciled (all 6 launch replies lost, then found on the "
        f"cluster by id and nonce); {unknown} parked with an unknown outcome, {adopted} of them adopted "
        "when the cluster answered",
        f"attempts: {retried} job(s) ran more than one attempt, {preempted} had an attempt PREEMPTED; "
        f"{faults.moved} attempt(s) moved off {LOST} while it was gone"
        + (f" ({len(faults.still_on_lost)} still followed there)" if faults.still_on_lost else ""),
        f"stale attempts on {LOST}: {len(faults.fenced_on_lost)} fenced before it came back; after: {there}; "
        f"{len(store.fences)} fence(s) left",
        "SIGKILLed processes: first attempt "
        + (", ".join(f"{k} ×{n}" for k, n in first_ends.items()) or "-")
        + "; job "
        + (", ".join(f"{k} ×{n}" for k, n in outcome.items()) or "-"),
        f"store after settle: {len(store.reservations)} reservation(s) "
        f"({parked_reservations} of jobs still parked), {len(store.fences)} fence(s)",
    ]
    return Verdict(states, by_kind, invariants, examples, notes)


async def run_chaos(options: Options, root: Path) -> Report:
    t0 = time.monotonic()
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    print(f"chaos: data in {root}", flush=True)
    stack = await start_stack(root, options)
    try:
        startup = time.monotonic() - t0
        chaos = Chaos(stack, options)
        ledger = shared_dir(root) / "executions.log"
        records = [Record(plan) for plan in plan_jobs(options, chaos.rng, ledger, time.time())]
        chaos.note(f"stack up in {startup:.0f}s; submitting {len(records)} jobs")
        sampler = asyncio.create_task(chaos.sample_live())
        killer = asyncio.create_task(chaos.preempt_tasks(records))
        await asyncio.gather(
            chaos.submit_all(records),
            chaos.kill_workers(),
            chaos.restart_temporal(),
            chaos.restart_peer(),
            chaos.lose_replies(),
            chaos.partition(),
            chaos.lose_peer(records),
        )
        chaos.faults_over.set()
        await killer
        if stack.worker is None or not stack.worker.running:
            stack.start_worker()
        chaos_end = time.monotonic()
        chaos.note("faults over; waiting for every job to settle")
        await chaos.settle()
        settled = time.monotonic()
        chaos.sampling = False
        await sampler
        # What ran (ledger, controllers) is read before what the workflows say, and the store
        # after: a job still moving can then only look better launched than it was, never worse.
        runs = await asyncio.to_thread(read_ledger, ledger)
        held = await chaos.held(list(stack.config.cluster_names))
        finals = await chaos.describe_all(records)
        for r in records:
            r.final = finals.get(r.job_id) if r.job_id is not None else None
        prefix = chaos.prefix
        state = await chaos.store_read(
            lambda s: StoreState(
                handles=[h for h in s.handles() if h.job_id.startswith(prefix)],
                reservations=[r for r in s.reservations() if r.job_id.startswith(prefix)],
                fences=[f for f in s.fences() if f.job_id.startswith(prefix)],
            )
        )
        await asyncio.to_thread(dump, root / "jobs.jsonl", [r.final for r in records if r.final is not None])
        await asyncio.to_thread(
            dump, root / "held.jsonl", [job for jobs in held.values() for job in jobs.values()]
        )
        await asyncio.to_thread(
            dump, root / "store.jsonl", [*state.handles, *state.reservations, *state.fences]
        )
        replay, task_failures = await chaos.check_histories()
        sampled = (chaos.live_twice, chaos.active_twice)
        verdict = judge(records, held, state, chaos.faults, sampled, runs)
        now = time.monotonic()
        timings = {
            "startup": startup,
            "chaos": chaos_end - t0 - startup,
            "settle": settled - chaos_end,
            "checks": now - settled,
            "total": now - t0,
        }
        return Report(options, records, chaos.faults, verdict, timings, replay, task_failures)
    finally:
        await stop_stack(stack)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=Options.jobs)
    parser.add_argument("--seed", type=int, default=Options.seed)
    parser.add_argument("--keep", type=Path, help="keep the stack's data (logs, databases) in this directory")
    parser.add_argument("--slurm", action="store_true", help=f"run {FLAKY}'s H100 backend on a local Slurm")
    args = parser.parse_args(argv)
    options = Options(jobs=args.jobs, seed=args.seed, slurm=args.slurm)
    root = args.keep or Path(tempfile.mkdtemp(prefix="iris-chaos-"))
    try:
        report = asyncio.run(run_chaos(options, root))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(report.table(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
