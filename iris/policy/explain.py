"""Human reasons for jobs the tick leaves queued (shared by the planner and its reference).

Each candidate peer gets one structured verdict; peers with the same verdict are grouped so a
federation of a hundred mostly-full peers stays a short payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from iris.policy.models import Band, Constraint, PeerVerdict, WaitingGroup, WaitKind
from iris.policy.reasons import ReasonCode
from iris.policy.routing import constraint_holds

QUEUED_REASON = "Queued for a federation peer to report free capacity"
# The reasons of the two ends a queued job can reach without a cluster, as the job and its queue
# handle both record them.
CANCELLED_BEFORE_HANDOFF = "Cancelled before handoff"
DEADLINE_PASSED = "Scheduling timeout passed before any cluster had room"


def queued_for_peer_reason(peer_id: str) -> str:
    return f"Queued for peer {peer_id} to report free capacity"


def unreachable_message(error: str | None) -> str:
    return f"unreachable: {error}" if error else "unreachable"


def stale_message(stale_after_ms: int) -> str:
    bound = f"{stale_after_ms // 1000}s" if stale_after_ms % 1000 == 0 else f"{stale_after_ms}ms"
    return f"stale: no report in the last {bound}"


def unknown_peer_message(peer_id: str) -> str:
    return f"unknown cluster '{peer_id}'"


def cap_message(cap: int) -> str:
    return f"per-tick cap of {cap} placements reached"


def pace_message() -> str:
    return "handoff rate reached: placements to this cluster are paced"


def full_message(token: str, needed: int, band: Band, available: int) -> str:
    return f"full: needs {needed} {token} at band {band.label}, {available} available"


def no_shape_message(
    constraints: Sequence[Constraint], backends_attrs: Sequence[Mapping[str, frozenset[str]]]
) -> str:
    """Name the constraint none of a peer's backends satisfies, else the combination they miss.

    ``backends_attrs`` are normalized attributes (:func:`iris.policy.routing.normalize_attributes`).
    """
    if not backends_attrs:
        return "advertises no backend"
    for c in constraints:
        wanted = frozenset(c.values)
        if not any(constraint_holds(c.op, wanted, a.get(c.key)) for a in backends_attrs):
            return f"no backend with {c.describe()}"
    return "no single backend with " + ", ".join(c.describe() for c in constraints)


def _peers(peer_ids: Iterable[str]) -> str:
    # Sorted: the same peers read the same whatever order their verdicts were grouped in.
    ids = sorted(set(peer_ids))
    return ", ".join(ids) if len(ids) <= 3 else f"{len(ids)} peers"


# The order of a summary's parts: fixed, so the same verdicts always read the same.
_SUMMARY_ORDER = (
    WaitKind.FULL,
    WaitKind.PER_TICK_CAP,
    WaitKind.NO_SHAPE,
    WaitKind.UNREACHABLE,
    WaitKind.STALE,
    WaitKind.UNKNOWN_PEER,
)


def summarize(pinned: str | None, verdicts: Sequence[PeerVerdict]) -> str:
    """The pending reason the tick stores and signals to the job (docs/DESIGN.md, "The tick").

    A function of the situation's substance only: which peers wait for what, and the job's need.
    Nothing that moves while the verdict stands (free counts, the best amount available, queue
    positions, times, a peer's error text) is in it, so a job waiting while capacity fluctuates
    gets one summary and one ``explain`` signal; those details stay in the verdicts.
    """
    base = queued_for_peer_reason(pinned) if pinned else QUEUED_REASON
    by_kind: dict[WaitKind, list[PeerVerdict]] = {}
    for v in verdicts:
        by_kind.setdefault(v.kind, []).append(v)
    parts: list[str] = []
    for kind in _SUMMARY_ORDER:
        vs = by_kind.get(kind)
        if not vs:
            continue
        peers = _peers(p for v in vs for p in v.peer_ids)
        if kind is WaitKind.FULL:
            # One job's FULL verdicts share its token and need; only what is available differs.
            parts.append(f"full on {peers} (needs {vs[0].needed} {vs[0].token})")
        elif kind is WaitKind.PER_TICK_CAP:
            # A paced cluster (iris/policy/pacing.py) and a capped one say which limit holds.
            paced = [p for v in vs if v.message == pace_message() for p in v.peer_ids]
            capped = [p for v in vs if v.message != pace_message() for p in v.peer_ids]
            if paced:
                parts.append(f"handoff rate reached on {_peers(paced)} (paced)")
            if capped:
                parts.append(f"per-tick cap reached on {_peers(capped)}")
        elif kind is WaitKind.NO_SHAPE:
            parts.append(f"no matching backend on {peers}")
        elif kind is WaitKind.UNREACHABLE:
            parts.append(f"{peers} unreachable")
        elif kind is WaitKind.STALE:
            parts.append(f"stale report from {peers}")
        else:
            parts.append(f"unknown cluster {peers}")
    return f"{base}: {'; '.join(parts)}" if parts else base


def reason_code(pinned: str | None, verdicts: Sequence[PeerVerdict], alone_fits: bool) -> ReasonCode:
    """The stable code of a waiting job's verdicts (docs/DESIGN.md, "Reason codes").

    ``alone_fits``: one of the candidate peers could have taken the job with what it reported (net
    of the ledger) before this tick placed anything: alone in the queue, the job would have been
    placed. Jobs ahead of it in the planner's order, or a per-tick cap, kept it waiting.

    Precedence when the verdicts are mixed, first match wins; a peer that answers and has the shape
    says more about the wait than one that is down, stale or lacks the shape:

    1. ``Priority``: ``alone_fits``.
    2. ``PinnedPeerFull`` (pinned) or ``NoCapacity``: a candidate answers with the shape, and is
       full (or capped, and full besides).
    3. ``PeerUnreachable``: no candidate answers with the shape; one does not answer at all.
    4. ``PeerStale``: likewise, and one answers with a report older than the staleness bound.
    5. ``ShapeMismatch``: every candidate lacks the shape (or the pin names no known cluster).
    """
    if alone_fits:
        return ReasonCode.Priority
    kinds = {v.kind for v in verdicts}
    if WaitKind.FULL in kinds or WaitKind.PER_TICK_CAP in kinds:
        return ReasonCode.PinnedPeerFull if pinned else ReasonCode.NoCapacity
    if WaitKind.UNREACHABLE in kinds:
        return ReasonCode.PeerUnreachable
    if WaitKind.STALE in kinds:
        return ReasonCode.PeerStale
    return ReasonCode.ShapeMismatch


def group_verdicts(
    per_peer: Iterable[tuple[str, WaitKind, str, str | None, int | None, int | None]],
) -> list[PeerVerdict]:
    """Fold ``(peer, kind, message, token, needed, available)`` rows into verdicts, first-seen order."""
    grouped: dict[tuple[WaitKind, str], PeerVerdict] = {}
    for peer_id, kind, message, token, needed, available in per_peer:
        key = (kind, message)
        verdict = grouped.get(key)
        if verdict is None:
            grouped[key] = PeerVerdict(
                kind=kind,
                peer_ids=[peer_id],
                message=message,
                token=token,
                needed=needed,
                available=available,
            )
        else:
            verdict.peer_ids.append(peer_id)
    return list(grouped.values())


_GroupKey = tuple[str, ReasonCode, tuple[tuple[WaitKind, str, tuple[str, ...]], ...]]


def merge_groups(
    groups: Iterable[tuple[list[tuple[int, str]], str, ReasonCode, list[PeerVerdict]]],
) -> list[WaitingGroup]:
    """One WaitingGroup per distinct (summary, code, verdicts); jobs given as (queue position, job id).

    Groups and the jobs inside them come out in queue order, however the caller grouped them.
    """
    jobs_of: dict[_GroupKey, list[tuple[int, str]]] = {}
    content: dict[_GroupKey, tuple[str, ReasonCode, list[PeerVerdict]]] = {}
    for jobs, summary, code, verdicts in groups:
        key = (summary, code, tuple((v.kind, v.message, tuple(v.peer_ids)) for v in verdicts))
        if key in jobs_of:
            jobs_of[key].extend(jobs)
        else:
            jobs_of[key] = list(jobs)
            content[key] = (summary, code, verdicts)
    out: list[tuple[int, WaitingGroup]] = []
    for key, jobs in jobs_of.items():
        jobs.sort()
        summary, code, verdicts = content[key]
        group = WaitingGroup(
            job_ids=[job_id for _, job_id in jobs], summary=summary, code=code, verdicts=verdicts
        )
        out.append((jobs[0][0], group))
    out.sort(key=lambda item: item[0])
    return [group for _, group in out]
