"""End-to-end benchmark of the job pipeline against the engine's ceiling, in one run.

    uv run python -m benchmarks.e2e [--jobs 500]

Starts its own real stack (in-memory Temporal dev server, moto, fake-gcs-server, the three
controllers as processes on free loopback ports, the federation store in a temp directory, and
``iris worker`` as its own process), then, in order:

1. light load: jobs submitted one at a time (each waits for the previous one to end) →
   submit→placed / submit→handed-off / submit→closed latencies; their histories give the number
   of activities and signals a real job executes;
2. the ceiling: ``--jobs`` no-op workflows with those counts (``benchmarks/ceiling.py``, its own
   worker process) on the same server, submitted the same way; measured again after step 3, and
   the ratio is taken against the mean of the two (the machine is shared: load drifts);
3. the pipeline: ``--jobs`` real jobs (GPU jobs queued and placed on the peers by the tick, and
   local CPU jobs), all submitted at once (open loop: ``--concurrency`` starts in flight, then
   the run waits for all of them on visibility) → throughput to
   HANDED_OFF, SUCCEEDED and closed, latency percentiles, the ratio pipeline/ceiling;
4. cancel: ``--cancel-jobs`` running ``sleep`` jobs on the peers, cancelled one at a time and then
   in a burst → cancel→terminated on the peer (the controller's ``finished_ms``).

Timestamps come from each job's ``status`` events (``at_ms`` per state change), the workflows'
close times and the controllers' job status. Everything is bounded by ``--timeout``. Not a test.
See docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from activities.placement import TickOutcome
from benchmarks.ceiling import CEILING_WORKFLOW, CeilingInput
from benchmarks.harness import (
    AccessLogCounter,
    BenchError,
    BenchStack,
    CpuMeter,
    Deadline,
    HistoryStats,
    LoadSampler,
    PySpy,
    fetch_stats,
    fmt,
    gather_bounded,
    machine,
    mean,
    pcts,
    run_main,
    summarize_collapsed,
    table,
    uptime_line,
    wait_until,
    write_json,
)
from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, source_label
from iris.client import AsyncIrisClient, build_spec
from iris.config import FederationConfig
from iris.contract import SA_SUBMITTER, manager_workflow_id
from iris.controller.client import ControllerClient
from iris.jobs import JobSpec, JobState, JobStatus

GPU = "gpu"
CPU = "cpu"
TASK_QUEUE = "iris-bench"
CEILING_QUEUE = "iris-bench-ceiling"
LIGHT_USER = "bench-light@bench.local"
LOAD_USER = "bench-load@bench.local"
CANCEL_USER = "bench-cancel@bench.local"
# Every job is signed by its user, who must be registered with a key (benchmarks/harness.py,
# ``register_users``); the cancels are signed by the jobs' owner.
USERS = {LIGHT_USER: ["user"], LOAD_USER: ["user"], CANCEL_USER: ["user"]}


# ---- configuration -----------------------------------------------------------------------------


def configure(args: argparse.Namespace) -> Any:
    """The demo topology, with room: capacity must not be what is measured."""

    def apply(cfg: FederationConfig) -> None:
        for c in cfg.clusters:
            for b in c.backends:
                b.cpu_slots = args.cpu_slots
                if b.devices:
                    b.devices = {t: args.peer_slots for t in b.devices}
        if args.max_per_peer is not None:
            cfg.max_per_peer_per_tick = args.max_per_peer if args.max_per_peer > 0 else None

    return apply


def spec_for(kind: str, name: str, user: str, command: Sequence[str]) -> JobSpec:
    if kind == GPU:
        return build_spec(list(command), name=name, user=user, device_type="h100", gpu_count=1)
    return build_spec(list(command), name=name, user=user)


def kinds(n: int, cpu_fraction: float) -> list[str]:
    """A deterministic mix: every k-th job is a local CPU job."""
    if cpu_fraction <= 0:
        return [GPU] * n
    every = max(1, round(1 / cpu_fraction))
    return [CPU if i % every == every - 1 else GPU for i in range(n)]


# ---- one job's timeline ------------------------------------------------------------------------


@dataclass
class JobTimes:
    job_id: str
    kind: str
    state: str
    cluster: str | None
    submit_ms: int
    submit_rpc_ms: float
    placed_ms: int | None
    handed_ms: int | None
    succeeded_ms: int | None
    killed_ms: int | None
    closed_ms: int | None = None

    @classmethod
    def of(cls, kind: str, status: JobStatus, submit_rpc_ms: float) -> JobTimes:
        def first(state: JobState, prefix: str = "") -> int | None:
            return next(
                (e.at_ms for e in status.events if e.state is state and e.message.startswith(prefix)), None
            )

        return cls(
            job_id=status.job_id,
            kind=kind,
            state=status.state.value,
            cluster=status.cluster,
            submit_ms=status.submit_ms,
            submit_rpc_ms=submit_rpc_ms,
            placed_ms=first(JobState.QUEUED_HANDOFF, "promoted to"),
            handed_ms=first(JobState.HANDED_OFF),
            succeeded_ms=first(JobState.SUCCEEDED),
            killed_ms=first(JobState.KILLED),
        )


async def close_times(client: Client, query: str, expect: int = 0, *, within: float = 30.0) -> dict[str, int]:
    """Close time per workflow id from visibility; waits (bounded) until ``expect`` are visible."""
    end = time.monotonic() + within
    while True:
        out: dict[str, int] = {}
        async for wf in client.list_workflows(query):
            if wf.close_time is not None:
                out[wf.id] = int(wf.close_time.timestamp() * 1000)
        if len(out) >= expect or time.monotonic() > end:
            return out
        await asyncio.sleep(0.5)


async def wait_all_closed(client: Client, query: str, *, within: float) -> None:
    """Poll visibility once a second until no workflow of ``query`` is running (light on the server,
    unlike one long-poll per workflow)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        running = await client.count_workflows(f"{query} AND ExecutionStatus = 'Running'")
        if running.count == 0:
            return
        await asyncio.sleep(1.0)
    raise BenchError(f"workflows of {query!r} still running after {within:.0f}s")


