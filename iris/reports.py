"""Gathering the federation's capacity reports from every cluster's controller."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from iris.config import ClusterConfig, ConfigError, FederationConfig
from iris.controller.client import ControllerClient
from iris.controller.errors import ControllerError
from iris.policy.models import BackendReport, Band, PeerReport, Quotas, Reservation


class FederationView(BaseModel):
    """The manager's view at one instant: who is home, how old a report may be, and every report."""

    home: str
    stale_after_ms: int
    # How long a cluster running an attempt may stay silent before the attempt counts as lost.
    peer_lost_after_s: float = 600.0
    # How often a running job asks its cluster itself while the cluster's watcher signals its
    # changes (docs/DESIGN.md, "Mirroring"); 0: no watchers, the job polls its cluster throughout.
    mirror_safety_poll_s: float = 0.0
    # The handoff's retry schedule and a parked job's probes (iris/config.py, docs/DESIGN.md,
    # "Errors, retries and parking"), taken by runs with the workflow's handoff-timers-v1 patch.
    # The defaults are the constants of the runs before it: a view recorded without them reads
    # back as those.
    handoff_retry_initial_s: float = 1.0
    handoff_retry_max_s: float = 10.0
    parked_probe_first_s: float = 15.0
    parked_probe_max_s: float = 600.0
    reports: list[PeerReport]
    # When the reports were read: staleness is judged at that instant, not when a (possibly
    # delayed) workflow task gets to look at them.
    fetched_ms: int | None = None
    # The configured backends of each cluster that did not answer: classification still counts
    # their shapes (the job waits for them), the tick never places there.
    configured: dict[str, list[BackendReport]] = {}
    # The federation store's confirmed reservations when the view was read: classification counts
    # home capacity another job has just taken (docs/DESIGN.md, "The ledger").
    reservations: list[Reservation] = []
    # The per-user caps on devices in use (config `[quotas]`), and, when any is set, the devices
    # each user's jobs hold by band (promoted or handed off): a job that would run at home at once
    # past its user's cap is queued instead (docs/DESIGN.md, "Fair share and aging"). A view
    # recorded without them reads back as no cap.
    quotas: Quotas = Quotas()
    held: dict[str, dict[Band, int]] = {}

    def report(self, cluster: str) -> PeerReport | None:
        return next((r for r in self.reports if r.peer_id == cluster), None)


async def cluster_report(config: FederationConfig, cluster: str, *, timeout_s: float = 5.0) -> PeerReport:
    """One cluster's backends; an unreachable controller yields ``reachable=False``, never capacity."""
    try:
        async with ControllerClient.for_cluster(config, cluster, timeout=timeout_s) as client:
            resp = await client.backends()
    except ControllerError as exc:
        return PeerReport(peer_id=cluster, reachable=False, error=f"{exc.code}: {exc.message}")
    except ConfigError as exc:  # e.g. our signing key is unreadable: say so, never crash the tick
        return PeerReport(peer_id=cluster, reachable=False, error=str(exc))
    if resp.cluster != cluster:
        # Another cluster's controller at this cluster's address (a misconfiguration): its
        # capacity is not this cluster's, so nothing may be placed on the strength of it.
        return PeerReport(
            peer_id=cluster,
            reachable=False,
            error=f"the controller at {client.base_url} answers as {resp.cluster!r}, not {cluster!r}",
        )
    return PeerReport(
        peer_id=cluster, reachable=True, last_contact_ms=int(time.time() * 1000), backends=resp.backends
    )


async def gather_reports(config: FederationConfig, *, timeout_s: float = 5.0) -> FederationView:
    """Poll every cluster concurrently."""
    reports = await asyncio.gather(
        *(cluster_report(config, c.name, timeout_s=timeout_s) for c in config.clusters)
    )
    return FederationView(
        home=config.home,
        stale_after_ms=config.stale_after_ms,
        peer_lost_after_s=config.peer_lost_after_s,
        mirror_safety_poll_s=config.mirror_safety_poll_s,
        handoff_retry_initial_s=config.handoff_retry_initial_s,
        handoff_retry_max_s=config.handoff_retry_max_s,
        parked_probe_first_s=config.parked_probe_first_s,
        parked_probe_max_s=config.parked_probe_max_s,
        reports=list(reports),
        fetched_ms=int(time.time() * 1000),
        configured={
            r.peer_id: configured_backends(config.cluster(r.peer_id)) for r in reports if not r.reachable
        },
    )


def configured_backends(cluster: ClusterConfig) -> list[BackendReport]:
    """A cluster's backends as the federation config declares them: shapes only, no capacity."""
    return [BackendReport(backend_id=b.id, advertised_attributes=b.attributes) for b in cluster.backends]


def config_view(config: FederationConfig, *, now_ms: int) -> FederationView:
    """The federation's shapes as configured: every cluster reachable, no capacity block.

    Enough to refuse, before anything starts, a pin to an unknown cluster or a shape that no
    backend anywhere has (docs/DESIGN.md, "Classification"), without credentials for any controller.
    The job workflow then classifies against live reports.
    """
    reports = [
        PeerReport(
            peer_id=c.name,
            reachable=True,
            last_contact_ms=now_ms,
            backends=configured_backends(c),
        )
        for c in config.clusters
    ]
    return FederationView(home=config.home, stale_after_ms=config.stale_after_ms, reports=reports)
