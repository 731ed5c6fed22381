"""Benchmark of the placement tick: `uv run python benchmarks/policy_bench.py`.

Times :func:`iris.policy.planner.plan` on synthetic federations (1k/10k/50k queued jobs x 10/100
clusters x 4 backends) and the simple reference planner on the same input, checks both return the
same result, and prints median time per tick, placements per second and the speed-up.

``--held N [N ...]``: the tick's own work with N jobs held running (HANDED_OFF, one GPU each, over
two peers, four users) in a federation store (SQLite in a temp directory, or ``--store-url``) and a
handful queued: each store call the tick makes (activities/placement.py, ``_tick``), the plan with
those jobs ``in_use``, and the tick's metrics (``TickMetrics.record``, which counts each user's
devices and share from them), timed step by step; ``--profile`` adds a cProfile of those ticks per N.

Not a test: numbers depend on the machine. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from sqlalchemy import Table, func, select
from temporalio.common import MetricMeter

from activities.placement import TickMetrics
from benchmarks.smoke import parse_args
from iris.policy import (
    Availability,
    BackendReport,
    Backfill,
    Band,
    Constraint,
    DeviceRequest,
    FairShare,
    HeldByBand,
    JobShape,
    Op,
    PeerReport,
    PlanRequest,
    PlanResult,
    Reservation,
    plan,
    plan_reference,
    plan_request,
)
from iris.reports import FederationView

if TYPE_CHECKING:
    from iris.store import FederationStore

T = TypeVar("T")

HOME = "marin"
NOW_MS = 1_800_000_000_000
STALE_AFTER_MS = 30_000
MAX_PER_PEER = 16
VARIANTS = ("h100", "h100", "a100", "h200")
REGIONS = ("us-east", "us-west", "us-central", "eu-west")
# The reference scores every backend for every job; past this many (job, backend) pairs it is
# timed once on a prefix of the queue and extrapolated, to keep the whole run to a few minutes.
REFERENCE_PAIR_BUDGET = 4_000_000


def federation(rng: random.Random, clusters: int) -> tuple[list[PeerReport], list[Reservation]]:
    reports: list[PeerReport] = []
    reservations: list[Reservation] = []
    for c in range(clusters):
        peer_id = HOME if c == 0 else f"cw-{c:03d}"
        backends: list[BackendReport] = []
        for k in range(4):
            variant = VARIANTS[(c + k) % len(VARIANTS)]
            region = REGIONS[c % len(REGIONS)]
            attrs = {
                "device-type": ["gpu"],
                "device-variant": [variant],
                "region": [region],
                "zone": [f"{region}-{k}"],
                "preemptible": [rng.choice(["true", "false"])],
            }
            epoch = NOW_MS - rng.randint(0, 20_000)
            if c % 25 == 7 and k == 0:
                # A legacy backend: matched on shape only.
                backends.append(BackendReport(backend_id=f"b{k}", advertised_attributes=attrs))
                continue
            total = rng.choice((16, 32, 64, 128))
            free = rng.randint(0, total // 2)
            held = [
                HeldByBand(band=Band.BATCH, amounts={variant: rng.randint(0, (total - free) // 2)}),
                HeldByBand(band=Band.INTERACTIVE, amounts={variant: rng.randint(0, (total - free) // 4)}),
            ]
            block = Availability(
                observation_epoch_ms=epoch,
                amounts={variant: free},
                total_amounts={variant: total},
                held_by_band=held,
            )
            backends.append(
                BackendReport(backend_id=f"b{k}", advertised_attributes=attrs, availability=block)
            )
            if rng.random() < 0.5:
                reservations.append(
                    Reservation(
                        peer_id=peer_id,
                        backend_id=f"b{k}",
                        observation_epoch_ms=epoch if rng.random() < 0.8 else epoch - 1,
                        amounts={variant: rng.choice((1, 2, 4, 8))},
                        band=rng.choice((None, Band.INTERACTIVE, Band.BATCH)),
                    )
                )
        reachable = rng.random() > 0.05
        last_contact = NOW_MS - (STALE_AFTER_MS + 1 if rng.random() < 0.05 else rng.randint(0, 10_000))
        reports.append(
            PeerReport(peer_id=peer_id, reachable=reachable, last_contact_ms=last_contact, backends=backends)
        )
    return reports, reservations


def queue(rng: random.Random, jobs: int, clusters: int) -> list[JobShape]:
    bands = (Band.PRODUCTION, Band.INTERACTIVE, Band.BATCH)
    out: list[JobShape] = []
    for i in range(jobs):
        r = rng.random()
        if r < 0.1:
            device = DeviceRequest()
        else:
            device = DeviceRequest(
                type="gpu",
                variant=rng.choice(VARIANTS),
                count=rng.choice((1, 2, 4, 8)),
                replicas=rng.choice((1, 1, 1, 2, 4)),
            )
        constraints: tuple[Constraint, ...] = ()
        if rng.random() < 0.1:
            constraints = (Constraint(key="region", op=Op.EQ, values=(rng.choice(REGIONS),)),)
        elif rng.random() < 0.05:
            constraints = (Constraint(key="preemptible", op=Op.NE, values=("true",)),)
        pin = f"cw-{rng.randrange(1, clusters):03d}" if clusters > 1 and rng.random() < 0.01 else None
        deadline = NOW_MS - 1 if rng.random() < 0.02 else None
        out.append(
            JobShape(
                job_id=f"user{i % 97}/job-{i}",
                constraints=constraints,
                device=device,
                band=rng.choices(bands, weights=(1, 5, 4))[0],
                target_cluster=pin,
                submit_ms=NOW_MS - rng.randint(0, 86_400_000),
                deadline_ms=deadline,
            )
        )
    return out


def timed(fn: Callable[[], PlanResult]) -> tuple[float, PlanResult]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class Row(NamedTuple):
    jobs: int
    clusters: int
    backends: int
    placed: int
    waiting: int
    median_s: float
    reference_s: float
    extrapolated: bool


def run_case(jobs: int, clusters: int, repeat: int, seed: int) -> Row:
    rng = random.Random(seed * 1_000_003 + clusters * 7 + jobs)
    reports, reservations = federation(rng, clusters)
    shapes = queue(rng, jobs, clusters)
    tick = partial(
        plan,
        home=HOME,
        reports=reports,
        reservations=reservations,
        now_ms=NOW_MS,
        stale_after_ms=STALE_AFTER_MS,
        max_per_peer=MAX_PER_PEER,
    )
    reference = partial(
        plan_reference,
        home=HOME,
        reports=reports,
        reservations=reservations,
        now_ms=NOW_MS,
        stale_after_ms=STALE_AFTER_MS,
        max_per_peer=MAX_PER_PEER,
    )

    result = tick(shapes)  # warm-up
    times = []
    for _ in range(repeat):
        elapsed, result = timed(partial(tick, shapes))
        times.append(elapsed)

    backends = sum(len(r.backends) for r in reports)
    prefix = min(len(shapes), max(1, REFERENCE_PAIR_BUDGET // max(1, backends)))
    sample = shapes[:prefix]
    ref_time, ref_result = timed(partial(reference, sample))
    expected = result if prefix == len(shapes) else tick(sample)
    if ref_result != expected:
        raise SystemExit(f"MISMATCH between planner and reference: {jobs} jobs x {clusters} clusters")
    return Row(
        jobs=jobs,
        clusters=clusters,
        backends=backends,
        placed=len(result.placements),
        waiting=sum(len(g.job_ids) for g in result.waiting),
        median_s=statistics.median(times),
        reference_s=ref_time * len(shapes) / prefix,
        extrapolated=prefix < len(shapes),
    )


# --- The tick's own work with jobs held running (--held) ---------------------------------------------

HELD_HOME = "home"
HELD_PEERS = ("cw-a", "cw-b")
HELD_USERS = ("alice", "bob", "carol", "dave")
HELD_BACKEND = "h100"
# Free on each peer besides what its held jobs take: room for a few one-GPU jobs, none for a gang of 8.
HELD_FREE = 4
# The steps of one tick, in its order (activities/placement.py, ``_tick``; the controllers' polls, the
# reconcile's list of closed workflows and the signals are network calls, not timed here). ``metrics``
# is the tick's own TickMetrics.record, which counts each user's devices and share from ``in_use``.
HELD_STEPS = (
    "save_reports",
    "expire_due",
    "load_reports",
    "prune_reservations",
    "queued",
    "reservations",
    "in_use",
    "plan",
    "update_reasons",
    "fences",
    "metrics",
)


def held_reports(held: int, now_ms: int) -> list[PeerReport]:
    """Home (CPU only) and two GPU peers, each running its half of the held jobs with a few h100 free;
    every observation a minute old (nothing has changed since)."""
    epoch = now_ms - 60_000
    cpu = Availability(observation_epoch_ms=epoch, amounts={"cpu": 64}, total_amounts={"cpu": 64})
    reports = [
        PeerReport(
            peer_id=HELD_HOME,
            last_contact_ms=now_ms,
            backends=[
                BackendReport(
                    backend_id="cpu", advertised_attributes={"device-type": ["cpu"]}, availability=cpu
                )
            ],
        )
    ]
    for k, peer in enumerate(HELD_PEERS):
        running = len(range(k, held, len(HELD_PEERS)))
        block = Availability(
            observation_epoch_ms=epoch,
            amounts={"h100": HELD_FREE},
            total_amounts={"h100": running + HELD_FREE},
            held_by_band=[HeldByBand(band=Band.INTERACTIVE, amounts={"h100": running})] if running else [],
        )
        attrs = {"device-type": ["gpu"], "device-variant": ["h100"], "region": [f"us-{k}"]}
        reports.append(
            PeerReport(
                peer_id=peer,
                last_contact_ms=now_ms,
                backends=[
                    BackendReport(backend_id=HELD_BACKEND, advertised_attributes=attrs, availability=block)
                ],
            )
        )
    return reports


def held_shape(rng: random.Random, job_id: str, user: str, now_ms: int, gpus: int = 1) -> JobShape:
    """A job as ``iris job submit --gpu h100`` stores it: its user, half with a --timeout."""
    return JobShape(
        job_id=job_id,
        device=DeviceRequest(type="gpu", variant="h100", count=gpus),
        band=Band.BATCH if rng.random() < 0.2 else Band.INTERACTIVE,
        submit_ms=now_ms - rng.randint(3_600_000, 2 * 86_400_000),
        user=user,
        time_limit_ms=rng.choice((None, 6 * 3_600_000, 2 * 86_400_000)),
    )


def held_store(url: str, held: int, queued: int, seed: int, now_ms: int) -> FederationStore:
    """A store holding ``held`` HANDED_OFF one-GPU jobs over the two peers (their reservations
    already pruned: the peers' observations count them) and ``queued`` waiting: one-GPU jobs, and a
    gang of 8 every fourth job (it fits nowhere: backfill holds devices for it)."""
    from iris.store import FederationStore, HandleState, JobHandle
    from iris.store.schema import job_handles
    from iris.store.store import _handle_values

    rng = random.Random(seed * 7_919 + held)
    store = FederationStore(url)
    if _stored(store):
        store.close()
        raise SystemExit(f"{store.url} holds something already: --store-url must name an empty store")
    rows = []
    for i in range(held):
        user = HELD_USERS[i % len(HELD_USERS)]
        shape = held_shape(rng, f"{user}/held-{i:06d}", user, now_ms)
        rows.append(
            _handle_values(
                JobHandle(
                    job_id=shape.job_id,
                    incarnation="inc-1",
                    state=HandleState.HANDED_OFF,
                    shape=shape,
                    assigned_peer=HELD_PEERS[i % len(HELD_PEERS)],
                    assigned_backend=HELD_BACKEND,
                    observation_epoch_ms=now_ms - 60_000,
                    # The handoff: when the job started holding its device (backfill reads it).
                    updated_ms=now_ms - rng.randint(60_000, 86_400_000),
                )
            )
        )
    for i in range(queued):
        user = HELD_USERS[i % len(HELD_USERS)]
        shape = held_shape(rng, f"{user}/queued-{i:03d}", user, now_ms, gpus=8 if i % 4 == 3 else 1)
        shape = shape.model_copy(update={"submit_ms": now_ms - rng.randint(1_000, 600_000)})
        rows.append(_handle_values(JobHandle(job_id=shape.job_id, incarnation="inc-1", shape=shape)))
    if rows:
        # One transaction: the store's own calls would take one each.
        with store._engine.begin() as conn:
            conn.execute(job_handles.insert(), rows)
    store.save_reports(held_reports(held, now_ms))
    return store


def held_tick(
    store: FederationStore,
    held: int,
    metrics: TickMetrics,
    loop: asyncio.AbstractEventLoop,
    times: dict[str, list[float]],
) -> PlanResult:
    """One tick's store calls, plan and metrics, in the tick's order; each step's time added to
    ``times``. Nothing is promoted: every tick finds the same state."""

    def step(name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        out = fn()
        times[name].append(time.perf_counter() - start)
        return out

    now_ms = int(time.time() * 1000)
    fair_share, backfill = FairShare(), Backfill()
    step("save_reports", partial(store.save_reports, held_reports(held, now_ms)))
    step("expire_due", partial(store.expire_due, now_ms))
    reports = step("load_reports", store.load_reports)
    step("prune_reservations", partial(store.prune_reservations, reports))
    queued = step("queued", store.queued)
    reservations = step("reservations", store.reservations)
    holding = step("in_use", store.in_use)
    request = partial(
        PlanRequest,
        home=HELD_HOME,
        jobs=[h.shape for h in queued],
        reports=reports,
        reservations=reservations,
        now_ms=now_ms,
        stale_after_ms=STALE_AFTER_MS,
        in_use=holding,
        fair_share=fair_share,
        backfill=backfill,
    )
    result = step("plan", lambda: plan_request(request()))
    reasons = {job_id: group.summary for group in result.waiting for job_id in group.job_ids}
    codes = {job_id: group.code for group in result.waiting for job_id in group.job_ids}
    step("update_reasons", partial(store.update_reasons, reasons, codes))
    step("fences", store.fences)
    view = FederationView(home=HELD_HOME, stale_after_ms=STALE_AFTER_MS, reports=reports)
    record = partial(
        metrics.record,
        MetricMeter.noop,
        queued=request.keywords["jobs"],
        waiting=result.waiting,
        view=view,
        seconds=0.0,
        in_use=holding,
        fair_share=fair_share,
    )
    step("metrics", lambda: loop.run_until_complete(_in_loop(record)))
    return result


async def _in_loop(fn: Callable[[], None]) -> None:
    """``fn`` in the event loop (TickMetrics arms its staleness timer on the running loop)."""
    fn()


class HeldRow(NamedTuple):
    held: int
    in_use: int
    placed: int
    waiting: int
    holds: int
    # Median seconds per step, and of the whole tick.
    steps: dict[str, float]
    total_s: float
    profile: str


def run_held(held: int, args: argparse.Namespace, workdir: Path) -> HeldRow:
    url = args.store_url or f"sqlite:///{workdir / f'held-{held}.db'}"
    store = held_store(url, held, args.held_queued, args.seed, int(time.time() * 1000))
    metrics = TickMetrics(stale_after_s=3600.0)
    loop = asyncio.new_event_loop()
    tick = partial(held_tick, store, held, metrics, loop)
    try:
        in_use = len(store.in_use())
        warm: dict[str, list[float]] = {name: [] for name in HELD_STEPS}
        result = tick(warm)  # warm-up (and the reasons stored once)
        times: dict[str, list[float]] = {name: [] for name in HELD_STEPS}
        totals: list[float] = []
        profiler = cProfile.Profile() if args.profile else None
        for _ in range(args.ticks):
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            result = tick(times)
            if profiler is not None:
                profiler.disable()
            totals.append(time.perf_counter() - start)
        shown = ""
        if profiler is not None:
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out).strip_dirs()
            stats.sort_stats("tottime").print_stats(args.profile_top)
            stats.sort_stats("cumulative").print_stats(args.profile_top)
            shown = out.getvalue()
    finally:
        loop.close()
        if args.store_url:
            _empty(store)
        store.close()
    return HeldRow(
        held=held,
        in_use=in_use,
        placed=len(result.placements),
        waiting=sum(len(g.job_ids) for g in result.waiting),
        holds=len(result.holds),
        steps={name: statistics.median(ts) for name, ts in times.items()},
        total_s=statistics.median(totals),
        profile=shown,
    )


def _tables() -> tuple[Table, ...]:
    from iris.store.schema import fences, job_handles, peer_reports, reservations

    return (job_handles, reservations, peer_reports, fences)


def _stored(store: FederationStore) -> bool:
    """Whether any table of the store holds a row."""
    with store._engine.connect() as conn:
        return any(conn.execute(select(func.count()).select_from(t)).scalar_one() for t in _tables())


def _empty(store: FederationStore) -> None:
    """Empty a store given by ``--store-url`` (empty when the run began) for the next N."""
    with store._engine.begin() as conn:
        for table in _tables():
            conn.execute(table.delete())


def print_held(rows: list[HeldRow], ticks: int) -> None:
    print()
    print(f"The tick's own work with N jobs held running (median ms over {ticks} ticks)")
    header = f"{'step':<20}" + "".join(f"{f'N={r.held:,}':>12}" for r in rows)
    print(header)
    print("-" * len(header))
    for name in HELD_STEPS:
        print(f"{name:<20}" + "".join(f"{r.steps[name] * 1000:>12.2f}" for r in rows))
    print("-" * len(header))
    print(f"{'tick (ms)':<20}" + "".join(f"{r.total_s * 1000:>12.2f}" for r in rows))
    print(f"{'in use':<20}" + "".join(f"{r.in_use:>12}" for r in rows))
    print(f"{'placed':<20}" + "".join(f"{r.placed:>12}" for r in rows))
    print(f"{'waiting':<20}" + "".join(f"{r.waiting:>12}" for r in rows))
    print(f"{'holds':<20}" + "".join(f"{r.holds:>12}" for r in rows))
    for r in rows:
        if r.profile:
            print()
            print(f"cProfile, N={r.held:,}, {ticks} ticks")
            print(r.profile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the placement tick against the reference planner.")
    parser.add_argument(
        "--jobs",
        type=int,
        nargs="+",
        default=None,
        help="queued jobs per planner case (default 1000 10000 50000; with --held, only if given)",
    )
    parser.add_argument("--clusters", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeat", type=int, default=5, help="ticks timed per case (median reported)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--held",
        type=int,
        nargs="+",
        default=None,
        help="time the tick's store reads, plan and metrics with N jobs held running, per N "
        "(the planner cases then run only if --jobs is given)",
    )
    parser.add_argument("--held-queued", type=int, default=8, help="jobs queued beside the held ones")
    parser.add_argument("--ticks", type=int, default=10, help="ticks timed per --held N (median reported)")
    parser.add_argument(
        "--store-url",
        default="",
        help="an empty federation store for --held, emptied after each N (default: SQLite in a temp dir)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the --held ticks, per N")
    parser.add_argument("--profile-top", type=int, default=25, help="entries shown per profile ordering")
    args = parse_args(
        parser, {"jobs": [300], "clusters": [5], "repeat": 1, "held": [0, 40], "ticks": 2}, argv
    )
    if args.held is not None:
        with tempfile.TemporaryDirectory(prefix="policy-bench-") as tmp:
            rows = [run_held(held, args, Path(tmp)) for held in args.held]
        print_held(rows, args.ticks)
        if args.jobs is None:
            return 0
        print()
    jobs_cases = args.jobs if args.jobs is not None else [1_000, 10_000, 50_000]

    header = (
        f"{'jobs':>6} {'clusters':>8} {'backends':>8} {'placed':>6} {'waiting':>7} {'median ms':>10} "
        f"{'placements/s':>12} {'reference ms':>13} {'speed-up':>9}"
    )
    print(header)
    print("-" * len(header))
    target_met: bool | None = None
    for clusters in args.clusters:
        for jobs in jobs_cases:
            row = run_case(jobs, clusters, args.repeat, args.seed)
            rate = row.placed / row.median_s if row.median_s > 0 else float("inf")
            ref = f"{'~' if row.extrapolated else ''}{row.reference_s * 1000:.0f}"
            speedup = row.reference_s / row.median_s
            print(
                f"{row.jobs:>6} {row.clusters:>8} {row.backends:>8} {row.placed:>6} {row.waiting:>7} "
                f"{row.median_s * 1000:>10.1f} {rate:>12.0f} {ref:>13} {speedup:>8.0f}x",
                flush=True,
            )
            if jobs == 10_000 and clusters == 100:
                target_met = row.median_s <= 0.100
    print()
    print(
        f"~ = reference timed on a prefix of {REFERENCE_PAIR_BUDGET:,} (job, backend) pairs and scaled "
        "to the full queue; its result on that prefix matched the planner's."
    )
    if target_met is not None:
        print(f"target 10k jobs x 100 clusters x 4 backends <= 100 ms: {'met' if target_met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
