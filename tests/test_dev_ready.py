"""`iris dev` says Ready. only once every cluster has reported capacity (issue 27: a Ray peer's came
about 2 minutes after Ready., and its first job waited without a word). Until then it names what
it waits for."""

from __future__ import annotations

from cli.dev import capacity_missing
from iris.policy.models import Availability, BackendReport, PeerReport
from iris.reports import FederationView


def _backend(backend_id: str, total: dict[str, int] | None) -> BackendReport:
    block = None if total is None else Availability(amounts=dict(total), total_amounts=total)
    return BackendReport(backend_id=backend_id, availability=block)


def _view(*reports: PeerReport) -> FederationView:
    return FederationView(home="marin", stale_after_ms=30_000, reports=list(reports))


def test_ready_when_every_backend_of_every_cluster_reports_capacity() -> None:
    view = _view(
        PeerReport(peer_id="marin", backends=[_backend("cpu-a", {"cpu": 8})]),
        PeerReport(peer_id="cw-rno2a", backends=[_backend("h100-rno2a", {"h100": 8, "cpu": 8})]),
    )
    assert capacity_missing(view) == []


def test_names_each_cluster_or_backend_still_missing_and_why() -> None:
    view = _view(
        PeerReport(peer_id="marin", backends=[_backend("cpu-a", {"cpu": 8})]),
        # A Ray peer whose head has not registered its resources yet: an empty capacity block.
        PeerReport(peer_id="cw-rno2a", backends=[_backend("h100-rno2a", {})]),
        # A Ray peer whose head does not answer: its controller answers 503 (unreachable).
        PeerReport(peer_id="cw-us-east-02a", reachable=False, error="UNAVAILABLE: Ray is not answering"),
        PeerReport(peer_id="shape-only", backends=[_backend("b", None)]),
        PeerReport(peer_id="empty"),
    )
    assert capacity_missing(view) == [
        "cw-rno2a/h100-rno2a (no capacity reported yet)",
        "cw-us-east-02a (not answering: UNAVAILABLE: Ray is not answering)",
        "shape-only/b (no capacity reported yet)",
        "empty (no backends reported)",
    ]
