"""A deliberately simple tick planner: the executable specification of docs/DESIGN.md, "The tick"
and "Fair share and aging".

For every job it scores every backend of every peer. Too slow for a large queue, but easy to read;
the property tests require :func:`iris.policy.planner.plan` to return exactly what this returns,
and the benchmark times both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from iris.policy.availability import Capacity, PeerStatus, gate, is_verified, peer_status, working_capacity
from iris.policy.backfill import Releases, Slot, admits, choose_hold, held_summary, take, usable
from iris.policy.explain import (
    full_message,
    group_verdicts,
    merge_groups,
    no_shape_message,
    reason_code,
    stale_message,
    summarize,
    unknown_peer_message,
    unreachable_message,
)
from iris.policy.fairshare import Shares, federation_totals, unique_jobs
from iris.policy.models import (
    BackendReport,
    Backfill,
    Band,
    Constraint,
    FairShare,
    Hold,
    JobShape,
    PeerReport,
    PeerVerdict,
    Placement,
    PlanResult,
    Reservation,
    WaitKind,
)
from iris.policy.pacing import PeerLimits
from iris.policy.reasons import ReasonCode
from iris.policy.routing import constraint_holds, job_constraints, normalize_attributes, pinned_cluster


def _matches(constraints: Sequence[Constraint], attrs: dict[str, frozenset[str]]) -> bool:
    return all(constraint_holds(c.op, frozenset(c.values), attrs.get(c.key)) for c in constraints)


# Rank of one option, smallest best: (shape-only, preempts, not home, remaining, peer, backend).
_Rank = tuple[int, int, int, int, str, str]


def queue_order(jobs: Sequence[JobShape]) -> list[JobShape]:
    """Band, then submit time, then job id; a duplicated job id keeps its first entry. The tick's
    order with no fair share (``aging_horizon_ms`` 0), and each user's own order within a band."""
    seen: set[str] = set()
    unique: list[JobShape] = []
    for job in jobs:
        if job.job_id not in seen:
            seen.add(job.job_id)
            unique.append(job)
    return sorted(unique, key=lambda j: (j.band, j.submit_ms, j.job_id))


def peer_order(reports: Sequence[PeerReport], home: str) -> list[PeerReport]:
    """Home first, then by peer id; a duplicated peer id keeps its first report."""
    first: dict[str, PeerReport] = {}
    for r in reports:
        first.setdefault(r.peer_id, r)
    return sorted(first.values(), key=lambda r: (r.peer_id != home, r.peer_id))


def unique_backends(report: PeerReport) -> list[BackendReport]:
    """A report's backends with a duplicated backend id keeping its first entry."""
    seen: set[str] = set()
    out: list[BackendReport] = []
    for b in report.backends:
        if b.backend_id not in seen:
            seen.add(b.backend_id)
            out.append(b)
    return out


def is_expired(job: JobShape, now_ms: int) -> bool:
    return job.deadline_ms is not None and now_ms >= job.deadline_ms


def plan_reference(
    jobs: Sequence[JobShape],
    *,
    home: str,
    reports: Sequence[PeerReport],
    reservations: Sequence[Reservation] = (),
    now_ms: int,
    stale_after_ms: int,
    max_per_peer: int | None = None,
    in_use: Sequence[JobShape] = (),
    fair_share: FairShare | None = None,
    backfill: Backfill | None = None,
    allowance: Mapping[str, int] | None = None,
) -> PlanResult:
    return plan_turns(
        jobs,
        home=home,
        reports=reports,
        reservations=reservations,
        now_ms=now_ms,
        stale_after_ms=stale_after_ms,
        max_per_peer=max_per_peer,
        in_use=in_use,
        fair_share=fair_share,
        backfill=backfill,
        allowance=allowance,
    )[0]


