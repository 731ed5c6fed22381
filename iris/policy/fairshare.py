"""Fair share between users within a band, aging, and per-user device caps (docs/DESIGN.md, "Fair
share and aging"): pure.

The order within a band. Each user (an *account*: the job's verified user, else the first segment of
its job id, which the workflow requires to be its signer's prefix) has a *dominant share*: over the
device tokens whose federation total is known, the largest fraction of that total its jobs hold
(the jobs promoted or handed off, plus what this tick already placed), capped at 1. A job's
*virtual submit time* is ``submit_ms + aging_horizon_ms × share(user)``, and a band's jobs are taken
in (virtual submit time, submit time, job id) order, the share read at the moment the job's turn
comes: after one of A's jobs is placed, A's share grows and B's next job may go first (progressive
filling, as DRF). Bands stay strict: every production job before any interactive one before any
batch one.

Aging is the same key read the other way: since a share lies in [0, 1], a job is delayed by at most
``aging_horizon_ms``, so a job goes ahead of every job of its band submitted more than
``aging_horizon_ms`` after it, whatever anyone holds. A job's turn therefore never waits on more than
the jobs of higher bands, those of its band already queued when it arrived, and those of its band
submitted within ``aging_horizon_ms`` after it: with bounded arrivals, a bounded number
(``tests/policy/test_policy_fairshare.py`` states and checks the bound). ``aging_horizon_ms == 0``
is plain FIFO within a band (today's order before fair share).

Caps (``Quotas``): a job whose placement would take its user past ``max_devices_per_user`` devices
in use (all bands), or past its band's cap, waits with ``UserQuota``. Devices are accelerator chips
(``count × replicas`` of a job that is not a CPU job), counted whatever the variant; CPU jobs are not
capped.

No recent-usage (decayed) term: the store keeps no history of what ended, and a decay computed from
the running jobs' ages alone would be a different quantity (usage of the jobs still running), so it
is left out rather than approximated.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from iris.policy.availability import CPU_TOKEN, gate, usable_block
from iris.policy.models import Band, FairShare, JobShape, PeerReport, Quotas


def account(job: JobShape) -> str:
    """Whose share a job counts against: its user, else its job id's first segment."""
    return job.user or job.job_id.partition("/")[0]


def devices(job: JobShape) -> int:
    """Accelerator devices the job holds while it runs (what a quota counts); 0 for a CPU job."""
    d = job.device
    if d.type.strip().lower() == CPU_TOKEN:
        return 0
    return d.count * d.replicas


def federation_totals(reports: Iterable[PeerReport]) -> dict[str, int]:
    """Each token's total over every backend with a block this code reads (a peer's first report
    and a backend's first entry; reachable or not: the federation's size, not what is up now). A
    block's ``total_amounts`` when it names the token, else its idle plus held amounts."""
    totals: dict[str, int] = {}
    seen_peers: set[str] = set()
    for report in reports:
        if report.peer_id in seen_peers:
            continue
        seen_peers.add(report.peer_id)
        seen_backends: set[str] = set()
        for backend in report.backends:
            if backend.backend_id in seen_backends:
                continue
            seen_backends.add(backend.backend_id)
            block = usable_block(backend)
            if block is None:
                continue
            declared: dict[str, int] = {}
            for token, amount in block.total_amounts.items():
                key = token.strip().lower()
                declared[key] = declared.get(key, 0) + max(0, amount)
            observed: dict[str, int] = {}
            for token, amount in block.amounts.items():
                key = token.strip().lower()
                observed[key] = observed.get(key, 0) + max(0, amount)
            for held in block.held_by_band:
                for token, amount in held.amounts.items():
                    key = token.strip().lower()
                    observed[key] = observed.get(key, 0) + max(0, amount)
            for key in declared.keys() | observed.keys():
                amount = declared[key] if key in declared else observed[key]
                totals[key] = totals.get(key, 0) + amount
    return totals


def virtual_ms(submit_ms: int, share: float, horizon_ms: int) -> float:
    """The job's place in its band: its submit time, delayed by its user's share of the horizon."""
    return submit_ms + horizon_ms * share


def quota_message(user: str, band: Band, need: int, cap: int, per_band: bool) -> str:
    """Why a capped user's job waits (stable while the cap holds: no in-use count in it)."""
    scope = f" at band {band.label}" if per_band else ""
    if need > cap:
        return f"Queued: needs {need} devices, more than the cap of {cap} per user{scope}"
    return f"Queued: user {user} is at its cap of {cap} devices in use{scope} (needs {need})"


def quota_refusal(job: JobShape, user: str, held: int, held_in_band: int, quotas: Quotas) -> str | None:
    """Why a cap keeps ``job`` waiting while its user holds ``held`` devices (``held_in_band`` of
    them in the job's band), or None: the overall cap first, then the band's."""
    need = devices(job)
    if not need:
        return None
    overall = quotas.max_devices_per_user
    if overall is not None and held + need > overall:
        return quota_message(user, job.band, need, overall, per_band=False)
    cap = quotas.cap(job.band)
    if cap is not None and held_in_band + need > cap:
        return quota_message(user, job.band, need, cap, per_band=True)
    return None


