"""Several workers: one burst through one ``iris worker``, then through two, then one again.

    uv run python -m benchmarks.workers [--jobs 300] [--workers 1,2,1] [--source HEAD]

Issue 17 ("Several workers"; docs/BENCHMARKS.md, "Several workers"). Starts its own real stack
(``benchmarks/harness.py``: in-memory Temporal dev server, moto, fake-gcs-server, the three
controllers as processes) with the federation store on PostgreSQL (a fresh database on
``--postgres``, default ``$IRIS_TEST_POSTGRES_URL`` or the local test server, dropped at the end):
every worker process shares it. Then, for each entry of ``--workers``, that many ``iris worker``
processes (started or stopped to get there) and a burst of ``--jobs`` jobs submitted at once, the
mix and command of ``benchmarks/e2e.py`` (4 of 5 ``h100×1`` queued and placed on the peers by the
tick, 1 of 5 local CPU, ``true``; ``--peer-slots`` per peer so capacity is not what is measured).

Per phase: throughput (jobs / (last close − first submit)), p50 and p95 submit→closed, the CPU
seconds of each process, how the jobs' activities split between the workers (a sample of
histories), the load average. Then the ratio of the two-worker throughput to the mean of the
one-worker phases around it (the machine is shared: load drifts). Not a test: numbers depend on the
machine.
"""

# The snapshot switch below runs before any project module is imported; the other imports follow it.

from __future__ import annotations

import sys

from benchmarks.source import run_from_snapshot

if __name__ == "__main__":
    run_from_snapshot("benchmarks.workers", sys.argv[1:])

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from activities.placement import TickOutcome
from benchmarks.e2e import CPU, GPU, kinds, manager_ticks, results_of, spec_for
from benchmarks.harness import (
    VENV_BIN,
    BenchError,
    BenchStack,
    CpuMeter,
    Deadline,
    LoadSampler,
    fmt,
    gather_bounded,
    machine,
    mean,
    pcts,
    run_main,
    table,
    uptime_line,
    write_json,
)
from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, source_label
from iris import devstack
from iris.client import AsyncIrisClient
from iris.config import STORE_URL_ENV, FederationConfig

TASK_QUEUE = "iris-bench-workers"
USER = "bench-workers@bench.local"
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def configure(args: argparse.Namespace) -> Any:
    """The demo topology with room (capacity is not what is measured)."""

    def apply(cfg: FederationConfig) -> None:
        for c in cfg.clusters:
            for b in c.backends:
                b.cpu_slots = args.cpu_slots
                if b.devices:
                    b.devices = {t: args.peer_slots for t in b.devices}

    return apply


@contextlib.contextmanager
def fresh_database(url: str) -> Any:
    """A new PostgreSQL database on ``url``'s server, dropped afterwards; yields its URL."""
    admin = create_engine(url, connect_args={"connect_timeout": 3}, isolation_level="AUTOCOMMIT")
    name = f"iris_bench_workers_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except Exception as exc:
        admin.dispose()
        raise BenchError(f"PostgreSQL not usable at {url}: {type(exc).__name__}: {exc}") from None
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


class Workers:
    """The ``iris worker`` processes of the run: the harness's first, then more of the same."""

    def __init__(self, stack: BenchStack) -> None:
        self.stack = stack
        self.procs: list[devstack.ManagedProcess] = []

    def identity_names(self) -> dict[str, str]:
        """The SDK's worker identity (``pid@host``) → "worker N"."""
        return {str(p.proc.pid): p.name for p in self.procs if p.proc is not None}

    async def scale(self, n: int) -> None:
        while len(self.procs) < n:
            if not self.procs:
                self.procs.append(await self.stack.start_worker())
                self.procs[0].name = "worker 1"
                continue
            argv = [str(VENV_BIN / "iris"), "--config", str(self.stack.config_file), "worker"]
            name = f"worker {len(self.procs) + 1}"
            self.procs.append(
                self.stack.start_process(name, [*argv, "--data-dir", str(self.stack.root / name)])
            )
        while len(self.procs) > n:
            proc = self.procs.pop()
            await asyncio.to_thread(proc.stop, 30)
            if proc in self.stack.extra:
                self.stack.extra.remove(proc)
        await asyncio.sleep(2.0)  # a new worker's pollers reach the server


