"""Benchmark of the placement tick: `uv run python benchmarks/policy_bench.py`.

Times :func:`iris.policy.planner.plan` on synthetic federations (1k/10k/50k queued jobs x 10/100
clusters x 4 backends) and the simple reference planner on the same input, checks both return the
same result, and prints median time per tick, placements per second and the speed-up.
Not a test: numbers depend on the machine. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from benchmarks.smoke import parse_args
from iris.policy import (
    Availability,
    BackendReport,
    Band,
    Constraint,
    DeviceRequest,
    HeldByBand,
    JobShape,
    Op,
    PeerReport,
    PlanResult,
    Reservation,
    plan,
    plan_reference,
)

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the placement tick against the reference planner.")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    parser.add_argument("--clusters", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--repeat", type=int, default=5, help="ticks timed per case (median reported)")
    parser.add_argument("--seed", type=int, default=1)
    args = parse_args(parser, {"jobs": [300], "clusters": [5], "repeat": 1}, argv)

    header = (
        f"{'jobs':>6} {'clusters':>8} {'backends':>8} {'placed':>6} {'waiting':>7} {'median ms':>10} "
        f"{'placements/s':>12} {'reference ms':>13} {'speed-up':>9}"
    )
    print(header)
    print("-" * len(header))
    target_met: bool | None = None
    for clusters in args.clusters:
        for jobs in args.jobs:
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
