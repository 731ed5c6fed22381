"""ListPeers: one live poll of every controller, for `iris peers` and `iris rpc controller list-peers`.

A short workflow rather than a direct call, so a CLI needs nothing but Temporal: the signing keys
stay with the workers (docs/DESIGN.md, "Where secrets live").
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.peers import PeerActivities
    from iris import contract
    from iris.reports import FederationView


@workflow.defn(name=contract.LIST_PEERS)
class ListPeersWorkflow:
    @workflow.run
    async def run(self) -> FederationView:
        return await workflow.execute_activity_method(
            PeerActivities.fetch_reports,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=2),
        )
