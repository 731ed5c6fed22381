"""Submit-time classification (docs/DESIGN.md, "Classification"): run at home, queue for the
federation, or reject.

In order: an explicit pin wins; then prefer-local when a home backend has the capacity free now;
then queue (unpinned) when any home backend or reachable peer backend has the job's shape; else
reject, naming the constraint nothing in the federation satisfies. The home cluster is still a
candidate of the queue, so a job that found home full runs there as soon as home frees up.

A cluster that is unreachable or stale at submit hosts nothing, but its backends still exist
(its last report's, or as configured): a job only such a cluster can run is queued, and waits for
it, rather than rejected because a controller was restarting (docs/DESIGN.md, "Classification": it
rejects a shape that no backend anywhere has).

A job larger than every backend of its shape (its whole gate on one backend, by the totals the
clusters report: iris/policy/sizing.py) is rejected too, naming the largest; a backend whose total
is unknown (its cluster not OK, never reported, or no total for the token) never counts against it.

A LOCAL decision carries the placement to promote the job with, through the same CAS and ledger
as the tick's (docs/DESIGN.md, "The ledger"): home's capacity is reserved like a peer's, so a burst
of submits never runs more at home than home has room for; those the CAS refuses wait in the queue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from iris.policy.availability import (
    PeerStatus,
    gate,
    is_verified,
    peer_status,
    usable_block,
    working_capacity,
)
from iris.policy.explain import QUEUED_REASON, queued_for_peer_reason
from iris.policy.fairshare import account, quota_refusal
from iris.policy.models import (
    BackendReport,
    Band,
    Classification,
    Constraint,
    Disposition,
    JobShape,
    PeerReport,
    Placement,
    Quotas,
    Reservation,
)
from iris.policy.reasons import ReasonCode
from iris.policy.routing import job_constraints, matches, resolve_cluster
from iris.policy.sizing import Candidate, too_large


def pick_backend(job: JobShape, report: PeerReport, reservations: Sequence[Reservation] = ()) -> str | None:
    """The best backend of one cluster for ``job``, or None when none has its shape.

    Preference: fits in idle capacity, fits by reclaiming lower-band work, shape-only (no capacity
    block, or a block that does not report the job's optional token, ``cpu``), does not fit now;
    then tightest fit; then backend id. Used to place a local or pinned job directly, outside the
    tick.
    """
    constraints = job_constraints(job)
    need = gate(job.device)
    best: tuple[int, int, str] | None = None
    for backend in report.backends:
        if not matches(constraints, backend.advertised_attributes):
            continue
        capacity = working_capacity(report.peer_id, backend, reservations)
        if capacity is None or not is_verified(capacity, need[0] if need else None):
            rank = (2, 0, backend.backend_id)
        elif need is None:
            rank = (0, 0, backend.backend_id)
        else:
            token, amount = need
            idle = capacity.idle(token)
            effective = capacity.effective(token, job.band)
            if idle >= amount:
                rank = (0, idle - amount, backend.backend_id)
            elif effective >= amount:
                rank = (1, effective - amount, backend.backend_id)
            else:
                # Closest to fitting first: it is the one that frees up soonest.
                rank = (3, amount - effective, backend.backend_id)
        if best is None or rank < best:
            best = rank
    return None if best is None else best[2]


def local_placement(
    job: JobShape, report: PeerReport, backend_id: str, reservations: Sequence[Reservation], reason: str
) -> Placement:
    """The placement that promotes ``job`` to one backend of ``report``'s cluster through the CAS.

    It reserves the job's gate against the backend's current observation when the backend's
    block verifies it (docs/DESIGN.md, "The ledger"); otherwise (ungated job, no block, a block
    without the job's optional token) nothing is reserved and the backend's own accounting holds
    the job.
    """
    backend = next((b for b in report.backends if b.backend_id == backend_id), None)
    need = gate(job.device)
    block = usable_block(backend) if backend is not None else None
    capacity = working_capacity(report.peer_id, backend, reservations) if backend is not None else None
    verified = is_verified(capacity, need[0] if need else None)
    return Placement(
        job_id=job.job_id,
        peer_id=report.peer_id,
        backend_id=backend_id,
        band=job.band,
        observation_epoch_ms=block.observation_epoch_ms if block is not None else None,
        reserved={need[0]: need[1]} if need is not None and verified else {},
        verified=verified,
        reason=reason,
    )


def _home_fits_now(
    job: JobShape, home: PeerReport, constraints: Sequence[Constraint], reservations: Sequence[Reservation]
) -> tuple[str | None, str]:
    """(backend that can run the job now, why home cannot) for prefer-local.

    "Free now" means idle capacity net of the ledger: reclaiming lower-band work is left to the
    tick, which prefers an idle peer over preempting at home. A backend that cannot verify the job
    (no block, or no ``cpu`` in it for a CPU job) fits by shape. Verified fits come first, then the
    tightest, then backend id.
    """
    need = gate(job.device)
    matching = [b for b in home.backends if matches(constraints, b.advertised_attributes)]
    if not matching:
        return None, ""
    best_idle = 0
    token = ""
    amount = 0
    chosen: tuple[int, int, str] | None = None
    for backend in matching:
        capacity = working_capacity(home.peer_id, backend, reservations)
        if capacity is None or need is None or not capacity.verifies(need[0]):
            rank = (0 if capacity is not None and need is None else 1, 0, backend.backend_id)
        else:
            token, amount = need
            idle = capacity.idle(token)
            best_idle = max(best_idle, idle)
            if idle < amount:
                continue
            rank = (0, idle - amount, backend.backend_id)
        if chosen is None or rank < chosen:
            chosen = rank
    if chosen is not None:
        return chosen[2], ""
    return None, f"home cluster {home.peer_id} has {best_idle} of the {amount} {token} needed free"


def _pinned_home_placement(
    job: JobShape,
    report: PeerReport,
    status: PeerStatus,
    configured: Mapping[str, Sequence[BackendReport]],
    reservations: Sequence[Reservation],
) -> Placement:
    """Where a job pinned to the home cluster goes: ``pick_backend``'s choice when home is OK.

    A verified choice reserves even when home is full now: the CAS then refuses it and the job
    waits in the queue, pinned to home, until the tick finds room there. A home that is not OK
    is not trusted for capacity: its best-known backend of the job's shape, nothing reserved. A
    home without the job's shape: force-routed (``backend_id == ""``), as the tick does for pins.
    """
    home = report.peer_id
    if status is PeerStatus.OK:
        backend_id = pick_backend(job, report, reservations)
        if backend_id is not None:
            reason = f"Pinned to the home cluster {home}, backend {backend_id}"
            return local_placement(job, report, backend_id, reservations, reason)
    constraints = job_constraints(job)
    known = sorted(_known_backends(report, configured), key=lambda b: b.backend_id)
    backend_id = next((b.backend_id for b in known if matches(constraints, b.advertised_attributes)), "")
    if backend_id:
        reason = f"Pinned to the home cluster {home}, backend {backend_id} by shape (home is {status.value})"
    else:
        reason = f"Pinned to the home cluster {home}, which advertises no backend of this shape: force-routed"
    return Placement(
        job_id=job.job_id,
        peer_id=home,
        backend_id=backend_id,
        band=job.band,
        verified=False,
        forced=not backend_id,
        reason=reason,
    )


def _reject_reason(
    constraints: Sequence[Constraint], candidates: Sequence[BackendReport], skipped: Sequence[str]
) -> str:
    if not candidates:
        reason = "no backend in the federation can host it: no reachable cluster reports any backend"
    else:
        missing = next(
            (c for c in constraints if not any(matches((c,), b.advertised_attributes) for b in candidates)),
            None,
        )
        if missing is not None:
            reason = f"no backend in the federation satisfies {missing.describe()}"
        else:
            together = ", ".join(c.describe() for c in constraints)
            reason = f"no single backend in the federation satisfies all of {together}"
    if skipped:
        reason += f" (not considered: {', '.join(skipped)})"
    return reason


def classify(
    job: JobShape,
    *,
    home: str,
    reports: Sequence[PeerReport],
    now_ms: int,
    stale_after_ms: int,
    reservations: Sequence[Reservation] = (),
    configured: Mapping[str, Sequence[BackendReport]] | None = None,
    reject_too_large: bool = True,
    held: Mapping[str, Mapping[Band, int]] | None = None,
    quotas: Quotas | None = None,
) -> Classification:
    """Classify a root job at submit (docs/DESIGN.md, "Classification"); ``reports`` has one entry
    per cluster, home included.

    ``held`` and ``quotas``: the devices each user's jobs hold, by band, and the per-user caps
    (docs/DESIGN.md, "Fair share and aging"). A job that would run at home at once but would take its
    user past a cap is queued instead (pinned home if it was), where the tick holds it with
    ``UserQuota``: running at home never bypasses a cap.

    ``configured`` holds clusters' backends as configured, used only for a cluster whose live report
    is not OK (it says which shapes exist there, never what is free). ``reservations`` is the
    ledger: what earlier promotions (local ones included) took from the observations reported.
    ``reject_too_large``: a job no backend of its shape can ever hold is rejected (``TooLarge``);
    False only for job runs that predate it (workflows/job.py, SIZE_PATCH).

    A LOCAL decision has ``placement`` set (see :func:`local_placement`), to be promoted by the CAS.
    """
    decision = _classify(
        job, home, reports, now_ms, stale_after_ms, reservations, configured, reject_too_large
    )
    if decision.disposition is not Disposition.LOCAL or quotas is None or not quotas.any:
        return decision
    user = account(job)
    mine = (held or {}).get(user, {})
    refusal = quota_refusal(job, user, sum(mine.values()), mine.get(job.band, 0), quotas)
    if refusal is None:
        return decision
    return Classification(
        disposition=Disposition.QUEUE, pinned_cluster=decision.pinned_cluster, reason=refusal
    )


def _classify(
    job: JobShape,
    home: str,
    reports: Sequence[PeerReport],
    now_ms: int,
    stale_after_ms: int,
    reservations: Sequence[Reservation],
    configured: Mapping[str, Sequence[BackendReport]] | None,
    reject_too_large: bool,
) -> Classification:
    configured = configured or {}
    by_id = {r.peer_id: r for r in reports}
    known = sorted(by_id)

    pin = (job.target_cluster or "").strip()
    if pin:
        resolved = resolve_cluster(pin, known)
        if resolved is None:
            return Classification(
                disposition=Disposition.REJECT,
                reason=f"unknown cluster '{pin}' (known: {', '.join(known)})",
            )
        pinned = by_id[resolved]
        pinned_status = peer_status(pinned, now_ms, stale_after_ms)
        if reject_too_large:
            # Against the pinned cluster's backends only: it is the one place the job may go.
            ok = pinned_status is PeerStatus.OK
            on_pin = [
                Candidate(peer_id=resolved, backend=b, trusted=ok)
                for b in _known_backends(pinned, configured)
            ]
            oversized = too_large(job, on_pin)
            if oversized is not None:
                return Classification(
                    disposition=Disposition.REJECT,
                    pinned_cluster=resolved,
                    reason=oversized.reason(),
                    code=ReasonCode.TooLarge,
                )
        if resolved == home:
            return Classification(
                disposition=Disposition.LOCAL,
                pinned_cluster=home,
                reason=f"Pinned to the home cluster {home}",
                placement=_pinned_home_placement(job, pinned, pinned_status, configured, reservations),
            )
        reason = queued_for_peer_reason(resolved)
        if pinned_status is not PeerStatus.OK:
            reason += f" (peer is currently {pinned_status.value})"
        return Classification(disposition=Disposition.QUEUE, pinned_cluster=resolved, reason=reason)

    constraints = job_constraints(job)
    home_report = by_id.get(home)
    why_not_home = ""
    if home_report is not None:
        home_status = peer_status(home_report, now_ms, stale_after_ms)
        if home_status is PeerStatus.OK:
            backend, why_not_home = _home_fits_now(job, home_report, constraints, reservations)
            if backend is not None:
                reason = f"Runs at home on {home}/{backend}"
                return Classification(
                    disposition=Disposition.LOCAL,
                    reason=reason,
                    placement=local_placement(job, home_report, backend, reservations, reason),
                )
        else:
            why_not_home = f"home cluster {home} is {home_status.value}"

    # Home backends count whatever home's state: the job waits for home to come back or free up.
    candidates: list[BackendReport] = _known_backends(home_report, configured) if home_report else []
    # Every backend the job could go to, and whether its cluster's report says its total (OK now).
    sized: list[Candidate] = []
    if home_report is not None:
        home_ok = peer_status(home_report, now_ms, stale_after_ms) is PeerStatus.OK
        sized += [Candidate(peer_id=home, backend=b, trusted=home_ok) for b in candidates]
    # Peers not OK now, with the backends they are known to have: they may host the job later.
    absent: dict[str, list[BackendReport]] = {}
    for report in sorted(reports, key=lambda r: r.peer_id):
        if report.peer_id == home:
            continue
        status = peer_status(report, now_ms, stale_after_ms)
        if status is PeerStatus.OK:
            candidates.extend(report.backends)
            sized += [Candidate(peer_id=report.peer_id, backend=b, trusted=True) for b in report.backends]
        else:
            theirs = _known_backends(report, configured)
            absent[f"{report.peer_id} {status.value}"] = theirs
            # Its last report's totals, or none as configured: not trusted while it is not OK.
            sized += [Candidate(peer_id=report.peer_id, backend=b, trusted=False) for b in theirs]
    oversized = too_large(job, sized) if reject_too_large else None
    if oversized is not None:
        return Classification(
            disposition=Disposition.REJECT, reason=oversized.reason(), code=ReasonCode.TooLarge
        )

    def fits(backends: Sequence[BackendReport]) -> bool:
        return any(matches(constraints, b.advertised_attributes) for b in backends)

    if fits(candidates):
        reason = QUEUED_REASON + (f" ({why_not_home})" if why_not_home else "")
        return Classification(disposition=Disposition.QUEUE, reason=reason)
    waiting_for = [name for name, known in absent.items() if fits(known)]
    if waiting_for:
        reason = f"{QUEUED_REASON} (only {', '.join(waiting_for)} can run it)"
        return Classification(disposition=Disposition.QUEUE, reason=reason)
    known_anywhere = candidates + [b for known in absent.values() for b in known]
    return Classification(
        disposition=Disposition.REJECT, reason=_reject_reason(constraints, known_anywhere, list(absent))
    )


def _known_backends(
    report: PeerReport, configured: Mapping[str, Sequence[BackendReport]]
) -> list[BackendReport]:
    """A cluster's backends: from its report, else (unreachable: the report has none) as configured."""
    return list(report.backends) if report.backends else list(configured.get(report.peer_id, ()))
