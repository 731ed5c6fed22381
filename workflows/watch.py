"""PeerWatch: one watcher per cluster (docs/DESIGN.md, "Mirroring"), an entity workflow.

Runs ``watch_peer`` (activities/watch.py) again and again: each run long-polls the cluster's change
feed for a while and signals the jobs that changed there, then returns its cursor, which the next
run continues from. Retried for ever through outages (the activity's heartbeat carries the cursor);
continues as new every ``runs_per_history`` runs so its history stays bounded. One per cluster per
task queue, whatever the number of workers: its workflow id is the singleton
(``contract.peer_watch_workflow_id``).
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.watch import WatchActivities, WatchInput
    from iris import contract

# Outages (of the cluster, or of Temporal while signalling) are retried for ever, at most 10 s apart.
_WATCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))


class WatcherInput(BaseModel):
    cluster: str
    cursor: str | None = None
    run_for_s: float = 1800.0
    wait_s: float = 20.0
    silent_report_s: float = 3.0
    runs_per_history: int = 50


@workflow.defn(name=contract.PEER_WATCH)
class PeerWatch:
    @workflow.run
    async def run(self, inp: WatcherInput) -> None:
        workflow.set_current_details(f"Watching {inp.cluster}'s change feed; signalling the jobs that change")
        cursor = inp.cursor
        for _ in range(inp.runs_per_history):
            try:
                outcome = await workflow.execute_activity_method(
                    WatchActivities.watch_peer,
                    WatchInput(
                        cluster=inp.cluster,
                        cursor=cursor,
                        run_for_s=inp.run_for_s,
                        wait_s=inp.wait_s,
                        silent_report_s=inp.silent_report_s,
                    ),
                    start_to_close_timeout=timedelta(seconds=inp.run_for_s + 120),
                    heartbeat_timeout=timedelta(seconds=max(30.0, inp.wait_s + 15)),
                    retry_policy=_WATCH_RETRY,
                )
            except ActivityError as exc:
                # Only a refusal ends up here (e.g. the cluster left the configuration): the jobs
                # there still have their own safety poll; the next worker start restarts a watcher.
                workflow.logger.warning("watcher of %s stopped: %s", inp.cluster, exc.cause or exc)
                return
            cursor = outcome.cursor
        workflow.continue_as_new(inp.model_copy(update={"cursor": cursor}))
