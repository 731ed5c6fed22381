"""Running jobs: how many jobs the federation holds running at once, and what holding them costs.

    uv run python -m benchmarks.running [--jobs 300,1000] [--source HEAD] [--out FILE.json]

Issue 17's benchmark (docs/BENCHMARKS.md, "Running jobs (issue 17)"). For each value of ``--jobs``,
on a fresh real stack (``benchmarks/harness.py``: in-memory Temporal dev server, moto,
fake-gcs-server, the three controllers as processes, the federation store, ``iris worker`` as its
own process with ``IRIS_TEMPORAL_METRICS`` set so the SDK serves its slot gauges):

1. **idle**: ``--idle-s`` seconds with nothing running: each controller's requests (its access
   log), CPU (``/proc/<pid>/stat``) and bytes on its sockets (``ss``); then ``--fresh`` one-line
   ``h100×1`` jobs one at a time, each timed from submit to HANDED_OFF (its own status events);
2. **ramp**: N ``h100×1`` jobs submitted at once. Each is ``sh -c 'read x < GATE; exec sleep S'``:
   it blocks on a FIFO the benchmark holds open, so nothing ends before the benchmark says so, and
   costs no CPU while it waits. The running count is read from the controllers' own records
   (``controller.db``), never from home. The ramp ends when all N run, when the count has not grown
   for ``--plateau-s`` after the last submission, or at ``--ramp-timeout``;
3. **hold**: ``--hold-s`` seconds with them running: the same controller figures as idle, the
   worker's activity slots (``temporal_worker_task_slots_used``, ``worker_type="ActivityWorker"``),
   its Temporal calls by operation (``temporal_request``), its RSS; then ``--fresh`` jobs again,
   one at a time, each waited for at most ``--fresh-timeout`` (two in a row that time out end the
   phase: they would all wait for the same thing);
4. **release**: the FIFO is closed (and replaced by an empty file for jobs not started yet), so
   every job then sleeps its own S, spread evenly over ``--spread-s``: the exits do not land in
   one second. The run waits (at most ``--drain-timeout``) for the jobs to close, then measures
   propagation: the controller's ``finished_ms`` (the process exited) to SUCCEEDED at home (the
   status event, for a sample of ``--result-sample`` jobs; and the workflow's close time, for all);
5. sampled job histories (``--history-sample``): events, KiB, signals, and the events a held job
   added during the hold window.

With ``--workspace-mib M`` (a list: ``0,6.5`` runs each N without and with one), every held job
is submitted from one synthetic workspace of M MiB over ``--workspace-files`` files, packed and
stored at home once, as a sweep from one checkout would be (issue 31, part 4). The run then
reports the peers' disk during the hold (bundles, their unpacked copies, the jobs' working
directories: how many copies of the workspace they amount to) and the launch rate, to set beside
the same N without a workspace. ``--retention-s R`` gives the peers that retention and waits, after
the drain, for the peers to delete every bundle and copy.

Finally a *paper projection* to 100,000 running jobs over 50 peers (requests/s, bytes/s, Temporal
signals and calls/s), from the per-peer and per-job figures measured here. Requests are counted
generically (every line of the access log, by method and route), so the benchmark measures any
revision (``--source``), whatever endpoints it uses. Not a test: numbers depend on the machine.
"""

# The snapshot switch below runs before any project module is imported; the other imports follow it.

from __future__ import annotations

import sys

from benchmarks.source import run_from_snapshot

if __name__ == "__main__":
    run_from_snapshot("benchmarks.running", sys.argv[1:])

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from benchmarks.harness import (
    BenchError,
    BenchStack,
    Deadline,
    LoadSampler,
    PySpy,
    cpu_seconds,
    gather_bounded,
    machine,
    mean,
    pcts,
    percentile,
    rss_mib,
    run_main,
    summarize_collapsed,
    table,
    uptime_line,
    write_json,
)
from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, source_label
from iris import devstack
from iris.bundle import Bundle, pack
from iris.client import AsyncIrisClient, build_spec
from iris.config import FederationConfig
from iris.jobs import JobSpec, JobState, JobStatus

TASK_QUEUE = "iris-bench-running"
USER = "bench-running@bench.local"
METRICS_ENV = "IRIS_TEMPORAL_METRICS"  # iris/temporal.py; absent from older revisions
# The paper projection (docs/BENCHMARKS.md, "Running jobs (issue 17)").
PROJ_JOBS = 100_000
PROJ_PEERS = 50


# ---- the gate ----------------------------------------------------------------------------------


# A sandboxed job has a private /tmp, /var/tmp and /dev/shm (docs/SECURITY.md, "The job sandbox"):
# the gate lives elsewhere, and its cluster shows the job its directory, read-only.
SANDBOX_PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")


def gate_parent() -> str | None:
    """Where the gate's directory is made: outside the sandbox's private paths when this process
    can write there (/run as root, else $XDG_RUNTIME_DIR), else the temp directory."""
    for parent in ("/run", os.environ.get("XDG_RUNTIME_DIR", "")):
        if parent and not parent.startswith(SANDBOX_PRIVATE) and os.access(parent, os.W_OK | os.X_OK):
            return parent
    return None


class Gate:
    """A FIFO the held jobs block on (``read x < GATE``): this process holds it open for writing,
    so a job's ``open`` returns and its ``read`` waits, at no CPU, until the FIFO's last writer
    closes. ``release`` first puts an empty regular file in its place (a job started later reads
    EOF at once), then closes: every blocked job reads EOF. Readable by the jobs' user (a root
    controller runs them as ``run_as``, docs/SECURITY.md)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="iris-bench-gate-", dir=gate_parent()))
        self.dir.chmod(0o755)
        self.path = self.dir / "gate"
        os.mkfifo(self.path)
        self.path.chmod(0o644)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        self.released_ms: int | None = None

    def command(self, sleep_s: float) -> list[str]:
        return ["/bin/sh", "-c", f"read x < {self.path}; exec sleep {sleep_s:.2f}"]

    def release(self) -> None:
        if self._fd is None:
            return
        spare = self.dir / "open"
        spare.write_bytes(b"")
        spare.chmod(0o644)
        os.replace(spare, self.path)
        os.close(self._fd)
        self._fd = None
        self.released_ms = int(time.time() * 1000)

    def reap_leftovers(self) -> int:
        """SIGKILL, by pid, any job process still naming this gate (its controller is gone)."""
        killed = 0
        needle = str(self.path).encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if needle in (d / "cmdline").read_bytes():
                    os.kill(int(d.name), signal.SIGKILL)
                    killed += 1
        return killed

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- a sweep's workspace (issue 31, part 4) ----------------------------------------------------


def sweep_workspace(root: Path, mib: float, files: int, seed: int = 31) -> Bundle:
    """A checkout of ``files`` files and ``mib`` MiB: source-like text in packages, a fifth of the
    bytes one random "weights" file; packed as the SDK packs a workdir."""
    rng = random.Random(seed)
    total = int(mib * 1024 * 1024)
    binary = total // 5
    text_each = max(1, (total - binary) // max(1, files - 1))
    words = [f"{w}_{i}" for i, w in enumerate(("loss", "step", "grad", "batch", "model", "eval"))]
    for i in range(files - 1):
        path = root / f"pkg{i % 12:02d}" / f"module_{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines, size = [], 0
        while size < text_each:
            line = f"def f_{rng.randrange(10**6)}({rng.choice(words)}): return {rng.random():.6f}\n"
            lines.append(line)
            size += len(line)
        path.write_text("".join(lines))
    (root / "weights.bin").write_bytes(rng.randbytes(binary))
    bundle = pack(root)
    if bundle is None:
        raise BenchError("the workspace packed to nothing")
    return bundle


def disk_bytes(root: Path) -> tuple[int, int, int]:
    """Under ``root``: bytes on disk of its files and of its directories (allocated blocks, each
    inode once), and how many files."""
    seen: set[tuple[int, int]] = set()
    data = dirs = files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            if stat.S_ISDIR(st.st_mode):
                dirs += st.st_blocks * 512
            else:
                data += st.st_blocks * 512
                files += 1
    return data, dirs, files


def peer_disk(state_dir: Path) -> dict[str, Any]:
    """What a peer's state directory holds for bundles and working directories."""
    bundles = state_dir / "bundles"
    tarballs = list(bundles.glob("*.tar.gz"))
    unpacked = [p for p in (bundles / "unpacked").glob("*") if not p.name.startswith(".")]
    out: dict[str, Any] = {
        "tarballs": len(tarballs),
        "tarball_bytes": sum(p.stat().st_size for p in tarballs),
        "unpacked_copies": len(unpacked),
    }
    out["unpacked_bytes"], _, out["unpacked_files"] = disk_bytes(bundles / "unpacked")
    out["work_bytes"], out["work_dir_bytes"], out["work_files"] = disk_bytes(state_dir / "work")
    out["work_dirs"] = sum(1 for p in (state_dir / "work").glob("*") if not p.name.endswith(".layer"))
    out["logs_bytes"] = sum(disk_bytes(state_dir / "logs")[:2])
    return out


