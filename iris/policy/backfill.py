"""EASY backfill (docs/DESIGN.md, "Backfill"): devices are held for a job that cannot start, and
only jobs that give them back in time may use them meanwhile.

When a gated job's turn finds no backend with room, the tick holds devices for it on the backend
where it could start soonest: ``start_ms``, the earliest time the free devices plus those of the
jobs running there (by their time limits: ``--timeout``, else the band's default) reach its need.
A later job in the tick's order may still take that backend's free devices if its own time limit
ends by ``start_ms`` (they are back before they are needed: a backfilled job), or if it takes no
more than the ``spare`` devices free at ``start_ms`` beyond the need. So no job after the held one
in the order moves its start later, in a model where jobs end by their limits (tests/policy/
test_policy_backfill.py checks it by simulation). One hold per backend and token, first come; a
tick starts with none: every tick holds again for the queue as it is, so a higher band's job,
whose turn comes first, never waits for a lower one's hold.

Pure functions and plain data, shared by the planner (:mod:`iris.policy.planner`) and its
reference (:mod:`iris.policy.reference`).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Sequence

from iris.policy.availability import gate
from iris.policy.models import Backfill, Hold, JobShape

# (peer id, backend id, token)
Slot = tuple[str, str, str]


class Releases:
    """When the devices held now come back, per backend and token: each running job's at its
    start plus its time limit (one overdue is taken as ending now), and each job this tick places
    at now plus its limit. A job whose backend or start is unknown gives nothing back."""

    def __init__(self, in_use: Iterable[JobShape], settings: Backfill, now_ms: int) -> None:
        self.now_ms = now_ms
        self.settings = settings
        ends: dict[Slot, list[tuple[int, int]]] = {}
        # A tick counts every running job (thousands, most alike): each kind of device is gated
        # once, and each slot's ends are gathered, then sorted once (the lists insertion builds).
        gates: dict[tuple[str, str, int, int], tuple[str, int] | None] = {}
        for job in in_use:
            where = job.running_on
            if where is None:
                continue
            d = job.device
            kind = (d.type, d.variant, d.count, d.replicas)
            if kind in gates:
                need = gates[kind]
            else:
                need = gates[kind] = gate(d)
            if need is None:
                continue
            token, amount = need
            if amount > 0:
                # Overdue: taken as ending now.
                end = max(where.since_ms + settings.limit_ms(job), now_ms)
                slot = (where.peer_id, where.backend_id, token)
                got = ends.get(slot)
                if got is None:
                    ends[slot] = [(end, amount)]
                else:
                    got.append((end, amount))
        for got in ends.values():
            got.sort()
        self.ends = ends

    def add(self, slot: Slot, end_ms: int, amount: int) -> None:
        if amount > 0:
            insort(self.ends.setdefault(slot, []), (end_ms, amount))

    def end_of(self, job: JobShape) -> int:
        """When ``job`` would give its devices back if it started now."""
        return self.now_ms + self.settings.limit_ms(job)

    def earliest(self, slot: Slot, free: int, need: int) -> tuple[int, int] | None:
        """(start, spare): the first time ``free`` plus what comes back reaches ``need``, and what
        is free then beyond it; None if it never does."""
        if free >= need:
            return self.now_ms, free - need
        have = free
        for end, amount in self.ends.get(slot, ()):
            have += amount
            if have >= need:
                return end, have - need
        return None


def admits(hold: Hold | None, need: int, end_ms: int) -> bool:
    """Whether a job of ``need`` devices ending by ``end_ms`` may start on a held backend now."""
    return hold is None or end_ms <= hold.start_ms or need <= hold.spare


def take(hold: Hold | None, need: int, end_ms: int) -> str | None:
    """Charge a placement to the backend's hold; the held job's id if the placement is backfilled
    (it fits only because it ends before the held start), else None."""
    if hold is None:
        return None
    if end_ms <= hold.start_ms:
        return hold.job_id if need > hold.spare else None
    hold.spare -= need
    return None


def choose_hold(
    job_id: str,
    token: str,
    need: int,
    candidates: Sequence[tuple[Slot, int]],
    releases: Releases,
) -> Hold | None:
    """The hold for a job that could not start: on the candidate (slot, free devices now) where it
    can start soonest, the first in ``candidates``' order among equals; None if it can start on
    none of them as things are (a backend too small, or held by jobs with no known end)."""
    best: tuple[int, int, Slot, int] | None = None
    for rank, (slot, free) in enumerate(candidates):
        found = releases.earliest(slot, free, need)
        if found is not None and (best is None or (found[0], rank) < (best[0], best[1])):
            best = (found[0], rank, slot, found[1])
    if best is None:
        return None
    start, _, (peer_id, backend_id, _), spare = best
    return Hold(
        job_id=job_id,
        peer_id=peer_id,
        backend_id=backend_id,
        token=token,
        amount=need,
        start_ms=start,
        spare=spare,
    )


def usable(hold: Hold | None, effective: int, need: int) -> int:
    """What a held backend offered a job that waits, as its FULL verdict says: all it has if that
    is less than the need (the job waits for capacity), else the spare (it waits for the hold)."""
    if hold is None or effective < need:
        return effective
    return min(effective, hold.spare)


def held_summary(summary: str, hold: Hold) -> str:
    """A held job's reason: its wait's summary, and where devices are held for it (no time: a
    summary stays the same while its situation does; ``describe`` shows the start)."""
    return f"{summary}; {hold.amount} {hold.token} held for it on {hold.peer_id}"