async def results_of(client: Client, ids: Sequence[str]) -> list[JobStatus]:
    async def one(wf_id: str) -> JobStatus:
        status: JobStatus = await client.get_workflow_handle(wf_id, result_type=JobStatus).result()
        return status

    out = await gather_bounded((one(i) for i in ids), 16)
    errors = [r for r in out if isinstance(r, BaseException)]
    if errors:
        raise BenchError(f"{len(errors)} jobs have no result, e.g. {errors[0]!r}")
    return list(out)


async def submit_and_wait(
    iris: AsyncIrisClient, spec: JobSpec, kind: str, *, within: float
) -> tuple[JobTimes, float]:
    t0 = time.perf_counter()
    await iris.submit_spec(spec)
    rpc_ms = (time.perf_counter() - t0) * 1000
    handle = iris.temporal.get_workflow_handle(spec.job_id, result_type=JobStatus)
    status: JobStatus = await asyncio.wait_for(handle.result(), within)
    return JobTimes.of(kind, status, rpc_ms), rpc_ms


# ---- phases ------------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    jobs: list[JobTimes]
    t0_ms: int
    cpu: CpuMeter
    requests: Counter[str]
    load: str
    histories: dict[str, list[HistoryStats]]
    ticks: list[TickOutcome]


async def light_phase(
    stack: BenchStack, iris: AsyncIrisClient, n: int, cpu_fraction: float, deadline: Deadline
) -> Phase:
    user = LIGHT_USER
    # Warm-up (imports, sandbox, first connections): one of each kind, not counted.
    for kind in (GPU, CPU):
        spec = spec_for(kind, f"warm-light-{kind}", user, ["true"])
        await submit_and_wait(iris, spec, kind, within=deadline.bound(120))
    access = AccessLogCounter(stack.controller_logs())
    access.mark()
    cpu = CpuMeter(stack.pids()).start()
    t0_ms = int(time.time() * 1000)
    jobs: list[JobTimes] = []
    with LoadSampler() as load:
        for i, kind in enumerate(kinds(n, cpu_fraction)):
            spec = spec_for(kind, f"light-{i:04d}", user, ["true"])
            times, _ = await submit_and_wait(iris, spec, kind, within=deadline.bound(120))
            jobs.append(times)
            await asyncio.sleep(0.2)
    cpu.stop()
    closed = await close_times(stack.client, f"IrisSubmitter = '{user}'", len(jobs) + 2)
    for j in jobs:
        j.closed_ms = closed.get(j.job_id)
    histories = await job_histories(stack.client, jobs, limit=len(jobs))
    ticks = await manager_ticks(stack, t0_ms, int(time.time() * 1000))
    return Phase("light", jobs, t0_ms, cpu, access.count(), load.summary(), histories, ticks)


