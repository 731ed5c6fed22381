"""Scheduling quality: a seeded synthetic trace replayed on the real stack, against an offline bound.

    uv run python -m benchmarks.trace [--minutes 10] [--seed 1] [--scale 60] [--load 0.9]
                                      [--backend process|slurm] [--out FILE.json] [--source HEAD]
                                      [--offline] [--fair-share]

Issue 19's benchmark (docs/BENCHMARKS.md, "Scheduling quality (issue 19)"):

1. **The trace** (:func:`generate`): Poisson arrivals of GPU jobs, each with a band (production,
   interactive, batch), a shape (1, 2, 4 or 8 H100 per replica, 1 to 3 replicas; a shape larger than
   every peer is drawn again), a duration (uniform in its band's range, in trace seconds) and a time
   limit (the duration times 1.2 to 2, plus 2 s of replay: submitted as its ``--timeout``). The
   arrival rate makes the offered load (chips x seconds asked per second) ``--load`` times the
   peers' H100s, so queues form and high bands meet capacity that batch work holds.
2. **The offline bound** (:func:`simulate`): the same trace, on the same peers, replayed in an
   event-driven simulation on the pure policy (``iris.policy.classify`` at arrival,
   ``iris.policy.plan`` at every arrival and end, no per-peer cap, no tick, no handoff and no
   reporting latency): work-conserving, and so a lower bound on the real stack's waits. With
   ``iris/policy/preemption.py`` present, capacity held by lower bands is reported and reclaimed at
   once (no grace period) through its ``choose_victims``; victims go back to the queue and restart
   from scratch. A revision with ``preempt_exempt_s`` (issue 29) also has a job back from a
   preemption exempt for each peer's configured time, in replay seconds: its chips are reported in
   ``exempt_by_band`` and the simulation plans again when the exemption ends. Without
   ``choose_victims``, held capacity cannot be reclaimed, so the simulation offers only idle
   capacity. The output says which. The plan sees the running jobs and their time limits, so a
   revision with backfill (issue 29) holds devices for jobs that cannot start; the same bound with
   backfill off is printed beside it (the policy before it, on the same trace).
3. **The replay**: on a fresh real stack (``benchmarks/harness.py``, the demo topology: two peers
   with 16 and 8 H100) on a frozen copy of ``--source``, each job is submitted at its arrival time
   divided by ``--scale`` and runs ``sleep (duration / scale)``. Arrivals fill the first three
   quarters of ``--minutes``; the last quarter at most lets the queue drain. The controllers' own
   records (``controller.db``, sampled every second) give each run's start and end; ``describe``
   gives each job's attempts (a ``PREEMPTED`` end is a preemption). With ``--backend slurm`` the
   two peers' H100 backends run their jobs on a single-node Slurm started for the run (those of
   ``config/clusters-slurm.toml``, iris/slurmdev.py; docs/DESIGN.md, "The Slurm backend").

Queue wait is the time a job is not running before it runs for good: submit to its first start,
plus, after each preempted run, that run's end to the next start. A job still waiting at the end is
censored (its wait so far is counted, and it is reported). Ticks are seconds over the manager's
tick period (``tick_interval_s``). The table gives per band: p50/p95 wait (s and ticks) measured
and in the bound; jobs that waited more than 10x their band's median (starvation; a median under
one tick counts as one tick); then GPU utilization while any job waits (every shape of the trace
fits some peer), preemptions and the GPU-seconds their runs had used (lost). ``--offline`` prints
the trace and the bound without starting anything.

**The fair-share scenario** (``--fair-share``, issue 29): every job is batch, and each is submitted
by user a or b (signed as that user), a drawing five times as many as b, at a load (6 by default)
where b alone asks all the H100s, so that both keep jobs waiting. Per user it prints jobs, waits,
GPU-seconds held and lost; then b's share of the GPU-seconds the band's jobs held while every user
had a job waiting (:func:`user_figures`; target at least 40%), measured, in the bound, and in the
bound with FIFO within the band (``aging_horizon_s`` 0: the order before fair share). The bound
orders a band with the measured revision's ``aging_horizon_s``, in replay seconds as the stack does.
"""

# The arguments are checked, then the snapshot switch runs, before any project module is imported;
# the other imports follow (hence E402 for this file). Bad arguments: one error line, nothing copied.
# ruff: noqa: E402

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.smoke import parse_args
from benchmarks.source import add_source_argument, run_from_snapshot

DEFAULT_LOAD = 0.9
# The fair-share scenario (--fair-share): batch only, user a submitting FAIR_SHARE_USERS' weights
# times b's jobs, at a load where b alone asks all the H100s (b's 1/6 of 6.0), so that both users
# keep jobs waiting and the order between them decides who holds what.
FAIR_SHARE_USERS: tuple[tuple[str, float], ...] = (("a", 5.0), ("b", 1.0))
FAIR_SHARE_LOAD = 6.0
# What b should hold of the band's GPU-seconds while both wait (issue 29's acceptance 2).
FAIR_SHARE_TARGET = 0.4


