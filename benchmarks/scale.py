"""Scale benchmark: a large queue waiting on a full federation.

    uv run python -m benchmarks.scale [--jobs 3000] [--settle 60]

Starts its own real stack (as ``benchmarks/e2e.py``: in-memory dev server, emulators, controllers
as processes, ``iris worker`` as its own process so its RSS is its own), fills every peer with one
``sleep`` job holding all its H100s, then submits ``--jobs`` H100 jobs that can only wait in the
federation queue. While they arrive, and for ``--settle`` seconds after, it samples the worker's
RSS, the placement manager's ``last_tick`` (queue length, plan_ms, total_ms) and the load. At the
end it reads every placement tick from the manager's histories (all its runs: it continues as new
every ``ticks_per_run`` ticks) and fetches a sample of job histories, to show per-job and
per-manager-run history sizes and that continue-as-new keeps the manager's history bounded.

On a 2-core machine the jobs reach the queue at about 12 per second (each runs its classification
and enqueue first; measured on cf45f4f), so 10k jobs take about 14 minutes plus the settle; the
default is smaller so a run finishes in about 6 minutes. Not a test. See docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType

from activities.placement import TickOutcome
from benchmarks.harness import (
    BenchError,
    BenchStack,
    CpuMeter,
    Deadline,
    HistoryStats,
    LoadSampler,
    PySpy,
    child_pid,
    fetch_stats,
    gather_bounded,
    machine,
    mean,
    pcts,
    rss_mib,
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
from iris.contract import SA_STATE, manager_workflow_id
from iris.jobs import JobState

TASK_QUEUE = "iris-bench-scale"
FILLER_USER = "bench-filler@bench.local"
SCALE_USER = "bench-scale@bench.local"
PEER_SLOTS = 8


def configure(cfg: FederationConfig) -> None:
    """The demo topology with 8 H100s per peer (one filler job takes them all)."""
    for c in cfg.clusters:
        for b in c.backends:
            if b.devices:
                b.devices = {t: PEER_SLOTS for t in b.devices}


@dataclass
class Sample:
    t_s: float
    submitted: int
    worker_rss_mib: float
    worker_hwm_mib: float
    server_rss_mib: float
    queued: int
    plan_ms: float
    total_ms: float
    load1: float


@dataclass
class ManagerRun:
    run_id: str
    status: str
    events: int
    kib: float
    ticks: int
    first_ms: int
    last_ms: int


async def manager_runs(stack: BenchStack) -> tuple[list[ManagerRun], list[tuple[int, TickOutcome]]]:
    """Every run of the placement manager, oldest first, and every tick (completion time, outcome)."""
    mid = manager_workflow_id(stack.config.temporal.task_queue)
    runs: list[ManagerRun] = []
    ticks: list[tuple[int, TickOutcome]] = []
    async for wf in stack.client.list_workflows(f"WorkflowId = '{mid}'"):
        history = await stack.client.get_workflow_handle(mid, run_id=wf.run_id).fetch_history()
        n_ticks = 0
        size = 0
        for e in history.events:
            size += e.ByteSize()
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                payloads = e.activity_task_completed_event_attributes.result.payloads
                if payloads:
                    (tick,) = await stack.client.data_converter.decode(payloads, [TickOutcome])
                    ticks.append((e.event_time.ToMilliseconds(), tick))
                    n_ticks += 1
        events = history.events
        runs.append(
            ManagerRun(
                run_id=wf.run_id,
                status=wf.status.name if wf.status is not None else "?",
                events=len(events),
                kib=size / 1024,
                ticks=n_ticks,
                first_ms=events[0].event_time.ToMilliseconds() if events else 0,
                last_ms=events[-1].event_time.ToMilliseconds() if events else 0,
            )
        )
    runs.sort(key=lambda r: r.first_ms)
    ticks.sort(key=lambda t: t[0])
    return runs, ticks


async def run(args: argparse.Namespace) -> int:
    deadline = Deadline(args.timeout)
    info = machine()
    root = Path(tempfile.mkdtemp(prefix="iris-bench-scale-"))
    stack = BenchStack(root)
    print(f"stack in {root} ({info['uptime_before']})", flush=True)
    try:
        # Submissions are signed by their user (docs/DESIGN.md, "User → home").
        users = {FILLER_USER: ["user"], SCALE_USER: ["user"]}
        await stack.start(configure, task_queue=TASK_QUEUE, users=users)
        worker = await stack.start_worker()
        assert worker.proc is not None
        wpid = worker.proc.pid
        spid = child_pid(os.getpid(), "temporal")
        iris = AsyncIrisClient(stack.client, stack.config)

        # Fill every peer: one job holding all its H100s.
        peers = [c.name for c in stack.config.clusters if any(b.devices for b in c.backends)]
        fillers = [
            build_spec(
                ["sleep", "3600"],
                name=f"filler-{p}",
                user=FILLER_USER,
                device_type="h100",
                gpu_count=PEER_SLOTS,
                target_cluster=p,
            )
            for p in peers
        ]
        for spec in fillers:
            await iris.submit_spec(spec)

        async def filled() -> bool:
            states = [(await iris.describe(s.job_id)).state for s in fillers]
            return all(s is JobState.RUNNING for s in states)

        await wait_until(filled, within=deadline.bound(120), interval=0.5, what="the fillers to run")
        print(f"[{time.strftime('%X')}] peers full; submitting {args.jobs} queued jobs", flush=True)

        samples: list[Sample] = []
        user = SCALE_USER
        counts = {"submitted": 0, "queued": 0}
        t0 = time.monotonic()
        t0_ms = int(time.time() * 1000)

        async def count_queued() -> int:
            """Jobs whose workflow has reached QUEUED_HANDOFF (visibility; no query to the worker)."""
            resp = await stack.client.count_workflows(
                f"IrisSubmitter = '{user}' AND IrisState = 'QUEUED_HANDOFF'"
            )
            counts["queued"] = resp.count
            return resp.count

        async def sample() -> None:
            rss, hwm = rss_mib(wpid)
            srss = rss_mib(spid)[0] if spid else float("nan")
            tick: TickOutcome | None = None
            with contextlib.suppress(Exception):  # a busy worker answers queries late
                tick = await stack.manager_tick()
            with contextlib.suppress(Exception):
                await count_queued()
            s = Sample(
                t_s=time.monotonic() - t0,
                submitted=counts["submitted"],
                worker_rss_mib=rss,
                worker_hwm_mib=hwm,
                server_rss_mib=srss,
                queued=counts["queued"],
                plan_ms=tick.plan_ms if tick else float("nan"),
                total_ms=tick.total_ms if tick else float("nan"),
                load1=os.getloadavg()[0],
            )
            samples.append(s)
            print(
                f"  t={s.t_s:5.0f}s submitted={s.submitted:6d} queued={s.queued:6d} "
                f"worker RSS={s.worker_rss_mib:6.0f} MiB server RSS={s.server_rss_mib:6.0f} MiB "
                f"last tick total={s.total_ms:7.1f} ms plan={s.plan_ms:6.1f} ms load={s.load1:.2f}",
                flush=True,
            )

        async def sampler() -> None:
            while True:
                await sample()
                await asyncio.sleep(args.sample_interval)

        async def submit(i: int) -> None:
            spec = build_spec(["true"], name=f"q-{i:06d}", user=user, device_type="h100", gpu_count=8)
            await iris.submit_spec(spec)
            counts["submitted"] += 1

        cpu = CpuMeter(stack.pids()).start()
        sampler_task = asyncio.create_task(sampler())
        budget_end = time.monotonic() + deadline.bound(args.budget)
        try:
            with LoadSampler() as load:
                # Paced admission: at most --backlog jobs submitted but not yet queued, so the worker
                # is measured working through a steady stream, not a 10k-task pile (which would
                # also starve the queries this benchmark samples with).
                nxt = 0
                while nxt < args.jobs and time.monotonic() < budget_end:
                    backlog = counts["submitted"] - await count_queued()
                    room = min(args.backlog - backlog, args.jobs - nxt)
                    if room <= 0:
                        await asyncio.sleep(0.5)
                        continue
                    results = await gather_bounded(
                        (submit(k) for k in range(nxt, nxt + room)), args.concurrency
                    )
                    errors = [r for r in results if isinstance(r, BaseException)]
                    if errors:
                        raise BenchError(f"{len(errors)} submissions failed, e.g. {errors[0]!r}")
                    nxt += room
                submit_s = time.monotonic() - t0
                print(
                    f"[{time.strftime('%X')}] submitted {counts['submitted']} in {submit_s:.0f}s; "
                    f"waiting for the queue",
                    flush=True,
                )

                # Every submitted job in the queue, within the budget (a minute's grace).
                progress = {"queued": -1, "since": time.monotonic()}

                async def all_queued() -> bool:
                    queued = await count_queued()
                    if queued != progress["queued"]:
                        progress["queued"], progress["since"] = queued, time.monotonic()
                    elif time.monotonic() - progress["since"] > 60:
                        print(f"  the queue stopped growing at {queued}; the job states below say why")
                        return True
                    return queued >= counts["submitted"]

                with contextlib.suppress(BenchError):
                    await wait_until(
                        all_queued,
                        within=max(1.0, budget_end + 60 - time.monotonic()),
                        interval=1.0,
                        what="the submitted jobs to be queued",
                    )
                # When the queue reached its final length (not when this wait gave up).
                queued_s = progress["since"] - t0
                print(
                    f"[{time.strftime('%X')}] {counts['queued']} queued after {queued_s:.0f}s; "
                    f"settling {args.settle:.0f}s",
                    flush=True,
                )
                spy: PySpy | None = None
                if args.profile:
                    spy = PySpy(wpid, root / "worker-settle.txt")
                    if not spy.start():
                        spy = None
                try:
                    await asyncio.sleep(deadline.bound(args.settle))
                finally:
                    if spy is not None:
                        spy.stop()
                        info["profile"] = {
                            "all": summarize_collapsed(spy.out, top=20),
                            "project": summarize_collapsed(spy.out, top=25, project_only=True),
                        }
        finally:
            sampler_task.cancel()
            cpu.stop()
        await sample()
        info["uptime_after"] = uptime_line()

        states: dict[str, int] = {}
        async for wf in stack.client.list_workflows(f"IrisSubmitter = '{SCALE_USER}'"):
            st = wf.typed_search_attributes.get(SA_STATE) or "?"
            key = st if wf.status is None or wf.status.name == "RUNNING" else f"{st} ({wf.status.name})"
            states[key] = states.get(key, 0) + 1
        print(f"job states: {states}", flush=True)
        info["job_states"] = states
        runs, ticks = await manager_runs(stack)
        n_sub = counts["submitted"]
        sample_ids = [f"bench-scale/q-{i:06d}" for i in range(0, n_sub, max(1, n_sub // args.history_sample))]
        stats = [
            s
            for s in await gather_bounded((fetch_stats(stack.client, j) for j in sample_ids), 16)
            if isinstance(s, HistoryStats)
        ]
        data = report(
            args, info, samples, runs, ticks, stats, cpu, load.summary(), submit_s, queued_s, t0_ms, counts
        )
        write_json(args.out, data)
        return 0
    finally:
        await stack.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report(
    args: argparse.Namespace,
    info: dict[str, Any],
    samples: list[Sample],
    runs: list[ManagerRun],
    ticks: list[tuple[int, TickOutcome]],
    stats: list[HistoryStats],
    cpu: CpuMeter,
    load: str,
    submit_s: float,
    queued_s: float,
    t0_ms: int,
    counts: dict[str, int],
) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": info, "args": vars(args), "source": source_label()}
    print()
    print(f"machine: {info['nproc']} CPUs ({info['cpu']}), {info['mem_gib']} GiB; Python {info['python']}")
    print(f"code: {source_label()}")
    print(f"before: {info['uptime_before']}")
    print(f"after:  {info['uptime_after']}")
    print("persistence: in-memory dev server; worker: `iris worker` as its own process (default settings)")
    n = counts["submitted"]
    print(
        f"jobs: {n} of {args.jobs} h100x8 jobs submitted on a full federation (each peer: {PEER_SLOTS} H100 "
        f"held by a sleep job), at most {args.backlog} not yet queued at a time; {counts['queued']} queued "
        f"after {queued_s:.0f}s ({counts['queued'] / queued_s:.1f} jobs/s reach the queue); settled "
        f"{args.settle:.0f}s; load {load}"
    )
    out["submitted"] = n
    out["queued"] = counts["queued"]
    out["queued_after_s"] = queued_s

    rss = [s.worker_rss_mib for s in samples]
    hwm = max(s.worker_hwm_mib for s in samples)
    print("\nWorker memory")
    print(
        table(
            ["", "MiB"],
            [
                ["worker RSS at start of submissions", rss[0]],
                ["worker RSS at the end", rss[-1]],
                ["worker RSS max sampled", max(rss)],
                ["worker peak RSS (VmHWM)", hwm],
                ["dev server RSS at the end", samples[-1].server_rss_mib],
            ],
        )
    )
    out["worker_rss_mib"] = {"start": rss[0], "end": rss[-1], "max": max(rss), "hwm": hwm}

    # Tick time against queue length.
    buckets: dict[int, list[TickOutcome]] = {}
    step = max(500, (n // 5 // 500) * 500)
    for at, tick in ticks:
        if at < t0_ms:
            continue
        buckets.setdefault(tick.queued // step, []).append(tick)
    rows = []
    for b in sorted(buckets):
        ts = buckets[b]
        tot = pcts([t.total_ms for t in ts])
        plan = pcts([t.plan_ms for t in ts])
        rows.append(
            [
                f"{b * step}–{(b + 1) * step - 1}",
                len(ts),
                plan["p50"],
                plan["p95"],
                tot["p50"],
                tot["p95"],
                mean(t.explained for t in ts),
            ]
        )
    print("\nPlacement ticks by queue length (from the manager's histories)")
    print(
        table(["queued", "ticks", "plan p50", "plan p95", "total p50", "total p95", "explain sig/tick"], rows)
    )
    settled = [t for at, t in ticks if t.queued >= counts["queued"] > 0]
    if settled:
        tot = pcts([t.total_ms for t in settled])
        plan = pcts([t.plan_ms for t in settled])
        print(
            f"full queue ({counts['queued']}): {len(settled)} ticks, plan_ms p50 {plan['p50']:.1f} "
            f"p95 {plan['p95']:.1f}; total_ms p50 {tot['p50']:.0f} p95 {tot['p95']:.0f}"
        )
        out["tick_full_queue_ms"] = {"plan": plan, "total": tot, "ticks": len(settled)}
    out["ticks_by_queue"] = rows

    print("\nPlacement manager runs (continue-as-new every ticks_per_run ticks)")
    run_rows = [
        [r.run_id[:8], r.status, r.ticks, r.events, r.kib, (r.last_ms - r.first_ms) / 1000] for r in runs
    ]
    print(table(["run", "status", "ticks", "events", "KiB", "seconds"], run_rows))
    out["manager_runs"] = [r.__dict__ for r in runs]

    print("\nPer queued job (sampled histories)")
    if stats:
        print(
            table(
                ["", "mean", "max"],
                [
                    ["events", mean(s.events for s in stats), max(s.events for s in stats)],
                    ["KiB", mean(s.bytes for s in stats) / 1024, max(s.bytes for s in stats) / 1024],
                    [
                        "workflow tasks",
                        mean(s.workflow_tasks for s in stats),
                        max(s.workflow_tasks for s in stats),
                    ],
                    [
                        "activities",
                        mean(s.activity_count for s in stats),
                        max(s.activity_count for s in stats),
                    ],
                    ["signals", mean(s.signal_count for s in stats), max(s.signal_count for s in stats)],
                ],
            )
        )
        out["job_history"] = {
            "n": len(stats),
            "events_mean": mean(s.events for s in stats),
            "kib_mean": mean(s.bytes for s in stats) / 1024,
            "signals_mean": mean(s.signal_count for s in stats),
        }

    print("\nCPU seconds during submission + settle")
    n = max(1, n)
    print(table(["process", "CPU s", "ms/job"], [[k, v, 1000 * v / n] for k, v in sorted(cpu.used.items())]))
    out["cpu_seconds"] = cpu.used
    out["samples"] = [s.__dict__ for s in samples]
    prof = info.get("profile")
    if prof:
        print("\npy-spy of the worker while the full queue settles: project code, % of samples")
        print("  inclusive                                                   | deepest project frame")
        for (name, share), (name2, share2) in zip(
            prof["project"]["inclusive"], prof["project"]["self"], strict=False
        ):
            print(f"  {share:5.1f}%  {name:<55} {share2:5.1f}%  {name2}")
        print("py-spy: self time, all code")
        for name, share in prof["all"]["self"]:
            print(f"  {share:5.1f}%  {name}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=3000, help="queued jobs (see docs/BENCHMARKS.md for 10k)")
    p.add_argument("--concurrency", type=int, default=50, help="submissions in flight")
    p.add_argument("--backlog", type=int, default=300, help="jobs submitted but not yet queued, at most")
    p.add_argument(
        "--budget",
        type=float,
        default=540,
        help="seconds for submitting and queueing; what is queued by then counts",
    )
    p.add_argument(
        "--settle", type=float, default=60, help="seconds to watch the full queue after submitting"
    )
    p.add_argument("--sample-interval", type=float, default=10, help="seconds between samples")
    p.add_argument("--history-sample", type=int, default=50, help="job histories fetched")
    p.add_argument("--timeout", type=float, default=1800, help="bound on the whole run, seconds")
    p.add_argument("--profile", action="store_true", help="py-spy the worker while the full queue settles")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stack's temp directory")
    add_source_argument(p)
    args = parse_args(p, {"jobs": 10, "settle": 3, "sample_interval": 1, "history_sample": 5, "timeout": 300})
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