# ---- what the controllers and the worker say ---------------------------------------------------


def controller_db(stack: BenchStack, cluster: str) -> Path:
    return stack.root / "clusters" / cluster / "controller.db"


def read_jobs(path: Path, columns: str = "job_id, state") -> list[tuple[Any, ...]]:
    """The controller's own job records (its SQLite store, read-only: no request to count)."""
    if not path.exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute(f"SELECT {columns} FROM jobs").fetchall()
    except sqlite3.Error as exc:
        raise BenchError(f"cannot read the controller's records {path}: {exc}") from exc


_ACCESS_RE = re.compile(r"\b(GET|POST|PUT|DELETE|PATCH|HEAD) (/\S*) -> (\d{3})")


def route(method: str, path: str) -> str:
    """A request's route, ids folded: ``GET /v1/jobs/{id}/logs``, ``GET /v1/changes``..."""
    for prefix in ("/v1/jobs/", "/v1/bundles/"):
        if path.startswith(prefix) and len(path) > len(prefix):
            rest = path[len(prefix) :]
            tail = rest.rsplit("/", 1)[-1] if rest.endswith(("/logs", "/terminate")) else ""
            name = "{id}" if prefix == "/v1/jobs/" else "{sha256}"
            return f"{method} {prefix}{name}" + (f"/{tail}" if tail else "")
    return f"{method} {path}"


class AccessLog:
    """One controller's requests, by route, since ``mark`` (its access log file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def count(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        if not self.path.exists():
            return counts
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            for line in fh.read().decode(errors="replace").splitlines():
                m = _ACCESS_RE.search(line)
                if m:
                    counts[route(m.group(1), m.group(2))] += 1
        return counts


_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


def socket_bytes(port: int) -> dict[str, tuple[int, int]]:
    """(bytes sent, bytes received) per established connection to ``port``, from the kernel's TCP
    info (``ss -tin``): what a controller's HTTP traffic weighs, whatever its routes."""
    try:
        out = subprocess.run(
            ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    conns: dict[str, tuple[int, int]] = {}
    peer = ""
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            parts = line.split()
            peer = parts[-1] if parts else ""
            continue
        found = dict((k, int(v)) for k, v in _SS_BYTES.findall(line))
        conns[peer] = (found.get("sent", 0), found.get("received", 0))
    return conns


def bytes_between(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """Bytes (sent, received) on connections between two ``socket_bytes`` reads. A connection
    opened and closed in between is not seen: a lower bound."""
    sent = recv = 0
    for peer, (s, r) in b.items():
        s0, r0 = a.get(peer, (0, 0))
        if s >= s0 and r >= r0:
            sent, recv = sent + s - s0, recv + r - r0
        else:  # the same address, a new connection
            sent, recv = sent + s, recv + r
    return sent, recv


@dataclass
class WorkerMetrics:
    """The worker's SDK metrics (``IRIS_TEMPORAL_METRICS``): slot gauges and call counters."""

    slots_used: float | None = None
    slots_available: float | None = None
    calls: dict[str, float] = field(default_factory=dict)


async def workflow_backlog(client: Client, task_queue: str) -> tuple[int, float] | None:
    """(tasks waiting, the oldest one's wait in s) on the jobs' workflow task queue, as the server
    estimates them; None if it cannot say."""
    try:
        resp = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
                report_stats=True,
            ),
            timeout=timedelta(seconds=5),
        )
    except Exception:
        return None
    if not resp.HasField("stats"):
        return None
    age = resp.stats.approximate_backlog_age
    return resp.stats.approximate_backlog_count, age.seconds + age.nanos / 1e9


async def scrape(http: httpx.AsyncClient, url: str | None, task_queue: str) -> WorkerMetrics | None:
    if url is None:
        return None
    try:
        text = (await http.get(url)).text
    except httpx.HTTPError:
        return None
    m = WorkerMetrics()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("temporal_request", "temporal_request_total"):
                op = s.labels.get("operation", "?")
                m.calls[op] = m.calls.get(op, 0.0) + s.value
            elif s.labels.get("task_queue") != task_queue or s.labels.get("worker_type") != "ActivityWorker":
                continue
            elif s.name == "temporal_worker_task_slots_used":
                m.slots_used = s.value
            elif s.name == "temporal_worker_task_slots_available":
                m.slots_available = s.value
    return m


# ---- one window of controller measurements -----------------------------------------------------


@dataclass
class ControllerWindow:
    """One controller over a window: requests by route, CPU seconds, bytes on its sockets."""

    seconds: float
    requests: Counter[str]
    cpu_s: float
    sent: int
    received: int

    @property
    def rps(self) -> float:
        return sum(self.requests.values()) / self.seconds

    @property
    def cpu_per_min(self) -> float:
        return self.cpu_s / self.seconds * 60

    @property
    def bytes_per_s(self) -> float:
        return (self.sent + self.received) / self.seconds


class Window:
    """Every controller's requests, CPU and bytes, plus the worker's calls and CPU, over a window."""

    def __init__(self, stack: BenchStack, peers: Sequence[str]) -> None:
        self.stack = stack
        self.clusters = [c.name for c in stack.config.clusters]
        self.logs = {c: AccessLog(p) for c, p in zip(self.clusters, stack.controller_logs(), strict=True)}
        self.pids = stack.pids()
        self.ports = {c.name: c.port for c in stack.config.clusters}
        self._t0 = 0.0
        self._cpu: dict[str, float] = {}
        self._bytes: dict[str, dict[str, tuple[int, int]]] = {}
        self.result: dict[str, ControllerWindow] = {}
        self.process_cpu: dict[str, float] = {}
        self.seconds = 0.0

    def start(self) -> None:
        for log in self.logs.values():
            log.mark()
        self._cpu = {n: cpu_seconds(p, children=False) for n, p in self.pids.items()}
        self._bytes = {c: socket_bytes(self.ports[c]) for c in self.clusters}
        self._t0 = time.monotonic()

    def stop(self) -> None:
        self.seconds = time.monotonic() - self._t0
        cpu = {n: cpu_seconds(p, children=False) - self._cpu[n] for n, p in self.pids.items()}
        self.process_cpu = cpu
        for c in self.clusters:
            sent, recv = bytes_between(self._bytes[c], socket_bytes(self.ports[c]))
            self.result[c] = ControllerWindow(
                self.seconds, self.logs[c].count(), cpu.get(f"controller {c}", float("nan")), sent, recv
            )