def _positive(kind: Callable[[str], float], *, zero: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value >= 0 if zero else value > 0) or value == math.inf:
            raise argparse.ArgumentTypeError(
                f"must be a {'non-negative' if zero else 'positive'} number: {text!r}"
            )
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        """Bad input is one line (no usage block) and exit status 2."""
        self.exit(2, f"benchmarks.trace: error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--minutes", type=_positive(float), default=10.0, help="replay length (arrivals: the first 3/4)"
    )
    p.add_argument("--seed", type=int, default=1, help="the trace's seed")
    p.add_argument(
        "--scale", type=_positive(float), default=60.0, help="trace seconds per replay second (compression)"
    )
    p.add_argument(
        "--load",
        type=_positive(float),
        help=(
            f"offered load, as a share of the H100s (default {DEFAULT_LOAD:g}; "
            f"{FAIR_SHARE_LOAD:g} with --fair-share)"
        ),
    )
    p.add_argument(
        "--fair-share",
        action="store_true",
        help=(
            "the fair-share scenario: batch jobs only, user a submitting 5x as many as user b; reports "
            "the GPU-seconds each held while both had a job waiting"
        ),
    )
    p.add_argument(
        "--backend",
        choices=("process", "slurm"),
        default="process",
        help="where the GPU peers run their jobs: processes, or a single-node Slurm started for the run",
    )
    p.add_argument(
        "--preempt-exempt-s",
        type=_positive(float, zero=True),
        help="every peer's preempt_exempt_s, in the stack and the bound (default: the config's)",
    )
    p.add_argument(
        "--aging-horizon-s",
        type=_positive(float, zero=True),
        help="the fair share's aging_horizon_s, in the stack and the bound (default: the config's; 0: FIFO)",
    )
    p.add_argument("--offline", action="store_true", help="print the trace and the bound only; start nothing")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the stack's temp directory")
    add_source_argument(p)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, ``--smoke`` (benchmarks/smoke.py) included."""
    return parse_args(parser(), {"minutes": 0.3}, argv)


if __name__ == "__main__":
    parse()
    run_from_snapshot("benchmarks.trace", sys.argv[1:])

import asyncio
import contextlib
import heapq
import importlib
import inspect
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from iris.policy import (
    Availability,
    BackendReport,
    Band,
    DeviceRequest,
    Disposition,
    HeldByBand,
    JobShape,
    PeerReport,
    classify,
    plan,
)

HOME = "home"
TOKEN = "h100"
TASK_QUEUE = "iris-bench-trace"
USER = "bench-trace@bench.local"
STARVATION_FACTOR = 10.0
# Arrivals fill this share of --minutes; the rest lets the queue drain.
ARRIVAL_SHARE = 0.75
# Bands, their share of arrivals, and their durations in trace seconds (uniform in [lo, hi]).
DEFAULT_BANDS: tuple[tuple[Band, float], ...] = (
    (Band.PRODUCTION, 0.15),
    (Band.INTERACTIVE, 0.35),
    (Band.BATCH, 0.50),
)
DEFAULT_DURATIONS: tuple[tuple[Band, float, float], ...] = (
    (Band.PRODUCTION, 120.0, 1200.0),
    (Band.INTERACTIVE, 60.0, 600.0),
    (Band.BATCH, 300.0, 2400.0),
)
DEFAULT_GPUS: tuple[tuple[int, float], ...] = ((1, 0.35), (2, 0.25), (4, 0.2), (8, 0.2))
DEFAULT_REPLICAS: tuple[tuple[int, float], ...] = ((1, 0.6), (2, 0.25), (3, 0.15))
# A job's time limit over its duration: users overestimate, by up to twice, plus LIMIT_SLACK_S
# (trace seconds: 2 s of replay at the default --scale), so that a replayed job, which starts a
# process and a sandbox before its sleep, is never killed by its limit.
LIMIT_FACTOR = (1.2, 2.0)
LIMIT_SLACK_S = 120.0


# ---- the trace ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceJob:
    """One job of the trace; times in trace seconds."""

    index: int
    arrival_s: float
    band: Band
    gpus: int
    replicas: int
    duration_s: float
    # The job's time limit (its --timeout), the user's estimate: its duration times a factor in
    # LIMIT_FACTOR, drawn from a generator of its own (the trace's jobs stay those of the seed).
    limit_s: float = 0.0
    # Who submits it (TraceConfig.users, from a generator of its own); "" for the one default user.
    user: str = ""

    @property
    def chips(self) -> int:
        return self.gpus * self.replicas


@dataclass(frozen=True)
class TraceConfig:
    """What :func:`generate` draws from. ``peers``: (peer id, H100 chips) of each GPU peer."""

    peers: tuple[tuple[str, int], ...]
    window_s: float
    seed: int = 1
    load: float = 0.9
    bands: tuple[tuple[Band, float], ...] = DEFAULT_BANDS
    durations: tuple[tuple[Band, float, float], ...] = DEFAULT_DURATIONS
    gpus: tuple[tuple[int, float], ...] = DEFAULT_GPUS
    replicas: tuple[tuple[int, float], ...] = DEFAULT_REPLICAS
    # (user, weight): each job's submitter, drawn with these weights; () for the one default user.
    users: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.peers or min(c for _, c in self.peers) < 1:
            raise ValueError("the trace needs at least one peer with at least one H100")
        if self.window_s <= 0 or self.load <= 0:
            raise ValueError("the trace's window and load must be positive")
        if self.users and (
            min(w for _, w in self.users) <= 0 or len({u for u, _ in self.users}) < len(self.users)
        ):
            raise ValueError("the trace's users need distinct names and positive weights")
        if not self.shapes():
            raise ValueError(f"no shape fits a peer of at most {self.largest_peer} H100")

    @property
    def capacity(self) -> int:
        return sum(c for _, c in self.peers)

    @property
    def largest_peer(self) -> int:
        return max(c for _, c in self.peers)

    def shapes(self) -> list[tuple[int, int, float]]:
        """(gpus, replicas, probability) of the shapes that fit some peer, renormalized: a shape
        larger than every peer would wait forever, so it is drawn again."""
        fits = [
            (g, r, pg * pr) for g, pg in self.gpus for r, pr in self.replicas if g * r <= self.largest_peer
        ]
        total = sum(p for _, _, p in fits)
        return [(g, r, p / total) for g, r, p in fits] if total > 0 else []

    def mean_chips(self) -> float:
        return sum(g * r * p for g, r, p in self.shapes())

    def mean_duration(self) -> float:
        weights = dict(self.bands)
        total = sum(weights.values())
        return sum(weights.get(b, 0.0) / total * (lo + hi) / 2 for b, lo, hi in self.durations)

    def rate(self) -> float:
        """Arrivals per trace second for the offered load: load x chips = rate x E[chips x duration]
        (shape and duration are drawn independently)."""
        return self.load * self.capacity / (self.mean_chips() * self.mean_duration())


def generate(cfg: TraceConfig) -> list[TraceJob]:
    """The trace: seeded (the same config gives the same jobs), arrivals in ``[0, window_s)``."""
    rng = random.Random(cfg.seed)
    rate = cfg.rate()
    bands = [b for b, _ in cfg.bands]
    band_weights = [w for _, w in cfg.bands]
    ranges = {b: (lo, hi) for b, lo, hi in cfg.durations}
    shapes = cfg.shapes()
    limits = random.Random(f"{cfg.seed}/limits")
    users = random.Random(f"{cfg.seed}/users")
    jobs: list[TraceJob] = []
    t = rng.expovariate(rate)
    while t < cfg.window_s:
        band = rng.choices(bands, band_weights)[0]
        gpus, replicas, _ = rng.choices(shapes, [p for _, _, p in shapes])[0]
        lo, hi = ranges[band]
        duration = rng.uniform(lo, hi)
        limit = duration * limits.uniform(*LIMIT_FACTOR) + LIMIT_SLACK_S
        user = users.choices([u for u, _ in cfg.users], [w for _, w in cfg.users])[0] if cfg.users else ""
        jobs.append(TraceJob(len(jobs), t, band, gpus, replicas, duration, limit, user))
        t += rng.expovariate(rate)
    return jobs


# ---- what happened to each job (measured or simulated) ------------------------------------------


@dataclass
class Run:
    """One run of a job on a peer, in replay seconds; ``end_s`` None: still running at the end."""

    start_s: float
    end_s: float | None = None
    preempted: bool = False
    peer: str = ""


@dataclass
class Outcome:
    """One job: its band, chips, when it was submitted (replay seconds) and its runs."""

    index: int
    band: Band
    chips: int
    submit_s: float | None
    runs: list[Run] = field(default_factory=list)
    user: str = ""


def queue_wait(o: Outcome, end_s: float) -> tuple[float, bool]:
    """(seconds waited, censored): submit to the first start, plus each preempted run's end to the
    next start; a job still waiting at ``end_s`` counts its wait so far and is censored."""
    assert o.submit_s is not None
    wait = 0.0
    t = o.submit_s
    for r in sorted(o.runs, key=lambda r: r.start_s):
        wait += max(0.0, r.start_s - t)
        if r.end_s is None or not r.preempted:
            return wait, False
        t = r.end_s
    return wait + max(0.0, end_s - t), True


def deltas_of(o: Outcome, end_s: float) -> list[tuple[float, int, int]]:
    """The job's (time, chips busy delta, jobs waiting delta) steps up to ``end_s``: it waits from
    its submission to each run's start (and after a preempted run), and holds its chips while it
    runs."""
    deltas: list[tuple[float, int, int]] = []
    if o.submit_s is None:
        return deltas
    t = o.submit_s
    for r in sorted(o.runs, key=lambda r: r.start_s):
        if r.start_s > t:
            deltas += [(t, 0, 1), (r.start_s, 0, -1)]
        end = end_s if r.end_s is None else r.end_s
        deltas += [(r.start_s, o.chips, 0), (end, -o.chips, 0)]
        if r.end_s is None or not r.preempted:
            return deltas
        t = r.end_s
    return [*deltas, (t, 0, 1), (end_s, 0, -1)]


def utilization(outcomes: Sequence[Outcome], capacity: int, start_s: float, end_s: float) -> dict[str, float]:
    """GPU utilization over ``[start_s, end_s]``: overall, and over the time some job waits (every
    shape of a trace fits some peer); plus how long jobs waited in that span."""
    deltas = sorted(d for o in outcomes for d in deltas_of(o, end_s))
    busy = waiting = 0
    last = start_s
    span = busy_area = wait_span = wait_busy = 0.0
    for at, d_busy, d_wait in [*deltas, (end_s, 0, 0)]:
        a, b = max(last, start_s), min(at, end_s)
        if b > a:
            span += b - a
            busy_area += busy * (b - a)
            if waiting > 0:
                wait_span += b - a
                wait_busy += busy * (b - a)
        last = max(last, at)
        busy += d_busy
        waiting += d_wait
    nan = float("nan")
    return {
        "overall": busy_area / (capacity * span) if span > 0 else nan,
        "while_waiting": wait_busy / (capacity * wait_span) if wait_span > 0 else nan,
        "waiting_s": wait_span,
        "span_s": span,
    }


def user_figures(outcomes: Sequence[Outcome], end_s: float, band: Band | None = None) -> dict[str, Any]:
    """Per user (of ``band``'s jobs, or all): jobs, p50/p95 wait, GPU-seconds held, preemptions and
    GPU-seconds lost; and the fair-share measure: the GPU-seconds each held while *every* user had
    a job waiting (``contended_gpu_s``, over ``contended_s``), where a scheduler's order between
    users shows (issue 29: with A submitting 5x B's batch jobs, B should hold at least 40%)."""
    group = [o for o in outcomes if o.submit_s is not None and (band is None or o.band is band)]
    users = sorted({o.user for o in group})
    steps = sorted((t, o.user, busy, wait) for o in group for t, busy, wait in deltas_of(o, end_s))
    busy = dict.fromkeys(users, 0)
    waiting = dict.fromkeys(users, 0)
    held = dict.fromkeys(users, 0.0)
    contended = dict.fromkeys(users, 0.0)
    contended_s = 0.0
    last = min((t for t, *_ in steps), default=0.0)
    for at, user, d_busy, d_wait in steps:
        dt = min(at, end_s) - last
        if dt > 0:
            for u in users:
                held[u] += busy[u] * dt
            if len(users) > 1 and all(waiting[u] > 0 for u in users):
                contended_s += dt
                for u in users:
                    contended[u] += busy[u] * dt
        last = max(last, min(at, end_s))
        busy[user] += d_busy
        waiting[user] += d_wait
    total = sum(contended.values())
    out: dict[str, Any] = {}
    for u in users:
        mine = [o for o in group if o.user == u]
        values = [queue_wait(o, end_s)[0] for o in mine]
        lost = preemption_figures(mine)
        out[u] = {
            "jobs": len(mine),
            "started": sum(1 for o in mine if o.runs),
            "p50_s": percentile(values, 50),
            "p95_s": percentile(values, 95),
            "gpu_s": held[u],
            "preemptions": lost["preemptions"],
            "wasted_gpu_s": lost["wasted_gpu_s"],
            "contended_gpu_s": contended[u],
            "contended_share": contended[u] / total if total > 0 else float("nan"),
        }
    return {"band": band.label if band else "all", "contended_s": contended_s, "users": out}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values (as benchmarks/harness.py)."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def summarize(outcomes: Sequence[Outcome], end_s: float, tick_s: float) -> dict[str, Any]:
    """Per band (and all): jobs, started, censored, p50/p95 wait in seconds and ticks, starved."""
    out: dict[str, Any] = {}
    groups: list[tuple[str, list[Outcome]]] = [
        (b.label, [o for o in outcomes if o.band is b and o.submit_s is not None]) for b in Band
    ]
    groups.append(("all", [o for o in outcomes if o.submit_s is not None]))
    starved_ids: set[int] = set()
    for label, group in groups:
        waits = [queue_wait(o, end_s) for o in group]
        values = [w for w, _ in waits]
        p50 = percentile(values, 50)
        if label != "all":
            bar = STARVATION_FACTOR * max(p50, tick_s) if values else math.inf
            starved = [o.index for o, w in zip(group, values, strict=True) if w > bar]
            starved_ids.update(starved)
        else:
            starved = sorted(starved_ids)
        p95 = percentile(values, 95)
        out[label] = {
            "jobs": len(group),
            "started": sum(1 for o in group if o.runs),
            "censored": sum(1 for _, c in waits if c),
            "p50_s": p50,
            "p95_s": p95,
            "p50_ticks": p50 / tick_s,
            "p95_ticks": p95 / tick_s,
            "max_s": max(values) if values else float("nan"),
            "starved": len(starved),
            "starved_jobs": starved,
        }
    return out


def preemption_figures(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Preempted runs and the GPU-seconds they had used (lost: a victim restarts from scratch)."""
    count = 0
    wasted = 0.0
    for o in outcomes:
        for r in o.runs:
            if r.preempted and r.end_s is not None:
                count += 1
                wasted += o.chips * max(0.0, r.end_s - r.start_s)
    return {"preemptions": count, "wasted_gpu_s": wasted}


# ---- the offline bound -------------------------------------------------------------------------

# (job id, band, chips, start s, times preempted before) of each running job.
RunningJob = tuple[str, Band, int, float, int]
# (waiting band, need, free, running jobs, now s, the peer's preempt_exempt_s) -> victims or None.
Chooser = Callable[[Band, int, int, Sequence[RunningJob], float, float], list[str] | None]


@dataclass(frozen=True)
class PreemptionModel:
    """What the measured revision's policy offers: its victim choice adapted to one token (None:
    no preemption), whether it has the exemption (``preempt_exempt_s``: its choice takes
    ``exempt_ms`` and its capacity reports ``exempt_by_band``), and a line saying so."""

    chooser: Chooser | None
    exemption: bool
    how: str


def preemption_chooser(exempt_s: float = 0.0) -> PreemptionModel:
    """The policy's victim choice (``iris.policy.preemption.choose_victims``, issue 19) if this
    revision has it, adapted to one token and to what its signature takes (``now_ms`` and
    ``exempt_ms``, issue 29; ``preempted_before``); ``exempt_s`` only names the exemption in the
    line (the simulation passes each peer's own)."""
    try:
        mod = importlib.import_module("iris.policy.preemption")
        choose = mod.choose_victims
        task_type = mod.RunningTask
    except (ImportError, AttributeError):
        return PreemptionModel(
            None, False, "not modelled: this revision has no iris.policy.preemption.choose_victims"
        )
    # A revision before the earlier-preemptions key has no such field; one before issue 29 takes
    # no time and no exemption.
    counts = "preempted_before" in {f.name for f in dataclasses.fields(task_type)}
    params = inspect.signature(choose).parameters
    timed = "now_ms" in params
    exemption = timed and "exempt_ms" in params and "exempt_by_band" in Availability.model_fields

    def chooser(
        band: Band, need: int, free: int, running: Sequence[RunningJob], now_s: float, peer_exempt_s: float
    ) -> list[str] | None:
        tasks = [
            task_type(
                task_id=tid,
                band=b,
                amounts={TOKEN: chips},
                started_ms=int(start * 1000),
                **({"preempted_before": before} if counts else {}),
            )
            for tid, b, chips, start, before in running
        ]
        when: dict[str, int] = {"now_ms": int(now_s * 1000)} if timed else {}
        if exemption:
            when["exempt_ms"] = round(peer_exempt_s * 1000)
        victims = choose(band, {TOKEN: need}, {TOKEN: free}, tasks, **when)
        return None if victims is None else [str(v.task_id) for v in victims]

    how = "modelled: iris.policy.preemption.choose_victims, no grace period"
    if exemption:
        how += f", exempt {exempt_s:g} s after a restart (preempt_exempt_s)"
    return PreemptionModel(chooser, exemption, how)


def _backend(peer: str) -> str:
    return f"{TOKEN}-{peer}"


def _reports(
    peers: Mapping[str, int],
    running: Mapping[str, dict[int, tuple[Band, int, float]]],
    now_ms: int,
    with_held: bool,
    exempt: Mapping[str, dict[Band, int]] | None = None,
) -> list[PeerReport]:
    """Every peer's report; ``exempt``: per peer, what exempt jobs hold by band (only passed for a
    revision whose reports have ``exempt_by_band``)."""
    reports = [
        PeerReport(
            peer_id=HOME,
            last_contact_ms=now_ms,
            backends=[
                BackendReport(
                    backend_id="cpu-home",
                    advertised_attributes={"device-type": ["cpu"]},
                    availability=Availability(observation_epoch_ms=now_ms, amounts={"cpu": 8}),
                )
            ],
        )
    ]
    for peer, total in peers.items():
        busy = sum(chips for _, chips, _ in running[peer].values())
        held: dict[Band, int] = {}
        for band, chips, _ in running[peer].values():
            held[band] = held.get(band, 0) + chips
        reports.append(
            PeerReport(
                peer_id=peer,
                last_contact_ms=now_ms,
                backends=[
                    BackendReport(
                        backend_id=_backend(peer),
                        advertised_attributes={"device-type": ["gpu"], "device-variant": [TOKEN]},
                        availability=Availability(
                            observation_epoch_ms=now_ms,
                            amounts={TOKEN: total - busy},
                            total_amounts={TOKEN: total},
                            held_by_band=[
                                HeldByBand(band=b, amounts={TOKEN: n}) for b, n in sorted(held.items())
                            ]
                            if with_held
                            else [],
                            **(
                                {
                                    "exempt_by_band": [
                                        HeldByBand(band=b, amounts={TOKEN: n})
                                        for b, n in sorted(exempt[peer].items())
                                    ]
                                }
                                if with_held and exempt is not None and exempt.get(peer)
                                else {}
                            ),
                        ),
                    )
                ],
            )
        )
    return reports


def shape(job: TraceJob, submit_ms: int, scale: float = 1.0) -> JobShape:
    """The job as the policy sees it; its time limit in replay seconds (a revision before backfill
    has no such field and ignores it) and its user (the account its fair share counts; without
    one, a job is its own account, which leaves the order within a band FIFO)."""
    fields: dict[str, Any] = {
        "job_id": f"j{job.index}",
        "device": DeviceRequest(type="gpu", variant=TOKEN, count=job.gpus, replicas=job.replicas),
        "band": job.band,
        "submit_ms": submit_ms,
        "time_limit_ms": math.ceil(job.limit_s / scale * 1000) if job.limit_s else None,
    }
    if job.user and "user" in JobShape.model_fields:
        fields["user"] = job.user
    return JobShape.model_validate(fields)


def fair_share_setting(aging_horizon_s: float | None) -> dict[str, Any]:
    """``plan``'s keyword for the order within a band: fair share with this aging horizon (replay
    seconds; 0 is FIFO), or nothing (the default, or a revision before fair share, issue 29)."""
    if aging_horizon_s is None or "fair_share" not in inspect.signature(plan).parameters:
        return {}
    from iris.policy import FairShare

    return {"fair_share": FairShare(aging_horizon_ms=round(aging_horizon_s * 1000))}


def backfill_setting(on: bool) -> dict[str, Any]:
    """``plan``'s keyword for backfill on or off; none for a revision before backfill (issue 29)."""
    if "backfill" not in inspect.signature(plan).parameters:
        return {}
    from iris.policy import Backfill

    return {"backfill": Backfill(enabled=on)}


def holding(
    shapes: Mapping[int, JobShape], running: Mapping[str, dict[int, tuple[Band, int, float]]]
) -> list[JobShape]:
    """The running jobs as the tick's ``in_use`` gives them: where each runs and since when (a
    revision before backfill gets the shapes alone)."""
    try:
        from iris.policy.models import RunningOn
    except ImportError:
        return [shapes[i] for jobs in running.values() for i in jobs]
    return [
        shapes[i].model_copy(
            update={
                "running_on": RunningOn(peer_id=peer, backend_id=_backend(peer), since_ms=int(start * 1000))
            }
        )
        for peer, jobs in running.items()
        for i, (_, _, start) in jobs.items()
    ]


@dataclass
class SimResult:
    outcomes: list[Outcome]
    end_s: float
    rejected: list[int]
    preemption: str


def simulate(
    jobs: Sequence[TraceJob],
    peers: Mapping[str, int],
    *,
    scale: float = 1.0,
    chooser: Chooser | None = None,
    preemption: str = "not modelled",
    exempt_s: Mapping[str, float] | None = None,
    backfill: bool = True,
    aging_horizon_s: float | None = None,
) -> SimResult:
    """The work-conserving replay of ``jobs`` on the pure policy, in replay seconds (trace seconds
    over ``scale``): classify at arrival, plan at every arrival and end, start what it places at
    once. With ``chooser``, held capacity is reported and a placement that preempts stops the
    chooser's victims on its peer first (they re-queue with their submit time and full duration).
    With ``exempt_s`` (each peer's ``preempt_exempt_s``, a revision that has it), a job back from a
    preemption is exempt for that long from its restart: its chips are reported exempt (the
    planner does not count them reclaimable) and the chooser never takes it; the simulation also
    plans again when an exemption ends, as the process backend schedules its head again then.
    The plan sees the running jobs (``in_use``) and, in a revision with backfill, holds devices for
    jobs that cannot start; ``backfill`` False turns that off (the policy before issue 29).
    ``aging_horizon_s`` is the fair share's (the config's ``aging_horizon_s``; 0: FIFO within a
    band; None: the policy's default)."""
    by_id = {f"j{j.index}": j for j in jobs}
    outcomes = {j.index: Outcome(j.index, j.band, j.chips, None, user=j.user) for j in jobs}
    arrivals = sorted(jobs, key=lambda j: (j.arrival_s, j.index))
    running: dict[str, dict[int, tuple[Band, int, float]]] = {p: {} for p in peers}
    ends: list[tuple[float, int, str, int]] = []  # (end, index, peer, generation)
    exemption_ends: list[float] = []  # when an exemption ends: plan again
    generation: dict[int, int] = {}
    queue: dict[str, JobShape] = {}
    shapes: dict[int, JobShape] = {}
    rejected: list[int] = []
    ai = 0
    now = 0.0

    def preempted_before(index: int) -> int:
        return sum(r.preempted for r in outcomes[index].runs)

    def is_exempt(peer: str, index: int, started: float) -> bool:
        span = (exempt_s or {}).get(peer, 0.0)
        return span > 0 and preempted_before(index) > 0 and now - started < span

    def exempt_held() -> dict[str, dict[Band, int]] | None:
        if exempt_s is None:
            return None
        out: dict[str, dict[Band, int]] = {}
        for peer, jobs_there in running.items():
            for index, (band, chips, started) in jobs_there.items():
                if is_exempt(peer, index, started):
                    out.setdefault(peer, {})[band] = out.get(peer, {}).get(band, 0) + chips
        return out

    def start(job_id: str, peer: str) -> None:
        j = by_id[job_id]
        running[peer][j.index] = (j.band, j.chips, now)
        outcomes[j.index].runs.append(Run(start_s=now, peer=peer))
        gen = generation[j.index] = generation.get(j.index, 0) + 1
        heapq.heappush(ends, (now + j.duration_s / scale, j.index, peer, gen))
        if exempt_s is not None and exempt_s.get(peer, 0.0) > 0 and preempted_before(j.index) > 0:
            heapq.heappush(exemption_ends, now + exempt_s[peer] + 1e-6)  # just past its end
        del queue[job_id]

    while ai < len(arrivals) or ends:
        next_arrival = arrivals[ai].arrival_s / scale if ai < len(arrivals) else math.inf
        next_end = ends[0][0] if ends else math.inf
        next_exemption_end = exemption_ends[0] if exemption_ends else math.inf
        now = min(next_arrival, next_end, next_exemption_end)
        while exemption_ends and exemption_ends[0] <= now:
            heapq.heappop(exemption_ends)
        while ends and ends[0][0] <= now:
            _, index, peer, gen = heapq.heappop(ends)
            if generation.get(index) != gen or index not in running[peer]:
                continue  # a run preempted before its end
            del running[peer][index]
            outcomes[index].runs[-1].end_s = now
        while ai < len(arrivals) and arrivals[ai].arrival_s / scale <= now:
            j = arrivals[ai]
            ai += 1
            s = shape(j, int(j.arrival_s / scale * 1000), scale)
            shapes[j.index] = s
            outcomes[j.index].submit_s = j.arrival_s / scale
            reports = _reports(peers, running, int(now * 1000), chooser is not None, exempt_held())
            c = classify(s, home=HOME, reports=reports, now_ms=int(now * 1000), stale_after_ms=2**40)
            if c.disposition is Disposition.REJECT:
                rejected.append(j.index)
            else:
                queue[s.job_id] = s
        # Plan until a pass places nothing: a preemption may re-queue victims that fit elsewhere.
        for _ in range(len(jobs) + 1):
            if not queue:
                break
            reports = _reports(peers, running, int(now * 1000), chooser is not None, exempt_held())
            result = plan(
                list(queue.values()),
                home=HOME,
                reports=reports,
                now_ms=int(now * 1000),
                stale_after_ms=2**40,
                in_use=holding(shapes, running),
                **backfill_setting(backfill),
                **fair_share_setting(aging_horizon_s),
            )
            placed = 0
            for p in result.placements:
                j = by_id[p.job_id]
                free = peers[p.peer_id] - sum(c for _, c, _ in running[p.peer_id].values())
                if free < j.chips:
                    if chooser is None:
                        continue
                    tasks = [
                        (f"j{i}", b, c, t, preempted_before(i)) for i, (b, c, t) in running[p.peer_id].items()
                    ]
                    victims = chooser(j.band, j.chips, free, tasks, now, (exempt_s or {}).get(p.peer_id, 0.0))
                    if not victims:
                        continue
                    for v in victims:
                        vj = by_id[v]
                        del running[p.peer_id][vj.index]
                        run = outcomes[vj.index].runs[-1]
                        run.end_s, run.preempted = now, True
                        queue[v] = shapes[vj.index]
                start(p.job_id, p.peer_id)
                placed += 1
            if not placed:
                break
    return SimResult(list(outcomes.values()), now, rejected, preemption)


# ---- the replay on the real stack --------------------------------------------------------------


@dataclass
class Seen:
    """One run as its controller recorded it (``controller.db``), keyed by (job id, nonce)."""

    peer: str
    state: str
    started_ms: int | None
    finished_ms: int | None


def submitter(user: str) -> str:
    """The signed user who submits a trace job of ``user`` ("": the one default user)."""
    return f"bench-trace-{user}@bench.local" if user else USER


def gpu_peers(cfg: Any) -> list[tuple[str, int]]:
    """(peer, H100 chips) of each cluster with H100s in a federation config."""
    out = []
    for c in cfg.clusters:
        chips = sum(int(b.devices.get(TOKEN, 0)) for b in c.backends if b.devices)
        if chips > 0 and c.name != cfg.home:
            out.append((c.name, chips))
    return out


async def start_slurm(root: Path) -> Any:
    """The run's single-node Slurm, with the GPUs of config/clusters-slurm.toml's peers."""
    from iris import slurmdev
    from iris.config import PROJECT_ROOT, load_config

    spec = slurmdev.spec_for(load_config(PROJECT_ROOT / "config" / "clusters-slurm.toml"))
    assert spec is not None
    slurm = slurmdev.SlurmCluster(spec, root / "slurm")
    await asyncio.to_thread(slurm.start)  # stops what it started if it fails
    print(f"[{time.strftime('%X')}] Slurm up: {slurm.address}", flush=True)
    return slurm


def overrides(cfg: Any, args: argparse.Namespace) -> None:
    """``--preempt-exempt-s`` and ``--aging-horizon-s`` on ``cfg`` (in place), where given."""
    if args.preempt_exempt_s is not None:
        for c in cfg.clusters:
            c.preempt_exempt_s = args.preempt_exempt_s
    if args.aging_horizon_s is not None:
        cfg.aging_horizon_s = args.aging_horizon_s


def on_slurm(cfg: Any, slurm: Any) -> None:
    """The GPU peers' backends of ``cfg`` (in place) as config/clusters-slurm.toml has them, on
    ``slurm``."""
    from iris import slurmdev
    from iris.config import PROJECT_ROOT, load_config

    on = load_config(PROJECT_ROOT / "config" / "clusters-slurm.toml")
    for c in cfg.clusters:
        theirs = {b.id: b for b in on.cluster(c.name).backends if b.kind == "slurm"}
        c.backends = [theirs.get(b.id, b) for b in c.backends]
    slurmdev.point_at(cfg, slurm)


async def replay(args: argparse.Namespace, trace: Sequence[TraceJob], tick_s: float) -> dict[str, Any]:
    """Submit each job at its (compressed) arrival time on a fresh stack; return each job's outcome
    in replay seconds from the run's start, and the run's end."""
    from benchmarks.harness import BenchStack, gather_bounded, uptime_line
    from benchmarks.running import controller_db, read_jobs
    from iris.client import AsyncIrisClient, build_spec

    root = Path(tempfile.mkdtemp(prefix="iris-bench-trace-"))
    stack = BenchStack(root)
    slurm: Any = None

    print(f"[{time.strftime('%X')}] stack in {root} ({uptime_line()})", flush=True)
    seen: dict[tuple[str, str], Seen] = {}
    job_ids: dict[str, int] = {}
    submit_ms: dict[int, int] = {}
    errors: list[str] = []
    sampler: asyncio.Task[None] | None = None
    try:
        # Submissions are signed by their user (docs/DESIGN.md, "User → home"); the production band
        # needs the admin role, which only a user with production jobs gets.
        if args.backend == "slurm":
            slurm = await start_slurm(root)

        def configure(cfg: Any) -> None:
            if slurm is not None:
                on_slurm(cfg, slurm)
            overrides(cfg, args)

        users: dict[str, list[str]] = {USER: ["user"]}  # the warm-up job's
        users.update({submitter(j.user): ["user"] for j in trace})
        for j in trace:
            if j.band is Band.PRODUCTION:
                users[submitter(j.user)] = ["user", "admin"]
        await stack.start(configure, task_queue=TASK_QUEUE, users=users)
        await stack.start_worker()
        iris = AsyncIrisClient(stack.client, stack.config)
        dbs = {c.name: controller_db(stack, c.name) for c in stack.config.clusters}

        async def sample() -> None:
            for peer, path in dbs.items():
                rows = await asyncio.to_thread(
                    read_jobs, path, "job_id, nonce, state, started_ms, finished_ms"
                )
                for job_id, nonce, state, started, finished in rows:
                    if job_id in job_ids:
                        seen[(job_id, nonce)] = Seen(peer, state, started, finished)

        # Warm-up (imports, the workflow sandbox, connections): not counted.
        warm = build_spec(["true"], name="trace-warm", user=USER, device_type="h100", gpu_count=1)
        await iris.submit_spec(warm)
        warm_end = time.monotonic() + 120
        while time.monotonic() < warm_end:
            with contextlib.suppress(Exception):
                if (await iris.describe(warm.job_id)).terminal:
                    break
            await asyncio.sleep(0.5)

        window = args.minutes * 60 * ARRIVAL_SHARE
        in_window = [j for j in trace if j.arrival_s / args.scale < window]
        t0_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        budget_end = t0 + args.minutes * 60

        async def submit(j: TraceJob) -> None:
            await asyncio.sleep(max(0.0, t0 + j.arrival_s / args.scale - time.monotonic()))
            spec = build_spec(
                ["sleep", f"{j.duration_s / args.scale:.2f}"],
                name=f"trace-{j.index:04d}",
                user=submitter(j.user),
                device_type="h100",
                gpu_count=j.gpus,
                replicas=j.replicas,
                priority=j.band,
                max_retries_preemption=3,
                # Its time limit, which backfill plans with (a revision without backfill only
                # enforces it; the job ends well before it).
                timeout_s=j.limit_s / args.scale,
            )
            job_ids[spec.job_id] = j.index
            submit_ms[j.index] = spec.submit_ms
            try:
                await iris.submit_spec(spec)
            except Exception as exc:  # counted and reported; the run goes on
                errors.append(f"job {j.index}: {exc!r}")
                del job_ids[spec.job_id]
                del submit_ms[j.index]

        async def sample_loop() -> None:
            last = 0.0
            while True:
                await sample()
                now = time.monotonic() - t0
                if now - last >= 10:
                    last = now
                    started = {job for (job, _), s in seen.items() if s.started_ms is not None}
                    running = sum(1 for s in seen.values() if s.state == "RUNNING")
                    print(
                        f"  t={now:4.0f}s submitted {len(job_ids)}/{len(in_window)} started {len(started)} "
                        f"running {running} errors {len(errors)}",
                        flush=True,
                    )
                await asyncio.sleep(1.0)

        print(
            f"[{time.strftime('%X')}] replay: {len(in_window)} jobs over {window:.0f}s, then at most "
            f"{args.minutes * 60 - window:.0f}s to drain",
            flush=True,
        )
        sampler = asyncio.create_task(sample_loop())
        await asyncio.gather(*(submit(j) for j in in_window))

        def all_started() -> bool:
            latest: dict[str, Seen] = {}
            for (job, _), s in seen.items():
                if s.started_ms is not None and (
                    job not in latest or (latest[job].started_ms or 0) < s.started_ms
                ):
                    latest[job] = s
            return len(latest) == len(job_ids) and all(s.state != "PREEMPTED" for s in latest.values())

        while time.monotonic() < budget_end:
            if all_started():
                break
            await asyncio.sleep(1.0)
        sampler.cancel()
        sampler = None
        await sample()
        end_ms = int(time.time() * 1000)
        print(f"[{time.strftime('%X')}] collecting {len(job_ids)} jobs' attempts", flush=True)
        statuses = await gather_bounded((iris.describe(j) for j in job_ids), 8)
        # How each attempt ended, as home recorded it: the last sample may have caught a run
        # still RUNNING that ended (or was preempted) before the next attempt replaced its record.
        attempt_end: dict[tuple[str, str], tuple[str, int | None]] = {}
        states: dict[str, int] = {}
        for job_id, st in zip(job_ids, statuses, strict=True):
            if isinstance(st, BaseException):
                errors.append(f"describe {job_id}: {st!r}")
                continue
            states[st.state.value] = states.get(st.state.value, 0) + 1
            for a in st.attempts:
                attempt_end[(job_id, a.nonce)] = (a.end or "", a.ended_ms)
        outcomes = {j.index: Outcome(j.index, j.band, j.chips, None, user=j.user) for j in in_window}
        for index in job_ids.values():
            outcomes[index].submit_s = (submit_ms[index] - t0_ms) / 1000
        for (job_id, nonce), s in seen.items():
            if s.started_ms is None or job_id not in job_ids:
                continue
            end_kind, home_ended = attempt_end.get((job_id, nonce), ("", None))
            ended = s.finished_ms if s.state not in ("RUNNING", "PENDING") else home_ended
            outcomes[job_ids[job_id]].runs.append(
                Run(
                    start_s=(s.started_ms - t0_ms) / 1000,
                    end_s=None if ended is None else (ended - t0_ms) / 1000,
                    preempted=s.state == "PREEMPTED" or end_kind == "PREEMPTED",
                    peer=s.peer,
                )
            )
        return {
            "outcomes": list(outcomes.values()),
            "end_s": (end_ms - t0_ms) / 1000,
            "errors": errors,
            "home_states": states,
        }
    finally:
        if sampler is not None:
            sampler.cancel()
        await stack.stop()
        if slurm is not None:
            await asyncio.to_thread(slurm.stop)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


# ---- the report --------------------------------------------------------------------------------


def fmt(v: float) -> str:
    if v != v:  # NaN
        return "-"
    return f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"


def pct(v: float) -> str:
    return "-" if v != v else f"{100 * v:.0f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, rule: bool = True) -> list[str]:
    """Aligned columns: the first to the left, the others to the right; a rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    head = line(headers)
    return [head, *(["-" * len(head)] if rule else []), *(line(r) for r in rows)]


def report(
    measured: dict[str, Any] | None,
    bound: dict[str, Any],
    tick_s: float,
) -> str:
    """The table: per band, measured (if any) and the offline bound side by side."""
    headers = ["band", "jobs", "started", "p50 s", "p95 s", "p50 ticks", "p95 ticks", "starved"]
    headers += ["bound p50 s", "bound p95 s", "bound starved"]
    rows = []
    for label in [b.label for b in Band] + ["all"]:
        b = bound["bands"][label]
        m = measured["bands"][label] if measured else None
        cens = f" ({m['censored']} waiting)" if m and m["censored"] else ""
        rows.append(
            [
                label,
                str(m["jobs"] if m else b["jobs"]),
                (str(m["started"]) + cens) if m else "-",
                fmt(m["p50_s"]) if m else "-",
                fmt(m["p95_s"]) if m else "-",
                fmt(m["p50_ticks"]) if m else "-",
                fmt(m["p95_ticks"]) if m else "-",
                str(m["starved"]) if m else "-",
                fmt(b["p50_s"]),
                fmt(b["p95_s"]),
                str(b["starved"]),
            ]
        )
    lines = table(headers, rows)
    bu, bp = bound["utilization"], bound["preemption"]
    if measured:
        mu, mp = measured["utilization"], measured["preemption"]
        lines.append(
            f"GPU utilization while a job waits: {pct(mu['while_waiting'])} over {mu['waiting_s']:.0f}s "
            f"(bound {pct(bu['while_waiting'])} over {bu['waiting_s']:.0f}s); overall {pct(mu['overall'])} "
            f"(bound {pct(bu['overall'])})"
        )
        lines.append(
            f"preemptions: {mp['preemptions']}, wasting {mp['wasted_gpu_s']:.0f} GPU-s "
            f"(bound {bp['preemptions']}, {bp['wasted_gpu_s']:.0f} GPU-s)"
        )
    else:
        lines.append(
            f"GPU utilization while a job waits (bound): {pct(bu['while_waiting'])} over "
            f"{bu['waiting_s']:.0f}s; overall {pct(bu['overall'])}"
        )
        lines.append(f"preemptions (bound): {bp['preemptions']}, wasting {bp['wasted_gpu_s']:.0f} GPU-s")
    for name, fig in (("measured", measured), ("bound", bound)):
        if fig is not None:
            lines.append(f"targets of issue 19, {name}: {targets(fig)}")
    lines.append(
        f"starved: waited more than {STARVATION_FACTOR:.0f}x the band's median (a median under one tick, "
        f"{tick_s:g} s, counts as one tick); ticks = seconds / tick period"
    )
    lines.append(
        f"bound: work-conserving simulation on the pure policy; preemption {bound['preemption_model']}"
    )
    return "\n".join(lines)


def users_report(measured: dict[str, Any] | None, bound: dict[str, Any], fifo: dict[str, Any] | None) -> str:
    """Per user (every band together): waits, GPU-seconds held and lost; then, per band with more
    than one user, each user's share of the GPU-seconds held while every user had a job waiting
    (the fair-share measure), measured, in the bound, and in the bound with FIFO within the band."""
    main = measured or bound
    headers = ["user", "jobs", "started", "p50 s", "p95 s", "GPU-s", "preemptions", "GPU-s lost"]
    rows = [
        [
            user,
            str(f["jobs"]),
            str(f["started"]),
            fmt(f["p50_s"]),
            fmt(f["p95_s"]),
            f"{f['gpu_s']:.0f}",
            str(f["preemptions"]),
            f"{f['wasted_gpu_s']:.0f}",
        ]
        for user, f in main["users"]["all"]["users"].items()
    ]
    lines = [f"per user ({'measured' if measured else 'bound'}):", *table(headers, rows, rule=False)]

    def share(fig: dict[str, Any] | None, label: str, user: str) -> str:
        if fig is None or label not in fig["users"] or user not in fig["users"][label]["users"]:
            return "-"
        f = fig["users"][label]
        return f"{pct(f['users'][user]['contended_share'])} over {f['contended_s']:.0f}s"

    for label in [b.label for b in Band]:
        uf = main["users"].get(label)
        if uf is None or len(uf["users"]) < 2:
            continue
        least = min(uf["users"], key=lambda u: uf["users"][u]["jobs"])
        mine = uf["users"][least]["contended_share"]
        verdict = "met" if mine >= FAIR_SHARE_TARGET else "NOT met"
        lines.append(
            f"fair share ({label}): {least}, with the fewest jobs, held {share(main, label, least)} "
            f"{'measured' if measured else '(bound)'} of the GPU-seconds while every user had a job waiting"
            + (f"; bound {share(bound, label, least)}" if measured else "")
            + f"; bound with FIFO within the band {share(fifo, label, least)}"
        )
        lines.append(f"target of issue 29: the lightest user holds ≥ {pct(FAIR_SHARE_TARGET)}: {verdict}")
    return "\n".join(lines)


def plain_line(
    plain: dict[str, Any], label: str = "bound without preemption (held capacity never reclaimed)"
) -> str:
    waits = ", ".join(
        f"{b.label} {fmt(plain['bands'][b.label]['p50_s'])}/{fmt(plain['bands'][b.label]['p95_s'])}"
        for b in Band
    )
    lost = plain.get("preemption", {})
    wasted = f"; preemptions {lost['preemptions']}, {lost['wasted_gpu_s']:.0f} GPU-s lost" if lost else ""
    return (
        f"{label}: p50/p95 s {waits}; starved "
        f"{plain['bands']['all']['starved']}; utilization while a job waits "
        f"{pct(plain['utilization']['while_waiting'])}{wasted}"
    )


def targets(fig: dict[str, Any]) -> str:
    """Issue 19's targets against one set of figures: production p95 wait at most 2 ticks, GPU
    utilization at least 90% while a job waits, no job starved (nor still waiting at the end)."""
    p95 = fig["bands"]["production"]["p95_ticks"]
    util = fig["utilization"]["while_waiting"]
    starved = fig["bands"]["all"]["starved"]
    waiting = fig["bands"]["all"]["censored"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return (
        f"production p95 ≤ 2 ticks {verdict(not p95 > 2)} ({fmt(p95)}); utilization while waiting "
        f"≥ 90% {verdict(not util < 0.9)} ({pct(util)}); no starvation "
        f"{verdict(starved == 0 and waiting == 0)} ({starved} starved, {waiting} still waiting)"
    )


def figures(outcomes: Sequence[Outcome], capacity: int, end_s: float, tick_s: float) -> dict[str, Any]:
    submitted = [o.submit_s for o in outcomes if o.submit_s is not None]
    start = min(submitted) if submitted else 0.0
    return {
        "bands": summarize(outcomes, end_s, tick_s),
        "utilization": utilization(outcomes, capacity, start, end_s),
        "preemption": preemption_figures(outcomes),
        "users": {
            label: user_figures(outcomes, end_s, band)
            for label, band in [("all", None), *((b.label, b) for b in Band)]
            if any(o.band is band or band is None for o in outcomes)
        },
        "end_s": end_s,
    }


def trace_config(args: argparse.Namespace, peers: Sequence[tuple[str, int]]) -> TraceConfig:
    """What the command line asks to replay: the three bands of one user at ``--load`` (default
    DEFAULT_LOAD), or with ``--fair-share`` batch jobs only of FAIR_SHARE_USERS at FAIR_SHARE_LOAD
    unless ``--load`` says otherwise. Arrivals fill ARRIVAL_SHARE of ``--minutes``, in trace time."""
    load = args.load if args.load is not None else FAIR_SHARE_LOAD if args.fair_share else DEFAULT_LOAD
    scenario: dict[str, Any] = (
        {"bands": ((Band.BATCH, 1.0),), "users": FAIR_SHARE_USERS} if args.fair_share else {}
    )
    window_s = args.minutes * 60 * ARRIVAL_SHARE * args.scale
    return TraceConfig(peers=tuple(peers), window_s=window_s, seed=args.seed, load=load, **scenario)


def trace_line(trace: Sequence[TraceJob], cfg: TraceConfig, scale: float) -> str:
    by_band = {b.label: sum(1 for j in trace if j.band is b) for b in Band}
    chips_s = sum(j.chips * j.duration_s for j in trace)
    return (
        f"trace: seed {cfg.seed}, {len(trace)} jobs ({', '.join(f'{k} {v}' for k, v in by_band.items())}), "
        f"peers {', '.join(f'{p} {c}' for p, c in cfg.peers)} H100; arrival rate "
        f"{cfg.rate() * scale:.3f}/s replayed; offered {chips_s / (cfg.capacity * cfg.window_s):.2f} "
        f"of capacity (target {cfg.load:g}); durations / {scale:g}"
    )


async def run(args: argparse.Namespace) -> int:
    from benchmarks.harness import machine, uptime_line, write_json
    from benchmarks.source import source_label
    from iris.config import load_config

    base = load_config()
    overrides(base, args)
    peers = gpu_peers(base)
    tick_s = float(base.tick_interval_s)
    cfg = trace_config(args, peers)
    trace = generate(cfg)
    # The order within a band as the measured revision's config has it (none before issue 29).
    horizon: float | None = getattr(base, "aging_horizon_s", None)
    # Each peer's preempt_exempt_s as the measured revision's config has it (none before issue 29).
    exempt = {name: float(getattr(base.cluster(name), "preempt_exempt_s", 0.0)) for name, _ in peers}
    model = preemption_chooser(max(exempt.values(), default=0.0))
    chooser, how = model.chooser, model.how

    def bound_of(backfill: bool, aging_horizon_s: float | None = horizon) -> SimResult:
        """The offline bound of this revision's policy, with or without backfill, with its fair
        share or another aging horizon (0: FIFO within a band)."""
        return simulate(
            trace,
            dict(peers),
            scale=args.scale,
            chooser=chooser,
            preemption=how,
            exempt_s=exempt if model.exemption else None,
            backfill=backfill,
            aging_horizon_s=aging_horizon_s,
        )

    sim = bound_of(True)
    capacity = cfg.capacity
    bound = figures(sim.outcomes, capacity, sim.end_s, tick_s)
    bound["preemption_model"] = how
    bound["rejected"] = sim.rejected
    # The same bound with FIFO within each band: the order before fair share (issue 29).
    fifo: dict[str, Any] | None = None
    if cfg.users and fair_share_setting(0.0):
        fifo_sim = bound_of(True, 0.0)
        fifo = figures(fifo_sim.outcomes, capacity, fifo_sim.end_s, tick_s)
    # The same bound with held capacity never reclaimed: what a stack whose backends do not preempt
    # could reach at best (the comparison before and after preemption lands).
    plain: dict[str, Any] | None = None
    if chooser is not None:
        plain_sim = simulate(trace, dict(peers), scale=args.scale)
        plain = figures(plain_sim.outcomes, capacity, plain_sim.end_s, tick_s)
    # The same bound with backfill off: the policy before issue 29's backfill, on the same trace.
    no_backfill: dict[str, Any] | None = None
    if backfill_setting(False):
        before = bound_of(False)
        no_backfill = figures(before.outcomes, capacity, before.end_s, tick_s)
    info = machine()
    print(f"code: {source_label()}; machine: {info['nproc']} CPUs, {info['mem_gib']} GiB", flush=True)
    print(trace_line(trace, cfg, args.scale), flush=True)
    data: dict[str, Any] = {
        "machine": info,
        "args": vars(args),
        "source": source_label(),
        "tick_s": tick_s,
        "trace": [asdict(j) for j in trace],
        "bound": {**bound, "outcomes": [asdict(o) for o in sim.outcomes]},
    }
    measured: dict[str, Any] | None = None
    if not args.offline:
        r = await replay(args, trace, tick_s)
        outcomes: list[Outcome] = r["outcomes"]
        measured = figures(outcomes, capacity, r["end_s"], tick_s)
        data["measured"] = {
            **measured,
            "errors": r["errors"],
            "home_states": r["home_states"],
            "outcomes": [asdict(o) for o in outcomes],
        }
        if r["errors"]:
            print(f"{len(r['errors'])} errors, e.g. {r['errors'][0]}", file=sys.stderr)
        print(f"home states at the end: {r['home_states']}")
    print()
    print(report(measured, bound, tick_s), flush=True)
    if plain is not None:
        data["bound_without_preemption"] = plain
        print(plain_line(plain))
    if no_backfill is not None:
        data["bound_without_backfill"] = no_backfill
        print(plain_line(no_backfill, "bound without backfill (nothing held for a job that cannot start)"))
    if cfg.users:
        if fifo is not None:
            data["bound_fifo"] = fifo
        print()
        print(users_report(measured, bound, fifo), flush=True)
    print(f"\ncode: {source_label()}; after: {uptime_line()}")
    write_json(args.out, data)
    return 0


def main() -> None:
    from benchmarks.harness import run_main

    args = parse()
    run_main(lambda: run(args))


if __name__ == "__main__":
    main()
