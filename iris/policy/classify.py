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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from iris.policy.availability import PeerStatus, gate, peer_status, working_capacity
from iris.policy.explain import QUEUED_REASON, queued_for_peer_reason
from iris.policy.models import (
    BackendReport,
    Classification,
    Constraint,
    Disposition,
    JobShape,
    PeerReport,
    Reservation,
)
from iris.policy.routing import job_constraints, matches, resolve_cluster


def pick_backend(job: JobShape, report: PeerReport, reservations: Sequence[Reservation] = ()) -> str | None:
    """The best backend of one cluster for ``job``, or None when none has its shape.

    Preference: fits in idle capacity, fits by reclaiming lower-band work, shape-only (no capacity
    block), does not fit now; then tightest fit; then backend id. Used to place a local or pinned
    job directly, outside the tick.
    """
    constraints = job_constraints(job)
    need = gate(job.device)
    best: tuple[int, int, str] | None = None
    for backend in report.backends:
        if not matches(constraints, backend.advertised_attributes):
            continue
        capacity = working_capacity(report.peer_id, backend, reservations)
        if capacity is None:
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


def _home_fits_now(
    job: JobShape, home: PeerReport, constraints: Sequence[Constraint], reservations: Sequence[Reservation]
) -> tuple[str | None, str]:
    """(backend that can run the job now, why home cannot) for prefer-local.

    "Free now" means idle capacity: reclaiming lower-band work is left to the tick, which prefers an
    idle peer over preempting at home.
    """
    need = gate(job.device)
    matching = [b for b in home.backends if matches(constraints, b.advertised_attributes)]
    if not matching:
        return None, ""
    best_idle = 0
    token = ""
    amount = 0
    chosen: tuple[int, str] | None = None
    for backend in matching:
        capacity = working_capacity(home.peer_id, backend, reservations)
        if need is None or capacity is None:
            rank = (0, backend.backend_id)
        else:
            token, amount = need
            idle = capacity.idle(token)
            best_idle = max(best_idle, idle)
            if idle < amount:
                continue
            rank = (idle - amount, backend.backend_id)
        if chosen is None or rank < chosen:
            chosen = rank
    if chosen is not None:
        return chosen[1], ""
    return None, f"home cluster {home.peer_id} has {best_idle} of the {amount} {token} needed free"


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
) -> Classification:
    """Classify a root job at submit (docs/DESIGN.md, "Classification"); ``reports`` has one entry
    per cluster, home included.

    ``configured`` holds clusters' backends as configured, used only for a cluster whose live report
    is not OK (it says which shapes exist there, never what is free).
    """
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
        if resolved == home:
            return Classification(
                disposition=Disposition.LOCAL,
                pinned_cluster=home,
                reason=f"Pinned to the home cluster {home}",
            )
        reason = queued_for_peer_reason(resolved)
        status = peer_status(by_id[resolved], now_ms, stale_after_ms)
        if status is not PeerStatus.OK:
            reason += f" (peer is currently {status.value})"
        return Classification(disposition=Disposition.QUEUE, pinned_cluster=resolved, reason=reason)

    constraints = job_constraints(job)
    home_report = by_id.get(home)
    why_not_home = ""
    if home_report is not None:
        home_status = peer_status(home_report, now_ms, stale_after_ms)
        if home_status is PeerStatus.OK:
            backend, why_not_home = _home_fits_now(job, home_report, constraints, reservations)
            if backend is not None:
                return Classification(
                    disposition=Disposition.LOCAL, reason=f"Runs at home on {home}/{backend}"
                )
        else:
            why_not_home = f"home cluster {home} is {home_status.value}"

    # Home backends count whatever home's state: the job waits for home to come back or free up.
    candidates: list[BackendReport] = _known_backends(home_report, configured) if home_report else []
    # Peers not OK now, with the backends they are known to have: they may host the job later.
    absent: dict[str, list[BackendReport]] = {}
    for report in sorted(reports, key=lambda r: r.peer_id):
        if report.peer_id == home:
            continue
        status = peer_status(report, now_ms, stale_after_ms)
        if status is PeerStatus.OK:
            candidates.extend(report.backends)
        else:
            absent[f"{report.peer_id} {status.value}"] = _known_backends(report, configured)

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
