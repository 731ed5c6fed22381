"""The chaos suite (issue 8 item 3): about 200 jobs across the home cluster and both peers while

- the worker (a separate ``iris worker`` process) is SIGKILLed and restarted every few seconds,
- the Temporal dev server is restarted once on the same SQLite database file,
- a peer controller (cw-rno2a) is stopped and started again,

then, once the faults stop, every job must settle. Asserted and printed as a table: 0 jobs lost,
0 duplicate handoffs (counted on the controllers: each job's ``attempts`` and the set of job ids
each holds), 0 deliveries after a recorded cancel, every job terminal or parked with a reason.

Everything is its own: Temporal (``--db-filename``), S3 and GCS emulators, three controllers and the
worker, on free loopback ports under one directory. Bounded in time and count. One command::

    uv run python -m scripts.chaos                # 200 jobs, prints the table, exit 1 on a violation
    uv run python -m scripts.chaos --jobs 60 --seed 7 --keep /tmp/chaos   # smaller, keep the data

The same run is ``IRIS_CHAOS=1 uv run pytest tests/chaos -m chaos`` (skipped by default: it takes a
few minutes, see docs/RELIABILITY.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
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
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.service import RPCError

from cli.ops import DeterminismReport, replay_histories
from iris import devstack
from iris.client import AsyncIrisClient, IrisError, JobAlreadyExists
from iris.config import FederationConfig, load_config
from iris.controller.client import ControllerClient
from iris.controller.identity import KEY_DIR_ENV, ensure_cluster_keys
from iris.controller.models import JobStatus as PeerJobStatus
from iris.jobs import JobState, JobStatus
from iris.store import FederationStore

T = TypeVar("T")
PEER_TO_RESTART = "cw-rno2a"
USER = "chaos@example.com"


@dataclass
class Options:
    jobs: int = 200
    seed: int = 20261130
    submit_window_s: float = 40.0  # jobs are submitted over this long, while the faults run
    chaos_s: float = 60.0  # how long the worker keeps being killed
    kill_every_s: tuple[float, float] = (3.0, 6.0)
    temporal_restart_at_s: float = 22.0
    peer_restart_at_s: float = 35.0
    peer_down_s: float = 5.0
    settle_s: float = 300.0  # after the faults, how long every job has to settle


# ---- the stack ---------------------------------------------------------------------------------


def chaos_config(root: Path) -> FederationConfig:
    """The demo topology on free loopback ports, its own task queue and store."""
    cfg = load_config().model_copy(deep=True)
    cfg.temporal.address = f"127.0.0.1:{devstack.free_port()}"
    cfg.temporal.ui_port = devstack.free_port()
    cfg.temporal.task_queue = "iris-chaos"
    cfg.s3_port = devstack.free_port()
    cfg.gcs_port = devstack.free_port()
    cfg.store_url = f"sqlite:///{root / 'worker' / 'federation.db'}"
    for c in cfg.clusters:
        c.port = devstack.free_port()
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
    worker: devstack.ManagedProcess | None = None
    worker_starts: int = 0
    client: Client | None = None

    @property
    def key_dir(self) -> Path:
        return self.root / "keys"

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
        return AsyncIrisClient(self.client, self.config)

    def controller_client(self, cluster: str) -> ControllerClient:
        return ControllerClient.for_cluster(self.config, cluster, key_dir=self.key_dir, timeout=10)


async def start_stack(root: Path) -> ChaosStack:
    cfg = chaos_config(root)
    config_file = root / "clusters.json"
    config_file.write_text(cfg.model_dump_json(indent=2))
    ensure_cluster_keys(cfg, root / "keys")
    child_env = {
        KEY_DIR_ENV: str(root / "keys"),
        "IRIS_STORE_URL": cfg.store_url,
        "IRIS_CONFIG": str(config_file),
    }
    temporal = devstack.temporal_server(cfg, root, db_file=root / "temporal.db")
    emulators = [devstack.s3_server(cfg, root), devstack.gcs_server(cfg, root)]
    controllers = {c.name: devstack.controller(config_file, cfg, c.name, root) for c in cfg.clusters}
    for svc in [temporal, *emulators, *controllers.values()]:
        # A controller keeps its own store's credentials (devstack.controller); no process gets another's.
        svc.env = {**child_env, **svc.env}
        svc.start()
    # The worker holds the home cluster's credentials only.
    worker_env = {**child_env, **devstack.store_credentials(cfg, cfg.home)}
    stack = ChaosStack(root, cfg, config_file, worker_env, temporal, controllers, emulators)
    for svc in [temporal, *emulators, *controllers.values()]:
        await asyncio.to_thread(svc.wait_ready, 120)
    await asyncio.to_thread(devstack.ensure_buckets, cfg)
    # A runtime that logs nothing: the SDK would print every reconnect attempt during the restart.
    quiet = Runtime(telemetry=TelemetryConfig(logging=None))
    stack.client = await Client.connect(
        cfg.temporal.address, data_converter=pydantic_data_converter, runtime=quiet
    )
    stack.start_worker()
    return stack


async def stop_stack(stack: ChaosStack) -> None:
    procs = [stack.worker, *stack.controllers.values(), *stack.emulators, stack.temporal]
    for proc in procs:
        if proc is not None:
            await asyncio.to_thread(proc.stop)


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class JobPlan:
    index: int
    kind: str
    kwargs: dict[str, Any]
    command: list[str]
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
    log: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    states: Counter[str]
    by_kind: dict[str, Counter[str]]
    invariants: dict[str, int]
    examples: dict[str, list[str]]


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
        lines = [
            f"chaos: {len(self.records)} jobs, seed {self.options.seed}: {t['total']:.0f}s in all "
            f"(stack up {t['startup']:.0f}s, faults {t['chaos']:.0f}s, settled {t['settle']:.0f}s later)",
            f"faults: {f.worker_kills} worker SIGKILLs ({f.worker_restarts} restarts), "
            f"{f.temporal_restarts} Temporal restart on the same db file (down {f.temporal_down_s:.1f}s), "
            f"{f.peer_restarts} peer restart ({PEER_TO_RESTART} down {f.peer_down_s:.1f}s)",
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
        lines += ["", f"{'invariant':<34}{'count':>6}"]
        lines += [f"{name:<34}{n:>6}" for name, n in self.invariants.items()]
        for name, examples in self.verdict.examples.items():
            if examples:
                lines.append(f"  {name}: {', '.join(examples[:5])}")
        lines += [line.line() for line in self.replay.failures[:5]]
        lines += ["", self.replay.summary()]
        failed = ", ".join(f"{cause} {n}" for cause, n in sorted(self.task_failures.items())) or "none"
        lines.append(f"workflow task failures by cause: {failed}")
        return "\n".join(lines)


def plan_jobs(options: Options, rng: random.Random) -> list[JobPlan]:
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
    plans = []
    for i in range(options.jobs):
        kind = rng.choices(names, weights)[0]
        sleep = f"{rng.uniform(0.1, 2.0):.2f}"
        command = ["sh", "-c", f"sleep {sleep}; echo chaos-{i}"]
        kwargs: dict[str, Any] = {}
        cancel_after = None
        if kind == "pinned-east":
            kwargs = {"target_cluster": "cw-us-east-02a"}
            if rng.random() < 0.6:
                kwargs.update(device_type="h100", gpu_count=rng.choice([1, 2, 4]))
        elif kind == "pinned-rno":
            kwargs = {"target_cluster": "cw-rno2a"}
            if rng.random() < 0.6:
                kwargs.update(device_type="h100", gpu_count=rng.choice([1, 2, 4]))
        elif kind == "gpu-unpinned":
            kwargs = {"device_type": "h100", "gpu_count": rng.choice([1, 2, 4, 8])}
        elif kind == "cancelled":
            command = ["sleep", "30"]
            kwargs = rng.choice(
                [{}, {"target_cluster": "cw-us-east-02a"}, {"device_type": "h100", "gpu_count": 8}]
            )
            cancel_after = rng.uniform(0.0, 6.0)
        elif kind == "missing-artifact":
            peer = rng.choice(["cw-us-east-02a", "cw-rno2a"])
            kwargs = {"target_cluster": peer, "artifacts": [f"s3://{peer}-artifacts/chaos/missing-{i}"]}
        elif kind == "deadline":
            kwargs = {"device_type": "h100", "gpu_count": 8, "replicas": 3, "scheduling_timeout_s": 10}
        plans.append(JobPlan(i, kind, kwargs, command, cancel_after))
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

    def note(self, message: str) -> None:
        line = f"  t+{time.monotonic() - self.started:5.1f}s {message}"
        self.faults.log.append(line)
        print(line, flush=True)

    async def submit(self, record: Record) -> None:
        plan = record.plan
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
        gap = self.options.submit_window_s / max(1, len(records))
        tasks = []
        for record in records:
            tasks.append(asyncio.create_task(self.submit(record)))
            await asyncio.sleep(self.rng.uniform(0, 2 * gap))
        await asyncio.gather(*tasks)

    async def kill_workers(self, until: float) -> None:
        lo, hi = self.options.kill_every_s
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.uniform(lo, hi))
            await asyncio.to_thread(self.stack.kill_worker)
            self.faults.worker_kills += 1
            await asyncio.sleep(self.rng.uniform(0.3, 1.5))
            self.stack.start_worker()
            self.faults.worker_restarts += 1
            self.note(f"worker SIGKILLed and restarted (#{self.faults.worker_kills})")

    async def restart_temporal(self) -> None:
        await asyncio.sleep(self.options.temporal_restart_at_s)
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
        await asyncio.sleep(self.options.peer_restart_at_s)
        peer = self.stack.controllers[PEER_TO_RESTART]
        down = time.monotonic()
        await asyncio.to_thread(peer.stop)
        self.note(f"controller {PEER_TO_RESTART} stopped")
        await asyncio.sleep(self.options.peer_down_s)
        peer.start()
        await asyncio.to_thread(peer.wait_ready, 120)
        self.faults.peer_restarts += 1
        self.faults.peer_down_s = time.monotonic() - down
        self.note(f"controller {PEER_TO_RESTART} back ({self.faults.peer_down_s:.1f}s)")

    async def unsettled(self) -> int:
        """Jobs whose workflow still runs and is not parked (HANDOFF_FAILED)."""
        assert self.stack.client is not None
        # This Temporal server is the suite's own: every JobWorkflow on it is one of ours.
        query = (
            "WorkflowType = 'JobWorkflow' AND ExecutionStatus = 'Running' AND IrisState != 'HANDOFF_FAILED'"
        )
        return (await self.stack.client.count_workflows(query)).count

    async def settle(self, records: list[Record]) -> None:
        deadline = time.monotonic() + self.options.settle_s
        last_report = 0.0
        while time.monotonic() < deadline:
            with contextlib.suppress(RPCError, RuntimeError):
                left = await self.unsettled()
                if left == 0:
                    return
                if time.monotonic() - last_report > 15:
                    last_report = time.monotonic()
                    self.note(f"{left} job(s) still moving")
            await asyncio.sleep(1.0)

    async def final_states(self, records: list[Record]) -> None:
        iris = self.stack.iris()
        gate = asyncio.Semaphore(8)

        async def one(record: Record) -> None:
            if record.job_id is None:
                return
            job_id = record.job_id
            async with gate:
                with contextlib.suppress(Exception):
                    record.final = await retrying(lambda: iris.describe(job_id), within=30)

        await asyncio.gather(*(one(r) for r in records))

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

    async def peer_jobs(self) -> dict[str, dict[str, PeerJobStatus]]:
        held: dict[str, dict[str, PeerJobStatus]] = {}
        for cluster in self.stack.config.cluster_names:
            async with self.stack.controller_client(cluster) as ctl:
                jobs = await ctl.list_jobs()
            held[cluster] = {j.job_id: j for j in jobs if j.job_id.startswith(f"chaos/c{self.run_id}-")}
        return held


def judge(
    records: list[Record], held: dict[str, dict[str, PeerJobStatus]], store_cancels: set[str]
) -> Verdict:
    where: dict[str, list[str]] = {}
    for cluster, jobs in held.items():
        for job_id in jobs:
            where.setdefault(job_id, []).append(cluster)
    examples: dict[str, list[str]] = {k: [] for k in ("lost", "duplicate", "after-cancel", "unsettled")}
    states: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    lost = duplicate = after_cancel = unsettled = 0
    for r in records:
        if r.job_id is None or r.final is None:
            lost += 1
            examples["lost"].append(f"#{r.plan.index} {r.submit_error or 'no status'}")
            states["(no status)"] += 1
            continue
        job_id, final = r.job_id, r.final
        states[final.state.value] += 1
        by_kind.setdefault(r.plan.kind, Counter())[final.state.value] += 1
        clusters = where.get(job_id, [])
        attempts = [held[c][job_id].attempts for c in clusters]
        if len(clusters) > 1 or any(a > 1 for a in attempts):
            duplicate += 1
            examples["duplicate"].append(f"{job_id} on {clusters} attempts {attempts}")
        recorded_cancel = r.cancel_won is True or job_id in store_cancels
        if recorded_cancel and clusters:
            after_cancel += 1
            examples["after-cancel"].append(f"{job_id} on {clusters}")
        parked = final.state is JobState.HANDOFF_FAILED and bool(final.reason.strip())
        if not (final.terminal or parked):
            unsettled += 1
            examples["unsettled"].append(f"{job_id} {final.state.value}: {final.reason[:60]}")
    invariants = {
        "jobs lost": lost,
        "duplicate handoffs (on peers)": duplicate,
        "deliveries after a recorded cancel": after_cancel,
        "not terminal nor parked w/ reason": unsettled,
    }
    return Verdict(states, by_kind, invariants, examples)


async def run_chaos(options: Options, root: Path) -> Report:
    t0 = time.monotonic()
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    print(f"chaos: data in {root}", flush=True)
    stack = await start_stack(root)
    try:
        startup = time.monotonic() - t0
        chaos = Chaos(stack, options)
        records = [Record(plan) for plan in plan_jobs(options, chaos.rng)]
        chaos.note(f"stack up in {startup:.0f}s; submitting {len(records)} jobs")
        faults_until = time.monotonic() + options.chaos_s
        submitting = asyncio.create_task(chaos.submit_all(records))
        await asyncio.gather(
            chaos.kill_workers(faults_until), chaos.restart_temporal(), chaos.restart_peer(), submitting
        )
        if stack.worker is None or not stack.worker.running:
            stack.start_worker()
        chaos_end = time.monotonic()
        chaos.note("faults over; waiting for every job to settle")
        await chaos.settle(records)
        settled = time.monotonic()
        await chaos.final_states(records)
        held = await chaos.peer_jobs()
        store = FederationStore(stack.config.store_url)
        try:
            handles = await asyncio.to_thread(store.handles)
        finally:
            store.close()
        store_cancels = {h.job_id for h in handles if h.cancel_requested and h.assigned_peer is None}
        replay, task_failures = await chaos.check_histories()
        timings = {
            "startup": startup,
            "chaos": chaos_end - t0 - startup,
            "settle": settled - chaos_end,
            "total": time.monotonic() - t0,
        }
        verdict = judge(records, held, store_cancels)
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
    args = parser.parse_args(argv)
    options = Options(jobs=args.jobs, seed=args.seed)
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
