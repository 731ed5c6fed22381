"""Handoff pacing: how many placements each cluster may be sent, by rate and by tick (docs/DESIGN.md,
"Handoff pacing").

A cluster is protected by a rate of handoffs a second (``handoffs_per_s``), a token bucket per
cluster that holds at most one second's worth: a tick may send a cluster as many jobs as fit and
as its bucket holds, so a sweep is placed at the rate, whatever the tick's length. The older cap
per tick (``max_per_peer_per_tick``) still applies when it is set, and the lower of the two binds.

Pure: the caller passes the clock in (``now_s``, monotonic seconds). The planner sees only each
cluster's allowance for the tick (:class:`PeerLimits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from iris.policy.explain import cap_message, pace_message
from iris.policy.models import PlanResult, WaitKind


@dataclass
class HandoffPace:
    """One token bucket per cluster: ``per_s`` tokens a second, at most ``burst`` held (default:
    one second's worth, and never less than one token). A cluster not seen before starts full."""

    per_s: float
    burst: float = 0.0
    _tokens: dict[str, float] = field(default_factory=dict)
    _at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.per_s > 0:
            raise ValueError("handoffs_per_s must be positive")
        if self.burst <= 0:
            self.burst = max(1.0, self.per_s)

    def _refill(self, peer: str, now_s: float) -> float:
        tokens = self._tokens.get(peer, self.burst)
        last = self._at.get(peer, now_s)
        tokens = min(self.burst, tokens + max(0.0, now_s - last) * self.per_s)
        self._tokens[peer] = tokens
        self._at[peer] = max(last, now_s)
        return tokens

    def allowance(self, peers: Iterable[str], now_s: float) -> dict[str, int]:
        """Placements each of ``peers`` may be sent now (whole tokens)."""
        # A float a hair under a whole token (0.1 s × 30/s) counts as that token.
        return {p: int(self._refill(p, now_s) + 1e-9) for p in peers}  # tokens are never negative

    def spend(self, placed: Mapping[str, int], now_s: float) -> None:
        """Take what a tick sent each cluster from its bucket (never below zero)."""
        for peer, n in placed.items():
            self._tokens[peer] = max(0.0, self._refill(peer, now_s) - n)


@dataclass(frozen=True)
class PeerLimits:
    """What one tick may send each cluster: the cap per tick (None: none) and each cluster's
    allowance from its bucket (a cluster not named has no bucket: not paced)."""

    max_per_peer: int | None = None
    allowance: Mapping[str, int] = field(default_factory=dict)

    def limit(self, peer: str) -> int | None:
        """The most placements ``peer`` may take this tick; None: no limit."""
        paced = self.allowance.get(peer)
        if paced is None:
            return self.max_per_peer
        if self.max_per_peer is None:
            return paced
        return min(paced, self.max_per_peer)

    def reached(self, peer: str, placed: int) -> bool:
        limit = self.limit(peer)
        return limit is not None and placed >= limit

    def message(self, peer: str) -> str:
        """Why a job waits for ``peer`` once its limit is reached: the pace, unless the cap binds.
        Stable from tick to tick (no count in it), so a job waiting on it is told once."""
        paced = self.allowance.get(peer)
        if paced is not None and (self.max_per_peer is None or paced < self.max_per_peer):
            return pace_message()
        assert self.max_per_peer is not None
        return cap_message(self.max_per_peer)


def held_by_cap(result: PlanResult) -> bool:
    """Some waiting job was held back by a cluster's cap per tick, not by its pace: another tick
    at once may place more. (A paced cluster's bucket refills over the interval: a tick at once
    would find it all but empty.)"""
    pace = pace_message()
    return any(
        v.kind is WaitKind.PER_TICK_CAP and v.message != pace
        for group in result.waiting
        for v in group.verdicts
    )