async def job_histories(
    client: Client, jobs: Sequence[JobTimes], *, limit: int
) -> dict[str, list[HistoryStats]]:
    by_kind: dict[str, list[HistoryStats]] = {GPU: [], CPU: []}
    sample = [j for j in jobs if j.kind == GPU][:limit] + [j for j in jobs if j.kind == CPU][:limit]
    stats = await gather_bounded((fetch_stats(client, j.job_id) for j in sample), 16)
    for j, s in zip(sample, stats, strict=True):
        if isinstance(s, HistoryStats):
            by_kind[j.kind].append(s)
    return by_kind


async def manager_ticks(stack: BenchStack, since_ms: int, until_ms: int) -> list[TickOutcome]:
    """Every placement tick whose activity completed in [since, until], from the manager's histories
    (all runs: continue-as-new rolls it over)."""
    from temporalio.api.enums.v1 import EventType

    mid = manager_workflow_id(stack.config.temporal.task_queue)
    ticks: list[TickOutcome] = []
    runs = [wf.run_id async for wf in stack.client.list_workflows(f"WorkflowId = '{mid}'")]
    for run_id in runs:
        history = await stack.client.get_workflow_handle(mid, run_id=run_id).fetch_history()
        for e in history.events:
            if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                continue
            at = e.event_time.ToMilliseconds()
            if not since_ms <= at <= until_ms:
                continue
            payloads = e.activity_task_completed_event_attributes.result.payloads
            if payloads:
                (tick,) = await stack.client.data_converter.decode(payloads, [TickOutcome])
                ticks.append(tick)
    return ticks


def profile_of(histories: dict[str, list[HistoryStats]]) -> dict[str, CeilingInput]:
    """The ceiling's shape per kind: the most common step sequence of the real jobs (activities,
    local activities and signals in history order)."""
    out: dict[str, CeilingInput] = {}
    for kind, hs in histories.items():
        if hs:
            steps, _ = Counter(h.steps for h in hs).most_common(1)[0]
            out[kind] = CeilingInput(steps=steps)
    return out


