"""Shared pieces of the end-to-end and scale benchmarks.

The real embedded stack (the same services as ``iris dev`` and the tests): an in-memory Temporal
dev server started with ``WorkflowEnvironment.start_local``, moto (S3), fake-gcs-server, one
controller process per cluster on free loopback ports, the federation store (SQLite) in a temp
directory, and ``iris worker`` as its own process so its CPU and memory are its own. Plus process
probes (CPU seconds, RSS from /proc), the machine's load, percentiles, history statistics and a
plain-text table. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from activities.placement import TickOutcome
from benchmarks.smoke import exit_now
from benchmarks.source import cleanup_snapshot
from iris import devstack, reaper
from iris.config import FederationConfig, load_config
from iris.contract import SEARCH_ATTRIBUTE_KEYS, manager_workflow_id
from iris.controller.identity import KEY_DIR_ENV, ensure_cluster_keys
from iris.payloadcodec import load_keyring
from iris.temporal import data_converter
from workflows.placement import PlacementManager

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class BenchError(RuntimeError):
    """The benchmark cannot go on (a service did not start, a phase ran out of time)."""


def run_main(coro: Callable[[], Awaitable[int]]) -> None:
    """asyncio.run with SIGTERM/SIGINT cancelling the run (so every service is stopped), then
    ``os._exit`` (the SDK runtime can crash at interpreter exit, sdk-python #300).

    The first signal cancels the run; a later one (``uv run`` passes its own SIGTERM on, so a
    ``pkill`` delivers two) is ignored, since cancelling the stop itself would leave the services
    running. A watchdog beside the driver (iris/reaper.py) ends whatever it started if it dies
    any other way (SIGKILL, a crash)."""
    reaper.watch()

    async def guarded() -> int:
        task = asyncio.ensure_future(coro())
        loop = asyncio.get_running_loop()

        def cancel_once() -> None:
            if not task.cancelling():
                task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, cancel_once)
        try:
            return await task
        except asyncio.CancelledError:
            print("interrupted; services stopped", file=sys.stderr)
            return 130

    code = 1
    try:
        code = asyncio.run(guarded())
    except (BenchError, TimeoutError) as exc:
        print(f"benchmark failed: {exc!r}", file=sys.stderr)
    finally:
        cleanup_snapshot()
    exit_now(code)


# ---- time bounds -------------------------------------------------------------------------------


class Deadline:
    """The run's overall time budget; each phase takes what it needs from what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def bound(self, seconds: float) -> float:
        """``seconds``, or less if the run's budget is nearly spent; raise if it is spent."""
        left = self.left()
        if left <= 1:
            raise BenchError("the run's time budget (--timeout) is spent")
        return min(seconds, left)


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], *, within: float, interval: float = 0.25, what: str
) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise BenchError(f"timed out after {within:.0f}s waiting for {what}")


# ---- statistics and output ---------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def pcts(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": float(len(values)),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values) if values else float("nan"),
    }


def fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    first = [
        h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    ]
    lines = ["  ".join(first), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    for r in cells:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(lines)


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        print(f"results written to {path}")


# ---- the machine and its processes -------------------------------------------------------------


def uptime_line() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> dict[str, Any]:
    mem_kb = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    cpu = ""
    with contextlib.suppress(OSError):
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1) if m else ""
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": round(mem_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "uptime_before": uptime_line(),
    }


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User+system CPU of a process (and of its reaped children): /proc/<pid>/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime=14, stime=15, cutime=16, cstime=17.
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    rss = hwm = float("nan")
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return rss, hwm


def child_pid(parent: int, comm: str) -> int | None:
    """A direct child of ``parent`` whose command name is ``comm`` (e.g. the dev server)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = (d / "stat").read_text()
            name = raw[raw.index("(") + 1 : raw.rindex(")")]
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
            if ppid == parent and name == comm:
                return int(d.name)
    return None


@dataclass
class CpuMeter:
    """CPU seconds used by each named process between ``start`` and ``stop``."""

    pids: dict[str, int]
    _start: dict[str, float] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    _t0: float = 0.0

    def start(self) -> CpuMeter:
        self._start = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self._t0 = time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        self.wall = time.monotonic() - self._t0
        self.used = {n: cpu_seconds(p) - self._start[n] for n, p in self.pids.items()}
        return self.used


class LoadSampler:
    """The 1-minute load average, sampled every few seconds while a phase runs."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            await asyncio.sleep(self.interval_s)

    def __enter__(self) -> LoadSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def summary(self) -> str:
        if not self.samples:
            return "-"
        avg = sum(self.samples) / len(self.samples)
        return f"{min(self.samples):.2f}..{max(self.samples):.2f} (mean {avg:.2f})"