def plan_turns(
    jobs: Sequence[JobShape],
    *,
    home: str,
    reports: Sequence[PeerReport],
    reservations: Sequence[Reservation] = (),
    now_ms: int,
    stale_after_ms: int,
    max_per_peer: int | None = None,
    in_use: Sequence[JobShape] = (),
    fair_share: FairShare | None = None,
    backfill: Backfill | None = None,
    allowance: Mapping[str, int] | None = None,
) -> tuple[PlanResult, list[str]]:
    """:func:`plan_reference`, and the job ids in the order their turns came."""
    limits = PeerLimits(max_per_peer, allowance or {})
    peers = peer_order(reports, home)
    status = {p.peer_id: peer_status(p, now_ms, stale_after_ms) for p in peers}
    capacity: dict[tuple[str, str], Capacity | None] = {}
    # What each backend offered before this tick placed anything (the reason codes compare).
    initial: dict[tuple[str, str], Capacity | None] = {}
    attrs: dict[tuple[str, str], dict[str, frozenset[str]]] = {}
    for p in peers:
        for b in unique_backends(p):
            capacity[(p.peer_id, b.backend_id)] = working_capacity(p.peer_id, b, reservations)
            initial[(p.peer_id, b.backend_id)] = working_capacity(p.peer_id, b, reservations)
            attrs[(p.peer_id, b.backend_id)] = normalize_attributes(b.advertised_attributes)
    placed_on: dict[str, int] = {}

    # Fair share (iris/policy/fairshare.py): whose turn is next is read from the shares as they are.
    shares = Shares(in_use, federation_totals(reports), fair_share or FairShare())
    # Each user's jobs of a band in submit order: their share is the same, so its first job left
    # is the one of them whose turn comes first.
    lanes: dict[tuple[Band, str], deque[JobShape]] = {}
    for job, user in sorted(unique_jobs(jobs), key=lambda item: (item[0].submit_ms, item[0].job_id)):
        lanes.setdefault((job.band, user), deque()).append(job)
    turns: list[str] = []
    # Backfill (iris/policy/backfill.py): when held devices come back, and what is held for whom.
    settings = backfill or Backfill()
    releases = Releases(in_use, settings, now_ms) if settings.enabled else None
    holds: dict[Slot, Hold] = {}

    placements: list[Placement] = []
    expired: list[str] = []
    waiting: list[tuple[int, JobShape, str | None]] = []
    capped: list[tuple[int, JobShape, str]] = []
    held: list[Hold] = []
    while lanes:
        # The next turn: the highest band, then the smallest (virtual submit time, submit, id).
        band, user = min(lanes, key=lambda lane: (lane[0], shares.key(lanes[lane][0], lane[1])))
        job = lanes[(band, user)].popleft()
        if not lanes[(band, user)]:
            del lanes[(band, user)]
        position = len(turns)
        turns.append(job.job_id)
        if is_expired(job, now_ms):
            expired.append(job.job_id)
            continue
        refusal = shares.refusal(job, user)
        if refusal is not None:
            capped.append((position, job, refusal))
            continue
        constraints = job_constraints(job)
        need = gate(job.device)
        pin = pinned_cluster(job.target_cluster, status)
        end_ms = releases.end_of(job) if releases is not None else 0
        best: _Rank | None = None
        for p in peers:
            if status[p.peer_id] is not PeerStatus.OK:
                continue
            if pin and pin != p.peer_id:
                continue
            if limits.reached(p.peer_id, placed_on.get(p.peer_id, 0)):
                continue
            not_home = int(p.peer_id != home)
            shape_matched = False
            for b in unique_backends(p):
                if not _matches(constraints, attrs[(p.peer_id, b.backend_id)]):
                    continue
                shape_matched = True
                cap = capacity[(p.peer_id, b.backend_id)]
                rank: _Rank
                if not is_verified(cap, need[0] if need else None):
                    # No block, or (a CPU job) a block that does not report cpu: by shape.
                    rank = (1, 0, not_home, 0, p.peer_id, b.backend_id)
                elif cap is None or need is None:
                    rank = (0, 0, not_home, 0, p.peer_id, b.backend_id)
                else:
                    token, amount = need
                    if not admits(holds.get((p.peer_id, b.backend_id, token)), amount, end_ms):
                        continue  # held for a job ahead, and this one would not give it back in time
                    if cap.idle(token) >= amount:
                        rank = (0, 0, not_home, cap.idle(token) - amount, p.peer_id, b.backend_id)
                    elif cap.effective(token, job.band) >= amount:
                        rank = (
                            0,
                            1,
                            not_home,
                            cap.effective(token, job.band) - amount,
                            p.peer_id,
                            b.backend_id,
                        )
                    else:
                        continue
                if best is None or rank < best:
                    best = rank
            if not shape_matched and pin == p.peer_id:
                # Force-route: the pin wins over what the peer advertises; nothing is reserved.
                best = (2, 0, not_home, 0, p.peer_id, "")
        if best is None:
            waiting.append((position, job, pin))
            if releases is not None and need is not None:
                open_peers = [p for p in peers if not limits.reached(p.peer_id, placed_on.get(p.peer_id, 0))]
                hold = _hold(job, need, pin, open_peers, status, capacity, attrs, holds, releases)
                if hold is not None:
                    holds[(hold.peer_id, hold.backend_id, hold.token)] = hold
                    held.append(hold)
            continue
        shape_only, preempts, _, _, peer_id, backend_id = best
        placed_on[peer_id] = placed_on.get(peer_id, 0) + 1
        shares.charge(job, user)
        cap = capacity.get((peer_id, backend_id)) if backend_id else None
        reserved: dict[str, int] = {}
        epoch: int | None = None
        ahead_of: str | None = None
        if cap is not None:
            block = next(b for b in _peer(peers, peer_id).backends if b.backend_id == backend_id).availability
            epoch = block.observation_epoch_ms if block is not None else None
            if need is not None and cap.verifies(need[0]):
                cap.spend(need[0], need[1], job.band)
                reserved = {need[0]: need[1]}
                if releases is not None:
                    slot = (peer_id, backend_id, need[0])
                    ahead_of = take(holds.get(slot), need[1], end_ms)
                    if not preempts:  # a preemptor's devices are its victims', already counted
                        releases.add(slot, end_ms, need[1])
        placements.append(
            Placement(
                job_id=job.job_id,
                peer_id=peer_id,
                backend_id=backend_id,
                band=job.band,
                observation_epoch_ms=epoch,
                reserved=reserved,
                verified=shape_only == 0,
                preempts=bool(preempts),
                forced=backend_id == "",
                reason=placement_reason(peer_id, backend_id, home, shape_only, bool(preempts), ahead_of),
                ahead_of=ahead_of,
            )
        )

    groups = []
    held_for = {h.job_id: h for h in held}
    for position, job, pin in waiting:
        verdicts = _verdicts(
            job, pin, peers, status, capacity, attrs, placed_on, limits, stale_after_ms, holds
        )
        fit = _alone_fits(job, pin, verdicts, initial, attrs)
        summary, code = summarize(pin, verdicts), reason_code(pin, verdicts, fit)
        if (hold := held_for.get(job.job_id)) is not None:
            summary, code = held_summary(summary, hold), ReasonCode.Reserved
        groups.append(([(position, job.job_id)], summary, code, verdicts))
    for position, job, refusal in capped:
        groups.append(([(position, job.job_id)], refusal, ReasonCode.UserQuota, []))
    result = PlanResult(placements=placements, expired=expired, waiting=merge_groups(groups), holds=held)
    return result, turns


