"""Two ``iris worker`` processes on one PostgreSQL federation store (issue 17, acceptance 3).

docs/DESIGN.md, "Components": a worker keeps no durable state, so any number of them can serve one
federation; what must not interleave is serialized by the store ("Promotion (the CAS)",
"Concurrency"). Here two real ``iris worker`` processes (the CLI's entry point, not in-process
workers) serve one task queue, with one Temporal dev server, one PostgreSQL store (a fresh
database) and the three real controllers as processes, and two things run through them:

- the cancel race of tests/cancel_race.py, ``ITERATIONS`` times (below): a cancel (Update, signal, Temporal
  cancel or the store's intent) racing the race's own ``place`` signals, the placement manager's and
  the promotion CAS, on whichever worker runs each task. Stages are seen in the store's handles;
  deliveries are counted by the controllers. 0 jobs both cancelled (the cancel told it won) and
  handed off, 0 second deliveries, 0 over-commits;
- a burst of ``BURST`` jobs (4 of 5 ``h100×1`` queued for the peers, 1 of 5 local CPU): every job
  SUCCEEDED, launched exactly once on exactly one cluster (the controllers' own records), never
  more jobs admitted on a backend than its slots (the controllers' admission and end times), no
  reservation left, and both workers ran activities (the identities in the jobs' histories).

Over-commit is judged from the controllers' records alone: on each (cluster, backend, resource),
at no instant did the jobs accepted and not yet ended need more than the backend's slots
(docs/DESIGN.md, "3. No backend is over-committed"; a controller sets a job's end before it answers
anything else, so a job placed on freed slots is always accepted after the end that freed them).

The burst's throughput is printed, not asserted; one worker against two, in one run, is
``uv run python -m benchmarks.workers`` (docs/BENCHMARKS.md, "Several workers").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from cancel_race import Milestones, Outcome, Race, run_race
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from stack import Stack, StackClient, wait_until
from temporalio.api.enums.v1 import EventType, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from iris import contract, devstack
from iris.config import STORE_URL_ENV, FederationConfig
from iris.contract import SEARCH_ATTRIBUTE_KEYS, manager_workflow_id
from iris.controller.client import ControllerClient
from iris.controller.errors import NotFound, Unavailable
from iris.controller.identity import KEY_DIR_ENV
from iris.controller.models import ControllerJobState
from iris.controller.models import JobStatus as PeerJobStatus
from iris.jobs import JobState, JobStatus
from iris.policy.models import Band, Placement
from iris.store import FederationStore, HandleState
from iris.temporal import data_converter
from workflows.placement import PlacementManager

T = TypeVar("T")
POSTGRES_URL = os.environ.get("IRIS_TEST_POSTGRES_URL") or "postgresql+psycopg://postgres@127.0.0.1:5432/test"
WORKERS = 2
# The suite's sizes keep CI under its time budget; the acceptance sizes (1000 and 500, docs/BENCHMARKS.md,
# "Several workers") run with IRIS_RACE_ITERATIONS=1000 IRIS_BURST_JOBS=500 (README, "Several workers").
ITERATIONS = int(os.environ.get("IRIS_RACE_ITERATIONS", "300"))
PARALLEL = 48
SEED = 20261201
# A race job takes one H100 (cw-us-east-02a has 16, cw-rno2a 8) and, delivered and not cancelled,
# runs this long: a cancel aimed at a running job has a run to terminate. (The peers do not fill in
# the race, most of whose jobs are cancelled; they do in the burst.)
RACE_GPUS = 1
RACE_RUN_S = 8
BURST = int(os.environ.get("IRIS_BURST_JOBS", "200"))
CPU_EVERY = 5  # every fifth job of the burst is a local CPU job
GPU_PEERS = {"cw-us-east-02a": "h100-us-east-02a", "cw-rno2a": "h100-rno2a"}


# ---- the federation: its own Temporal, controllers, store and two worker processes --------------


@dataclass
class TwoWorkers:
    stack: Stack  # this federation as a Stack (its own client, config and store)
    workers: list[devstack.ManagedProcess]
    controllers: dict[str, ControllerClient] = field(default_factory=dict)

    @property
    def config(self) -> FederationConfig:
        return self.stack.config

    @property
    def store(self) -> FederationStore:
        return self.stack.store

    def identities(self, history_identities: Iterable[str]) -> Counter[str]:
        """Identities (the SDK's ``pid@host``) as "worker 1", "worker 2", or themselves if unknown."""
        names = {str(w.proc.pid): f"worker {i + 1}" for i, w in enumerate(self.workers) if w.proc is not None}
        return Counter(names.get(identity.partition("@")[0], identity) for identity in history_identities)

    async def records(self) -> list[tuple[str, PeerJobStatus]]:
        """Every job each controller holds for the home cluster, as (cluster, record)."""
        out: list[tuple[str, PeerJobStatus]] = []
        for cluster, client in self.controllers.items():
            out += [(cluster, job) for job in await asked(client.list_jobs)]
        return out


async def asked(call: Callable[[], Awaitable[T]], tries: int = 5) -> T:
    """A controller's answer, asked again after a transient failure (as the activities do: a
    kept-alive connection the server closes as a request goes out fails that request)."""
    for attempt in range(1, tries + 1):
        try:
            return await call()
        except Unavailable:
            if attempt == tries:
                raise
            await asyncio.sleep(0.2 * attempt)  # not a wait: the retry's backoff
    raise AssertionError("unreachable")


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database on the test server, dropped afterwards; its URL. A skip naming the server
    if it does not answer (as the store tests do, tests/store/conftest.py)."""
    admin = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3}, isolation_level="AUTOCOMMIT")
    name = f"iris_two_workers_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except Exception as exc:
        admin.dispose()
        pytest.skip(
            f"PostgreSQL not reachable at {POSTGRES_URL}: {type(exc).__name__}: {exc}".splitlines()[0]
        )
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def worker_process(config_file: Path, root: Path, n: int, env: dict[str, str]) -> devstack.ManagedProcess:
    """``iris worker`` as a deployment runs it, with a data directory of its own."""
    argv = [str(devstack.venv_bin("iris")), "--config", str(config_file), "worker"]
    return devstack.ManagedProcess(
        name=f"iris worker {n}",
        argv=[*argv, "--data-dir", str(root / f"worker-{n}")],
        log_path=root / "logs" / f"worker-{n}.log",
        ready=lambda: True,
        address="",
        env=env,
    )


async def pollers(client: Client, task_queue: str) -> set[str]:
    """The identities polling ``task_queue`` for activities."""
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
    )
    return {p.identity for p in resp.pollers}


@pytest.fixture(scope="module")
async def two_workers(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TwoWorkers]:
    """Its own Temporal dev server, PostgreSQL database, controllers and two ``iris worker``
    processes; the session stack's object-store emulators, cluster keys and users."""
    root = tmp_path_factory.mktemp("two-workers")
    async with contextlib.AsyncExitStack() as cleanup:
        url = cleanup.enter_context(postgres_database())
        env = await WorkflowEnvironment.start_local(
            dev_server_existing_path=str(devstack.venv_bin("temporal")),
            search_attributes=SEARCH_ATTRIBUTE_KEYS,
            data_converter=data_converter(),
            dev_server_startup_timeout=timedelta(seconds=60),
            dev_server_log_level="error",
        )
        cleanup.push_async_callback(env.shutdown)
        cfg = stack.config.model_copy(deep=True)
        cfg.temporal.address = env.client.service_client.config.target_host
        # Its last 8 characters name the race's jobs (tests/cancel_race.py).
        cfg.temporal.task_queue = f"iris-two-workers-{uuid.uuid4().hex[:8]}"
        cfg.store_url = url
        for c in cfg.clusters:
            c.port = devstack.free_port()
        config_file = root / "clusters.json"
        config_file.write_text(cfg.model_dump_json(indent=2))
        store = FederationStore(url)
        cleanup.callback(store.close)
        processes = [
            devstack.controller(config_file, cfg, c.name, root, key_dir=stack.key_dirs[c.name])
            for c in cfg.clusters
        ]
        # Each worker holds what a deployment gives it: the home cluster's key directory and
        # object-store credentials, and the shared store.
        worker_env = {
            KEY_DIR_ENV: str(stack.key_dirs[cfg.home]),
            STORE_URL_ENV: url,
            **devstack.store_credentials(cfg, cfg.home),
        }
        workers = [worker_process(config_file, root, n, worker_env) for n in range(1, WORKERS + 1)]
        for group in (processes, workers):
            for proc in group:
                proc.start()
            cleanup.push_async_callback(stop_all, group)
        for proc in processes:
            await asyncio.to_thread(proc.wait_ready, 60)
        controllers = {c.name: ControllerClient.for_cluster(cfg, c.name, timeout=30.0) for c in cfg.clusters}
        for client in controllers.values():
            cleanup.push_async_callback(client.aclose)
        federation = TwoWorkers(
            stack=Stack(
                config=cfg,
                config_file=config_file,
                data_dir=root,
                key_dir=stack.key_dirs[cfg.home],
                key_dirs=stack.key_dirs,
                client=env.client,
                iris=StackClient(env.client, cfg),
                store=store,
                shared_dir=stack.shared_dir,  # in the copied config's sandbox_rw_paths
                services={p.name: p for p in [*processes, *workers]},
            ),
            workers=workers,
            controllers=controllers,
        )
        await ready(federation)
        yield federation


async def stop_all(processes: list[devstack.ManagedProcess]) -> None:
    """SIGTERM, then SIGKILL after 5 s (a controller otherwise waits for its open long polls)."""
    await asyncio.gather(*(asyncio.to_thread(p.stop, 5.0) for p in processes))


async def ready(federation: TwoWorkers) -> None:
    """Both workers poll the jobs' queue, and the placement manager has ticked."""
    client, queue = federation.stack.client, federation.config.temporal.task_queue
    manager = client.get_workflow_handle(manager_workflow_id(queue))

    async def up() -> bool:
        for w in federation.workers:
            assert w.running, f"{w.name} exited during start; see {w.log_path}"
        if len(await pollers(client, queue)) < WORKERS:
            return False
        with contextlib.suppress(Exception):
            return await manager.query(PlacementManager.last_tick) is not None
        return False

    await wait_until(up, timeout=90, interval=0.5, what=f"{WORKERS} workers polling {queue} and a tick")


# ---- what the controllers recorded ---------------------------------------------------------------


def slots(config: FederationConfig) -> dict[tuple[str, str, str], int]:
    """Each (cluster, backend, resource)'s slots: device chips per token, and ``cpu``."""
    out: dict[tuple[str, str, str], int] = {}
    for c in config.clusters:
        for b in c.backends:
            out[(c.name, b.id, "cpu")] = b.cpu_slots
            for token, n in (b.devices or {}).items():
                out[(c.name, b.id, token)] = n
    return out


@dataclass
class Admitted:
    """What each (cluster, backend, resource) held at once, from its controller's records."""

    peaks: dict[str, str]
    over_commits: list[str]


def admitted(
    config: FederationConfig, records: Iterable[tuple[str, PeerJobStatus]], demand: dict[str, tuple[str, int]]
) -> Admitted:
    """``demand``: job id → (resource, amount) of the jobs to count. A job holds its demand from its
    acceptance (``created_ms``) to its end (``finished_ms``); within one millisecond, ends go first.
    An over-commit is an instant at which a backend held more than its slots."""
    capacity = slots(config)
    events: dict[tuple[str, str, str], list[tuple[int, int, str]]] = defaultdict(list)
    for cluster, job in records:
        if job.job_id not in demand:
            continue
        resource, amount = demand[job.job_id]
        end = job.finished_ms if job.finished_ms is not None else 2**62
        events[(cluster, job.backend_id, resource)] += [
            (job.created_ms, amount, job.job_id),
            (end, -amount, ""),
        ]
    result = Admitted(peaks={}, over_commits=[])
    for key, evs in sorted(events.items()):
        held = peak = 0
        limit = capacity.get(key, 0)
        for at, amount, job_id in sorted(evs, key=lambda e: (e[0], e[1])):
            held += amount
            peak = max(peak, held)
            if held > limit:
                result.over_commits.append(
                    f"{'/'.join(key)}: {held} > {limit} slots at {at} ms ({job_id} accepted)"
                )
        result.peaks["/".join(key)] = f"{peak}/{limit}"
    return result


def launches(
    records: Iterable[tuple[str, PeerJobStatus]], job_ids: Iterable[str]
) -> dict[str, list[tuple[str, int]]]:
    """job id → [(cluster, launches there)] for each of ``job_ids`` any controller holds."""
    wanted = set(job_ids)
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for cluster, job in records:
        if job.job_id in wanted:
            out[job.job_id].append((cluster, job.attempts))
    return out


@dataclass
class Histories:
    """From the jobs' histories: who started their activities and workflow tasks (by worker), and
    how many ``place`` signals each job received."""

    activities: Counter[str]
    tasks: Counter[str]
    places: Counter[int]


async def histories(federation: TwoWorkers, job_ids: Iterable[str]) -> Histories:
    client = federation.stack.client
    gate = asyncio.Semaphore(16)
    activities: list[str] = []
    tasks: list[str] = []
    places: Counter[int] = Counter()

    async def one(job_id: str) -> None:
        async with gate:
            history = await client.get_workflow_handle(job_id).fetch_history()
        placed = 0
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                activities.append(e.activity_task_started_event_attributes.identity)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                tasks.append(e.workflow_task_started_event_attributes.identity)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                placed += e.workflow_execution_signaled_event_attributes.signal_name == contract.PLACE
        places[placed] += 1

    await asyncio.gather(*(one(j) for j in job_ids))
    return Histories(federation.identities(activities), federation.identities(tasks), places)


def phases(finals: list[JobStatus], records: Iterable[tuple[str, PeerJobStatus]]) -> str:
    """p50 / max seconds of each part of the jobs' story: submit → first state of each kind, and the
    controller's acceptance → start → end."""
    firsts: dict[str, list[float]] = defaultdict(list)
    for s in finals:
        seen: set[JobState] = set()
        for e in s.events:
            if e.state not in seen:
                seen.add(e.state)
                firsts[e.state.value].append((e.at_ms - s.submit_ms) / 1000)
    peer = {job.job_id: job for _, job in records}
    for s in finals:
        job = peer.get(s.job_id)
        if job is not None and job.started_ms and job.finished_ms:
            firsts["~accepted"].append((job.created_ms - s.submit_ms) / 1000)
            firsts["~started"].append((job.started_ms - s.submit_ms) / 1000)
            firsts["~finished"].append((job.finished_ms - s.submit_ms) / 1000)
        firsts["~closed"].append((s.updated_ms - s.submit_ms) / 1000)

    def p50(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    order = sorted(firsts, key=lambda k: p50(firsts[k]))
    return "  submit → " + ", ".join(f"{k} {p50(firsts[k]):.1f}/{max(firsts[k]):.1f}" for k in order)


# ---- the cancel race on two workers ------------------------------------------------------------


class StoreMilestones(Milestones):
    """The stages of tests/cancel_race.py as seen from outside the workers: a ``place`` signal just
    sent is the CAS about to run ("placed" and "promoting"); the rest comes from the store."""

    def reach(self, job_id: str, stage: str) -> None:
        super().reach(job_id, stage)
        if stage == "placed":
            super().reach(job_id, "promoting")


# The stages a handle in each state has reached.
STAGES_BY_STATE = {
    HandleState.QUEUED_HANDOFF: ("queued",),
    HandleState.PENDING_HANDOFF: ("queued", "launching"),
    HandleState.HANDOFF_FAILED: ("queued", "launching"),
    HandleState.HANDED_OFF: ("queued", "launching", "running"),
}
EVERY_STAGE = ("queued", "placed", "promoting", "launching", "running")


@contextlib.asynccontextmanager
async def watching(
    store: FederationStore, race: Race[ControllerPeers], every_s: float = 0.05
) -> AsyncIterator[None]:
    """Mark each race job's stages from its store handle, read every ``every_s``. A job whose
    handle was live and no longer is has ended: it has passed every stage (a cancel aimed at one it
    was not seen in lands after the end). One seen in no live state after 5 s is read on its own."""
    seen: set[str] = set()
    ended: set[str] = set()
    first_look: dict[str, float] = {}

    async def watch() -> None:
        while True:
            live = {h.job_id: h.state for h in await asyncio.to_thread(store.handles, STAGES_BY_STATE)}
            now = time.monotonic()
            for job_id in [j for j in race.started if j not in ended]:
                state = live.get(job_id)
                if state is not None:
                    seen.add(job_id)
                    for stage in STAGES_BY_STATE[state]:
                        race.milestones.reach(job_id, stage)
                    continue
                stale = now - first_look.setdefault(job_id, now) > 5.0
                if job_id in seen or stale:
                    handle = await asyncio.to_thread(store.get, job_id) if job_id not in seen else None
                    if job_id in seen or (handle is not None and handle.state.terminal):
                        ended.add(job_id)
                        for stage in EVERY_STAGE:
                            race.milestones.reach(job_id, stage)
                    else:
                        first_look[job_id] = now
            await asyncio.sleep(every_s)  # not a wait: the watcher's sampling period

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class ControllerPeers:
    """Deliveries as the controllers recorded them: launches of the job id on every cluster (a
    repeated launch of one attempt is answered with the same record, not counted again)."""

    def __init__(self, federation: TwoWorkers) -> None:
        self.federation = federation

    async def delivery(self, job_id: str) -> tuple[int, bool]:
        delivered, terminated = 0, False
        for client in self.federation.controllers.values():
            try:
                job = await asked(functools.partial(client.status, job_id))
            except NotFound:
                continue
            delivered += job.attempts
            terminated |= job.state is ControllerJobState.KILLED
        return delivered, terminated


@pytest.mark.timeout(900)
async def test_the_cancel_race_on_two_workers_delivers_no_won_cancel_nothing_twice_and_never_overcommits(
    two_workers: TwoWorkers,
) -> None:
    fed = two_workers
    places = random.Random(SEED + 1)

    def place_on(job_id: str) -> Placement:
        # As the tick offers a verified fit: the CAS charges one chip against the latest report.
        peer = places.choice(sorted(GPU_PEERS))
        return Placement(
            job_id=job_id,
            peer_id=peer,
            backend_id=GPU_PEERS[peer],
            band=Band.INTERACTIVE,
            reserved={"h100": RACE_GPUS},
            reason="race",
        )

    race = Race(
        fed.stack,
        fed.store,
        ControllerPeers(fed),
        StoreMilestones(),
        fed.config.temporal.task_queue,
        random.Random(SEED),
        place_on,
        command=["sleep", str(RACE_RUN_S)],
        gpu_count=RACE_GPUS,
        # Stages are seen from outside (above), and a promotion takes a workflow task and an
        # activity on a busy worker: cancels spread over 0.3 s after the stage meet the CAS.
        jitter_s=0.3,
        # Real workers on a shared machine: a job may wait for a slot or a busy worker.
        stage_timeout_s=120.0,
        end_timeout_s=180.0,
    )
    async with watching(fed.store, race):
        run = await run_race(race, ITERATIONS, PARALLEL)
    records = await fed.records()
    held = admitted(fed.config, records, {job_id: ("h100", RACE_GPUS) for job_id in race.started})
    won_and_delivered = [o.job_id for o in run.outcomes if o.cancel_won and o.deliveries]
    left = [r for r in await asyncio.to_thread(fed.store.reservations) if r.job_id in set(race.started)]
    twice = {j: where for j, where in launches(records, race.started).items() if sum(n for _, n in where) > 1}
    sample = race.started[:: max(1, len(race.started) // 100)]
    sampled = await histories(fed, sample)
    print("\n" + run.summary())
    print(
        f"  cancel won yet delivered {len(won_and_delivered)}, delivered twice {len(twice)},"
        f" over-commits {len(held.over_commits)}; peak held {held.peaks}"
    )
    print(f"  activities of {len(sample)} jobs by worker: {dict(sampled.activities)}")

    assert run.violations == [], "\n".join(run.violations[:30] + await story(fed, run.outcomes))
    assert won_and_delivered == []
    assert twice == {}
    assert held.over_commits == [], held.over_commits[:20]
    assert left == [], left[:5]  # every reservation ended with its job
    assert run.was_a_race(), run.wins
    assert sorted(sampled.activities) == [f"worker {i + 1}" for i in range(WORKERS)], sampled.activities


async def story(federation: TwoWorkers, outcomes: list[Outcome]) -> list[str]:
    """For a failure message: what became of the jobs with a problem (handle, status, events)."""
    lines = []
    for o in [o for o in outcomes if o.problems][:5]:
        handle = await asyncio.to_thread(federation.store.get, o.job_id)
        final = o.final
        lines.append(f"{o.job_id}: handle {handle.state if handle else None}, final {final and final.state}")
        if final is not None:
            lines += [
                f"  +{(e.at_ms - final.submit_ms) / 1000:.1f}s {e.state.value} {e.message[:120]}"
                for e in final.events
            ]
    return lines


# ---- a burst on two workers ----------------------------------------------------------------------


@pytest.mark.timeout(900)
async def test_a_burst_of_jobs_on_two_workers_runs_each_exactly_once_and_never_overcommits(
    two_workers: TwoWorkers,
) -> None:
    fed = two_workers
    tag = uuid.uuid4().hex[:6]
    kinds = {f"burst-{tag}-{i:03d}": "cpu" if i % CPU_EVERY == CPU_EVERY - 1 else "gpu" for i in range(BURST)}
    gate = asyncio.Semaphore(32)

    async def submit(name: str, kind: str) -> str:
        async with gate:
            if kind == "gpu":
                return await fed.stack.iris.submit(["sleep", "1"], name=name, device_type="h100", gpu_count=1)
            return await fed.stack.iris.submit(["true"], name=name)

    started = time.monotonic()
    ids = await asyncio.gather(*(submit(name, kind) for name, kind in kinds.items()))
    submitted_s = time.monotonic() - started
    finals = await asyncio.gather(
        *(fed.stack.client.get_workflow_handle(j, result_type=JobStatus).result() for j in ids)
    )
    elapsed_s = time.monotonic() - started

    records = await fed.records()
    demand = {j: ("h100", 1) if kinds[j.split("/", 1)[1]] == "gpu" else ("cpu", 1) for j in ids}
    held = admitted(fed.config, records, demand)
    ran = launches(records, ids)
    not_once = {j: ran.get(j, []) for j in ids if [n for _, n in ran.get(j, [])] != [1]}
    elsewhere = [s.job_id for s in finals if [c for c, _ in ran.get(s.job_id, [])] != [s.cluster]]
    left = [r for r in fed.store.reservations() if r.job_id in demand]
    seen = await histories(fed, ids[:: max(1, BURST // 100)])
    ticks = await histories(fed, [manager_workflow_id(fed.config.temporal.task_queue)])
    where = Counter(s.cluster for s in finals)
    print(phases(finals, records))
    print(
        f"\nburst of {BURST} jobs on {WORKERS} workers: submitted in {submitted_s:.1f}s, all ended in"
        f" {elapsed_s:.1f}s: {BURST / elapsed_s:.1f} jobs/s; by cluster {dict(where)}"
    )
    print(f"  launched other than once {len(not_once)}, over-commits {len(held.over_commits)}")
    print(f"  peak held {held.peaks}")
    print(
        f"  in 100 jobs: activities by worker {dict(seen.activities)}, workflow tasks {dict(seen.tasks)},"
        f" ticks {dict(ticks.activities)}; jobs by place signals received {dict(seen.places)}"
    )

    assert Counter(s.state for s in finals) == {JobState.SUCCEEDED: BURST}, Counter(s.state for s in finals)
    assert not_once == {}, list(not_once.items())[:20]
    assert elsewhere == [], elsewhere[:20]
    assert held.over_commits == [], held.over_commits[:20]
    assert left == [], left[:5]
    # Both workers ran the burst's activities.
    assert sorted(seen.activities) == [f"worker {i + 1}" for i in range(WORKERS)], seen.activities
