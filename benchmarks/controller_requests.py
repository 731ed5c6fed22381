"""What one controller request costs as the store fills with finished jobs (issue 17, "Controller
efficiency"); and what one ``StateStore.save`` costs the event loop.

For each ``--jobs`` size (default ``0,20000``): a fresh state directory whose ``controller.db``
already holds that many finished jobs (written with the measured code's ``StateStore.save``, each
save timed), a real ``python -m iris.controller`` process on a free loopback port (one process
backend, no auth), then ``--requests`` sequential requests per route, each measured as wall time at
the client and as the controller process's CPU time (utime + stime from /proc) divided by the
number of requests:

- ``GET /v1/backends`` (the capacity report every home reads every tick),
- ``GET /v1/jobs/{id}`` (a random finished job),
- ``GET /v1/changes?since=CURSOR`` (the current cursor: the steady-state poll of a peer's poller),
- ``GET /v1/jobs?limit=100`` (the first page of a resync),
- ``GET /v1/health`` (the floor: no executor work at all).

A route whose cost does not depend on the number of finished jobs shows the same numbers in every
column.

``--finishing N`` (e.g. 2000) then measures the write-through store under load: N ``sleep`` jobs
on a CPU backend with N slots, all running at once, each ending at a whole second spread evenly
over one minute. Sampled every second: saves per second (every save takes the next change-feed
version, read from the cursor of ``GET /v1/jobs?limit=1``), the controller's CPU, and the latency
of ``GET /v1/health`` (an event-loop stall shows there). ``--bystanders K`` keeps K idle processes
of another run id on the host meanwhile, as another peer's running jobs would be: each is one more
process a look through /proc for an ended run's leftovers reads.

Runs on a frozen copy of ``--source`` (default HEAD), like ``e2e`` (``benchmarks/source.py``):
compare ``--source <old-rev>`` with ``--source HEAD``. Not a test. Results: docs/DESIGN.md
("Controller costs").
"""

# The snapshot switch below runs before any project module is imported; the other imports follow it.

from __future__ import annotations

import sys

from benchmarks.source import run_from_snapshot

if __name__ == "__main__":
    run_from_snapshot("benchmarks.controller_requests", sys.argv[1:])

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import CLK_TCK, machine, percentile, table, write_json
from benchmarks.smoke import parse_args
from benchmarks.source import cleanup_snapshot, source_label
from iris.controller.models import ControllerJobState, LaunchRequest
from iris.controller.state import JobRecord, StateStore, now_ms
from iris.devstack import free_port
from iris.policy.models import Band, DeviceRequest

ROUTES = ("health", "backends", "job", "changes", "jobs_page")


GPU_BACKEND = """[[clusters.backends]]
id = "gpu"
attributes = {{ "device-type" = ["gpu"], "device-variant" = ["h100"] }}
devices = {{ h100 = 16 }}
cpu_slots = 4
"""

CPU_BACKEND = """[[clusters.backends]]
id = "cpu"
attributes = {{ "device-type" = ["cpu"] }}
cpu_slots = {slots}
"""


def _config(path: Path, port: int, backend: str) -> None:
    """A federation of an empty home and one peer on ``port`` with ``backend`` (a TOML table)."""
    run_as = str(os.geteuid())
    path.write_text(
        f"""home = "home"
[[clusters]]
name = "home"
port = {free_port()}
backends = []
run_as = "{run_as}"

[[clusters]]
name = "peer"
port = {port}
run_as = "{run_as}"

{backend}"""
    )