class Holdings:
    """The jobs holding devices, counted by kind for what is read of them: each user's devices by
    band (:meth:`devices`) and dominant share (:meth:`shares`), and a tick's :class:`Shares`.

    ``kinds``: (account, one of its jobs, how many) per (account, band, device type, variant,
    count, replicas), in first-seen order; a duplicated job id counts once. Every job of a kind
    holds what the one given holds. A tick reads every running job, thousands of them and most
    alike: they are walked once here, and what a job holds is then worked out once per kind."""

    __slots__ = ("kinds",)

    def __init__(self, in_use: Iterable[JobShape]) -> None:
        seen: set[str] = set()
        counts: dict[tuple[str, Band, str, str, int, int], int] = {}
        first: dict[tuple[str, Band, str, str, int, int], tuple[str, JobShape]] = {}
        for job in in_use:
            job_id = job.job_id
            if job_id in seen:
                continue
            seen.add(job_id)
            d = job.device
            user = account(job)
            kind = (user, job.band, d.type, d.variant, d.count, d.replicas)
            n = counts.get(kind)
            if n is None:
                counts[kind] = 1
                first[kind] = (user, job)
            else:
                counts[kind] = n + 1
        self.kinds: list[tuple[str, JobShape, int]] = [(*first[kind], n) for kind, n in counts.items()]

    def devices(self) -> dict[str, dict[Band, int]]:
        """Per user, the devices its jobs hold, by band (what a cap counts); users holding none are
        left out."""
        out: dict[str, dict[Band, int]] = {}
        for user, job, count in self.kinds:
            n = devices(job) * count
            if n:
                per_band = out.setdefault(user, {})
                per_band[job.band] = per_band.get(job.band, 0) + n
        return out

    def shares(self, reports: Iterable[PeerReport], policy: FairShare) -> dict[str, float]:
        """Each user holding devices, with its dominant share of them now, by user."""
        shares = Shares((), federation_totals(reports), policy, held=self)
        users = sorted({*shares.used, *self.devices()})
        return {user: shares.share(user) for user in users}


def held_devices(in_use: Iterable[JobShape]) -> dict[str, dict[Band, int]]:
    """Per user, the devices its jobs in ``in_use`` hold, by band (what a cap counts); users
    holding none are left out. A duplicated job id counts once."""
    return Holdings(in_use).devices()


def user_shares(
    in_use: Sequence[JobShape], reports: Iterable[PeerReport], policy: FairShare
) -> dict[str, float]:
    """Each user holding devices, with its dominant share of them now (what ``iris job list
    --shares`` and ``iris_user_share`` show), by user."""
    return Holdings(in_use).shares(reports, policy)


class Shares:
    """What each user holds during one tick: its devices per token and in all, and its share.

    Built from the jobs holding devices now; :meth:`charge` adds each placement, so a share only
    grows within a tick (the planner's lazy re-keying relies on it). ``held``: ``in_use`` already
    counted (``in_use`` is then not read).
    """

    __slots__ = ("band_devices", "devices", "policy", "shares", "totals", "used", "version")

    def __init__(
        self,
        in_use: Sequence[JobShape],
        totals: dict[str, int],
        policy: FairShare,
        *,
        held: Holdings | None = None,
    ) -> None:
        self.policy = policy
        # Only tokens with a known, non-zero total measure a share.
        self.totals = {t: n for t, n in totals.items() if n > 0}
        self.used: dict[str, dict[str, int]] = {}
        self.devices: dict[str, int] = {}
        self.band_devices: dict[tuple[str, Band], int] = {}
        self.shares: dict[str, float] = {}
        # Per user, how many times its share changed this tick.
        self.version: dict[str, int] = {}
        for user, job, count in (Holdings(in_use) if held is None else held).kinds:
            self._add(user, job, count)

    def _add(self, user: str, job: JobShape, count: int = 1) -> None:
        """``count`` jobs like ``job`` of ``user`` hold their devices."""
        need = gate(job.device)
        if need is not None:
            token, amount = need
            per_token = self.used.setdefault(user, {})
            per_token[token] = per_token.get(token, 0) + amount * count
        n = devices(job) * count
        if n:
            self.devices[user] = self.devices.get(user, 0) + n
            key = (user, job.band)
            self.band_devices[key] = self.band_devices.get(key, 0) + n
        self.shares.pop(user, None)

    def share(self, user: str) -> float:
        """The user's dominant share now: the largest fraction of a token's total it holds, at most 1."""
        cached = self.shares.get(user)
        if cached is None:
            cached = 0.0
            for token, amount in self.used.get(user, {}).items():
                total = self.totals.get(token)
                if total:
                    cached = max(cached, amount / total)
            cached = min(1.0, cached)
            self.shares[user] = cached
        return cached

    def key(self, job: JobShape, user: str) -> tuple[float, int, str]:
        """The job's order within its band now: (virtual submit time, submit time, job id)."""
        return (
            virtual_ms(job.submit_ms, self.share(user), self.policy.aging_horizon_ms),
            job.submit_ms,
            job.job_id,
        )

    def refusal(self, job: JobShape, user: str) -> str | None:
        """Why a cap keeps the job waiting now, or None: the overall cap first, then the band's."""
        quotas = self.policy.quotas
        if not quotas.any:
            return None
        held = self.devices.get(user, 0)
        return quota_refusal(job, user, held, self.band_devices.get((user, job.band), 0), quotas)

    def charge(self, job: JobShape, user: str) -> None:
        """A placement of ``job`` this tick: its user holds its devices from now on."""
        before = self.share(user)
        self._add(user, job)
        if self.share(user) != before:
            self.version[user] = self.version.get(user, 0) + 1