def _hold(
    job: JobShape,
    need: tuple[str, int],
    pin: str | None,
    peers: Sequence[PeerReport],
    status: dict[str, PeerStatus],
    capacity: dict[tuple[str, str], Capacity | None],
    attrs: dict[tuple[str, str], dict[str, frozenset[str]]],
    holds: dict[Slot, Hold],
    releases: Releases,
) -> Hold | None:
    """Devices to hold for a gated job that found no room: every candidate backend of an answering
    peer below its per-tick cap (``peers``) that reports the job's token and holds for no one yet,
    in (home first, peer, backend) order."""
    token, amount = need
    constraints = job_constraints(job)
    candidates: list[tuple[Slot, int]] = []
    for p in peers:
        if status[p.peer_id] is not PeerStatus.OK or (pin and pin != p.peer_id):
            continue
        for b in sorted(unique_backends(p), key=lambda b: b.backend_id):
            cap = capacity[(p.peer_id, b.backend_id)]
            slot = (p.peer_id, b.backend_id, token)
            if cap is None or not cap.verifies(token) or slot in holds:
                continue
            if _matches(constraints, attrs[(p.peer_id, b.backend_id)]):
                candidates.append((slot, cap.idle(token)))
    return choose_hold(job.job_id, token, amount, candidates, releases)


