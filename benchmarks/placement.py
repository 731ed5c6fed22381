"""Placement at sweep speed: N one-GPU jobs submitted at once to one peer with room for all of them.

    uv run python -m benchmarks.placement [--jobs 1000] [--source HEAD] [--out FILE.json]

Issue 31, acceptance 5 (docs/BENCHMARKS.md, "Placement at sweep speed"). On a fresh real stack
(``benchmarks/harness.py``), with the config's placement settings unless ``--max-per-peer`` or
``--handoffs-per-s`` is given:

- **one peer with room**: ``cw-us-east-02a`` gets N + 8 H100 slots; every other cluster's devices are
  taken away, so every job queues for that one peer and the placement tick is what starts them;
- **the ramp**: N ``h100×1`` jobs, each ``sh -c 'read x < GATE; exec sleep 0'`` (it blocks on a FIFO
  the benchmark holds open, so no job ends before all run), submitted through the SDK at once
  (``--concurrency`` in flight). Timed from the first submit to the moment the peer's own records
  (``controller.db``) hold all N RUNNING;
- **what it cost**: CPU seconds of each process over the ramp (per placed job), the controller's
  requests by kind (per job), and every placement tick of the ramp from the manager's histories:
  how many it placed, how long it took;
- then the gate opens, the jobs end, and the run checks that every one SUCCEEDED on the peer and
  closed at home (a placement that ran a job twice, or lost one, fails the run).

``--ceiling`` then measures the engine's own rate for the same steps on the same server: N no-op
workflows (``benchmarks/ceiling.py``) shaped like a job's history up to its launch (the sampled
histories' most common steps, cut after the last activity: the launch), submitted the same way,
timed from the first start to the last close. Placements a second over that rate is the ramp's
ratio to the engine: what the placement pipeline could reach on this machine at best.

``--profile`` py-spies the worker over the ramp (only the thread holding the GIL). Not a test:
numbers depend on the machine; ``--smoke`` is a tiny run that only shows the path works.
"""

# The snapshot switch below runs before any project module is imported; the other imports follow it.

from __future__ import annotations

import sys

from benchmarks.source import run_from_snapshot

if __name__ == "__main__":
    run_from_snapshot("benchmarks.placement", sys.argv[1:])

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.ceiling import CeilingInput
from benchmarks.e2e import GPU, ceiling_phase
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
    gather_bounded,
    machine,
    pcts,
    run_main,
    summarize_collapsed,
    table,
    uptime_line,
    write_json,
)
from benchmarks.running import USER, Gate, controller_db, fresh_jobs, read_jobs, sandboxes_for
from benchmarks.scale import manager_runs
from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, source_label
from iris.client import AsyncIrisClient, build_spec
from iris.config import FederationConfig

TASK_QUEUE = "iris-bench-sweep"  # not "...-placement": that suffix names the tick's own queue
PEER = "cw-us-east-02a"


def configure(args: argparse.Namespace, n: int, gate: Gate) -> Any:
    slots = n + 8

    def apply(cfg: FederationConfig) -> None:
        for c in cfg.clusters:
            for b in c.backends:
                if b.devices:
                    b.devices = {t: slots for t in b.devices} if c.name == PEER else {}
        sandboxes_for(cfg, gate, slots)
        if args.max_per_peer is not None:
            cfg.max_per_peer_per_tick = args.max_per_peer if args.max_per_peer > 0 else None
        if args.handoffs_per_s is not None:
            if "handoffs_per_s" not in type(cfg).model_fields:
                raise SystemExit("--handoffs-per-s: the measured revision has no such setting")
            cfg.handoffs_per_s = args.handoffs_per_s if args.handoffs_per_s > 0 else None

    return apply