# ---- one run (one N) ---------------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float
    phase: str
    running: dict[str, int]
    running_all: int
    worker_rss_mib: float
    slots_used: float | None
    slots_available: float | None
    load1: float
    # The jobs' workflow task queue: tasks waiting for a poll, and the oldest one's wait (s).
    wft_backlog: int | None = None
    wft_backlog_age_s: float | None = None


@dataclass
class Fresh:
    job_id: str
    handed_off_ms: float | None
    waited_ms: float
    state: str


# Where the clusters' uid pools start, and how far apart (see ``configure``).
BENCH_UIDS_FROM = 100_000
BENCH_UIDS_PER_CLUSTER = 100_000


def configure(args: argparse.Namespace, n: int, gate: Gate) -> tuple[Callable[[FederationConfig], None], int]:
    """The demo topology with room for N on the two peers (and the fresh jobs), its sandboxed
    jobs shown the gate; (the stack's configure step, H100 slots per peer)."""
    slots = args.peer_slots or math.ceil((n + 4 * args.fresh + 8) / 2)

    def apply(cfg: FederationConfig) -> None:
        for c in cfg.clusters:
            for b in c.backends:
                if b.devices:
                    b.devices = {t: slots for t in b.devices}
        if args.max_per_peer is not None:
            cfg.max_per_peer_per_tick = args.max_per_peer if args.max_per_peer > 0 else None
        if args.retention_s > 0:
            for c in cfg.clusters:
                c.retention_s = args.retention_s
        if args.safety_poll_s is not None:
            cfg.mirror_safety_poll_s = args.safety_poll_s
        if args.no_sandbox:
            # The worker's side alone: a sandboxed held job costs this machine about 2.3 MiB of
            # memory (its bwrap pair and its shell), and 10,000 of them do not fit in 24 GiB.
            for c in cfg.clusters:
                c.sandbox = "off"
        if args.cached_workflows:
            # A revision before `[worker]` keeps its own cache size (4,096).
            if "worker" not in type(cfg).model_fields:
                raise SystemExit("--cached-workflows: the measured revision has no [worker] settings")
            cfg.worker.max_cached_workflows = args.cached_workflows
        sandboxes_for(cfg, gate, slots)

    return apply, slots


def sandboxes_for(cfg: FederationConfig, gate: Gate, slots: int) -> None:
    """Every cluster's sandboxed jobs shown the gate, and a pool of job uids with room for ``slots``."""
    for i, c in enumerate(cfg.clusters):
        # A revision without the job sandbox has no such field: its jobs see /tmp as it is.
        if "sandbox_ro_paths" in type(c).model_fields:
            c.sandbox_ro_paths = [*c.sandbox_ro_paths, str(gate.dir)]
        # A root controller runs each job as a uid of its pool, and the default pool (584 uids,
        # shared by the host's controllers) holds fewer jobs than N: each cluster gets a pool of
        # its own with room for its slots, in the range systemd leaves unused (65536-524287).
        if "sandbox_uids" in type(c).model_fields:
            first = BENCH_UIDS_FROM + i * BENCH_UIDS_PER_CLUSTER
            c.sandbox_uids = f"{first}-{first + max(slots, 64) + 63}"


async def start_worker_with_metrics(stack: BenchStack) -> str | None:
    """``iris worker`` with ``IRIS_TEMPORAL_METRICS`` set (only it inherits the variable); the
    endpoint's URL if the measured revision serves it."""
    port = devstack.free_port()
    os.environ[METRICS_ENV] = f"127.0.0.1:{port}"
    try:
        await stack.start_worker()
    finally:
        os.environ.pop(METRICS_ENV, None)
    url = f"http://127.0.0.1:{port}/metrics"
    async with httpx.AsyncClient(timeout=5) as http:
        m = await scrape(http, url, TASK_QUEUE)
    if m is None or m.slots_used is None:
        print("  the worker serves no SDK metrics (this revision has no IRIS_TEMPORAL_METRICS)", flush=True)
        return None
    return url


async def handed_off(iris: AsyncIrisClient, spec: JobSpec, within: float) -> Fresh:
    """Submit one job and wait (at most ``within``) for its HANDED_OFF event (its workflow's own
    status, polled)."""
    t0 = time.monotonic()
    await iris.submit_spec(spec)
    status: JobStatus | None = None
    while time.monotonic() - t0 < within:
        with contextlib.suppress(Exception):
            status = await asyncio.wait_for(iris.describe(spec.job_id), 10)
            at = next((e.at_ms for e in status.events if e.state is JobState.HANDED_OFF), None)
            if at is not None:
                return Fresh(spec.job_id, float(at - spec.submit_ms), (time.monotonic() - t0) * 1000, "ok")
            if status.terminal:
                return Fresh(spec.job_id, None, (time.monotonic() - t0) * 1000, status.state.value)
        await asyncio.sleep(0.25)
    return Fresh(spec.job_id, None, (time.monotonic() - t0) * 1000, "timeout")


async def fresh_jobs(
    iris: AsyncIrisClient, tag: str, count: int, within: float, deadline: Deadline
) -> list[Fresh]:
    out: list[Fresh] = []
    timeouts = 0
    for i in range(count):
        spec = build_spec(["true"], name=f"fresh-{tag}-{i:02d}", user=USER, device_type="h100", gpu_count=1)
        f = await handed_off(iris, spec, deadline.bound(within))
        out.append(f)
        print(f"  fresh {tag} {i}: {f.state} {fmt_ms(f.handed_off_ms)}", flush=True)
        timeouts = timeouts + 1 if f.state == "timeout" else 0
        if timeouts >= 2:
            print(f"  two fresh jobs in a row not handed off within {within:.0f}s: phase ended", flush=True)
            break
        await asyncio.sleep(0.5)
    return out


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


async def close_times(client: Client, query: str) -> dict[str, int]:
    out: dict[str, int] = {}
    async for wf in client.list_workflows(query):
        if wf.close_time is not None:
            out[wf.id] = int(wf.close_time.timestamp() * 1000)
    return out


@dataclass
class JobHistory:
    events: int
    kib: float
    activities: Counter[str]
    signals_total: int
    signals_after_launch: int
    hold_events: int
    hold_signals: int


async def job_history(client: Client, job_id: str, hold: tuple[int, int]) -> JobHistory:
    history = await client.get_workflow_handle(job_id).fetch_history()
    acts: Counter[str] = Counter()
    names: dict[int, str] = {}
    launched_at: int | None = None
    signals = after = in_hold = hold_signals = size = 0
    for e in history.events:
        size += e.ByteSize()
        at = e.event_time.ToMilliseconds()
        during_hold = hold[0] <= at <= hold[1]
        in_hold += during_hold
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = e.activity_task_scheduled_event_attributes.activity_type.name
            acts[name] += 1
            names[e.event_id] = name
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            sched = e.activity_task_completed_event_attributes.scheduled_event_id
            if names.get(sched) == "launch_job" and launched_at is None:
                launched_at = at
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            signals += 1
            hold_signals += during_hold
            if launched_at is not None:
                after += 1
    return JobHistory(len(history.events), size / 1024, acts, signals, after, in_hold, hold_signals)


