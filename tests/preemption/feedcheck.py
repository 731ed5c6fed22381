"""What the preemption tests of both backends share (docs/DESIGN.md, "Preemption"): an Executor
whose capacity report's ``held_by_band`` is compared with its RUNNING jobs after every change its
change feed shows, and the waits the tests use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from iris.controller.executors.core import Executor
from iris.controller.models import ControllerJobState as S


class FeedChecked:
    """Reads the executor's change feed; a subclass says how to read its backend's report."""

    # How long ``until`` waits by default.
    timeout_s = 20.0

    def __init__(self, executor: Executor, backend_id: str) -> None:
        self.executor = executor
        self.backend_id = backend_id
        self.cursor: str | None = None
        self.checks = 0
        self.preemptions_seen: set[str] = set()

    def expected(self) -> dict[int, dict[str, int]]:
        """What the RUNNING jobs hold, by band and token: what ``held_by_band`` must say."""
        held: dict[int, dict[str, int]] = {}
        for job in self.executor.jobs.values():
            if job.state is S.RUNNING:
                demand = self.executor.backends[self.backend_id].demand(job.device)
                by = held.setdefault(int(job.band), {})
                by[demand.resource] = by.get(demand.resource, 0) + demand.total
        return held

    def promised(self, token: str) -> int:
        """What the PENDING jobs will take of ``token``."""
        backend = self.executor.backends[self.backend_id]
        return sum(
            backend.demand(j.device).total
            for j in self.executor.jobs.values()
            if j.state is S.PENDING and backend.demand(j.device).resource == token
        )

    def read_feed(self) -> None:
        """The changes since the last look (the PREEMPTED ones noted)."""
        found = self.executor.changes(self.cursor, 1000, lambda _: True)
        self.cursor = found.cursor
        for st in found.jobs:
            if st.state is S.PREEMPTED:
                self.preemptions_seen.add(st.job_id)

    def check(self) -> None:
        """Read the feed, then compare the report with the job table."""
        raise NotImplementedError

    async def watch(self) -> None:
        # The executor runs on this event loop: whenever this task runs, the executor is between
        # two of its steps, and every change since the last look is in the feed.
        while True:
            self.check()
            await asyncio.sleep(0.005)  # not a wait: the checker's sampling period

    def state(self, job_id: str) -> S:
        return self.executor.get(job_id).state

    async def until(self, what: str, cond: Callable[[], bool], timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout_s if timeout is None else timeout)
        while not cond():
            if loop.time() > deadline:
                states = {j: r.state.value for j, r in self.executor.jobs.items()}
                raise AssertionError(f"timed out waiting for {what}: {states}")
            await asyncio.sleep(0.02)