async def ceiling_phase(
    stack: BenchStack,
    profile: dict[str, CeilingInput],
    n: int,
    light_n: int,
    cpu_fraction: float,
    concurrency: int,
    deadline: Deadline,
    tag: str,
) -> tuple[Phase | None, Phase]:
    """(light-load ceiling latencies or None if ``light_n`` is 0, burst ceiling throughput), on a
    no-op worker process of its own."""
    client = stack.client
    proc = stack.start_process(
        "ceiling worker",
        [
            sys.executable,
            "-m",
            "benchmarks.ceiling",
            "--address",
            stack.config.temporal.address,
            "--task-queue",
            CEILING_QUEUE,
        ],
    )

    def sa(user: str) -> TypedSearchAttributes:
        return TypedSearchAttributes([SearchAttributePair(SA_SUBMITTER, user)])

    async def one(wf_id: str, kind: str, user: str) -> JobTimes:
        submit_ms = int(time.time() * 1000)
        t = time.perf_counter()
        handle = await client.start_workflow(
            CEILING_WORKFLOW,
            profile.get(kind, CeilingInput()),
            id=wf_id,
            task_queue=CEILING_QUEUE,
            search_attributes=sa(user),
            result_type=int,
        )
        rpc_ms = (time.perf_counter() - t) * 1000
        await asyncio.wait_for(handle.result(), deadline.bound(600))
        return JobTimes(wf_id, kind, "CLOSED", None, submit_ms, rpc_ms, None, None, None, None)

    async def ceiling_light(light_n: int) -> Phase:
        """One at a time, like the pipeline's light phase."""
        cpu = CpuMeter(stack.pids()).start()
        t0 = int(time.time() * 1000)
        light: list[JobTimes] = []
        with LoadSampler() as load:
            for i, kind in enumerate(kinds(light_n, cpu_fraction)):
                light.append(await one(f"ceiling-light-{i:04d}", kind, "ceiling-light@bench.local"))
                await asyncio.sleep(0.2)
        cpu.stop()
        closed = await close_times(client, "IrisSubmitter = 'ceiling-light@bench.local'", len(light))
        for j in light:
            j.closed_ms = closed.get(j.job_id)
        return Phase("ceiling light", light, t0, cpu, Counter(), load.summary(), {}, [])

    try:
        for kind in (GPU, CPU):  # warm-up
            await one(f"ceiling-warm-{tag}-{kind}", kind, "ceiling-warm@bench.local")
        light_phase_: Phase | None = None
        if light_n > 0:
            light_phase_ = await ceiling_light(light_n)
        # Burst: open loop, like the pipeline's.
        # Burst: open loop, like the pipeline's.
        cpu = CpuMeter(stack.pids()).start()
        t0 = int(time.time() * 1000)
        user = f"ceiling-{tag}@bench.local"
        starts: dict[str, tuple[str, int, float]] = {}

        async def start(wf_id: str, kind: str) -> None:
            submit_ms = int(time.time() * 1000)
            t = time.perf_counter()
            await client.start_workflow(
                CEILING_WORKFLOW,
                profile.get(kind, CeilingInput()),
                id=wf_id,
                task_queue=CEILING_QUEUE,
                search_attributes=sa(user),
            )
            starts[wf_id] = (kind, submit_ms, (time.perf_counter() - t) * 1000)

        with LoadSampler() as load:
            results = await asyncio.wait_for(
                gather_bounded(
                    (start(f"ceiling-{tag}-{i:05d}", kind) for i, kind in enumerate(kinds(n, cpu_fraction))),
                    concurrency,
                ),
                deadline.bound(600),
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise BenchError(f"{len(errors)} ceiling workflows failed to start, e.g. {errors[0]!r}")
            await wait_all_closed(client, f"IrisSubmitter = '{user}'", within=deadline.bound(1800))
        cpu.stop()
        closed = await close_times(client, f"IrisSubmitter = '{user}'", len(starts))
        burst = [
            JobTimes(wf, kind, "CLOSED", None, ms, rpc, None, None, None, None, closed.get(wf))
            for wf, (kind, ms, rpc) in starts.items()
        ]
        burst_phase = Phase(f"ceiling {tag}", burst, t0, cpu, Counter(), load.summary(), {}, [])
        return light_phase_, burst_phase
    finally:
        await asyncio.to_thread(proc.stop, 10)
        stack.extra.remove(proc)


async def load_phase(
    stack: BenchStack,
    iris: AsyncIrisClient,
    n: int,
    cpu_fraction: float,
    concurrency: int,
    deadline: Deadline,
    profile_dir: Path | None,
) -> Phase:
    user = LOAD_USER
    access = AccessLogCounter(stack.controller_logs())
    access.mark()
    spies: list[PySpy] = []
    if profile_dir is not None:
        pids = stack.pids()
        for name in ("iris worker", "controller cw-us-east-02a"):
            if name in pids:
                spy = PySpy(pids[name], profile_dir / f"{name.replace(' ', '-')}.txt")
                if spy.start():
                    spies.append(spy)
    cpu = CpuMeter(stack.pids()).start()
    t0_ms = int(time.time() * 1000)

    rpc_ms: dict[str, float] = {}
    job_kinds: dict[str, str] = {}

    async def submit(i: int, kind: str) -> None:
        # The spec (and its submit_ms) is made when the start is actually sent.
        spec = spec_for(kind, f"load-{i:05d}", user, ["true"])
        t = time.perf_counter()
        await iris.submit_spec(spec)
        rpc_ms[spec.job_id] = (time.perf_counter() - t) * 1000
        job_kinds[spec.job_id] = kind

    try:
        with LoadSampler() as load:
            # Open loop: every job is submitted as fast as ``concurrency`` starts in flight allow,
            # then the run waits for all of them.
            submitted = await asyncio.wait_for(
                gather_bounded((submit(i, k) for i, k in enumerate(kinds(n, cpu_fraction))), concurrency),
                deadline.bound(600),
            )
            errors = [r for r in submitted if isinstance(r, BaseException)]
            if errors:
                raise BenchError(f"{len(errors)} submissions failed, e.g. {errors[0]!r}")
            await wait_all_closed(stack.client, f"IrisSubmitter = '{user}'", within=deadline.bound(1800))
    finally:
        cpu.stop()
        for spy in spies:
            spy.stop()
    statuses = await results_of(stack.client, list(job_kinds))
    jobs = [JobTimes.of(job_kinds[st.job_id], st, rpc_ms[st.job_id]) for st in statuses]
    closed = await close_times(stack.client, f"IrisSubmitter = '{user}'", len(jobs))
    for j in jobs:
        j.closed_ms = closed.get(j.job_id)
    histories = await job_histories(stack.client, jobs, limit=100)
    ticks = await manager_ticks(stack, t0_ms, int(time.time() * 1000))
    return Phase("pipeline", jobs, t0_ms, cpu, access.count(), load.summary(), histories, ticks)


async def cancel_phase(
    stack: BenchStack, iris: AsyncIrisClient, n: int, deadline: Deadline
) -> dict[str, Any]:
    """``n`` running sleep jobs on the peers; half cancelled one at a time, half in a burst."""
    user = CANCEL_USER
    specs = [spec_for(GPU, f"cancel-{i:03d}", user, ["sleep", "600"]) for i in range(n)]
    owner = iris.as_user(user)
    await gather_bounded((iris.submit_spec(s) for s in specs), 16)

    async def all_running() -> bool:
        states = await asyncio.gather(*(iris.describe(s.job_id) for s in specs))
        bad = [s for s in states if s.terminal]
        if bad:
            raise BenchError(
                f"a sleep job ended before its cancel: {bad[0].job_id} {bad[0].state} {bad[0].reason}"
            )
        return all(s.state is JobState.RUNNING for s in states)

    await wait_until(all_running, within=deadline.bound(180), interval=0.5, what=f"{n} sleep jobs to run")

    async def cancel(spec: JobSpec) -> dict[str, Any]:
        t_cancel = int(time.time() * 1000)
        await owner.cancel(spec.job_id, "benchmark cancel")
        handle = iris.temporal.get_workflow_handle(spec.job_id, result_type=JobStatus)
        status: JobStatus = await asyncio.wait_for(handle.result(), deadline.bound(120))
        assert status.cluster is not None
        async with ControllerClient.for_cluster(stack.config, status.cluster) as ctl:
            remote = await ctl.status(spec.job_id)
        killed = next((e.at_ms for e in status.events if e.state is JobState.KILLED), None)
        return {
            "job_id": spec.job_id,
            "state": status.state.value,
            "remote_state": remote.state.value,
            "peer_ms": (remote.finished_ms - t_cancel) if remote.finished_ms else None,
            "home_ms": (killed - t_cancel) if killed else None,
        }

    half = n // 2
    one_at_a_time = []
    for s in specs[:half]:
        one_at_a_time.append(await cancel(s))
        await asyncio.sleep(0.2)
    burst = await asyncio.gather(*(cancel(s) for s in specs[half:]))
    return {"one_at_a_time": one_at_a_time, "burst": list(burst)}


# ---- report ------------------------------------------------------------------------------------


def _lat(jobs: Sequence[JobTimes], attr: str, kind: str | None = None) -> list[float]:
    out = []
    for j in jobs:
        if kind is not None and j.kind != kind:
            continue
        v = getattr(j, attr)
        if v is not None:
            out.append(float(v - j.submit_ms))
    return out


def _throughput(phase: Phase, attr: str) -> float:
    times: list[int] = [getattr(j, attr) for j in phase.jobs if getattr(j, attr) is not None]
    if not times:
        return float("nan")
    return len(times) / max(0.001, (max(times) - phase.t0_ms) / 1000)


def report(
    args: argparse.Namespace,
    info: dict[str, Any],
    light: Phase,
    ceiling_light: Phase,
    ceilings: tuple[Phase, Phase],
    load: Phase,
    cancels: dict[str, Any],
    profile: dict[str, CeilingInput],
    profile_dir: Path | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": info, "args": vars(args), "source": source_label()}
    print()
    print(f"machine: {info['nproc']} CPUs ({info['cpu']}), {info['mem_gib']} GiB; Python {info['python']}")
    print(f"code: {source_label()}")
    print(f"before: {info['uptime_before']}")
    print(f"after:  {info['uptime_after']}")
    print("persistence: in-memory dev server (temporal server start-dev, no --db-filename)")
    print("worker: `iris worker` as its own process; the ceiling's no-op worker too")
    if args.dynamic_config:
        print(f"server dynamic config: {', '.join(args.dynamic_config)}")
    n_gpu = sum(1 for k in kinds(args.jobs, args.cpu_fraction) if k == GPU)
    print(
        f"jobs: {args.jobs} ({n_gpu} queued h100x1 + {args.jobs - n_gpu} local CPU, command `true`), "
        f"{args.concurrency} starts in flight; peers {args.peer_slots} h100 slots each; "
        + (
            f"max {args.max_per_peer} per peer per tick"
            if args.max_per_peer
            else "no cap per peer per tick"
            if args.max_per_peer == 0
            else "the config's cap per peer per tick (default none) and handoff pace (default 50/s)"
        )
    )
    states = {p.name: dict(Counter(j.state for j in p.jobs)) for p in (light, load)}
    states["cancel (home/peer)"] = dict(
        Counter(f"{c['state']}/{c['remote_state']}" for m in cancels.values() for c in m)
    )
    print("job states: " + "; ".join(f"{name} {counts}" for name, counts in states.items()))
    out["job_states"] = states

    # Throughput.
    ceiling_a, ceiling_b = ceilings
    t_a = _throughput(ceiling_a, "closed_ms")
    t_b = _throughput(ceiling_b, "closed_ms")
    t_ceiling = (t_a + t_b) / 2
    t_closed = _throughput(load, "closed_ms")
    ratio = t_closed / t_ceiling
    rows = [
        ["pipeline → HANDED_OFF", _throughput(load, "handed_ms"), "", ""],
        ["pipeline → SUCCEEDED", _throughput(load, "succeeded_ms"), "", ""],
        ["pipeline → workflow closed", t_closed, t_ceiling, ratio],
        ["ceiling a (before the pipeline) → closed", t_a, "", ""],
        ["ceiling b (after the pipeline) → closed", t_b, "", ""],
    ]
    print("\nThroughput (jobs/s, first submit → last job reaching the state)")
    print(table(["", "jobs/s", "ceiling/s", "ratio"], rows))
    print(
        f"ratio pipeline/ceiling = {ratio:.2f} (target ≥ 0.8); against ceiling a {t_closed / t_a:.2f}, "
        f"b {t_closed / t_b:.2f}"
    )
    out["throughput"] = {
        "handed_off": _throughput(load, "handed_ms"),
        "succeeded": _throughput(load, "succeeded_ms"),
        "closed": t_closed,
        "ceiling_a": t_a,
        "ceiling_b": t_b,
        "ceiling_mean": t_ceiling,
        "ratio": ratio,
    }

    # Timeline of the burst: how many jobs had reached each point, every few seconds.
    horizon = max((j.closed_ms or 0) for j in load.jobs) - load.t0_ms
    step = max(5000, int(horizon / 12 / 1000) * 1000)
    tl_rows = []
    for t in range(step, horizon + step, step):
        cut = load.t0_ms + t

        def upto(attr: str, cut: int = cut) -> int:
            return sum(1 for j in load.jobs if (getattr(j, attr) or cut + 1) <= cut)

        tl_rows.append(
            [f"+{t / 1000:.0f}s", upto("submit_ms"), upto("placed_ms"), upto("handed_ms"), upto("closed_ms")]
        )
    print("\nBurst timeline (jobs that had reached each point)")
    print(table(["", "submitted", "placed", "handed off", "closed"], tl_rows))
    out["timeline"] = tl_rows

    # Latency.
    lat_rows: list[list[object]] = []
    lat: dict[str, dict[str, float]] = {}

    def add(label: str, values: list[float]) -> None:
        p = pcts(values)
        lat[label] = p
        lat_rows.append([label, int(p["n"]), p["p50"], p["p95"], p["p99"], p["max"]])

    add("light: submit→placed (queued GPU)", _lat(light.jobs, "placed_ms", GPU))
    add("light: submit→handed off (queued GPU)", _lat(light.jobs, "handed_ms", GPU))
    add("light: submit→handed off (local CPU)", _lat(light.jobs, "handed_ms", CPU))
    add("light: submit→handed off (all)", _lat(light.jobs, "handed_ms"))
    add("light: submit→closed (all)", _lat(light.jobs, "closed_ms"))
    add("light: ceiling start→closed (all)", _lat(ceiling_light.jobs, "closed_ms"))
    add("burst: submit RPC (start_workflow)", [j.submit_rpc_ms for j in load.jobs])
    add("burst: submit→placed (queued GPU)", _lat(load.jobs, "placed_ms", GPU))
    add("burst: submit→handed off (queued GPU)", _lat(load.jobs, "handed_ms", GPU))
    add("burst: submit→handed off (local CPU)", _lat(load.jobs, "handed_ms", CPU))
    add("burst: submit→closed (all)", _lat(load.jobs, "closed_ms"))
    add("burst: ceiling a start→closed (all)", _lat(ceiling_a.jobs, "closed_ms"))
    for mode in ("one_at_a_time", "burst"):
        label = mode.replace("_", " ")
        add(
            f"cancel ({label}) → terminated on peer",
            [c["peer_ms"] for c in cancels[mode] if c["peer_ms"] is not None],
        )
        add(
            f"cancel ({label}) → KILLED at home",
            [c["home_ms"] for c in cancels[mode] if c["home_ms"] is not None],
        )
    print("\nLatency (ms)")
    print(table(["", "n", "p50", "p95", "p99", "max"], lat_rows))
    out["latency_ms"] = lat
    out["cancel_states"] = states["cancel (home/peer)"]

    # Per-job cost.
    print("\nPer job: history (means over sampled histories) and controller requests")
    hist_rows = []
    per_job: dict[str, Any] = {}
    for phase in (light, load):
        for kind, hs in phase.histories.items():
            if not hs:
                continue
            row = {
                "events": mean(h.events for h in hs),
                "KiB": mean(h.bytes for h in hs) / 1024,
                "workflow tasks": mean(h.workflow_tasks for h in hs),
                "activities": mean(h.activity_count for h in hs),
                "local act.": mean(h.local_activities for h in hs),
                "signals": mean(h.signal_count for h in hs),
                "SA upserts": mean(h.upserts for h in hs),
                "memo upserts": mean(h.memo_upserts for h in hs),
                "round trips": mean(h.round_trips() for h in hs),
            }
            per_job[f"{phase.name} {kind}"] = row
            hist_rows.append([f"{phase.name} {kind} (n={len(hs)})", *row.values()])
    print(
        table(
            ["", "events", "KiB", "WFTs", "activities", "local", "signals", "SA upd", "memo upd", "RPCs"],
            hist_rows,
        )
    )
    for phase in (light, load):
        for kind, hs in phase.histories.items():
            acts: Counter[str] = Counter()
            sigs: Counter[str] = Counter()
            for h in hs:
                acts.update(h.activities)
                sigs.update(h.signals)
            if hs:
                a = ", ".join(f"{k} {v / len(hs):.2f}" for k, v in acts.most_common())
                s = ", ".join(f"{k} {v / len(hs):.2f}" for k, v in sigs.most_common()) or "none"
                print(f"  {phase.name} {kind}: activities/job: {a}; signals/job: {s}")
    prof = {k: v.model_dump() for k, v in profile.items()}
    print(f"  ceiling shape per kind (from the light-load histories): {prof}")
    out["history_per_job"] = per_job
    out["ceiling_profile"] = prof

    req_rows = []
    for phase in (light, load):
        n = max(1, len(phase.jobs))
        req_rows.append(
            [
                phase.name,
                *(phase.requests[k] / n for k in ("backends", "launch", "status", "logs", "terminate")),
                sum(phase.requests.values()) / n,
            ]
        )
    print("\nController requests per job (all three controllers' access logs)")
    print(table(["", "backends", "launch", "status", "logs", "terminate", "total"], req_rows))
    out["controller_requests_per_job"] = {p.name: dict(p.requests) for p in (light, load)}

    # Ticks.
    for phase in (light, load):
        if phase.ticks:
            placed = [len(t.placed) for t in phase.ticks]
            total = pcts([t.total_ms for t in phase.ticks])
            plan = pcts([t.plan_ms for t in phase.ticks])
            print(
                f"\nplacement ticks during {phase.name}: {len(phase.ticks)}; placed/tick mean "
                f"{mean(placed):.1f} max {max(placed)}; total_ms p50 {fmt(total['p50'])} "
                f"p95 {fmt(total['p95'])}; plan_ms p50 {fmt(plan['p50'])}; "
                f"queued max {max(t.queued for t in phase.ticks)}"
            )
    out["ticks"] = {
        p.name: [t.model_dump(exclude={"placed", "expired"}) | {"placed": len(t.placed)} for t in p.ticks]
        for p in (light, load)
    }

    # CPU.
    print("\nCPU seconds per process and phase [ms of CPU per job]")
    phases = (light, ceiling_light, ceiling_a, load, ceiling_b)
    names = sorted({k for p in phases for k in p.cpu.used})
    cpu_rows: list[list[object]] = [["wall seconds", *(f"{p.cpu.wall:.1f}" for p in phases)]]
    for k in names:
        cells = []
        for p in phases:
            n = max(1, len(p.jobs))
            used = p.cpu.used.get(k)
            cells.append("-" if used is None else f"{used:.1f} [{1000 * used / n:.0f}]")
        cpu_rows.append([k, *cells])
    cpu_rows.append(["load average (1 min)", *(p.load for p in phases)])
    print(table(["", *(p.name for p in phases)], cpu_rows))
    out["cpu_seconds"] = {p.name: {"wall": p.cpu.wall, **p.cpu.used, "load": p.load} for p in phases}

    if profile_dir is not None:
        out["profiles"] = {}
        for f in sorted(profile_dir.glob("*.txt")):
            everything = summarize_collapsed(f, top=20)
            mine = summarize_collapsed(f, top=25, project_only=True)
            out["profiles"][f.stem] = {"all": everything, "project": mine}
            print(f"\npy-spy {f.stem}: self time, % of samples (all code)")
            for name, share in everything["self"]:
                print(f"  {share:5.1f}%  {name}")
            print(f"py-spy {f.stem}: project code, % of samples: inclusive | deepest project frame")
            for (name, share), (name2, share2) in zip(mine["inclusive"], mine["self"], strict=False):
                print(f"  {share:5.1f}%  {name:<60} {share2:5.1f}%  {name2}")
    return out


async def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.timeout)
    info = machine()
    root = Path(tempfile.mkdtemp(prefix="iris-bench-e2e-"))
    profile_dir = (root / "profile") if args.profile else None
    if profile_dir is not None:
        profile_dir.mkdir()
    stack = BenchStack(root)
    print(f"stack in {root} ({info['uptime_before']})", flush=True)
    try:
        await stack.start(
            configure(args), task_queue=TASK_QUEUE, users=USERS, dynamic_config=args.dynamic_config
        )
        await stack.start_worker()
        iris = AsyncIrisClient(stack.client, stack.config)
        print(f"[{time.strftime('%X')}] light load: {args.light_jobs} jobs one at a time", flush=True)
        light = await light_phase(stack, iris, args.light_jobs, args.cpu_fraction, deadline)
        profile = profile_of(light.histories)
        print(f"[{time.strftime('%X')}] ceiling: {args.jobs} no-op workflows {profile}", flush=True)
        ceiling_light, ceiling_a = await ceiling_phase(
            stack, profile, args.jobs, args.light_jobs, args.cpu_fraction, args.concurrency, deadline, "a"
        )
        assert ceiling_light is not None
        print(f"[{time.strftime('%X')}] pipeline: {args.jobs} jobs", flush=True)
        load = await load_phase(
            stack, iris, args.jobs, args.cpu_fraction, args.concurrency, deadline, profile_dir
        )
        print(f"[{time.strftime('%X')}] ceiling again: {args.jobs} no-op workflows", flush=True)
        _, ceiling_b = await ceiling_phase(
            stack, profile, args.jobs, 0, args.cpu_fraction, args.concurrency, deadline, "b"
        )
        print(f"[{time.strftime('%X')}] cancel: {args.cancel_jobs} running jobs", flush=True)
        cancels = await cancel_phase(stack, iris, args.cancel_jobs, deadline)
        info["uptime_after"] = uptime_line()
        data = report(
            args, info, light, ceiling_light, (ceiling_a, ceiling_b), load, cancels, profile, profile_dir
        )
        write_json(args.out, data)
        if profile_dir is not None:
            print(f"profiles kept in {profile_dir}")
        return 0
    finally:
        await stack.stop()
        if not args.keep and profile_dir is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--jobs", type=int, default=500, help="jobs in the throughput phase (and ceiling workflows)"
    )
    p.add_argument("--light-jobs", type=int, default=50, help="jobs submitted one at a time")
    p.add_argument("--cancel-jobs", type=int, default=20, help="running jobs cancelled")
    p.add_argument("--cpu-fraction", type=float, default=0.2, help="share of local CPU jobs")
    p.add_argument("--concurrency", type=int, default=50, help="submissions in flight in the burst phases")
    p.add_argument("--peer-slots", type=int, default=256, help="h100 slots per peer backend")
    p.add_argument("--cpu-slots", type=int, default=64, help="CPU job slots per backend")
    p.add_argument(
        "--max-per-peer",
        type=int,
        default=None,
        help="placements per peer per tick (default: the config's; 0 = no cap)",
    )
    p.add_argument(
        "--dynamic-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dev server setting, e.g. system.enableActivityEagerExecution=true (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=1500, help="bound on the whole run, seconds")
    p.add_argument(
        "--profile", action="store_true", help="py-spy the worker and one controller in the pipeline phase"
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stack's temp directory")
    add_source_argument(p)
    args = parse_args(p, {"jobs": 5, "light_jobs": 2, "cancel_jobs": 2, "cpu_fraction": 0.5, "timeout": 300})
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