@dataclass
class PhaseResult:
    name: str
    workers: int
    jobs: int
    wall_s: float
    per_s: float
    closed_ms: dict[str, float]
    cpu: dict[str, float]
    activities: Counter[str]
    states: Counter[str]
    load: str
    ticks: list[TickOutcome]


async def burst(
    stack: BenchStack,
    workers: Workers,
    n: int,
    cpu_fraction: float,
    concurrency: int,
    tag: str,
    deadline: Deadline,
) -> PhaseResult:
    iris = AsyncIrisClient(stack.client, stack.config, principal=USER)
    specs = [
        (kind, spec_for(kind, f"workers-{tag}-{i:05d}", USER, ["true"]))
        for i, kind in enumerate(kinds(n, cpu_fraction))
    ]
    pids = stack.pids()
    for p in workers.procs:
        if p.proc is not None:
            pids[p.name] = p.proc.pid
    pids.pop("iris worker", None)
    cpu = CpuMeter(pids).start()
    t0_ms = int(time.time() * 1000)
    with LoadSampler() as load:
        started = await asyncio.wait_for(
            gather_bounded((iris.submit_spec(spec) for _, spec in specs), concurrency), deadline.bound(600)
        )
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            raise BenchError(f"{len(errors)} submissions failed, e.g. {errors[0]!r}")
        finals = await asyncio.wait_for(
            results_of(stack.client, [s.job_id for _, s in specs]), deadline.bound(1800)
        )
    cpu.stop()
    first = min(s.submit_ms for s in finals)
    last = max(s.updated_ms for s in finals)
    wall_s = (last - first) / 1000
    names = workers.identity_names()
    activities: Counter[str] = Counter()
    sample = [s.job_id for _, s in specs][:: max(1, n // 100)]
    for job_id in sample:
        history = await stack.client.get_workflow_handle(job_id).fetch_history()
        for e in history.events:
            if e.HasField("activity_task_started_event_attributes"):
                identity = e.activity_task_started_event_attributes.identity
                activities[names.get(identity.partition("@")[0], identity)] += 1
    return PhaseResult(
        name=tag,
        workers=len(workers.procs),
        jobs=n,
        wall_s=wall_s,
        per_s=n / wall_s if wall_s > 0 else float("nan"),
        closed_ms=pcts([float(s.updated_ms - s.submit_ms) for s in finals]),
        cpu=cpu.used,
        activities=activities,
        states=Counter(s.state.value for s in finals),
        load=load.summary(),
        ticks=await manager_ticks(stack, t0_ms, int(time.time() * 1000)),
    )


async def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.timeout)
    info = machine()
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise BenchError("--workers takes positive counts, e.g. 1,2,1")
    root = Path(tempfile.mkdtemp(prefix="iris-bench-workers-"))
    stack = BenchStack(root)
    print(f"measuring {source_label()}; stack in {root} ({info['uptime_before']})", flush=True)
    results: list[PhaseResult] = []
    try:
        with fresh_database(args.postgres) as url:
            os.environ[STORE_URL_ENV] = url  # every worker process inherits it
            # Submissions and cancels are signed by their user (docs/DESIGN.md, "User → home").
            await stack.start(configure(args), task_queue=TASK_QUEUE, users={USER: ["user"]})
            workers = Workers(stack)
            try:
                await workers.scale(1)
                iris = AsyncIrisClient(stack.client, stack.config, principal=USER)
                for kind in (GPU, CPU):  # warm-up (imports, sandbox, connections): not counted
                    spec = spec_for(kind, f"warm-{kind}", USER, ["true"])
                    await iris.submit_spec(spec)
                    await results_of(stack.client, [spec.job_id])
                for i, n in enumerate(counts):
                    await workers.scale(n)
                    tag = f"p{i + 1}-{n}w"
                    print(f"[{time.strftime('%X')}] {tag}: {args.jobs} jobs on {n} worker(s)", flush=True)
                    results.append(
                        await burst(
                            stack, workers, args.jobs, args.cpu_fraction, args.concurrency, tag, deadline
                        )
                    )
            finally:
                await stack.stop()
                os.environ.pop(STORE_URL_ENV, None)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    info["uptime_after"] = uptime_line()
    report(args, info, results)
    return 0


def report(args: argparse.Namespace, info: dict[str, Any], results: list[PhaseResult]) -> None:
    print(f"\n{args.jobs} jobs per phase ({info['nproc']} CPUs, {info['cpu']}); {source_label()}")
    rows = []
    for r in results:
        workers_cpu = sum(v for k, v in r.cpu.items() if k.startswith("worker"))
        rows.append(
            [
                r.name,
                r.workers,
                r.wall_s,
                r.per_s,
                r.closed_ms["p50"] / 1000,
                r.closed_ms["p95"] / 1000,
                len(r.ticks),
                mean(len(t.placed) for t in r.ticks),
                pcts([t.total_ms for t in r.ticks])["p50"],
                workers_cpu,
                r.cpu.get("temporal server", float("nan")),
                sum(r.cpu.values()),
                " ".join(f"{k.split()[-1]}:{v}" for k, v in sorted(r.activities.items())),
                r.load,
            ]
        )
    print(
        table(
            [
                "phase",
                "workers",
                "wall s",
                "jobs/s",
                "closed p50 s",
                "p95 s",
                "ticks",
                "placed/tick",
                "tick ms p50",
                "worker CPU s",
                "server CPU s",
                "all CPU s",
                "activities by worker",
                "load (1 min)",
            ],
            rows,
        )
    )
    for r in results:
        if set(r.states) != {"SUCCEEDED"}:
            print(f"  {r.name}: final states {dict(r.states)}")
    ratios = []
    for i, r in enumerate(results):
        if r.workers == 1:
            continue
        # Against the one-worker phases just before and after it: each phase runs a little slower
        # than the one before (the stack's stores grow), so a far-away phase would bias the ratio.
        before = next((x for x in reversed(results[:i]) if x.workers == 1), None)
        after = next((x for x in results[i + 1 :] if x.workers == 1), None)
        around = [x.per_s for x in (before, after) if x is not None]
        if around:
            ratios.append(r.per_s / mean(around))
            print(
                f"{r.name}: {r.workers} workers {fmt(r.per_s)} jobs/s against {fmt(mean(around))} with one"
                f" ({'/'.join(x.name for x in (before, after) if x is not None)}): ratio {ratios[-1]:.2f}"
            )
    write_json(
        args.out,
        {
            "machine": info,
            "source": source_label(),
            "ratios": ratios,
            "phases": [
                {
                    "name": r.name,
                    "workers": r.workers,
                    "jobs": r.jobs,
                    "wall_s": r.wall_s,
                    "jobs_per_s": r.per_s,
                    "closed_ms": r.closed_ms,
                    "cpu_s": r.cpu,
                    "activities": dict(r.activities),
                    "states": dict(r.states),
                    "load": r.load,
                    "ticks": len(r.ticks),
                    "placed_per_tick": mean(len(t.placed) for t in r.ticks),
                    "tick_ms": pcts([t.total_ms for t in r.ticks]),
                }
                for r in results
            ],
        },
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=300, help="jobs per burst")
    p.add_argument("--workers", default="1,2,1", help="worker processes per phase, in order")
    p.add_argument("--cpu-fraction", type=float, default=0.2, help="share of local CPU jobs")
    p.add_argument("--concurrency", type=int, default=50, help="submissions in flight")
    p.add_argument("--peer-slots", type=int, default=256, help="h100 slots per peer backend")
    p.add_argument("--cpu-slots", type=int, default=64, help="CPU job slots per backend")
    p.add_argument(
        "--postgres",
        default=os.environ.get("IRIS_TEST_POSTGRES_URL") or DEFAULT_POSTGRES,
        help="a PostgreSQL server (URL of a database to connect to) where a fresh database is made",
    )
    p.add_argument("--timeout", type=float, default=1800, help="bound on the whole run, seconds")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stack's temp directory")
    add_source_argument(p)
    args = parse_args(p, {"jobs": 5, "workers": "1,2", "timeout": 300})
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