# ---- controller access logs --------------------------------------------------------------------

_ACCESS_RE = re.compile(r"\b(GET|POST|PUT|DELETE) (/v1/\S*) -> (\d{3})")


def request_kind(method: str, path: str) -> str:
    if path == "/v1/backends":
        return "backends"
    if path == "/v1/health":
        return "health"
    if path.startswith("/v1/jobs"):
        if method == "POST" and path.endswith("/terminate"):
            return "terminate"
        if method == "POST":
            return "launch"
        if path.endswith("/logs"):
            return "logs"
        return "status"
    return "other"


class AccessLogCounter:
    """Counts controller requests by kind from the controllers' logs, between two marks."""

    def __init__(self, log_files: Sequence[Path]) -> None:
        self.files = list(log_files)
        self._offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self._offsets = {f: f.stat().st_size if f.exists() else 0 for f in self.files}

    def count(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for f in self.files:
            if not f.exists():
                continue
            with f.open("rb") as fh:
                fh.seek(self._offsets.get(f, 0))
                for line in fh.read().decode(errors="replace").splitlines():
                    m = _ACCESS_RE.search(line)
                    if m:
                        counts[request_kind(m.group(1), m.group(2))] += 1
        return counts


# ---- histories ---------------------------------------------------------------------------------


def _event_type(event: Any) -> str:
    from temporalio.api.enums.v1 import EventType

    return str(EventType.Name(event.event_type)).removeprefix("EVENT_TYPE_")


@dataclass
class HistoryStats:
    events: int
    bytes: int
    by_type: Counter[str]
    activities: Counter[str]
    signals: Counter[str]
    # The job's steps in history order: "a" activity, "l" local activity, "s" signal received.
    steps: str = ""

    @property
    def workflow_tasks(self) -> int:
        return self.by_type["WORKFLOW_TASK_COMPLETED"]

    @property
    def activity_count(self) -> int:
        return sum(self.activities.values())

    @property
    def signal_count(self) -> int:
        return sum(self.signals.values())

    @property
    def local_activities(self) -> int:
        return self.steps.count("l")

    @property
    def upserts(self) -> int:
        return self.by_type["UPSERT_WORKFLOW_SEARCH_ATTRIBUTES"]

    @property
    def memo_upserts(self) -> int:
        return self.by_type["WORKFLOW_PROPERTIES_MODIFIED"]

    def round_trips(self) -> int:
        """Worker↔server RPCs this history implies: start, 2 per workflow task (poll + complete),
        2 per activity attempt (poll + complete), 1 per signal. Heartbeats and queries not counted."""
        attempts = self.by_type["ACTIVITY_TASK_STARTED"]
        return 1 + 2 * self.workflow_tasks + 2 * attempts + self.signal_count


LOCAL_ACTIVITY_MARKER = "core_local_activity"


def history_stats(history: WorkflowHistory) -> HistoryStats:
    by_type: Counter[str] = Counter()
    activities: Counter[str] = Counter()
    signals: Counter[str] = Counter()
    steps: list[str] = []
    size = 0
    for e in history.events:
        t = _event_type(e)
        by_type[t] += 1
        size += e.ByteSize()
        if t == "ACTIVITY_TASK_SCHEDULED":
            activities[e.activity_task_scheduled_event_attributes.activity_type.name] += 1
            steps.append("a")
        elif (
            t == "MARKER_RECORDED" and e.marker_recorded_event_attributes.marker_name == LOCAL_ACTIVITY_MARKER
        ):
            steps.append("l")
        elif t == "WORKFLOW_EXECUTION_SIGNALED":
            signals[e.workflow_execution_signaled_event_attributes.signal_name] += 1
            steps.append("s")
    return HistoryStats(
        events=len(history.events),
        bytes=size,
        by_type=by_type,
        activities=activities,
        signals=signals,
        steps="".join(steps),
    )


async def fetch_stats(client: Client, workflow_id: str, run_id: str | None = None) -> HistoryStats:
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    return history_stats(history)


def mean(values: Iterable[float]) -> float:
    v = list(values)
    return sum(v) / len(v) if v else float("nan")


# ---- the stack ---------------------------------------------------------------------------------


def free_port_config(base: FederationConfig, temporal_address: str, task_queue: str) -> FederationConfig:
    """The demo topology on free loopback ports (never colliding with a running ``iris dev``)."""
    cfg = base.model_copy(deep=True)
    cfg.temporal.address = temporal_address
    cfg.temporal.task_queue = task_queue
    cfg.temporal.ui_port = devstack.free_port()
    cfg.s3_port = devstack.free_port()
    cfg.gcs_port = devstack.free_port()
    for c in cfg.clusters:
        c.host = "127.0.0.1"
        c.port = devstack.free_port()
        if c.object_store is not None:
            port = cfg.s3_port if c.object_store.kind == "s3" else cfg.gcs_port
            c.object_store.endpoint = f"http://127.0.0.1:{port}"
    return cfg


def register_users(cfg: FederationConfig, users: Mapping[str, Sequence[str]], key_dir: Path) -> None:
    """Give each of ``users`` (principal → roles) a signing key in ``key_dir`` and register it in
    ``cfg``, as ``iris dev`` does for its user: submissions, cancels and replays are signed and the
    worker verifies them against the config's users (docs/DESIGN.md, "User → home").

    This process signs with the keys in ``key_dir`` from then on (``$IRIS_USER_KEY_DIR``; an
    ``$IRIS_USER_KEY`` naming one key for every principal is dropped), so a run never reads or
    writes the real ``~/.config/iris``. A revision from before signed submissions has no
    ``iris.userauth``: nothing to do (``--source`` may name one).
    """
    try:
        from iris.userauth import USER_KEY_DIR_ENV, USER_KEY_ENV, register_user
    except ImportError:
        return
    os.environ.pop(USER_KEY_ENV, None)
    os.environ[USER_KEY_DIR_ENV] = str(key_dir)
    for principal, roles in users.items():
        register_user(cfg, principal, list(roles))


class BenchStack:
    """The real stack for one benchmark run, in ``root`` (a temp directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env: WorkflowEnvironment | None = None
        self.services: list[devstack.ManagedProcess] = []
        self.worker: devstack.ManagedProcess | None = None
        self.extra: list[devstack.ManagedProcess] = []
        self._config: FederationConfig | None = None
        self.config_file = root / "clusters.json"

    @property
    def client(self) -> Client:
        assert self.env is not None
        return self.env.client

    @property
    def config(self) -> FederationConfig:
        assert self._config is not None
        return self._config

    async def start(
        self,
        configure: Callable[[FederationConfig], None],
        *,
        task_queue: str,
        users: Mapping[str, Sequence[str]] | None = None,
        dynamic_config: Sequence[str] = (),
    ) -> None:
        """``users``: the principals the benchmark submits (and cancels) as, with their roles; each
        gets a signing key in this run's own directory (``register_users``).
        ``dynamic_config``: ``key=value`` server settings (``--dynamic-config-value``)."""
        extra: list[str] = []
        for kv in dynamic_config:
            extra += ["--dynamic-config-value", kv]
        self.env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(devstack.venv_bin("temporal")),
            search_attributes=SEARCH_ATTRIBUTE_KEYS,
            data_converter=data_converter(load_keyring()),
            dev_server_startup_timeout=timedelta(seconds=60),
            dev_server_log_level="error",
            dev_server_extra_args=extra,
        )
        address = self.env.client.service_client.config.target_host
        cfg = free_port_config(load_config(), address, task_queue)
        configure(cfg)
        register_users(cfg, users or {}, self.root / "user-keys")
        self._config = cfg
        self.config_file.write_text(cfg.model_dump_json(indent=2))
        # The home side's credentials only; each controller gets its own from devstack.controller.
        os.environ.update(devstack.store_credentials(cfg, cfg.home))
        key_dir = self.root / "keys"
        ensure_cluster_keys(cfg, key_dir)
        os.environ[KEY_DIR_ENV] = str(key_dir)
        services = [
            devstack.s3_server(cfg, self.root),
            devstack.gcs_server(cfg, self.root),
            *(devstack.controller(self.config_file, cfg, c.name, self.root) for c in cfg.clusters),
        ]
        for svc in services:
            svc.start()
            self.services.append(svc)
        for svc in services:
            await asyncio.to_thread(svc.wait_ready, 90)
        await asyncio.to_thread(devstack.ensure_buckets, cfg)

    def controller_logs(self) -> list[Path]:
        return [self.root / "logs" / f"controller-{c.name}.log" for c in self.config.clusters]

    def pids(self) -> dict[str, int]:
        """The processes whose CPU the benchmarks account: server, worker(s), controllers, driver."""
        out: dict[str, int] = {}
        server = child_pid(os.getpid(), "temporal")
        if server is not None:
            out["temporal server"] = server
        if self.worker is not None and self.worker.proc is not None:
            out["iris worker"] = self.worker.proc.pid
        for p in self.extra:
            if p.proc is not None and p.running:
                out[p.name] = p.proc.pid
        for svc in self.services:
            if svc.name.startswith("controller") and svc.proc is not None:
                out[svc.name] = svc.proc.pid
        out["benchmark driver"] = os.getpid()
        return out

    async def start_worker(self, *, within: float = 90.0) -> devstack.ManagedProcess:
        """``iris worker`` as its own process; ready once the placement manager has ticked."""
        worker = devstack.ManagedProcess(
            name="iris worker",
            argv=[
                str(VENV_BIN / "iris"),
                "--config",
                str(self.config_file),
                "worker",
                "--data-dir",
                str(self.root),
            ],
            log_path=self.root / "logs" / "worker.log",
            ready=lambda: True,
            address="",
            env={"PYTHONPATH": str(PROJECT_ROOT)},
        )
        worker.start()
        self.worker = worker
        handle = self.client.get_workflow_handle(manager_workflow_id(self.config.temporal.task_queue))

        async def ticked() -> bool:
            if not worker.running:
                raise BenchError(f"the worker exited during start; see {worker.log_path}")
            try:
                tick = await asyncio.wait_for(handle.query(PlacementManager.last_tick), 5)
            except Exception:
                return False
            return tick is not None

        await wait_until(ticked, within=within, interval=0.5, what="the placement manager's first tick")
        return worker

    def start_process(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None
    ) -> devstack.ManagedProcess:
        proc = devstack.ManagedProcess(
            name=name,
            argv=list(argv),
            log_path=self.root / "logs" / f"{name.replace(' ', '-')}.log",
            ready=lambda: True,
            address="",
            env={"PYTHONPATH": str(PROJECT_ROOT), **(env or {})},
        )
        proc.start()
        self.extra.append(proc)
        return proc

    async def manager_tick(self) -> TickOutcome | None:
        handle = self.client.get_workflow_handle(manager_workflow_id(self.config.temporal.task_queue))
        result: TickOutcome | None = await asyncio.wait_for(handle.query(PlacementManager.last_tick), 10)
        return result

    async def stop(self) -> None:
        for p in [*self.extra, *([self.worker] if self.worker else [])]:
            await asyncio.to_thread(p.stop, 10)
        for svc in reversed(self.services):
            await asyncio.to_thread(svc.stop, 10)
        if self.env is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.env.shutdown(), 30)


# ---- py-spy ------------------------------------------------------------------------------------


class PySpy:
    """``py-spy record`` on one process for the length of a phase (raw collapsed stacks)."""

    def __init__(self, pid: int, out: Path, *, rate: int = 50, gil: bool = False) -> None:
        self.pid = pid
        self.out = out
        self.rate = rate
        # Only the thread holding the GIL is sampled: Python's own CPU, without the threads that
        # wait for it (which an ordinary sample counts as busy).
        self.gil = gil
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> bool:
        exe = VENV_BIN / "py-spy"
        if not exe.exists():
            print("py-spy not found next to the interpreter; profile skipped", file=sys.stderr)
            return False
        self.proc = subprocess.Popen(
            [
                str(exe),
                "record",
                "--pid",
                str(self.pid),
                "--rate",
                str(self.rate),
                "--format",
                "raw",
                "--output",
                str(self.out),
                "--nonblocking",
                *(["--gil"] if self.gil else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return True

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


PROJECT_CODE = ("iris", "workflows", "activities", "worker", "cli")


def summarize_collapsed(
    path: Path, *, top: int = 25, project_only: bool = False
) -> dict[str, list[tuple[str, float]]]:
    """From py-spy's raw (collapsed) output: the ``top`` functions by inclusive and by self share of
    the samples, named ``func (dir/file.py)``. ``project_only`` keeps the project's own frames; then
    "self" is what the deepest project frame spent, library calls below it included."""
    total = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    if not path.exists():
        return {"inclusive": [], "self": []}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        seen: set[str] = set()
        names = []
        for frame in stack.split(";"):
            m = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
            file = m.group(2) if m else ""
            name = f"{m.group(1)} ({'/'.join(file.split('/')[-2:])})" if m else frame
            # py-spy names files relative to their sys.path entry: "iris/reports.py", "temporalio/...".
            mine = "/" in file and file.split("/")[0] in PROJECT_CODE and "site-packages" not in file
            if project_only and not mine:
                continue
            names.append(name)
            if name not in seen:
                seen.add(name)
                inclusive[name] += count
        if names:
            own[names[-1]] += count
    if total == 0:
        return {"inclusive": [], "self": []}
    return {
        "inclusive": [(name, 100.0 * c / total) for name, c in inclusive.most_common(top)],
        "self": [(name, 100.0 * c / total) for name, c in own.most_common(top)],
    }


async def gather_bounded(coros: Iterable[Awaitable[Any]], limit: int) -> list[Any]:
    """Run awaitables with at most ``limit`` in flight; results in order (exceptions returned)."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[Any]) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