def _fill(state_dir: Path, n: int) -> tuple[list[str], list[float]]:
    """``n`` finished jobs in a fresh store; their ids and each save's duration (µs)."""
    store = StateStore(state_dir)
    ids: list[str] = []
    saves: list[float] = []
    try:
        now = now_ms()
        for i in range(n):
            req = LaunchRequest(
                job_id=f"bench/finished-{i}",
                command=["python", "-c", "print('hello')"],
                env={"A": "1"},
                device=DeviceRequest(type="gpu", variant="h100", count=1),
                band=Band.BATCH,
                user="alice@example.com",
                requester="home",
                nonce="n1",
                backend_id="gpu",
            )
            job = JobRecord.new(req, seq=i + 1, run_id=f"{i:032x}", attempts=1)
            job.state = ControllerJobState.SUCCEEDED
            job.exit_code = 0
            job.started_ms = job.finished_ms = now
            for task in job.tasks:
                task.state = ControllerJobState.SUCCEEDED
                task.exit_code = 0
            t0 = time.perf_counter()
            store.save(job)
            saves.append((time.perf_counter() - t0) * 1e6)
            ids.append(job.job_id)
    finally:
        store.close()
    return ids, saves


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _start(cfg: Path, state_dir: Path, port: int) -> tuple[subprocess.Popen[bytes], float]:
    log = (state_dir.parent / "controller.log").open("ab")
    started = time.monotonic()
    args = ["--config", str(cfg), "--cluster", "peer", "--state-dir", str(state_dir), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "iris.controller", *args, "--log-level", "WARNING"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = started + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"controller exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                return proc, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("controller not ready")


def _measure(client: httpx.Client, pid: int, path: str, n: int) -> dict[str, float]:
    for _ in range(min(20, n)):  # warm-up
        client.get(path).raise_for_status()
    walls: list[float] = []
    cpu0 = _cpu_s(pid)
    for _ in range(n):
        t0 = time.perf_counter()
        resp = client.get(path)
        walls.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()
    cpu = _cpu_s(pid) - cpu0
    return {
        "p50_ms": percentile(walls, 50),
        "p99_ms": percentile(walls, 99),
        "cpu_ms_per_request": cpu * 1000 / n,
    }


def run_size(n_jobs: int, requests: int, workdir: Path) -> dict[str, Any]:
    state_dir = workdir / f"state-{n_jobs}"
    ids, saves = _fill(state_dir, n_jobs)
    port = free_port()
    cfg = workdir / f"clusters-{n_jobs}.toml"
    _config(cfg, port, GPU_BACKEND.format())
    proc, ready_s = _start(cfg, state_dir, port)
    out: dict[str, Any] = {"jobs": n_jobs, "ready_s": ready_s}
    if saves:
        out["save_us"] = {
            "p50": percentile(saves, 50),
            "p99": percentile(saves, 99),
            "max": max(saves),
        }
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            page = client.get("/v1/jobs", params={"limit": 1}).json()
            cursor = page["cursor"]
            rng = random.Random(17)
            job_path = f"/v1/jobs/{rng.choice(ids)}" if ids else "/v1/jobs/bench/none"
            paths = {
                "health": "/v1/health",
                "backends": "/v1/backends",
                "job": job_path,
                "changes": f"/v1/changes?since={cursor}",
                "jobs_page": "/v1/jobs?limit=100",
            }
            if not ids:
                del paths["job"]
            out["routes"] = {name: _measure(client, proc.pid, p, requests) for name, p in paths.items()}
            out["rss_mib"] = int(Path(f"/proc/{proc.pid}/statm").read_text().split()[1]) * 4096 / 2**20
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def _bystanders(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` idle processes carrying a run id of their own, as another controller's jobs on the same
    host would: each is a process a look through /proc for leftovers reads."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "IRIS_RUN_ID": "bench-bystander"}
    return [
        subprocess.Popen(["sleep", "3600"], env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]


async def _finishing(
    n: int, workdir: Path, window_s: int = 60, lead_s: int = 30, bystanders: int = 0
) -> dict[str, Any]:
    state_dir = workdir / "state-finishing"
    port = free_port()
    cfg = workdir / "clusters-finishing.toml"
    _config(cfg, port, CPU_BACKEND.format(slots=n))
    others = _bystanders(bystanders)
    proc, _ = _start(cfg, state_dir, port)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            # Every job ends at a whole second of [end0, end0 + window_s): sh execs sleep for the rest.
            # The first end comes ``lead_s`` (and 1 s per 25 jobs) after now: time to launch them all.
            end0 = int(time.time()) + lead_s + n // 25
            sem = asyncio.Semaphore(16)
            launched_at = time.monotonic()

            ends: dict[str, int] = {}

            async def launch(i: int) -> None:
                end = end0 + i * window_s // n
                ends[f"bench/finishing-{i}"] = end
                body = {
                    "job_id": f"bench/finishing-{i}",
                    "command": ["/bin/sh", "-c", f"exec sleep $(( {end} - $(date +%s) ))"],
                    "user": "alice@example.com",
                    "requester": "home",
                    "nonce": "n1",
                    "backend_id": "cpu",
                }
                async with sem:
                    (await client.post("/v1/jobs", json=body)).raise_for_status()

            await asyncio.gather(*(launch(i) for i in range(n)))
            launch_s = time.monotonic() - launched_at
            late = max(0.0, time.time() - end0)
            samples: list[dict[str, float]] = []
            deadline = end0 + window_s + 120
            while time.time() < deadline:
                t0 = time.perf_counter()
                await client.get("/v1/health")
                health_ms = (time.perf_counter() - t0) * 1000
                page = (await client.get("/v1/jobs", params={"limit": 1})).json()
                version = int(page["cursor"].rsplit("-", 1)[1])
                samples.append(
                    {"t": time.time(), "version": version, "cpu": _cpu_s(proc.pid), "health_ms": health_ms}
                )
                if time.time() > end0 + window_s + 5:
                    jobs = await _all_jobs(client)
                    if all(j["state"] not in ("PENDING", "RUNNING") for j in jobs):
                        break
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
            jobs = await _all_jobs(client)
    finally:
        for other in others:
            other.kill()
            other.wait()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finished = sorted(j["finished_ms"] / 1000 for j in jobs if j.get("finished_ms"))
    first, last = finished[0], finished[-1]
    during = [s for s in samples if first <= s["t"] <= last + 1]
    rates = [(b["version"] - a["version"]) / (b["t"] - a["t"]) for a, b in itertools.pairwise(during)]
    cpu = [(b["cpu"] - a["cpu"]) / (b["t"] - a["t"]) for a, b in itertools.pairwise(during)]
    health = [s["health_ms"] for s in during]
    # From the job's end mark to its record saying so (leftovers killed, slots free). The sleep ends
    # within the second after its mark (``date +%s`` rounds down): up to 1 s of this is the job's.
    lag = [j["finished_ms"] / 1000 - ends[j["job_id"]] for j in jobs if j.get("finished_ms")]
    states: dict[str, int] = {}
    for j in jobs:
        states[j["state"]] = states.get(j["state"], 0) + 1
    return {
        "jobs": n,
        "bystanders": bystanders,
        "launch_s": launch_s,
        "launch_late_s": late,
        "states": states,
        "finish_window_s": last - first,
        "saves_per_s_mean": (during[-1]["version"] - during[0]["version"])
        / (during[-1]["t"] - during[0]["t"])
        if len(during) > 1
        else 0.0,
        "saves_per_s_max": max(rates, default=0.0),
        "saves_per_job": samples[-1]["version"] / n if samples else 0.0,
        "controller_cpu_mean": sum(cpu) / len(cpu) if cpu else 0.0,
        "controller_cpu_max": max(cpu, default=0.0),
        "exit_to_settled_s": {"p50": percentile(lag, 50), "p99": percentile(lag, 99), "max": max(lag)},
        "health_ms": {
            "p50": percentile(health, 50),
            "p99": percentile(health, 99),
            "max": max(health, default=0.0),
        },
    }


async def _all_jobs(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = []
    after: int | None = 0
    while after is not None:
        page = (await client.get("/v1/jobs", params={"after": after})).json()
        jobs += page["jobs"]
        after = page["next_after"]
    return jobs


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.controller_requests", description=__doc__)
    p.add_argument("--jobs", default="0,20000", help="finished jobs in the store, comma-separated sizes")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per route and size")
    p.add_argument(
        "--finishing", type=int, default=0, help="then N sleep jobs ending over one minute (0: skip)"
    )
    p.add_argument(
        "--finish-window", type=int, default=60, help="seconds over which the --finishing jobs end"
    )
    p.add_argument("--finish-lead", type=int, default=30, help="seconds to the first end (+1 per 25 jobs)")
    p.add_argument(
        "--bystanders",
        type=int,
        default=0,
        help="idle processes of another run id on the host while --finishing runs (another peer's jobs)",
    )
    p.add_argument("--source", default="HEAD", help="git revision, 'worktree' or a directory")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = parse_args(
        p,
        {
            "jobs": "0,50",
            "requests": 20,
            "finishing": 10,
            "finish_window": 3,
            "finish_lead": 2,
            "bystanders": 5,
        },
    )
    sizes = [int(s) for s in args.jobs.split(",") if s.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="iris-bench-requests-"))
    results: list[dict[str, Any]] = []
    finishing: dict[str, Any] | None = None
    try:
        for n in sizes:
            print(f"{n} finished jobs...", flush=True)
            results.append(run_size(n, args.requests, workdir))
        if args.finishing:
            print(f"{args.finishing} jobs ending within {args.finish_window} s...", flush=True)
            finishing = asyncio.run(
                _finishing(
                    args.finishing,
                    workdir,
                    window_s=args.finish_window,
                    lead_s=args.finish_lead,
                    bystanders=args.bystanders,
                )
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        cleanup_snapshot()
    print(f"code: {source_label()}")
    ready = ", ".join(f"{r['jobs']} jobs: {r['ready_s']:.2f}" for r in results)
    print(f"controller ready after (s): {ready}")
    for r in results:
        if "save_us" in r:
            s = r["save_us"]
            print(
                f"StateStore.save with up to {r['jobs']} rows: p50 {s['p50']:.0f} µs, "
                f"p99 {s['p99']:.0f} µs, max {s['max']:.0f} µs"
            )
    headers = ["route", *(f"{r['jobs']} jobs p50/p99 ms, cpu ms/req" for r in results)]
    rows = []
    for route in ROUTES:
        cells: list[object] = [route]
        for r in results:
            m = r["routes"].get(route)
            cells.append(
                "-" if m is None else f"{m['p50_ms']:.2f}/{m['p99_ms']:.2f}, {m['cpu_ms_per_request']:.2f}"
            )
        rows.append(cells)
    print(table(headers, rows))
    if finishing is not None:
        f = finishing
        h, lag = f["health_ms"], f["exit_to_settled_s"]
        print(
            f"{f['jobs']} jobs ({f.get('bystanders', 0)} bystander processes) "
            f"launched in {f['launch_s']:.1f} s "
            f"({f['launch_late_s']:.1f} s past the first end); ended {f['states']} over "
            f"{f['finish_window_s']:.1f} s: {f['saves_per_job']:.1f} saves per job, "
            f"{f['saves_per_s_mean']:.0f} saves/s mean, {f['saves_per_s_max']:.0f} max; controller CPU "
            f"{f['controller_cpu_mean']:.0%} mean, {f['controller_cpu_max']:.0%} max; "
            f"GET /v1/health meanwhile p50 {h['p50']:.1f} ms, p99 {h['p99']:.1f} ms, max {h['max']:.1f} ms; "
            f"exit to settled p50 {lag['p50']:.2f} s, p99 {lag['p99']:.2f} s, max {lag['max']:.2f} s"
        )
    write_json(
        args.out, {"machine": machine(), "source": source_label(), "results": results, "finishing": finishing}
    )
    if args.out:
        print(json.dumps({"written": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
