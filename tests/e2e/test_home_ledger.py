"""Home capacity through the same ledger (docs/DESIGN.md, "The ledger"): a LOCAL job takes home's
CPU slots through the queue's CAS, so a burst of submits never runs more at home than home has
room for; the rest wait in the federation queue and go wherever the tick finds room."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections import Counter
from pathlib import Path

from stack import Stack
from temporalio.worker import Replayer

from iris.contract import job_workflow_id
from iris.jobs import JobState
from iris.temporal import data_converter
from workflows.job import JobWorkflow
from workflows.runner import workflow_runner

JOBS = 100  # home has 16 CPU slots (two backends of 8, config/clusters.toml)


async def test_a_burst_of_cpu_jobs_never_waits_at_home_while_a_peer_has_room(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:6]
    ids = await asyncio.gather(
        *(stack.iris.submit(["sleep", "2"], name=f"burst-{tag}-{i:03d}") for i in range(JOBS))
    )
    outcomes = await asyncio.gather(
        *(stack.iris.wait(job_id, timeout_s=600) for job_id in ids), return_exceptions=True
    )
    # Every job's history replays against the code, as a query of an ended job replays it: the
    # burst mixes local activities, the tick's signals and refused CASes in one workflow task.
    # Checked first, so that a wait that failed on a replay (a query of a job its worker no
    # longer holds replays it) leaves the history behind to read.
    replayer = Replayer(
        workflows=[JobWorkflow], workflow_runner=workflow_runner(), data_converter=data_converter()
    )
    failed = []
    for job_id in ids:
        history = await stack.client.get_workflow_handle(job_workflow_id(job_id)).fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is not None:
            failed.append(job_id)
            path = Path(tempfile.gettempdir()) / f"burst-{job_id.replace('/', '_')}.json"
            path.write_text(history.to_json())
            print(f"{job_id}: {result.replay_failure} (history in {path})")
    assert failed == [], failed
    errors = [(i, repr(o)) for i, o in zip(ids, outcomes, strict=True) if isinstance(o, BaseException)]
    assert errors == [], errors[:3]
    finals = [o for o in outcomes if not isinstance(o, BaseException)]

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