async def run(args: argparse.Namespace) -> int:
    info = machine()
    n = args.jobs
    deadline = Deadline(args.timeout)
    root = Path(tempfile.mkdtemp(prefix="iris-bench-sweep-"))
    stack = BenchStack(root)
    gate = Gate()
    out: dict[str, Any] = {"jobs": n, "machine": info, "source": source_label()}
    print(f"{source_label()}; N={n}; stack in {root} ({uptime_line()})", flush=True)
    try:
        await stack.start(configure(args, n, gate), task_queue=TASK_QUEUE, users={USER: ["user"]})
        await stack.start_worker()
        iris = AsyncIrisClient(stack.client, stack.config)
        db = controller_db(stack, PEER)
        cfg = stack.config
        out["config"] = {
            "max_per_peer_per_tick": cfg.max_per_peer_per_tick,
            "handoffs_per_s": getattr(cfg, "handoffs_per_s", None),
            "tick_interval_s": cfg.tick_interval_s,
        }
        print(f"[{time.strftime('%X')}] warm-up; placement settings {out['config']}", flush=True)
        await fresh_jobs(iris, "warm", 2, deadline.bound(120), deadline)
        await asyncio.sleep(2)

        specs = [
            build_spec(gate.command(0), name=f"sweep-{i:05d}", user=USER, device_type="h100", gpu_count=1)
            for i in range(n)
        ]
        ids = {s.job_id for s in specs}

        def running_now() -> int:
            return sum(1 for job_id, state in read_jobs(db) if state == "RUNNING" and job_id in ids)

        access = AccessLogCounter(stack.controller_logs())
        access.mark()
        meter = CpuMeter(stack.pids())
        spy: PySpy | None = None
        if args.profile:
            assert stack.worker is not None and stack.worker.proc is not None
            spy = PySpy(stack.worker.proc.pid, root / "worker-ramp.txt", gil=True)
            spy = spy if spy.start() else None
        print(f"[{time.strftime('%X')}] submitting {n} jobs", flush=True)
        wall_t0_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        meter.start()
        with LoadSampler() as load:
            submitting = asyncio.ensure_future(
                gather_bounded((iris.submit_spec(s) for s in specs), args.concurrency)
            )
            curve: list[tuple[float, int]] = []
            reached_s: float | None = None
            submitted_s: float | None = None
            last_print = 0.0
            bound = time.monotonic() + deadline.bound(args.ramp_timeout)
            while time.monotonic() < bound:
                if submitted_s is None and submitting.done():
                    submitted_s = time.monotonic() - t0
                count = await asyncio.to_thread(running_now)
                t = time.monotonic() - t0
                curve.append((t, count))
                if t - last_print >= args.print_every:
                    last_print = t
                    print(f"  t={t:5.1f}s running={count}", flush=True)
                if count >= n:
                    reached_s = t
                    break
                await asyncio.sleep(args.sample_interval)
            results = await submitting
            if submitted_s is None:
                submitted_s = time.monotonic() - t0
        cpu = meter.stop()
        wall_t1_ms = int(time.time() * 1000)
        if spy is not None:
            spy.stop()
            out["profile"] = {
                "all": summarize_collapsed(root / "worker-ramp.txt", top=25),
                "project": summarize_collapsed(root / "worker-ramp.txt", top=25, project_only=True),
            }
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise BenchError(f"{len(errors)} submissions failed, e.g. {errors[0]!r}")
        requests = access.count()
        placed = curve[-1][1] if curve else 0
        print(
            f"[{time.strftime('%X')}] "
            + (f"all {n} RUNNING {reached_s:.1f}s after the first submit" if reached_s else f"{placed}/{n}")
            + f"; submitted in {submitted_s:.1f}s",
            flush=True,
        )

        # What each job's history holds once it runs (a sample, before any ends).
        sample = [s.job_id for s in specs[:: max(1, n // args.history_sample)]]
        stats = [
            h
            for h in await gather_bounded((fetch_stats(stack.client, j) for j in sample), 8)
            if isinstance(h, HistoryStats)
        ]

        # The jobs end; each must have run once and closed at home.
        gate.release()
        query = f"IrisSubmitter = '{USER}' AND ExecutionStatus = 'Running'"
        drain_end = time.monotonic() + deadline.bound(args.drain_timeout)
        while time.monotonic() < drain_end:
            if not (await stack.client.count_workflows(query)).count:
                break
            await asyncio.sleep(1)
        peer_states = Counter(state for job_id, state in read_jobs(db) if job_id in ids)
        open_left = (await stack.client.count_workflows(query)).count
        _, ticks = await manager_runs(stack)
        ramp_ticks = [t for at, t in ticks if wall_t0_ms <= at <= wall_t1_ms]
        placed_per_tick = [len(t.placed) for t in ramp_ticks]
        out.update(
            {
                "submitted_s": submitted_s,
                "all_running_s": reached_s,
                "running_at_end": placed,
                "placements_per_s": (placed / reached_s) if reached_s else None,
                "curve": curve,
                "cpu_s": cpu,
                "cpu_ms_per_job": {k: 1000 * v / max(1, placed) for k, v in cpu.items()},
                "wall_s": meter.wall,
                "requests": dict(requests),
                "requests_per_job": {k: v / max(1, placed) for k, v in requests.items()},
                "ticks": {
                    "count": len(ramp_ticks),
                    "placed": pcts([float(x) for x in placed_per_tick]) if placed_per_tick else {},
                    "placed_total": sum(placed_per_tick),
                    "total_ms": pcts([t.total_ms for t in ramp_ticks]) if ramp_ticks else {},
                    "plan_ms": pcts([t.plan_ms for t in ramp_ticks]) if ramp_ticks else {},
                    "queued_max": max((t.queued for t in ramp_ticks), default=0),
                },
                "history_to_running": history_summary(stats),
                "peer_states": dict(peer_states),
                "open_after_drain": open_left,
                "load": load.summary(),
            }
        )
        if args.ceiling:
            out["ceiling"] = c = await ceiling_rate(stack, stats, n, args.concurrency, deadline)
            rate = out["placements_per_s"]
            c["ratio"] = rate / c["per_s"] if rate else None
        report(out)
        write_json(args.out, out)
        ok = reached_s is not None and peer_states.get("SUCCEEDED", 0) == n and open_left == 0
        if not ok:
            print("FAILED: not every job ran once and closed (see peer states above)", flush=True)
        return 0 if ok else 1
    finally:
        await stack.stop()
        gate.reap_leftovers()
        gate.remove()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def launch_steps(stats: list[HistoryStats]) -> str:
    """A job's steps up to its launch: the sampled histories' most common step sequence, cut after
    its last activity (the launch; a job sampled while RUNNING has no activity after it)."""
    if not stats:
        raise BenchError("no job history was sampled: the ceiling has no shape to copy")
    steps, _ = Counter(h.steps for h in stats).most_common(1)[0]
    last = steps.rfind("a")
    if last < 0:
        raise BenchError(f"the sampled jobs ran no activity before RUNNING (steps {steps!r})")
    return steps[: last + 1]


async def ceiling_rate(
    stack: BenchStack, stats: list[HistoryStats], n: int, concurrency: int, deadline: Deadline
) -> dict[str, Any]:
    """The engine's rate for a job's steps up to its launch, on the same server (its own no-op
    worker process; the iris worker stays up, idle)."""
    steps = launch_steps(stats)
    print(f"[{time.strftime('%X')}] ceiling: {n} no-op workflows of steps {steps!r}", flush=True)
    _, phase = await ceiling_phase(
        stack, {GPU: CeilingInput(steps=steps)}, n, 0, 0.0, concurrency, deadline, "placement"
    )
    closed = [j.closed_ms for j in phase.jobs if j.closed_ms is not None]
    if len(closed) < n:
        raise BenchError(f"only {len(closed)} of {n} ceiling workflows closed")
    span_s = max(0.001, (max(closed) - phase.t0_ms) / 1000)
    used = phase.cpu.used
    return {
        "steps": steps,
        "all_closed_s": span_s,
        "per_s": n / span_s,
        "cpu_ms_per_job": {k: 1000 * v / n for k, v in used.items()},
        "load": phase.load,
    }


def history_summary(stats: list[HistoryStats]) -> dict[str, Any]:
    """Per job, the mean of each count over the sampled histories (up to RUNNING)."""
    k = max(1, len(stats))
    activities: Counter[str] = Counter()
    signals: Counter[str] = Counter()
    for h in stats:
        activities.update(h.activities)
        signals.update(h.signals)
    return {
        "sampled": len(stats),
        "events": sum(h.events for h in stats) / k,
        "kib": sum(h.bytes for h in stats) / k / 1024,
        "workflow_tasks": sum(h.workflow_tasks for h in stats) / k,
        "local_activities": sum(h.local_activities for h in stats) / k,
        "upserts": sum(h.upserts for h in stats) / k,
        "memo_upserts": sum(h.memo_upserts for h in stats) / k,
        "activities": {a: c / k for a, c in sorted(activities.items())},
        "signals": {a: c / k for a, c in sorted(signals.items())},
    }


def report(r: dict[str, Any]) -> None:
    n = r["jobs"]
    print(f"\n=== {n} one-GPU jobs submitted at once to {PEER} (room for all) ===")
    print(f"placement settings: {r['config']}")
    if r["all_running_s"] is not None:
        print(
            f"all {n} RUNNING {r['all_running_s']:.1f}s after the first submit "
            f"({r['placements_per_s']:.1f} placements a second); submitted in {r['submitted_s']:.1f}s"
        )
    else:
        print(f"not all RUNNING within the bound: {r['running_at_end']} of {n}")
    t = r["ticks"]
    if t["count"]:
        print(
            f"placement ticks in the ramp: {t['count']}, placed per tick p50 {t['placed']['p50']:.0f}"
            f" / max {t['placed']['max']:.0f} (total {t['placed_total']}); tick ms p50"
            f" {t['total_ms']['p50']:.0f} / p95 {t['total_ms']['p95']:.0f}; plan ms p50"
            f" {t['plan_ms']['p50']:.1f}; queue max {t['queued_max']}"
        )
    rows = [(k, f"{r['cpu_s'][k]:.1f}", f"{r['cpu_ms_per_job'][k]:.1f}") for k in r["cpu_s"]]
    print(table(["process", "CPU s over the ramp", "CPU ms per placed job"], rows))
    per = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["requests_per_job"].items()))
    print(f"controller requests per job over the ramp: {per}")
    h = r["history_to_running"]
    print(
        f"history per job up to RUNNING (n={h['sampled']}): {h['events']:.1f} events, {h['kib']:.1f} KiB, "
        f"{h['workflow_tasks']:.1f} workflow tasks, {h['local_activities']:.1f} local activities, "
        f"{h['upserts']:.1f} + {h['memo_upserts']:.1f} search-attribute + memo upserts"
    )
    print("  activities: " + ", ".join(f"{a} {c:.2f}" for a, c in h["activities"].items()))
    print("  signals: " + ", ".join(f"{a} {c:.2f}" for a, c in h["signals"].items()))
    print(f"after the drain: peer states {r['peer_states']}; workflows still open {r['open_after_drain']}")
    print(f"load over the ramp: {r['load']}")
    c = r.get("ceiling")
    if c:
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in c["cpu_ms_per_job"].items() if v >= 0.05)
        ratio = f"{c['ratio']:.2f}" if c["ratio"] is not None else "n/a (the ramp did not finish)"
        print(
            f"the engine's ceiling for the steps up to the launch ({c['steps']!r}): {n} no-op workflows"
            f" all closed after {c['all_closed_s']:.1f}s, {c['per_s']:.1f} a second; placements/ceiling"
            f" = {ratio}; CPU ms per workflow: {cpu}; load {c['load']}"
        )
    prof = r.get("profile")
    if prof:
        print("worker profile over the ramp (GIL holder), project frames, inclusive share:")
        for name, share in prof["project"]["inclusive"][:20]:
            print(f"  {share:5.1f}%  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000, help="jobs submitted at once")
    p.add_argument("--concurrency", type=int, default=50, help="submissions in flight")
    p.add_argument("--max-per-peer", type=int, default=None, help="placements per peer per tick (0 = no cap)")
    p.add_argument(
        "--handoffs-per-s", type=float, default=None, help="handoffs a second per peer (0 = no limit)"
    )
    p.add_argument("--ramp-timeout", type=float, default=600, help="bound on waiting for all N to run")
    p.add_argument("--drain-timeout", type=float, default=300, help="bound on waiting for the jobs to close")
    p.add_argument("--sample-interval", type=float, default=0.5, help="seconds between reads of the peer")
    p.add_argument("--print-every", type=float, default=5, help="seconds between progress lines")
    p.add_argument("--history-sample", type=int, default=20, help="job histories read once all run")
    p.add_argument("--timeout", type=float, default=1800, help="bound on the whole run, seconds")
    p.add_argument("--profile", action="store_true", help="py-spy the worker over the ramp (GIL holder)")
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="then time N no-op workflows of a job's steps up to its launch on the same server",
    )
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stack's temp directory")
    add_source_argument(p)
    smoke = {
        "jobs": 6,
        "history_sample": 3,
        "ramp_timeout": 120,
        "drain_timeout": 120,
        "print_every": 2,
        "timeout": 300,
    }
    args = parse_args(p, smoke)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