def placement_reason(
    peer_id: str, backend_id: str, home: str, shape_only: int, preempts: bool, ahead_of: str | None = None
) -> str:
    where = "the home cluster" if peer_id == home else f"peer {peer_id}"
    if shape_only == 2:
        return f"Pinned to {where}, which advertises no backend of this shape: force-routed"
    if shape_only == 1:
        return f"Placed on {where} backend {backend_id} by shape (it reports no capacity for this job)"
    how = "by reclaiming lower-priority work" if preempts else "with free capacity"
    if ahead_of is not None:
        how += f", ahead of {ahead_of} (backfill: its time limit ends before that job's reserved start)"
    return f"Placed on {where} backend {backend_id} {how}"


def _peer(peers: Sequence[PeerReport], peer_id: str) -> PeerReport:
    return next(p for p in peers if p.peer_id == peer_id)


def _alone_fits(
    job: JobShape,
    pin: str | None,
    verdicts: Sequence[PeerVerdict],
    initial: dict[tuple[str, str], Capacity | None],
    attrs: dict[tuple[str, str], dict[str, frozenset[str]]],
) -> bool:
    """Whether a peer that answers and is full or capped had room for ``job`` before the tick placed
    anything (alone in the queue, it would have been placed); a pinned job's peer without its shape
    would have been force-routed."""
    need = gate(job.device)
    constraints = job_constraints(job)
    if pin and any(v.kind is WaitKind.NO_SHAPE for v in verdicts):
        return True
    taken = {p for v in verdicts if v.kind in (WaitKind.FULL, WaitKind.PER_TICK_CAP) for p in v.peer_ids}
    for (peer_id, backend_id), cap in initial.items():
        if peer_id not in taken or not _matches(constraints, attrs[(peer_id, backend_id)]):
            continue
        if not is_verified(cap, need[0] if need else None) or need is None:
            return True  # shape-only or ungated: it always fits
        assert cap is not None
        if cap.effective(need[0], job.band) >= need[1]:
            return True
    return False


def _verdicts(
    job: JobShape,
    pin: str | None,
    peers: Sequence[PeerReport],
    status: dict[str, PeerStatus],
    capacity: dict[tuple[str, str], Capacity | None],
    attrs: dict[tuple[str, str], dict[str, frozenset[str]]],
    placed_on: dict[str, int],
    limits: PeerLimits,
    stale_after_ms: int,
    holds: dict[Slot, Hold],
) -> list[PeerVerdict]:
    """Why no peer took ``job``, read off the end-of-tick state (capacity only shrinks in a tick)."""
    constraints = job_constraints(job)
    need = gate(job.device)
    rows: list[tuple[str, WaitKind, str, str | None, int | None, int | None]] = []
    candidates = [p for p in peers if not pin or p.peer_id == pin]
    if pin and not candidates:
        rows.append((pin, WaitKind.UNKNOWN_PEER, unknown_peer_message(pin), None, None, None))
    for p in candidates:
        st = status[p.peer_id]
        if st is PeerStatus.UNREACHABLE:
            rows.append((p.peer_id, WaitKind.UNREACHABLE, unreachable_message(p.error), None, None, None))
            continue
        if st is PeerStatus.STALE:
            rows.append((p.peer_id, WaitKind.STALE, stale_message(stale_after_ms), None, None, None))
            continue
        unique = unique_backends(p)
        matching = [b for b in unique if _matches(constraints, attrs[(p.peer_id, b.backend_id)])]
        if not matching:
            advertised = [attrs[(p.peer_id, b.backend_id)] for b in unique]
            message = no_shape_message(constraints, advertised)
            rows.append((p.peer_id, WaitKind.NO_SHAPE, message, None, None, None))
            continue
        if limits.reached(p.peer_id, placed_on.get(p.peer_id, 0)):
            rows.append((p.peer_id, WaitKind.PER_TICK_CAP, limits.message(p.peer_id), None, None, None))
            continue
        # Only verified, gated backends can be left full (anything else always fits).
        assert need is not None
        token, amount = need
        band: Band = job.band
        available = max(
            usable(holds.get((p.peer_id, b.backend_id, token)), c.effective(token, band), amount)
            for b in matching
            if (c := capacity[(p.peer_id, b.backend_id)]) is not None and c.verifies(token)
        )
        rows.append(
            (p.peer_id, WaitKind.FULL, full_message(token, amount, band, available), token, amount, available)
        )
    return group_verdicts(rows)
