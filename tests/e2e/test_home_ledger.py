"""Home capacity through the same ledger (docs/DESIGN.md, "The ledger"): a LOCAL job takes home's
CPU slots through the queue's CAS, so a burst of submits never runs more at home than home has
room for; the rest wait in the federation queue and go wherever the tick finds room."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from stack import Stack

from iris.jobs import JobState

JOBS = 100  # home has 16 CPU slots (two backends of 8, config/clusters.toml)


async def test_a_burst_of_cpu_jobs_never_waits_at_home_while_a_peer_has_room(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    ids = await asyncio.gather(
        *(stack.iris.submit(["sleep", "2"], name=f"burst-{tag}-{i:03d}") for i in range(JOBS))
    )
    finals = await asyncio.gather(*(stack.iris.wait(job_id, timeout_s=600) for job_id in ids))

    assert Counter(s.state for s in finals) == {JobState.SUCCEEDED: JOBS}
    home = [s for s in finals if s.cluster == stack.config.home]
    # A job that ran at home never waited there for a slot: home took only what it had room for.
    waited = [s for s in home if any(e.state is JobState.PENDING for e in s.events)]
    assert waited == [], [(s.job_id, s.disposition, [e.message for e in s.events]) for s in waited[:2]]
    # Home took what it had room for at submit (later submits find freed slots); the rest queued.
    dispositions = Counter(s.disposition for s in finals)
    assert dispositions["local"] > 0 and dispositions["queue"] > 0, dispositions
    # The peers' CPU slots took their share of the burst.
    peers = Counter(s.cluster for s in finals if s.cluster != stack.config.home)
    assert set(peers) == {"cw-us-east-02a", "cw-rno2a"}, peers
    # No reservation outlives its job.
    left = [r for r in stack.store.reservations() if r.job_id in set(ids)]
    assert left == [], left
