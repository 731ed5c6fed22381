"""The home-side copy of every job's output (docs/DESIGN.md, "Logs"), kept in the home cluster's
object store.

The mirror activity copies each new piece of a job's log from the cluster that runs it into
immutable objects ``iris-logs/<job id>/<start>-<end>``, named by the controller's byte offsets,
so a retried copy rewrites the same object and readers never see a gap or a duplicate. `iris job
logs` reads them back, whether or not the peer still remembers the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from iris.config import FederationConfig
from iris.objectstore import ObjectStore, open_store

PREFIX = "iris-logs"
_NAME = re.compile(r"(\d{16})-(\d{16})$")


@dataclass(frozen=True)
class RelayedChunk:
    data: str
    next_offset: int


class LogRelay:
    """Append and read relayed logs in the home cluster's object store (synchronous I/O)."""

    def __init__(self, config: FederationConfig) -> None:
        store = config.home_cluster.object_store
        if store is None:
            raise ValueError(f"home cluster {config.home} has no object store to relay logs into")
        self._objects: ObjectStore = open_store(store)

    @staticmethod
    def _prefix(job_id: str) -> str:
        return f"{PREFIX}/{job_id}/"

    def _ranges(self, job_id: str) -> list[tuple[int, int, str]]:
        out = []
        for key in self._objects.keys(self._prefix(job_id)):
            m = _NAME.search(key)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), key))
        return sorted(out)

    def relayed_offset(self, job_id: str) -> int:
        """How far (in the source's byte offsets) the copy reaches."""
        ranges = self._ranges(job_id)
        return ranges[-1][1] if ranges else 0

    def append(self, job_id: str, start: int, end: int, data: str) -> None:
        if end <= start:
            return
        self._objects.put(f"{self._prefix(job_id)}{start:016d}-{end:016d}", data.encode("utf-8"))

    def read(self, job_id: str, offset: int = 0) -> RelayedChunk:
        """Everything copied from ``offset`` on (``offset`` is a ``next_offset`` this returned)."""
        parts: list[str] = []
        next_offset = offset
        for start, end, key in self._ranges(job_id):
            if start < next_offset:
                continue
            if start > next_offset:
                break  # a piece still being copied: stop before the gap
            parts.append(self._objects.get(key).decode("utf-8", errors="replace"))
            next_offset = end
        return RelayedChunk(data="".join(parts), next_offset=next_offset)
