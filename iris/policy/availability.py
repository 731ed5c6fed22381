"""Capacity as the policy sees it (docs/DESIGN.md, "Placement"): gates, versioned blocks, bands,
reservations, staleness.

A backend's block says what is idle (``amounts``) and what admitted work holds per band
(``held_by_band``), and which part of that is exempt from preemption for now (``exempt_by_band``).
A job of band B may use the idle capacity plus whatever is held, and not exempt, by strictly
lower-priority bands, since the peer's scheduler would preempt that work to admit it. Reservations
the ledger confirmed against the same observation are spent first, so successive ticks between two
heartbeats never re-spend one advertised number; a newer observation already reflects them.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from iris.policy.models import (
    AVAILABILITY_VERSION,
    Availability,
    BackendReport,
    Band,
    DeviceRequest,
    PeerReport,
    Reservation,
)
from iris.policy.preemption import overrides_exemption
from iris.policy.routing import AUTO_VARIANT

# The token of CPU jobs: one unit per replica (a process slot on the process backend).
CPU_TOKEN = "cpu"
# Tokens a block may leave out: a block that does not name one says nothing about it, so a job
# gated on it is matched there by shape only (an older controller, or a Ray backend, that reports
# devices but not CPU). Any other token absent from a block has nothing free.
OPTIONAL_TOKENS: frozenset[str] = frozenset({CPU_TOKEN})
# Bands in the order held capacity is reclaimed: lowest priority first, so higher-priority work is
# disturbed last.
_RECLAIM_ORDER: tuple[Band, ...] = tuple(sorted(Band, reverse=True))


class PeerStatus(StrEnum):
    OK = "ok"
    UNREACHABLE = "unreachable"
    STALE = "stale"


def gate(device: DeviceRequest) -> tuple[str, int] | None:
    """``(token, amount)`` a backend must have available, or None when the request is not gated.

    A GPU with a concrete variant is gated on its chips (``count x replicas``); a CPU job on
    ``cpu``, one unit per replica, the process backend's slot accounting (docs/DESIGN.md,
    "Vocabulary"). ``auto`` names no token and TPU slices are matched on shape. A backend whose
    block does not report ``cpu`` takes CPU jobs by shape (:meth:`Capacity.verifies`).
    """
    dtype = device.type.strip().lower()
    if dtype == CPU_TOKEN:
        return (CPU_TOKEN, device.replicas)
    variant = device.variant.strip().lower()
    if dtype != "gpu" or not variant or variant == AUTO_VARIANT:
        return None
    need = device.count * device.replicas
    return (variant, need) if need > 0 else None


def usable_block(backend: BackendReport) -> Availability | None:
    """The backend's block if this code understands it; None means shape-only (legacy or newer)."""
    block = backend.availability
    if block is None or block.version != AVAILABILITY_VERSION:
        return None
    return block


def peer_status(report: PeerReport, now_ms: int, stale_after_ms: int) -> PeerStatus:
    """Unreachable and stale peers host nothing; a report never contacted counts as stale."""
    if not report.reachable:
        return PeerStatus.UNREACHABLE
    if report.last_contact_ms is None or now_ms - report.last_contact_ms > stale_after_ms:
        return PeerStatus.STALE
    return PeerStatus.OK