class Turns:
    """The jobs of a tick in turn: bands strictly, then (virtual submit time, submit time, job id)
    with each user's share read when the turn comes (``Shares.charge`` between turns moves it).

    One entry per (band, user) lane in a heap; a user's share only grows within a tick, so an entry
    keyed with an older share sorts no later than it should: it is re-keyed when it comes up. (The
    key is :meth:`Shares.key`, written out here: this runs once per queued job every tick.)
    """

    __slots__ = ("heap", "horizon", "shares")

    def __init__(self, jobs: Iterable[tuple[JobShape, str]], shares: Shares) -> None:
        self.shares = shares
        horizon = self.horizon = shares.policy.aging_horizon_ms
        # Job ids are unique here, so the job itself never takes part in the ordering.
        fifo = [(job.submit_ms, job.job_id, job, user) for job, user in jobs]
        fifo.sort(reverse=True)
        # Each lane newest first, so its next job is popped from the end. Indexed by band first (a
        # list: an enum member hashes in Python, which a dict key per job would pay for).
        by_band: list[dict[str, list[JobShape]]] = [{} for _ in range(max(Band) + 1)]
        for _, _, job, user in fifo:
            lanes = by_band[job.band]
            lane = lanes.get(user)
            if lane is None:
                lanes[user] = [job]
            else:
                lane.append(job)
        version = shares.version
        # (band, virtual submit time, submit time, job id, user, the user's share version, the
        # horizon times that share, the lane): the last three only carry what the next key needs.
        heap: list[tuple[Band, float, int, str, str, int, float, list[JobShape]]] = []
        for band in Band:
            for user, lane in by_band[band].items():
                head = lane[-1]
                scaled = horizon * shares.share(user)
                seen = version.get(user, 0)
                heap.append(
                    (band, head.submit_ms + scaled, head.submit_ms, head.job_id, user, seen, scaled, lane)
                )
        heapq.heapify(heap)
        self.heap = heap

    def next(self) -> tuple[JobShape, str] | None:
        """The next job and its user; None when every job has had its turn."""
        heap = self.heap
        version = self.shares.version
        while heap:
            band, _, _, _, user, seen, scaled, lane = heap[0]
            current = version.get(user, 0)
            if seen != current:
                # Its share grew since: the same head again, keyed with the share it has now.
                scaled = self.horizon * self.shares.share(user)
                head = lane[-1]
                entry = (
                    band,
                    head.submit_ms + scaled,
                    head.submit_ms,
                    head.job_id,
                    user,
                    current,
                    scaled,
                    lane,
                )
                heapq.heapreplace(heap, entry)
                continue
            job = lane.pop()
            if lane:
                head = lane[-1]
                entry = (band, head.submit_ms + scaled, head.submit_ms, head.job_id, user, seen, scaled, lane)
                heapq.heapreplace(heap, entry)
            else:
                heapq.heappop(heap)
            return job, user
        return None


def unique_jobs(jobs: Iterable[JobShape]) -> list[tuple[JobShape, str]]:
    """Each job with its account (as :func:`account`); a duplicated job id keeps its first entry."""
    seen: set[str] = set()
    out: list[tuple[JobShape, str]] = []
    for job in jobs:
        job_id = job.job_id
        if job_id not in seen:
            seen.add(job_id)
            out.append((job, job.user or job_id.partition("/")[0]))
    return out


def fill_order(
    jobs: Sequence[JobShape],
    *,
    in_use: Sequence[JobShape] = (),
    reports: Sequence[PeerReport] = (),
    policy: FairShare | None = None,
) -> list[JobShape]:
    """The planner's order when every job is placed in turn (each placement charging its user): the
    queue as ``iris job list`` and ``--dry-run`` show it. A duplicated job id keeps its first entry.

    The tick's own order differs only where a job is not placed (it charges nothing): a position is
    not a promise. Caps are not applied here: a capped job keeps its place.
    """
    shares = Shares(in_use, federation_totals(reports), policy or FairShare())
    turns = Turns(unique_jobs(jobs), shares)
    out: list[JobShape] = []
    while (turn := turns.next()) is not None:
        job, user = turn
        out.append(job)
        shares.charge(job, user)
    return out