async def run_one(
    args: argparse.Namespace, n: int, info: dict[str, Any], ws_mib: float = 0.0
) -> dict[str, Any]:
    deadline = Deadline(args.timeout)
    root = Path(tempfile.mkdtemp(prefix="iris-bench-running-"))
    stack = BenchStack(root)
    gate = Gate()
    apply, slots = configure(args, n, gate)
    out: dict[str, Any] = {"jobs": n, "peer_slots": slots, "workspace_mib": ws_mib}
    bundle: Bundle | None = None
    if ws_mib > 0:
        bundle = sweep_workspace(root / "workspace", ws_mib, args.workspace_files)
        out["workspace"] = {
            "files": bundle.ref.files,
            "bytes": bundle.ref.workspace_bytes,
            "bundle_bytes": bundle.ref.size,
        }
    if args.retention_s > 0:
        # Read by each controller at its start (docs/DESIGN.md, "Retention").
        os.environ["IRIS_RETENTION_SWEEP_S"] = "5"
    print(
        f"\n[{time.strftime('%X')}] N={n}"
        + (f", workspace {ws_mib:g} MiB / {args.workspace_files} files" if bundle else "")
        + f": stack in {root} ({uptime_line()})",
        flush=True,
    )
    samples: list[Sample] = []
    sampler: asyncio.Task[None] | None = None
    try:
        # Submissions are signed by their user (docs/DESIGN.md, "User → home").
        await stack.start(apply, task_queue=TASK_QUEUE, users={USER: ["user"]})
        metrics_url = await start_worker_with_metrics(stack)
        assert stack.worker is not None and stack.worker.proc is not None
        wpid = stack.worker.proc.pid
        iris = AsyncIrisClient(stack.client, stack.config)
        peers = [c.name for c in stack.config.clusters if any(b.devices for b in c.backends)]
        dbs = {c.name: controller_db(stack, c.name) for c in stack.config.clusters}
        held: dict[str, float] = {}  # job id -> its sleep after the gate opens
        phase = {"name": "start"}
        t0 = time.monotonic()
        http = httpx.AsyncClient(timeout=5)

        async def sample() -> Sample:
            running: dict[str, int] = {}
            running_all = 0
            for c, path in dbs.items():
                rows = await asyncio.to_thread(read_jobs, path)
                live = [r[0] for r in rows if r[1] == "RUNNING"]
                running_all += len(live)
                if c in peers:
                    running[c] = sum(1 for j in live if j in held)
            m = await scrape(http, metrics_url, TASK_QUEUE)
            backlog = await workflow_backlog(stack.client, TASK_QUEUE)
            s = Sample(
                t_s=time.monotonic() - t0,
                phase=phase["name"],
                running=running,
                running_all=running_all,
                worker_rss_mib=rss_mib(wpid)[0],
                slots_used=m.slots_used if m else None,
                slots_available=m.slots_available if m else None,
                load1=os.getloadavg()[0],
                wft_backlog=backlog[0] if backlog else None,
                wft_backlog_age_s=backlog[1] if backlog else None,
            )
            samples.append(s)
            return s

        async def sample_loop() -> None:
            last_print = 0.0
            while True:
                s = await sample()
                if s.t_s - last_print >= args.print_every:
                    last_print = s.t_s
                    print(
                        f"  t={s.t_s:5.0f}s {s.phase:<8} running={sum(s.running.values()):5d} "
                        f"{dict(s.running)} slots={s.slots_used} worker RSS={s.worker_rss_mib:.0f} MiB "
                        f"WFT backlog={s.wft_backlog} ({s.wft_backlog_age_s or 0:.0f}s) load={s.load1:.2f}",
                        flush=True,
                    )
                await asyncio.sleep(args.sample_interval)

        # Warm-up (imports, sandbox, connections): not counted.
        print(f"[{time.strftime('%X')}] warm-up", flush=True)
        await fresh_jobs(iris, "warm", 2, deadline.bound(120), deadline)
        await asyncio.sleep(3)
        sampler = asyncio.create_task(sample_loop())

        # 1. Idle.
        phase["name"] = "idle"
        print(f"[{time.strftime('%X')}] idle window {args.idle_s:.0f}s", flush=True)
        idle = Window(stack, peers)
        m_idle0 = await scrape(http, metrics_url, TASK_QUEUE)
        idle.start()
        await asyncio.sleep(deadline.bound(args.idle_s))
        idle.stop()
        m_idle1 = await scrape(http, metrics_url, TASK_QUEUE)
        rss_idle = rss_mib(wpid)[0]
        print(f"[{time.strftime('%X')}] idle: {args.fresh} fresh jobs one at a time", flush=True)
        fresh_idle = await fresh_jobs(iris, "idle", args.fresh, args.fresh_timeout, deadline)

        # 2. Ramp.
        phase["name"] = "ramp"
        specs = []
        for i in range(n):
            sleep_s = args.spread_s * (i + 0.5) / n
            spec = build_spec(
                gate.command(sleep_s),
                name=f"held-{i:05d}",
                user=USER,
                device_type="h100",
                gpu_count=1,
                bundle=bundle.ref if bundle is not None else None,
            )
            specs.append(spec)
            held[spec.job_id] = sleep_s
        print(f"[{time.strftime('%X')}] ramp: submitting {n} held jobs", flush=True)
        ramp_t0 = time.monotonic()
        results = await gather_bounded((iris.submit_spec(s, bundle) for s in specs), args.concurrency)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise BenchError(f"{len(errors)} submissions failed, e.g. {errors[0]!r}")
        submitted_s = time.monotonic() - ramp_t0
        print(f"[{time.strftime('%X')}] submitted {n} in {submitted_s:.0f}s", flush=True)
        best, best_at = -1, time.monotonic()
        ramp_end = time.monotonic() + deadline.bound(args.ramp_timeout)
        reached_s: float | None = None
        while time.monotonic() < ramp_end:
            s = samples[-1] if samples else await sample()
            now_running = sum(s.running.values())
            if now_running > best:
                best, best_at = now_running, time.monotonic()
            if now_running >= n:
                reached_s = time.monotonic() - ramp_t0
                break
            if time.monotonic() - best_at > args.plateau_s:
                print(f"  running stopped growing at {best} for {args.plateau_s:.0f}s", flush=True)
                break
            await asyncio.sleep(args.sample_interval)
        ramp_s = time.monotonic() - ramp_t0
        print(
            f"[{time.strftime('%X')}] ramp ended after {ramp_s:.0f}s: "
            f"{'all running' if reached_s is not None else f'{best} of {n} running (max)'}",
            flush=True,
        )
        await asyncio.sleep(deadline.bound(args.settle_s))

        # 3. Hold.
        phase["name"] = "hold"
        print(f"[{time.strftime('%X')}] hold window {args.hold_s:.0f}s", flush=True)
        hold = Window(stack, peers)
        m_hold0 = await scrape(http, metrics_url, TASK_QUEUE)
        hold_t0_ms = int(time.time() * 1000)
        hold_from = len(samples)
        hold.start()
        await asyncio.sleep(deadline.bound(args.hold_s))
        hold.stop()
        hold_t1_ms = int(time.time() * 1000)
        m_hold1 = await scrape(http, metrics_url, TASK_QUEUE)
        hold_samples = samples[hold_from:] or samples[-1:]
        rss_hold = rss_mib(wpid)[0]
        states = {c: dbs[c].parent for c in peers}
        out["peer_disk"] = {c: await asyncio.to_thread(peer_disk, d) for c, d in states.items()}
        phase["name"] = "fresh"
        print(f"[{time.strftime('%X')}] loaded: {args.fresh} fresh jobs one at a time", flush=True)
        fresh_load = await fresh_jobs(iris, "load", args.fresh, args.fresh_timeout, deadline)
        running_at_release = sum(samples[-1].running.values()) if samples else 0

        # 4. Release and drain.
        phase["name"] = "drain"
        drain_window = Window(stack, peers)
        spy: PySpy | None = None
        if args.profile:
            spy = PySpy(wpid, root / "worker-drain.txt", gil=True)
            spy = spy if spy.start() else None
        drain_window.start()
        gate.release()
        assert gate.released_ms is not None
        print(
            f"[{time.strftime('%X')}] released {running_at_release} running jobs; "
            f"exits spread over {args.spread_s:.0f}s; draining (at most {args.drain_timeout:.0f}s)",
            flush=True,
        )
        drain_end = time.monotonic() + deadline.bound(args.drain_timeout)
        query = f"IrisSubmitter = '{USER}'"
        while time.monotonic() < drain_end:
            running_wf = await stack.client.count_workflows(f"{query} AND ExecutionStatus = 'Running'")
            if running_wf.count == 0:
                break
            await asyncio.sleep(2)
        drain_s = (int(time.time() * 1000) - gate.released_ms) / 1000
        drain_window.stop()
        if spy is not None:
            spy.stop()
            out["drain_profile"] = {
                "all": summarize_collapsed(root / "worker-drain.txt", top=20),
                "project": summarize_collapsed(root / "worker-drain.txt", top=25, project_only=True),
            }
        sampler.cancel()
        sampler = None

        # 5. Collect.
        print(f"[{time.strftime('%X')}] collecting", flush=True)
        finished: dict[str, tuple[str, int | None]] = {}
        for c in peers:
            for job_id, state, fin in await asyncio.to_thread(
                read_jobs, dbs[c], "job_id, state, finished_ms"
            ):
                if job_id in held:
                    finished[job_id] = (state, fin)
        closed = await close_times(stack.client, query)
        ids = [s.job_id for s in specs]
        prop_close = [
            float(closed[j] - fin)
            for j in ids
            if j in closed and (fin := finished.get(j, ("", None))[1]) is not None
        ]
        step = max(1, n // max(1, args.result_sample))
        sample_ids = [j for j in ids[::step] if j in closed]

        async def succeeded_at(job_id: str) -> tuple[str, int | None, str]:
            st: JobStatus = await stack.client.get_workflow_handle(job_id, result_type=JobStatus).result()
            at = next((e.at_ms for e in st.events if e.state is JobState.SUCCEEDED), None)
            return job_id, at, st.state.value

        got = await gather_bounded((succeeded_at(j) for j in sample_ids), 16)
        prop_event: list[float] = []
        home_states: Counter[str] = Counter()
        for r in got:
            if isinstance(r, BaseException):
                continue
            job_id, at, state = r
            home_states[state] += 1
            fin = finished.get(job_id, ("", None))[1]
            if at is not None and fin is not None:
                prop_event.append(float(at - fin))
        hist_ids = [j for j in ids[:: max(1, n // max(1, args.history_sample))] if j in closed]
        hist = [
            h
            for h in await gather_bounded(
                (job_history(stack.client, j, (hold_t0_ms, hold_t1_ms)) for j in hist_ids), 16
            )
            if isinstance(h, JobHistory)
        ]

        if args.retention_s > 0 and bundle is not None:
            # Retention: the jobs go retention_s after they ended, then their bundle and its copy.
            last_end_ms = max((fin for _, fin in finished.values() if fin is not None), default=None)
            print(f"[{time.strftime('%X')}] waiting for retention ({args.retention_s:.0f}s)", flush=True)
            wait_end = time.monotonic() + deadline.bound(args.retention_s + 120)
            left = {c: await asyncio.to_thread(peer_disk, d) for c, d in states.items()}
            while time.monotonic() < wait_end and any(
                v["tarballs"] or v["unpacked_copies"] for v in left.values()
            ):
                await asyncio.sleep(2)
                left = {c: await asyncio.to_thread(peer_disk, d) for c, d in states.items()}
            out["after_retention"] = {
                "after_last_end_s": (time.time() * 1000 - last_end_ms) / 1000 if last_end_ms else None,
                "peer_disk": left,
            }

        # ---- figures ----
        running_hold = [sum(s.running.values()) for s in hold_samples]
        per_peer_steady = {p: percentile([s.running.get(p, 0) for s in hold_samples], 50) for p in peers}
        slots_hold = [s.slots_used for s in hold_samples if s.slots_used is not None]
        out.update(
            {
                "submitted_in_s": submitted_s,
                "ramp_s": ramp_s,
                "all_running_after_s": reached_s,
                "running_max": max((sum(s.running.values()) for s in samples), default=0),
                "running_steady": percentile(running_hold, 50),
                "running_hold_min": min(running_hold, default=0),
                "running_per_peer_steady": per_peer_steady,
                "running_at_release": running_at_release,
                "slots": {
                    "hold_median": percentile(slots_hold, 50) if slots_hold else None,
                    "max": max((s.slots_used for s in samples if s.slots_used is not None), default=None),
                    "capacity": (
                        (hold_samples[-1].slots_used or 0) + (hold_samples[-1].slots_available or 0)
                        if hold_samples and hold_samples[-1].slots_available is not None
                        else None
                    ),
                    "idle": m_idle1.slots_used if m_idle1 else None,
                },
                "worker_rss_mib": {
                    "idle": rss_idle,
                    "hold": rss_hold,
                    "hwm": rss_mib(wpid)[1],
                    "per_running_job_kib": (rss_hold - rss_idle)
                    * 1024
                    / max(1, percentile(running_hold, 50)),
                },
                "wft_backlog": {
                    "max": max((s.wft_backlog for s in samples if s.wft_backlog is not None), default=None),
                    "max_age_s": max(
                        (a for a in (s.wft_backlog_age_s for s in samples) if a is not None), default=None
                    ),
                },
            }
        )
        ctl: dict[str, Any] = {}
        for c in idle.clusters:
            i_w, h_w = idle.result[c], hold.result[c]
            on_c = per_peer_steady.get(c, 0.0)

            def per(a: float, b: float, k: float = on_c) -> float:
                return (b - a) / k if k else float("nan")

            ctl[c] = {
                "running": on_c,
                "idle_rps": i_w.rps,
                "hold_rps": h_w.rps,
                "rps_per_job": per(i_w.rps, h_w.rps),
                "idle_cpu_s_per_min": i_w.cpu_per_min,
                "hold_cpu_s_per_min": h_w.cpu_per_min,
                "cpu_ms_per_min_per_job": per(i_w.cpu_per_min, h_w.cpu_per_min) * 1000,
                "idle_bytes_per_s": i_w.bytes_per_s,
                "hold_bytes_per_s": h_w.bytes_per_s,
                "bytes_per_s_per_job": per(i_w.bytes_per_s, h_w.bytes_per_s),
                "bytes_per_request": (h_w.sent + h_w.received) / max(1, sum(h_w.requests.values())),
                "idle_routes": dict(i_w.requests),
                "hold_routes": dict(h_w.requests),
            }
        out["controllers"] = ctl
        out["process_cpu_s_per_min"] = {
            "idle": {k: v / idle.seconds * 60 for k, v in idle.process_cpu.items()},
            "hold": {k: v / hold.seconds * 60 for k, v in hold.process_cpu.items()},
        }

        def call_rates(a: WorkerMetrics | None, b: WorkerMetrics | None, seconds: float) -> dict[str, float]:
            if a is None or b is None:
                return {}
            return {op: (v - a.calls.get(op, 0.0)) / seconds for op, v in b.calls.items()}

        out["worker_temporal_calls_per_s"] = {
            "idle": call_rates(m_idle0, m_idle1, idle.seconds),
            "hold": call_rates(m_hold0, m_hold1, hold.seconds),
        }
        ok_idle = [f.handed_off_ms for f in fresh_idle if f.handed_off_ms is not None]
        # A job not handed off within the bound counts with the time it waited: a lower bound.
        load_vals = [f.handed_off_ms if f.handed_off_ms is not None else f.waited_ms for f in fresh_load]
        censored = sum(1 for f in fresh_load if f.handed_off_ms is None)
        idle_p50 = percentile(ok_idle, 50)
        load_p50 = percentile(load_vals, 50)
        out["fresh"] = {
            "idle": [asdict(f) for f in fresh_idle],
            "loaded": [asdict(f) for f in fresh_load],
            "idle_p50_ms": idle_p50,
            "loaded_p50_ms": load_p50,
            "loaded_censored": censored,
            "ratio": load_p50 / idle_p50 if idle_p50 else float("nan"),
        }
        out["propagation_ms"] = {
            "exit_to_succeeded_event": pcts(prop_event),
            "exit_to_closed": pcts(prop_close),
            "home_states_sampled": dict(home_states),
        }
        peer_states = Counter(st for st, _ in finished.values())
        out["drain"] = {
            "released_ms": gate.released_ms,
            "seconds": drain_s,
            "closed": sum(1 for j in ids if j in closed),
            "peer_states": dict(peer_states),
            # CPU seconds of each process from the release to the last close.
            "cpu_s": drain_window.process_cpu,
        }
        if hist:
            acts: Counter[str] = Counter()
            for h in hist:
                acts.update(h.activities)
            out["history"] = {
                "n": len(hist),
                "events_mean": mean(h.events for h in hist),
                "events_max": max(h.events for h in hist),
                "kib_mean": mean(h.kib for h in hist),
                "signals_mean": mean(h.signals_total for h in hist),
                "signals_after_launch_mean": mean(h.signals_after_launch for h in hist),
                "hold_events_per_job_per_min": mean(h.hold_events for h in hist) / (hold.seconds / 60),
                "hold_signals_per_job_per_min": mean(h.hold_signals for h in hist) / (hold.seconds / 60),
                "activities_per_job": {k: v / len(hist) for k, v in acts.most_common()},
            }
        out["samples"] = [asdict(s) for s in samples]
        out["windows_s"] = {"idle": idle.seconds, "hold": hold.seconds}
        out["uptime_after"] = uptime_line()
        await http.aclose()
        return out
    finally:
        if sampler is not None:
            sampler.cancel()
        gate.release()
        await stack.stop()
        leftovers = gate.reap_leftovers()
        if leftovers:
            print(f"  killed {leftovers} job processes left behind by the controllers", file=sys.stderr)
        gate.remove()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


# ---- report ------------------------------------------------------------------------------------


def report_one(r: dict[str, Any]) -> None:
    n = r["jobs"]
    print(f"\n=== N = {n} held sleep jobs (h100×1), peers {r['peer_slots']} H100 slots each ===")
    reached = r["all_running_after_s"]
    print(
        f"running at once (controllers' records): max {r['running_max']}, steady {r['running_steady']:.0f} "
        f"(hold window min {r['running_hold_min']}), per peer {r['running_per_peer_steady']}; "
        + (f"all {n} running {reached:.0f}s after the first submit" if reached else "never all running")
        + f"; submitted in {r['submitted_in_s']:.0f}s"
    )
    s = r["slots"]
    print(
        f"worker activity slots in use: hold median {s['hold_median']}, max {s['max']}, of {s['capacity']} "
        f"(idle {s['idle']})"
    )
    w = r["worker_rss_mib"]
    print(
        f"worker RSS: idle {w['idle']:.0f} MiB, N running {w['hold']:.0f} MiB, peak {w['hwm']:.0f} MiB "
        f"({w['per_running_job_kib']:.0f} KiB per running job)"
    )
    b = r.get("wft_backlog") or {}
    if b.get("max") is not None:
        print(
            f"jobs' workflow task backlog: max {b['max']} tasks, oldest {b['max_age_s']:.1f}s "
            "(tasks waiting for a poll)"
        )
    if reached:
        print(f"launch rate: {n / reached:.1f} jobs/s to all running")
    ws = r.get("workspace")
    for c, d in r.get("peer_disk", {}).items():
        copies = (d["unpacked_bytes"] + d["work_bytes"]) / ws["bytes"] if ws else float("nan")
        print(
            f"peer {c} disk in the hold: {d['tarballs']} bundle(s) {d['tarball_bytes'] / MIB_F:.1f} MiB, "
            f"{d['unpacked_copies']} unpacked ({d['unpacked_bytes'] / MIB_F:.1f} MiB, "
            f"{d['unpacked_files']} files), "
            f"{d['work_dirs']} working dirs: files {d['work_bytes'] / MIB_F:.1f} MiB ({d['work_files']}), "
            f"directories {d['work_dir_bytes'] / MIB_F:.1f} MiB, "
            f"logs {d['logs_bytes'] / MIB_F:.1f} MiB" + (f"; workspace copies: {copies:.2f}" if ws else "")
        )
    after = r.get("after_retention")
    if after is not None:
        left = {c: (d["tarballs"], d["unpacked_copies"]) for c, d in after["peer_disk"].items()}
        print(
            f"after retention ({after['after_last_end_s']:.0f}s after the last end): (bundles, copies) {left}"
        )
    rows = []
    for c, v in r["controllers"].items():
        rows.append(
            [
                c,
                v["running"],
                v["idle_rps"],
                v["hold_rps"],
                v["rps_per_job"],
                v["idle_cpu_s_per_min"],
                v["hold_cpu_s_per_min"],
                v["cpu_ms_per_min_per_job"],
                v["idle_bytes_per_s"] / 1024,
                v["hold_bytes_per_s"] / 1024,
                v["bytes_per_request"],
            ]
        )
    print("\nControllers (idle window vs N running; per job = (N running - idle) / jobs on that controller)")
    print(
        table(
            [
                "controller",
                "running",
                "idle req/s",
                "req/s",
                "req/s/job",
                "idle CPU s/min",
                "CPU s/min",
                "CPU ms/min/job",
                "idle KiB/s",
                "KiB/s",
                "B/req",
            ],
            rows,
        )
    )
    for c, v in r["controllers"].items():
        routes = ", ".join(f"{k} {cnt}" for k, cnt in sorted(v["hold_routes"].items(), key=lambda x: -x[1]))
        print(f"  {c} requests in the hold window: {routes or 'none'}")
    cpu = r["process_cpu_s_per_min"]
    print(
        "CPU s/min, idle → hold: "
        + ", ".join(f"{k} {cpu['idle'].get(k, float('nan')):.1f} → {v:.1f}" for k, v in cpu["hold"].items())
    )
    calls = r["worker_temporal_calls_per_s"]["hold"]
    if calls:
        top = sorted(calls.items(), key=lambda x: -x[1])[:8]
        print("worker → Temporal calls/s in the hold window: " + ", ".join(f"{k} {v:.1f}" for k, v in top))
    f = r["fresh"]
    cens = f" (≥: {f['loaded_censored']} not handed off in time)" if f["loaded_censored"] else ""
    print(
        f"\nfresh job submit→HANDED_OFF p50: idle {f['idle_p50_ms']:.0f} ms, with N running "
        f"{f['loaded_p50_ms']:.0f} ms{cens} → ratio {f['ratio']:.2f} "
        f"(n = {len(f['idle'])} / {len(f['loaded'])})"
    )
    p = r["propagation_ms"]
    print("state propagation, process exit on the peer (finished_ms) → home, ms:")
    print(
        table(
            ["", "n", "p50", "p95", "p99", "max"],
            [
                [k, int(v["n"]), v["p50"], v["p95"], v["p99"], v["max"]]
                for k, v in (
                    ("→ SUCCEEDED event (sample)", p["exit_to_succeeded_event"]),
                    ("→ workflow closed (all)", p["exit_to_closed"]),
                )
            ],
        )
    )
    d = r["drain"]
    print(
        f"drain: {d['closed']} of {n} closed {d['seconds']:.0f}s after the release; peer states "
        f"{d['peer_states']}; home states (sample) {p['home_states_sampled']}"
    )
    if d.get("cpu_s") and d["closed"]:
        print(
            "drain CPU, ms per closed job: "
            + ", ".join(f"{k} {v * 1000 / d['closed']:.1f}" for k, v in d["cpu_s"].items())
        )
    prof = r.get("drain_profile")
    if prof:
        print(
            "py-spy of the worker over the drain (GIL holder only): project code, % of samples: "
            "inclusive | deepest frame"
        )
        for (a, pa), (b, pb) in zip(prof["project"]["inclusive"], prof["project"]["self"], strict=False):
            print(f"  {pa:5.1f} {a[:70]:70} | {pb:5.1f} {b[:70]}")
        print("  all code, self time:")
        for name, share in prof["all"]["self"][:15]:
            print(f"  {share:5.1f} {name[:110]}")
    h = r.get("history")
    if h:
        print(
            f"history per job (n={h['n']}): {h['events_mean']:.1f} events (max {h['events_max']}), "
            f"{h['kib_mean']:.1f} KiB, {h['signals_mean']:.2f} signals ({h['signals_after_launch_mean']:.2f} "
            f"after the launch), {h['hold_events_per_job_per_min']:.2f} events per minute while held; "
            f"activities/job: " + ", ".join(f"{k} {v:.2f}" for k, v in h["activities_per_job"].items())
        )


def projection(r: dict[str, Any], runtime_s: float) -> dict[str, Any]:
    """Paper projection to PROJ_JOBS running over PROJ_PEERS peers from one run's figures.

    The model is linear: what a controller (or the worker) does idle scales with the clusters, what
    it does on top with N running scales with the running jobs. A per-job increase below zero is
    the noise of two windows on a shared machine (holding a job may cost next to nothing) and
    counts as zero. The idle part of the worker's calls and slots is taken per cluster, which
    overstates the federation-wide placement tick's share (small either way)."""
    peers = [v for v in r["controllers"].values() if v["running"] > 0]
    if not peers:
        return {}
    clusters = max(1, len(r["controllers"]))
    per_peer_jobs = PROJ_JOBS / PROJ_PEERS

    def up(value: float) -> float:
        return max(0.0, value) if value == value else 0.0  # NaN (no job there) counts as zero

    idle_rps = mean(v["idle_rps"] for v in peers)
    rps_job = up(mean(v["rps_per_job"] for v in peers))
    idle_bps = mean(v["idle_bytes_per_s"] for v in peers)
    bps_job = up(mean(v["bytes_per_s_per_job"] for v in peers))
    idle_cpu = mean(v["idle_cpu_s_per_min"] for v in peers)
    cpu_job = up(mean(v["cpu_ms_per_min_per_job"] for v in peers))
    steady = max(1.0, r["running_steady"])
    calls_idle = r["worker_temporal_calls_per_s"]["idle"]
    calls_hold = r["worker_temporal_calls_per_s"]["hold"]
    calls = {
        op: calls_idle.get(op, 0.0) / clusters * (PROJ_PEERS + 1)
        + up(v - calls_idle.get(op, 0.0)) / steady * PROJ_JOBS
        for op, v in calls_hold.items()
    }
    slots = r["slots"]
    slots_needed = None
    if slots["hold_median"] is not None:
        idle_slots = slots["idle"] or 0.0
        slots_needed = (
            idle_slots / clusters * (PROJ_PEERS + 1)
            + up(slots["hold_median"] - idle_slots) / steady * PROJ_JOBS
        )
    h = r.get("history") or {}
    completions = PROJ_JOBS / runtime_s
    signals_held = PROJ_JOBS * h.get("hold_signals_per_job_per_min", 0.0) / 60
    per_peer_rps = idle_rps + rps_job * per_peer_jobs
    per_peer_bps = idle_bps + bps_job * per_peer_jobs
    return {
        "assumptions": {
            "running": PROJ_JOBS,
            "peers": PROJ_PEERS,
            "jobs_per_peer": per_peer_jobs,
            "mean_runtime_s": runtime_s,
            "completions_per_s": completions,
        },
        "per_peer_requests_per_s": per_peer_rps,
        "federation_requests_per_s": PROJ_PEERS * per_peer_rps,
        "per_peer_bytes_per_s": per_peer_bps,
        "federation_bytes_per_s": PROJ_PEERS * per_peer_bps,
        "per_peer_controller_cpu_cores": (idle_cpu + cpu_job * per_peer_jobs / 1000) / 60,
        # Signals: the ones a job receives after its launch (its state changes) at the completion
        # rate, plus those a held job receives while nothing changes (counted in the hold window).
        "temporal_signals_per_s": completions * h.get("signals_after_launch_mean", 0.0) + signals_held,
        "held_job_history_events_per_s": PROJ_JOBS * h.get("hold_events_per_job_per_min", 0.0) / 60,
        "worker_temporal_calls_per_s": calls,
        "activity_slots_needed": slots_needed,
    }


def report_projection(n: int, p: dict[str, Any]) -> None:
    if not p:
        return
    a = p["assumptions"]
    print(
        f"\nPAPER PROJECTION (not measured) from N={n}: {a['running']:,} running jobs over "
        f"{a['peers']} peers "
        f"({a['jobs_per_peer']:.0f} each), mean job runtime {a['mean_runtime_s']:.0f}s "
        f"({a['completions_per_s']:.0f} completions/s); linear in the per-job figures above"
    )
    rows = [
        ["controller requests/s, per peer", p["per_peer_requests_per_s"]],
        ["controller requests/s, federation", p["federation_requests_per_s"]],
        ["controller bytes/s, per peer (KiB/s)", p["per_peer_bytes_per_s"] / 1024],
        ["controller bytes/s, federation (MiB/s)", p["federation_bytes_per_s"] / 1024 / 1024],
        ["controller CPU, per peer (cores)", p["per_peer_controller_cpu_cores"]],
        ["Temporal signals/s received by job workflows", p["temporal_signals_per_s"]],
        ["job history events/s while nothing ends", p["held_job_history_events_per_s"]],
        [
            "worker activity slots held",
            p["activity_slots_needed"] if p["activity_slots_needed"] is not None else "-",
        ],
    ]
    for op, v in sorted(p["worker_temporal_calls_per_s"].items(), key=lambda x: -x[1])[:5]:
        rows.append([f"worker → Temporal {op}/s", v])
    print(table(["projection", "value"], rows))


MIB_F = 1024.0 * 1024.0


def summary(runs: list[dict[str, Any]]) -> None:
    if len(runs) < 2:
        return
    base = {r["jobs"]: r for r in runs if not r.get("workspace_mib")}
    for r in runs:
        b = base.get(r["jobs"])
        if r.get("workspace_mib") and b is not None and r["all_running_after_s"] and b["all_running_after_s"]:
            ratio = b["all_running_after_s"] / r["all_running_after_s"]
            print(
                f"N={r['jobs']}: launch rate with the {r['workspace_mib']:g} MiB workspace / without: "
                f"{ratio:.2f} ({r['jobs'] / r['all_running_after_s']:.1f} vs "
                f"{b['jobs'] / b['all_running_after_s']:.1f} jobs/s)"
            )
    print("\nSummary")
    rows = []
    for r in runs:
        f, p = r["fresh"], r["propagation_ms"]["exit_to_succeeded_event"]
        reqs = sum(v["hold_rps"] for v in r["controllers"].values())
        rows.append(
            [
                r["jobs"],
                r["running_max"],
                r["running_steady"],
                r["slots"]["hold_median"] if r["slots"]["hold_median"] is not None else "-",
                reqs,
                f["idle_p50_ms"],
                f["loaded_p50_ms"],
                f["ratio"],
                p["p50"],
                p["p99"],
                r["worker_rss_mib"]["hold"],
                r.get("history", {}).get("events_mean", float("nan")),
            ]
        )
    print(
        table(
            [
                "N",
                "run max",
                "run steady",
                "slots",
                "ctl req/s",
                "fresh idle ms",
                "fresh N ms",
                "ratio",
                "prop p50",
                "prop p99",
                "RSS MiB",
                "events/job",
            ],
            rows,
        )
    )


# Processes a held job keeps on its peer's host: bwrap, bwrap's init in the job's pid namespace,
# and the job's own (`sh`, then `sleep`).
PIDS_PER_JOB = 3


def host_tasks() -> int:
    """Every task (process or thread) the host runs now: each holds a pid."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):  # it ended meanwhile
                count += len(os.listdir(f"/proc/{pid}/task"))
    return count


def pid_shortfall(n: int, pid_max_path: Path = Path("/proc/sys/kernel/pid_max")) -> str | None:
    """Why this host cannot hold ``n`` jobs' processes at once (None if it can): each needs
    ``PIDS_PER_JOB`` pids, beside every task the host runs already."""
    try:
        pid_max = int(pid_max_path.read_text())
    except (OSError, ValueError):
        return None
    tasks = host_tasks()
    needed = tasks + PIDS_PER_JOB * n + 1000
    if needed <= pid_max:
        return None
    return (
        f"{n} running jobs need about {PIDS_PER_JOB * n} pids beside the host's {tasks} tasks, and "
        f"kernel.pid_max is {pid_max}: raise it first (sysctl -w kernel.pid_max={max(4 * needed, 65536)})"
    )


async def run(args: argparse.Namespace) -> int:
    short = pid_shortfall(max(args.jobs))
    if short is not None:
        print(f"error: {short}", file=sys.stderr)
        return 2
    info = machine()
    data: dict[str, Any] = {"machine": info, "args": vars(args), "source": source_label(), "runs": []}
    print(f"code: {source_label()}; machine: {info['nproc']} CPUs, {info['mem_gib']} GiB", flush=True)
    for n, ws_mib in [(n, w) for n in args.jobs for w in args.workspace_mib]:
        t = time.monotonic()
        with LoadSampler() as load:
            r = await run_one(args, n, info, ws_mib)
        r["wall_s"] = time.monotonic() - t
        r["load"] = load.summary()
        r["projection"] = projection(r, args.projection_runtime_s)
        data["runs"].append(r)
        report_one(r)
        report_projection(n, r["projection"])
        print(f"(N={n}: {r['wall_s']:.0f}s wall, load {r['load']})", flush=True)
        write_json(args.out, data)
    summary(data["runs"])
    print(f"\ncode: {source_label()}; before: {info['uptime_before']}; after: {uptime_line()}")
    return 0


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of job counts: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("job counts must be positive")
    return values


def _sizes(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sizes in MiB: {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError("workspace sizes must be 0 or more")
    return values


def _cache_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of workflows: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("the cache holds at least 1 workflow")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--jobs", type=_counts, default=[300], help="held jobs, e.g. 300,1000,2000 (a stack each)")
    p.add_argument(
        "--peer-slots", type=int, default=0, help="H100 slots per peer (default: enough for N over 2 peers)"
    )
    p.add_argument(
        "--safety-poll-s",
        type=float,
        default=None,
        help="each running job's safety poll (the config's mirror_safety_poll_s; default: the config's)",
    )
    p.add_argument(
        "--no-sandbox",
        action="store_true",
        help="the peers run the held jobs without sandboxes (sandbox = off): what the worker holds, "
        "without the host's cost of 10,000 sandboxes (about 2.3 MiB each here)",
    )
    p.add_argument("--max-per-peer", type=int, default=None, help="placements per peer per tick (0 = no cap)")
    p.add_argument(
        "--cached-workflows",
        type=_cache_size,
        default=0,
        help="the worker's [worker] max_cached_workflows (default: the config's, 4,096)",
    )
    p.add_argument("--concurrency", type=int, default=50, help="submissions in flight in the ramp")
    p.add_argument("--idle-s", type=float, default=30, help="idle measurement window")
    p.add_argument("--hold-s", type=float, default=60, help="measurement window with N running")
    p.add_argument("--settle-s", type=float, default=10, help="pause between the ramp and the hold window")
    p.add_argument("--ramp-timeout", type=float, default=600, help="bound on waiting for N to run")
    p.add_argument(
        "--plateau-s", type=float, default=60, help="end the ramp when running has not grown this long"
    )
    p.add_argument("--fresh", type=int, default=10, help="fresh jobs timed idle and with N running")
    p.add_argument("--fresh-timeout", type=float, default=60, help="bound per fresh job, seconds")
    p.add_argument("--spread-s", type=float, default=60, help="the held jobs' exits spread over this")
    p.add_argument("--drain-timeout", type=float, default=300, help="bound on waiting for jobs to close")
    p.add_argument("--result-sample", type=int, default=300, help="jobs whose SUCCEEDED event is read")
    p.add_argument("--history-sample", type=int, default=30, help="job histories fetched")
    p.add_argument("--sample-interval", type=float, default=2, help="seconds between samples")
    p.add_argument("--print-every", type=float, default=10, help="seconds between progress lines")
    p.add_argument(
        "--projection-runtime-s", type=float, default=3600, help="mean job runtime for the projection"
    )
    p.add_argument(
        "--workspace-mib",
        type=_sizes,
        default=[0.0],
        help="submit every held job from one workspace of this many MiB (0: none); a list runs each N "
        "with each",
    )
    p.add_argument("--workspace-files", type=int, default=300, help="files in that workspace")
    p.add_argument(
        "--retention-s",
        type=float,
        default=0,
        help="the peers' retention_s; after the drain, wait for them to delete the bundle (0: the "
        "default, no wait)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="bound on one N's run, seconds")
    p.add_argument("--profile", action="store_true", help="py-spy the worker over the drain (GIL holder)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stacks' temp directories")
    add_source_argument(p)
    smoke = {
        "jobs": [4],
        "idle_s": 2,
        "hold_s": 2,
        "settle_s": 0,
        "fresh": 1,
        "spread_s": 2,
        # The ramp ends as soon as all 4 run: a long plateau only waits for a busy machine.
        "plateau_s": 60,
        "ramp_timeout": 120,
        "drain_timeout": 120,
        "result_sample": 4,
        "history_sample": 2,
        "sample_interval": 0.5,
        "print_every": 2,
        "timeout": 300,
        # The sweep's path: one small workspace behind every job, and its deletion by retention.
        "workspace_mib": [0.5],
        "workspace_files": 20,
        "retention_s": 15,
    }
    args = parse_args(p, smoke)
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