class Capacity:
    """Spendable capacity of one backend for one observation; mutated as work is charged to it."""

    __slots__ = ("exempt", "free", "held", "reported")

    def __init__(
        self,
        free: dict[str, int],
        held: dict[Band, dict[str, int]],
        reported: frozenset[str] | None = None,
        exempt: dict[Band, dict[str, int]] | None = None,
    ) -> None:
        self.free = free
        # What each band holds that higher bands may reclaim.
        self.held = held
        # What exempt work of each band holds (a job back from a preemption, within its cluster's
        # preempt_exempt_s): only the most protected band may reclaim it (``overrides_exemption``).
        self.exempt = exempt if exempt is not None else {}
        # Every token the block names (amounts, totals or held), whatever its value.
        if reported is None:
            reported = frozenset(free).union(*(a.keys() for a in held.values()))
        self.reported = reported

    @classmethod
    def from_block(cls, block: Availability) -> Capacity:
        free: dict[str, int] = {}
        for token, amount in block.amounts.items():
            key = token.strip().lower()
            free[key] = free.get(key, 0) + max(0, amount)
        held: dict[Band, dict[str, int]] = {}
        for entry in block.held_by_band:
            per_band = held.setdefault(entry.band, {})
            for token, amount in entry.amounts.items():
                key = token.strip().lower()
                per_band[key] = per_band.get(key, 0) + max(0, amount)
        totals: dict[str, int] = {}
        for token, amount in block.total_amounts.items():
            key = token.strip().lower()
            totals[key] = totals.get(key, 0) + max(0, amount)
        # A block never offers more than the backend's declared total: idle + held beyond it is a
        # malformed (or hostile) report, read conservatively. Held capacity is kept for the highest
        # bands first, so what lower bands claim (and higher bands could reclaim) is trimmed first.
        for key, total in totals.items():
            room = total - min(free.get(key, 0), total)
            if key in free:
                free[key] = total - room
            for band in sorted(held):
                amounts = held[band]
                if key in amounts:
                    amounts[key] = min(amounts[key], room)
                    room -= amounts[key]
        reported = frozenset(free).union(totals, *(a.keys() for a in held.values()))
        # What exempt work holds (a job back from a preemption, within its cluster's
        # preempt_exempt_s) leaves the held amounts: no band but the most protected one may
        # reclaim it yet (iris/policy/preemption.py, ``overrides_exemption``).
        exempt: dict[Band, dict[str, int]] = {}
        for entry in block.exempt_by_band:
            per_band = held.get(entry.band, {})
            for token, amount in entry.amounts.items():
                key = token.strip().lower()
                if key in per_band:
                    moved = min(per_band[key], max(0, amount))
                    per_band[key] -= moved
                    if moved:
                        into = exempt.setdefault(entry.band, {})
                        into[key] = into.get(key, 0) + moved
        return cls(free, held, reported, exempt)

    def copy(self) -> Capacity:
        return Capacity(
            dict(self.free),
            {b: dict(a) for b, a in self.held.items()},
            self.reported,
            {b: dict(a) for b, a in self.exempt.items()},
        )

    def verifies(self, token: str) -> bool:
        """Whether this block's numbers speak for ``token``: always for a device token (absent
        means nothing free), for an optional token (``cpu``) only when the block reports it."""
        return token not in OPTIONAL_TOKENS or token in self.reported

    def idle(self, token: str) -> int:
        return self.free.get(token, 0)

    def reclaimable(self, token: str, band: Band | None) -> int:
        """Held capacity of bands strictly lower than ``band`` (None: any band), exempt work's
        included for a band that overrides the exemption (and for None)."""
        total = sum(amounts.get(token, 0) for b, amounts in self.held.items() if band is None or b > band)
        if self.exempt and (band is None or overrides_exemption(band)):
            shielded = self.exempt.items()
            total += sum(amounts.get(token, 0) for b, amounts in shielded if band is None or b > band)
        return total

    def effective(self, token: str, band: Band | None) -> int:
        return self.idle(token) + self.reclaimable(token, band)

    def spend(self, token: str, amount: int, band: Band | None) -> int:
        """Take ``amount``: idle first, then the lowest reclaimable band up. Returns what is missing."""
        take = min(self.free.get(token, 0), amount)
        if take:
            self.free[token] -= take
        remaining = amount - take
        pools = [self.held]
        if self.exempt and (band is None or overrides_exemption(band)):
            pools.append(self.exempt)  # exempt work only once nothing else is left
        for pool in pools:
            for b in _RECLAIM_ORDER:
                if remaining <= 0:
                    break
                if band is not None and b <= band:
                    continue
                amounts = pool.get(b)
                if not amounts:
                    continue
                taken = min(amounts.get(token, 0), remaining)
                if taken:
                    amounts[token] -= taken
                    remaining -= taken
        return remaining


def replay(capacity: Capacity, reservations: Iterable[Reservation]) -> None:
    """Charge reservations to ``capacity``; callers pass only those of this backend and observation."""
    for r in reservations:
        for token, amount in sorted(r.amounts.items()):
            # A reservation that no longer fits just empties the backend: never negative.
            capacity.spend(token.strip().lower(), max(0, amount), r.band)


def reservations_for(
    reservations: Iterable[Reservation], peer_id: str, backend_id: str, observation_epoch_ms: int
) -> list[Reservation]:
    return [
        r
        for r in reservations
        if r.peer_id == peer_id
        and r.backend_id == backend_id
        and r.observation_epoch_ms == observation_epoch_ms
    ]


def working_capacity(
    peer_id: str, backend: BackendReport, reservations: Iterable[Reservation] = ()
) -> Capacity | None:
    """A backend's capacity net of the reservations confirmed against its current observation.

    None for a shape-only backend (no block, or a version this code does not read).
    """
    block = usable_block(backend)
    if block is None:
        return None
    capacity = Capacity.from_block(block)
    replay(
        capacity,
        reservations_for(reservations, peer_id, backend.backend_id, block.observation_epoch_ms),
    )
    return capacity


def is_verified(capacity: Capacity | None, token: str | None) -> bool:
    """Whether a job gated on ``token`` (None: ungated) is judged on this capacity, not by shape.

    A backend without a usable block is shape-only for every job; one whose block leaves out an
    optional token (``cpu``) is shape-only for jobs gated on it: never 0 free.
    """
    return capacity is not None and (token is None or capacity.verifies(token))


def effective_capacity(
    peer_id: str,
    backend: BackendReport,
    token: str,
    band: Band,
    reservations: Iterable[Reservation] = (),
) -> int | None:
    """What a job of ``band`` may use of ``token`` on one backend; None when shape-only for it."""
    capacity = working_capacity(peer_id, backend, reservations)
    key = token.strip().lower()
    if capacity is None or not capacity.verifies(key):
        return None
    return capacity.effective(key, band)


def live_reservations(
    reservations: Iterable[Reservation], reports: Iterable[PeerReport]
) -> list[Reservation]:
    """The reservations still charged against a current observation; the rest can leave the ledger.

    An unreachable peer keeps its reservations: its last observation may still be the current one
    when it comes back.
    """
    current: set[tuple[str, str, int]] = set()
    keep_peers: set[str] = set()
    for report in reports:
        if not report.reachable:
            keep_peers.add(report.peer_id)
            continue
        for backend in report.backends:
            block = usable_block(backend)
            if block is not None:
                current.add((report.peer_id, backend.backend_id, block.observation_epoch_ms))
    return [
        r
        for r in reservations
        if r.peer_id in keep_peers or (r.peer_id, r.backend_id, r.observation_epoch_ms) in current
    ]
