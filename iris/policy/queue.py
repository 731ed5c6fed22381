"""The queue as one job sees it (docs/DESIGN.md, "Queue position and dry-run"): pure functions.

``queue_positions``: where each queued job stands among the jobs competing for the same shape, in
the order the planner takes them when each is placed in turn (bands, then fair share within a band:
:func:`iris.policy.fairshare.fill_order`, the order :func:`iris.policy.planner.plan` follows while
every job it meets is placed). Jobs compete for the same shape when the
planner puts them in one class: the same routing constraints and the same gate token (a GPU
variant, ``cpu``, or none), whatever their counts, bands or pins.

``dry_run``: what would happen to a job submitted now: its classification, the position it would
take, and each peer's verdict, from the same classify and plan the job workflow and the tick run,
with the job added behind the queue. No I/O: the caller passes the stored reports, ledger and queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel, Field

from iris.policy.availability import gate
from iris.policy.classify import classify
from iris.policy.explain import no_shape_message
from iris.policy.fairshare import account, fill_order, held_devices
from iris.policy.models import (
    BackendReport,
    Backfill,
    Band,
    Constraint,
    Disposition,
    FairShare,
    JobShape,
    PeerReport,
    Placement,
    Reservation,
    WaitKind,
)
from iris.policy.planner import plan
from iris.policy.reasons import ReasonCode
from iris.policy.reference import peer_order
from iris.policy.routing import job_constraints, normalize_attributes, pinned_cluster

# The planner's class of a job: its routing constraints and its gate token ("" when ungated).
CompetingKey = tuple[tuple[Constraint, ...], str]
# Dry-run copies of the job are told apart by a suffix no job id can hold (ids are printable).
_COPY = "\x00"


def competing_key(job: JobShape) -> CompetingKey:
    """The jobs a job competes with share this key (the planner's class: constraints, token)."""
    need = gate(job.device)
    return job_constraints(job), need[0] if need is not None else ""


def shape_label(key: CompetingKey) -> str:
    """``device-type=gpu, device-variant=h100`` (or ``any backend`` with no constraint)."""
    constraints, _ = key
    return ", ".join(c.describe() for c in constraints) or "any backend"


class QueuePosition(BaseModel):
    """A queued job's place among the jobs competing for its shape (1 is taken first)."""

    job_id: str
    position: int = Field(ge=1)
    # Jobs competing for the same shape, this one included.
    of: int = Field(ge=1)
    # Of the jobs ahead of it, those in a higher band (the rest come before it in its band's
    # fair-share order).
    ahead_in_higher_bands: int = 0
    shape: str
    # The job's band, by name (production, interactive, batch).
    band: str
    # Every job in the queue, whatever its shape.
    queued: int = 0

    def describe(self) -> str:
        """``2 of 5 waiting for device-type=gpu, device-variant=h100 (1 ahead in a higher band)``."""
        higher = (
            f" ({self.ahead_in_higher_bands} ahead in a higher band)" if self.ahead_in_higher_bands else ""
        )
        return f"{self.position} of {self.of} waiting for {self.shape}{higher}"


def queue_positions(
    jobs: Sequence[JobShape],
    job_ids: Iterable[str] | None = None,
    *,
    in_use: Sequence[JobShape] = (),
    reports: Sequence[PeerReport] = (),
    fair_share: FairShare | None = None,
) -> dict[str, QueuePosition]:
    """Each job's position among those competing for its shape; only ``job_ids`` if given (a job
    id not in the queue is left out). A duplicated job id keeps its first entry, as in the planner.
    ``in_use``, ``reports`` and ``fair_share`` are what the tick's fair share reads (the jobs
    holding devices, the reports whose totals the shares divide by, the settings)."""
    wanted = None if job_ids is None else set(job_ids)
    ordered = fill_order(jobs, in_use=in_use, reports=reports, policy=fair_share)
    # The key is a function of these (as the planner's shape cache): computed once per shape.
    cache: dict[tuple[tuple[Constraint, ...], str, str, bool], CompetingKey] = {}
    keys: list[CompetingKey] = []
    for job in ordered:
        d = job.device
        shape = (job.constraints, d.type, d.variant, d.count > 0)
        key = cache.get(shape)
        if key is None:
            key = cache[shape] = competing_key(job)
        keys.append(key)
    totals: dict[CompetingKey, int] = {}
    for key in keys:
        totals[key] = totals.get(key, 0) + 1
    seen: dict[CompetingKey, int] = {}
    by_band: dict[CompetingKey, dict[Band, int]] = {}
    out: dict[str, QueuePosition] = {}
    for job, key in zip(ordered, keys, strict=True):
        position = seen.get(key, 0) + 1
        seen[key] = position
        bands = by_band.setdefault(key, {})
        if wanted is None or job.job_id in wanted:
            above = sum(n for band, n in bands.items() if band < job.band)
            out[job.job_id] = QueuePosition(
                job_id=job.job_id,
                position=position,
                of=totals[key],
                ahead_in_higher_bands=above,
                shape=shape_label(key),
                band=job.band.label,
                queued=len(ordered),
            )
        bands[job.band] = bands.get(job.band, 0) + 1
    return out


class Outlook(StrEnum):
    """One peer's verdict on a job submitted now: the WaitKind values, and two that take it."""

    CHOSEN = "chosen"  # the peer the job would go to now
    FITS = "fits"  # has room too, but ranks after the chosen one
    FULL = WaitKind.FULL.value
    PER_TICK_CAP = WaitKind.PER_TICK_CAP.value
    NO_SHAPE = WaitKind.NO_SHAPE.value
    UNREACHABLE = WaitKind.UNREACHABLE.value
    STALE = WaitKind.STALE.value
    UNKNOWN_PEER = WaitKind.UNKNOWN_PEER.value


# The order verdict groups are listed in: where it goes first, then as explain.summarize orders.
_OUTLOOK_ORDER = tuple(Outlook)


class PeerOutlook(BaseModel):
    """One verdict, shared by every peer in ``peer_ids`` (grouped as iris/policy/explain.py does)."""

    outlook: Outlook
    peer_ids: list[str]
    message: str


class DryRun(BaseModel):
    """What would happen to a job submitted now (``iris job run --dry-run``)."""

    job_id: str
    disposition: Disposition
    classification: str
    pinned_cluster: str | None = None
    # Where it would be placed now (at home through the CAS, or by the next tick); None: it waits.
    placement: Placement | None = None
    # Why it would wait (the tick's summary and its code), when it would; or the code of its
    # rejection when classification names one (``TooLarge``).
    waiting: str | None = None
    code: ReasonCode | None = None
    # The place it would take in the queue (a job that runs at home at once still passes through it).
    position: QueuePosition | None = None
    verdicts: list[PeerOutlook] = Field(default_factory=list)
    # What it was judged on: when, and the queue it would join.
    now_ms: int = 0
    queued: int = 0

    @property
    def rejected(self) -> bool:
        return self.disposition is Disposition.REJECT


def _shape_copy(job: JobShape, suffix: str, pin: str | None) -> JobShape:
    """The job as the dry-run plans it: the job itself (no suffix), or pinned to one peer as a user
    of its own (the fair share: see :func:`dry_run`)."""
    user = account(job) if not suffix else f"{account(job)}{_COPY}{suffix}"
    return job.model_copy(
        update={"job_id": f"{job.job_id}{_COPY}{suffix}", "target_cluster": pin, "user": user}
    )


def _room(p: Placement) -> str:
    """What a placement says about its peer, as a verdict (not as a decision taken)."""
    if p.forced:
        return "force-routed to the pin: it advertises no backend of this shape"
    if not p.verified:
        return f"backend {p.backend_id} has the shape (it reports no capacity for this job)"
    if p.preempts:
        return f"room on backend {p.backend_id} by reclaiming lower-priority work"
    return f"room on backend {p.backend_id}"


def _no_shape(job: JobShape, report: PeerReport | None, configured: Sequence[BackendReport]) -> str:
    backends = report.backends if report is not None and report.backends else configured
    attrs = [normalize_attributes(b.advertised_attributes) for b in backends]
    return no_shape_message(job_constraints(job), attrs)


def dry_run(
    job: JobShape,
    *,
    home: str,
    reports: Sequence[PeerReport],
    queue: Sequence[JobShape],
    reservations: Sequence[Reservation] = (),
    configured: Mapping[str, list[BackendReport]] | None = None,
    now_ms: int,
    stale_after_ms: int,
    max_per_peer: int | None = None,
    in_use: Sequence[JobShape] = (),
    fair_share: FairShare | None = None,
    backfill: Backfill | None = None,
) -> DryRun:
    """Classify ``job`` as its workflow would, then plan the queue with it added as the tick would.

    Only the jobs ahead of it in the planner's order take part (a job's turn never depends on the
    jobs behind it). The job goes in once as submitted, and, unless it is pinned, once pinned to
    each peer: the copy that is not pinned says where it would go, the pinned ones what every other
    peer would say (a pinned copy charges only its own peer, so none affects another). A peer that
    lacks the shape is reported as such, never "force-routed": only a user's own pin does that.
    """
    decision = classify(
        job,
        home=home,
        reports=reports,
        now_ms=now_ms,
        stale_after_ms=stale_after_ms,
        configured=configured,
        reservations=reservations,
        held=held_devices(in_use),
        quotas=(fair_share or FairShare()).quotas,
    )
    # The queue it would join, in the planner's order: the jobs before it are those ahead.
    order = fill_order([*queue, job], in_use=in_use, reports=reports, policy=fair_share)
    turn = next((i for i, j in enumerate(order) if j.job_id == job.job_id), len(order))
    ahead = order[:turn]
    position = queue_positions(
        [*queue, job], [job.job_id], in_use=in_use, reports=reports, fair_share=fair_share
    ).get(job.job_id)
    # A pin to a cluster nobody knows is rejected unresolved: it is still the only one asked.
    pin = decision.pinned_cluster or pinned_cluster(job.target_cluster, [r.peer_id for r in reports])
    # A job pinned home is LOCAL, but only runs at once if the CAS finds home's room: what the
    # tick would do with it pinned tells that, as for a queued one.
    queues = decision.disposition is Disposition.QUEUE or (
        decision.disposition is Disposition.LOCAL and pin is not None
    )
    own = _shape_copy(job, "", pin)
    if pin:
        copies = [own]
    else:
        # Unpinned, the job itself takes part only if it would enter the queue (a LOCAL job is
        # promoted at home by its workflow, a rejected one never queues); each pinned copy asks
        # one peer.
        peers = [p.peer_id for p in peer_order(reports, home)]
        copies = [own] if queues else []
        copies += [_shape_copy(job, p, p) for p in peers]
    # Each pinned copy counts as a user of its own, so that one copy's placement never moves
    # another's turn or cap. It holds what the job's user holds, and the user's jobs ahead of it
    # as placed (as its position assumes): its turn comes after them, its cap counts them.
    user = account(job)
    mine = [u for u in [*in_use, *ahead] if account(u) == user]
    aliases = [
        u.model_copy(update={"job_id": f"{u.job_id}{_COPY}{c.job_id}", "user": c.user})
        for c in copies
        if c.user != user
        for u in mine
    ]
    result = plan(
        [*ahead, *copies],
        home=home,
        reports=reports,
        reservations=reservations,
        now_ms=now_ms,
        stale_after_ms=stale_after_ms,
        max_per_peer=max_per_peer,
        in_use=[*in_use, *aliases],
        fair_share=fair_share,
        backfill=backfill,
    )
    placement = decision.placement if decision.disposition is Disposition.LOCAL and not pin else None
    waiting: str | None = None
    code: ReasonCode | None = decision.code if decision.disposition is Disposition.REJECT else None
    if queues:
        placement = result.placement_for(own.job_id)
        explanation = result.explain(own.job_id)
        if explanation is not None:
            waiting, code = explanation.summary, explanation.code
    if placement is not None:
        placement = placement.model_copy(update={"job_id": job.job_id})

    rows: list[tuple[Outlook, str, str]] = []
    chosen = placement.peer_id if placement is not None else None
    reports_by_peer = {r.peer_id: r for r in reports}
    for copy in copies:
        peer = copy.target_cluster
        if peer is None:
            continue
        if peer == chosen:
            assert placement is not None
            rows.append((Outlook.CHOSEN, peer, _room(placement)))
            continue
        placed = result.placement_for(copy.job_id)
        if placed is not None and placed.forced:
            conf = (configured or {}).get(peer, [])
            rows.append((Outlook.NO_SHAPE, peer, _no_shape(job, reports_by_peer.get(peer), conf)))
        elif placed is not None:
            rows.append((Outlook.FITS, peer, _room(placed)))
        else:
            why = result.explain(copy.job_id)
            for v in why.verdicts if why is not None else ():
                for p in v.peer_ids:
                    rows.append((Outlook(v.kind.value), p, v.message))
    grouped: dict[tuple[Outlook, str], PeerOutlook] = {}
    for outlook, peer, message in rows:
        entry = grouped.get((outlook, message))
        if entry is None:
            grouped[(outlook, message)] = PeerOutlook(outlook=outlook, peer_ids=[peer], message=message)
        elif peer not in entry.peer_ids:
            entry.peer_ids.append(peer)
    verdicts = sorted(grouped.values(), key=lambda v: _OUTLOOK_ORDER.index(v.outlook))
    return DryRun(
        job_id=job.job_id,
        disposition=decision.disposition,
        classification=decision.reason,
        pinned_cluster=pin,
        placement=placement,
        waiting=waiting,
        code=code,
        position=position,
        verdicts=verdicts,
        now_ms=now_ms,
        queued=len(queue),
    )
