"""What a client asks of the queue, answered at home (docs/DESIGN.md, "Queue position and dry-run").

The SDK talks only to Temporal, never to the federation store: `iris job list`, `describe` and
`run --dry-run` send an Update to the placement manager, which runs one of these as a local
activity. Each reads the store as the tick does (the queue, the stored reports, the ledger) and
answers with the pure functions of :mod:`iris.policy.queue`; nothing is written, nothing started.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from temporalio import activity

from iris import contract
from iris.config import FederationConfig

# The messages are the SDK's too: they live in iris/inquiry.py, which needs no activity code.
from iris.inquiry import MAX_POSITION_IDS as MAX_POSITION_IDS
from iris.inquiry import DryRunRequest as DryRunRequest
from iris.inquiry import PositionsAnswer as PositionsAnswer
from iris.inquiry import PositionsRequest as PositionsRequest
from iris.inquiry import UserShare
from iris.policy.fairshare import held_devices, user_shares
from iris.policy.models import PeerReport
from iris.policy.queue import DryRun, dry_run, queue_positions
from iris.reports import configured_backends

if TYPE_CHECKING:
    from iris.store import FederationStore


class InquiryActivities:
    def __init__(self, config: FederationConfig, store: FederationStore) -> None:
        self._config = config
        self._store = store

    @activity.defn(name=contract.READ_QUEUE_POSITIONS)
    async def read_queue_positions(self, inp: PositionsRequest) -> PositionsAnswer:
        queued = await asyncio.to_thread(self._store.queued)
        # What the tick's fair share reads besides the queue (docs/DESIGN.md, "Fair share and aging").
        in_use = await asyncio.to_thread(self._store.in_use)
        reports = await asyncio.to_thread(self._store.load_reports)
        fair_share = self._config.fair_share()
        positions = queue_positions(
            [h.shape for h in queued], inp.job_ids, in_use=in_use, reports=reports, fair_share=fair_share
        )
        held = held_devices(in_use)
        users = {
            user: UserShare(devices=sum(held.get(user, {}).values()), share=share)
            for user, share in user_shares(in_use, reports, fair_share).items()
        }
        return PositionsAnswer(
            positions=positions, queued=len(queued), at_ms=int(time.time() * 1000), users=users
        )

    @activity.defn(name=contract.PLAN_DRY_RUN)
    async def plan_dry_run(self, inp: DryRunRequest) -> DryRun:
        store = self._store
        reports = await asyncio.to_thread(store.load_reports)
        reservations = await asyncio.to_thread(store.reservations)
        queued = await asyncio.to_thread(store.queued)
        in_use = await asyncio.to_thread(store.in_use)
        config = self._config
        # Every configured cluster is judged, reported yet or not (a peer never reached since the
        # store was created has no stored report: it counts as unreachable).
        known = {r.peer_id for r in reports}
        reports = [
            *reports,
            *(
                PeerReport(peer_id=c.name, reachable=False, error="no report stored yet")
                for c in config.clusters
                if c.name not in known
            ),
        ]
        configured = {
            c.name: configured_backends(c)
            for c in config.clusters
            if not any(r.peer_id == c.name and r.reachable and r.backends for r in reports)
        }
        return dry_run(
            inp.job,
            home=config.home,
            reports=reports,
            queue=[h.shape for h in queued],
            reservations=reservations,
            configured=configured,
            now_ms=int(time.time() * 1000),
            stale_after_ms=config.stale_after_ms,
            max_per_peer=config.max_per_peer_per_tick,
            in_use=in_use,
            fair_share=config.fair_share(),
            backfill=config.backfill_policy(),
        )
