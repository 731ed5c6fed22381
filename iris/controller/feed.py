"""The controller's change feed (docs/DESIGN.md, "The change feed"): which jobs changed since a cursor.

Every persisted change of a job record (its state, a task, a new attempt) takes the next version of
a counter; a job removed by retention leaves a tombstone with its version. A reader keeps the cursor
of its last reply and asks for what changed since: one reply carries each changed job once, in the
order of its latest change. A cursor names the controller's incarnation (a random epoch drawn at
start) and a version. One from before a restart, from the future, or older than the tombstones still
kept cannot be answered exactly: the answer is an explicit resync, and the reader lists every job.

In memory only, and O(changes since the cursor) per reply: the jobs sit in the order of their
latest change, so a reply walks back from the newest change and stops at the cursor.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass

# Tombstones kept for readers that are behind; a cursor older than the oldest one dropped resyncs.
MAX_TOMBSTONES = 10_000


@dataclass(frozen=True)
class Changes:
    """What changed after a cursor: job ids (oldest change first), removed job ids, and the cursor
    that continues after them. ``resync``: the cursor cannot be answered (list every job instead)."""

    changed: list[str]
    # (job id, its requester): a reader sees only its own jobs' tombstones.
    removed: list[tuple[str, str]]
    cursor: str
    more: bool = False
    resync: bool = False


class ChangeFeed:
    """Versions each job change; answers and long-polls "what changed since". Event-loop only."""

    def __init__(self, *, max_tombstones: int = MAX_TOMBSTONES) -> None:
        self.epoch = secrets.token_hex(8)
        self._version = 0
        # job id -> version of its latest change, in version order (the newest last).
        self._latest: OrderedDict[str, int] = OrderedDict()
        # job id -> (version of its removal, its requester), in version order.
        self._removed: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._max_tombstones = max_tombstones
        # Cursors below this have lost tombstones: they resync.
        self._floor = 0
        self._changed = asyncio.Event()
        self._closed = False

    def close(self) -> None:
        """The controller stops: every long poll answers now, and later ones do not wait."""
        self._closed = True
        self._changed.set()

    @property
    def version(self) -> int:
        return self._version

    def cursor(self, version: int | None = None) -> str:
        return f"{self.epoch}-{self._version if version is None else version}"

    def _bump(self) -> int:
        self._version += 1
        # Wake every waiter, then arm a fresh event for the next change.
        self._changed.set()
        self._changed = asyncio.Event()
        return self._version

    def touch(self, job_id: str) -> None:
        """The job's record changed (it was saved)."""
        version = self._bump()
        self._latest.pop(job_id, None)
        self._latest[job_id] = version
        self._removed.pop(job_id, None)

    def forget(self, job_id: str, requester: str) -> None:
        """The job was removed (retention): readers see a tombstone."""
        if self._latest.pop(job_id, None) is None:
            return
        self._removed[job_id] = (self._bump(), requester)
        while len(self._removed) > self._max_tombstones:
            _, (dropped, _owner) = self._removed.popitem(last=False)
            self._floor = dropped

    def parse(self, cursor: str | None) -> int | None:
        """The version a cursor stands for; None when it cannot be answered exactly (resync)."""
        if not cursor:
            return None
        epoch, _, number = cursor.rpartition("-")
        if epoch != self.epoch or not number.isdigit():
            return None
        version = int(number)
        if version > self._version or version < self._floor:
            return None
        return version

    def since(self, cursor: str | None, limit: int) -> Changes:
        """What changed after ``cursor``, at most ``limit`` entries (``more`` if there are others)."""
        after = self.parse(cursor)
        if after is None:
            return Changes(changed=[], removed=[], cursor=self.cursor(), resync=True)
        # (version, job id, requester of a removed job or None)
        entries: list[tuple[int, str, str | None]] = []
        for job_id, version in reversed(self._latest.items()):
            if version <= after:
                break
            entries.append((version, job_id, None))
        for job_id, (version, requester) in reversed(self._removed.items()):
            if version <= after:
                break
            entries.append((version, job_id, requester))
        entries.sort()
        more = len(entries) > limit
        entries = entries[:limit]
        last = entries[-1][0] if entries else after
        return Changes(
            changed=[j for _, j, owner in entries if owner is None],
            removed=[(j, owner) for _, j, owner in entries if owner is not None],
            cursor=self.cursor(last),
            more=more,
        )

    async def wait(self, cursor: str | None, timeout_s: float) -> None:
        """Return once something changed after ``cursor`` (at once for a resync), or after
        ``timeout_s``."""
        after = self.parse(cursor)
        if after is None or after < self._version or self._closed:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return
